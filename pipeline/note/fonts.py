"""Lean copies of the note's Noto faces, made once per machine from the system's fonts.

Every compile subsets and deflates each face it used into the PDF, and shapes every glyph
through the face's tables. With faces cut to the Latin script and stripped of TrueType hinting
(bytecode most PDF viewers do not run), a typical note's compile took 12% fewer instructions
and its PDF a third fewer bytes. The monospaced faces lose their layout tables too (GSUB,
GPOS, GDEF): they hold nothing Typst applies to the trade table's text (no kerning, no
ligatures; numerators, fractions, small capitals and other languages' letter forms only when
asked for), yet shaping still went through them: without them a dense page's compile took
3.4% fewer instructions and a typical note's 2.3%, its pages the same pixel for pixel.
In the monospaced copies, five space characters the notes' other text never sets in them
(U+2002 to U+2006) become blank glyphs 2, 4, 8, 16 and 32 cells wide: a run of a table's padding
spaces is set as a few of them (pipeline/note/spaced.py), where it was a glyph a cell shaped,
laid out and written one by one, 38% of a dense page's glyphs.
The copies are named "CN Noto Sans" and "CN Noto Sans Mono" (the PostScript names are kept),
so the template's font lists can name them first and fall back to the full system faces for
any character a client's name brings from outside them. A machine that cannot make them
renders with the system faces, the same notes a little slower, and says so.
"""

from __future__ import annotations

import functools
from collections import Counter
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from pipeline.settings import cache_dir

log = logging.getLogger(__name__)

SYSTEM_FONTS = Path("/usr/share/fonts/truetype/noto")
FACES = ["NotoSans-Regular", "NotoSans-Bold", "NotoSansMono-Regular", "NotoSansMono-Bold"]
# Basic Latin, Latin-1, Latin Extended-A, general punctuation, the rupee and minus signs, and
# the dotted circle that shaping inserts before a stray combining mark.
UNICODES = "U+0020-007E,U+00A0-017F,U+2000-206F,U+20B9,U+2212,U+25CC"
MONO_DROPPED = ("GSUB", "GPOS", "GDEF")
# In the mono faces, cells wide; padded.c's spaced() holds the same (tests/test_padded.py holds them together)
WIDE_SPACES = {0x2002: 2, 0x2003: 4, 0x2004: 8, 0x2005: 16, 0x2006: 32}
WIDENED = "wide-spaces"  # in a directory whose monospaced faces have them
RECIPE = f"v4 {UNICODES} no-hinting all-layout-features mono-without-layout wide-spaces {sorted(WIDE_SPACES.items())}"  # a new recipe makes a new directory


@functools.cache
def lean_font_dir() -> Path | None:
    """The directory of lean faces, made now if this machine has none; None if it cannot."""
    sources = [SYSTEM_FONTS / f"{face}.ttf" for face in FACES]
    missing = [str(s) for s in sources if not s.exists()]
    if missing:
        log.warning("notes render with the system's fonts, a little slower: %s missing", ", ".join(missing))
        return None
    digest = hashlib.sha256(RECIPE.encode() + b"".join(s.read_bytes()[:4096] for s in sources)).hexdigest()[:16]
    target = cache_dir() / f"fonts-{digest}"
    if not target.is_dir():
        try:
            _make(sources, target)
        except Exception as e:  # noqa: BLE001 - any failure leaves the system's fonts, said once
            log.warning("notes render with the system's fonts, a little slower: cannot make lean faces (%s)", e)
            return None
    lost = [face for face in FACES if not (target / f"{face}.ttf").is_file()]
    if lost:  # a cache cleaned file by file: Typst would fall back to the system's faces unsaid
        log.warning("notes render with the system's fonts, a little slower: %s lacks %s (remove it to make them again)",
                    target, ", ".join(lost))
        return None
    return target


def _make(sources: list[Path], target: Path) -> None:
    """Builds into a fresh directory renamed into place: render workers may start at once."""
    from fontTools import subset

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=".fonts-"))
    options = subset.Options(layout_features=["*"], hinting=False, name_IDs=["*"], name_languages=["*"],
                             notdef_outline=True, glyph_names=False)
    try:
        widened = []
        for source in sources:
            font = subset.load_font(str(source), options)
            subsetter = subset.Subsetter(options)
            subsetter.populate(unicodes=subset.parse_unicodes(UNICODES))
            subsetter.subset(font)
            if "Mono" in source.name:
                for table in MONO_DROPPED:
                    if table in font:
                        del font[table]
                widened.append(_widen_spaces(font))
            _rename_family(font)
            subset.save_font(font, str(partial / source.name), options)
        if widened and all(widened):
            (partial / WIDENED).write_text(f"{sorted(WIDE_SPACES.items())}\n")
        try:
            os.rename(partial, target)
        except OSError:
            if not target.is_dir():
                raise
            # another worker finished first: its faces are the same
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # a failed or beaten build leaves nothing


def _widen_spaces(font) -> bool:
    """WIDE_SPACES' glyphs made that many cells wide (a cell: the space's advance). A face whose
    wide spaces are not blank glyphs of their own is left as it is, and the padding stays spaces
    (wide_spaces)."""
    cmap, metrics = font.getBestCmap(), font["hmtx"]
    glyphs, uses = {char: cmap.get(char) for char in WIDE_SPACES}, Counter(cmap.values())
    if any(g is None or uses[g] != 1 or font["glyf"][g].numberOfContours != 0 for g in glyphs.values()):
        log.warning("%s has no wide spaces of its own to widen: the tables' padding stays spaces",
                    font["name"].getDebugName(4))
        return False
    cell = metrics[cmap[0x20]][0]
    for char, glyph in glyphs.items():
        metrics[glyph] = (cell * WIDE_SPACES[char], 0)
    font["hhea"].advanceWidthMax = max(advance for advance, _ in metrics.metrics.values())
    return True


def wide_spaces(font_dir: Path) -> bool:
    """Whether the monospaced faces in `font_dir` were given WIDE_SPACES' widths when made:
    padding set as wide spaces in a face without them would close up the table's columns."""
    return (font_dir / WIDENED).is_file()


def _rename_family(font) -> None:
    """"Noto Sans" -> "CN Noto Sans" in the family names (1 and 16) and full name (4)."""
    for record in font["name"].names:
        if record.nameID in (1, 4, 16):
            text = record.toUnicode()
            if text.startswith("Noto Sans"):
                record.string = "CN " + text


if __name__ == "__main__":  # `python -m pipeline.note.fonts`: make them now (install, node setup)
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("fontTools").setLevel(logging.WARNING)
    raise SystemExit(0 if lean_font_dir() else 1)
