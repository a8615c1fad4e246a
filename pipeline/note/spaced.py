"""A note's monospaced text with each run of padding spaces set as a few wide spaces.

Typst shapes, lays out and writes every glyph, a blank one too: a dense page's padding was 38%
of its glyphs. The lean monospaced faces (pipeline/note/fonts.py) make U+2002 to U+2006 blank
glyphs 2 to 32 cells wide, so a run of n spaces takes one glyph for each set bit of n (and one
for each 32), and the page looks the same to the pixel. Only what the template sets in those
faces is changed, and only for a compile that has them: the note's data keeps its spaces.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from pipeline import native
from pipeline.note.fonts import WIDE_SPACES

_RUN = re.compile(" {2,}")
_AS_ONE_CELL = dict.fromkeys(WIDE_SPACES, " ")


def spaced(line: str) -> str:
    """padded.c's spaced() twin, for any line. A wide space that came in the line's own text
    (a cell's) is set as the one cell it was counted as."""
    return _RUN.sub(lambda run: _wide(len(run.group())), line.translate(_AS_ONE_CELL))


@lru_cache(maxsize=256)
def _wide(cells: int) -> str:
    """`cells` as wide spaces, widest first, and a space for an odd cell."""
    out = []
    for char, n in sorted(WIDE_SPACES.items(), key=lambda item: -item[1]):
        count, cells = divmod(cells, n)
        out.append(chr(char) * count)
    return "".join(out) + " " * cells


def _compiled():
    module = native.extension(Path(__file__).with_name("padded.c"), "a note's padding is set as wide spaces in Python")
    if module is None:
        return spaced
    c = module.spaced

    def compiled(line: str) -> str:
        out = c(line)
        return spaced(line) if out is None else out  # None: not ASCII
    return compiled


_spaced = _compiled()


def spaced_note(note: dict) -> dict:
    """The note as the template gets it when the lean faces are there: its trade table's lines
    and heads and its levies table spaced; a shallow copy, the rest shared. A note whose data
    is not of that shape goes as it is, for Typst to fail it alone."""
    try:
        levies = note["levies"]
        return {**note,
                "heads": _lines(note["heads"]),
                "levies": {**levies, "head": _spaced(levies["head"]), "lines": _lines(levies["lines"]),
                           "net": _spaced(levies["net"])},
                "pages": [{**page, "groups": [{**group, "lines": _lines(group["lines"])} for group in page["groups"]]}
                          for page in note["pages"]]}
    except (TypeError, KeyError, AttributeError):
        return note


def _lines(lines: list[str]) -> list[str]:
    if type(lines) is not list:
        raise TypeError(f"lines, not {type(lines).__name__}")
    return [_spaced(line) for line in lines]
