"""Note data -> PDF bytes with Typst; one compiler per process, reused for every note.

Creating a compiler scans the fonts (tens of ms); compiling a typical note is a few ms.
Notes are compiled together, up to BATCH_PAGES pages at a time, and cut apart
(pipeline/note/assemble.py): a lone note's compile spent about a quarter of its instructions
subsetting and compressing the fonts it embeds, which a compile of many does once for all.
Tagged PDF is off by default: it doubled compile time and grew files ~8x here, and the
archive of record is the signed PDF, not an accessibility edition.

The notes reach Typst as a file, not as `sys.inputs`: typst-py rebuilds and rehashes the
whole standard library whenever `sys.inputs` changes, a tenth of a typical note's compile.
The file lives only for its compile, in a directory of this process's own (mode 0700, in
memory where /dev/shm exists): it holds the client's PAN before the note is encrypted.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import shutil
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

import typst

from pipeline.note.assemble import PaginationError, split
from pipeline.note.fonts import lean_font_dir, wide_spaces
from pipeline.note.spaced import spaced_note
from pipeline.settings import TEMPLATES

TEMPLATE = TEMPLATES / "contract_note.typ"
NOTES_FILE = "notes.json"  # the name the template reads, beside it
BATCH_PAGES = 30  # pages a compile, at most (unless one note has more): 15 saves as much CPU; Typst keeps
# its last compiles memoised, so a worker peaked at 330 MB with 30 (470 MB with 60, 170 MB a note a compile)
LOCK = ".held"  # locked by the process that renders in the directory
MEMO_AGE = 10  # typst-py keeps what Typst memoised in the last this many compiles (comemo::evict(10))


class RenderError(RuntimeError):
    pass


class _Compiler:
    """The template copied into a private directory, with the compiler that reads it there."""

    def __init__(self, parent: Path | None = None) -> None:
        shm = Path("/dev/shm")
        parent = parent or (shm if shm.is_dir() else Path(tempfile.gettempdir()))
        _sweep(parent)
        # Made under a name the sweep passes over, locked, then renamed: a cn-render-* directory
        # is locked from the moment it can be seen. Made under its own name, another process's
        # sweep could find it between the lock file's creation and its lock, and remove it.
        making = Path(tempfile.mkdtemp(prefix=".cn-render-", dir=parent))
        self._held = open(making / LOCK, "w")  # noqa: SIM115 - held for the process's life
        fcntl.flock(self._held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.dir = making.with_name(making.name[1:])
        os.rename(making, self.dir)
        atexit.register(shutil.rmtree, self.dir, True)
        shutil.copy(TEMPLATE, self.dir / TEMPLATE.name)
        fonts = lean_font_dir()
        self.typst = typst.Compiler(str(self.dir / TEMPLATE.name), root=str(self.dir),
                                    font_paths=[str(fonts)] if fonts else [])
        self.spaced = fonts is not None and wide_spaces(fonts)  # the system faces' wide spaces are a cell wide
        self.lock = threading.Lock()  # one note file, and typst-py's compiler is not re-entrant

    def compile(self, notes: list[dict], tagged: bool) -> bytes:
        path = self.dir / NOTES_FILE
        with self.lock:
            path.write_text(json.dumps([spaced_note(note) for note in notes] if self.spaced else notes))
            try:
                return self.typst.compile(format="pdf", pdf_tags=tagged)
            finally:
                os.unlink(path)


def forget() -> None:
    """Ages out what Typst memoised for this process's compiles so far. typst-py keeps every
    memo entry used in its last MEMO_AGE compiles, which pays when a compile shares work with
    the ones before (a shard's batches share the template and the header). A huge note's page
    ranges share next to nothing: each is its own pages, so a range worker held ten ranges'
    layouts (25 dense pages a range: ~680 MB). Ten compiles of an empty document, 0.2 ms each,
    age them out: a worker rendering ranges peaked at ~195 MB (in one process; ~240 MB as a
    Ray worker in bench/render.py)."""
    empty = _empty()
    for _ in range(MEMO_AGE):
        empty.compile(input=b"", format="pdf")


@lru_cache(maxsize=1)
def _empty() -> typst.Compiler:
    return typst.Compiler(ignore_system_fonts=True)  # an empty document needs no font


def _sweep(parent: Path) -> None:
    """Removes what render processes that are gone left behind: Ray's workers exit without
    running atexit, and one killed mid-compile leaves its last note's data. A directory is
    gone when nobody holds its lock: the kernel lets go of a dead process's locks, whatever
    PID namespace it ran in (a container, or the tests' simulated instances, may share
    /dev/shm with processes whose PIDs it cannot see). One without a lock is being made."""
    for left in parent.glob("cn-render-*"):
        try:
            lock = os.open(left / LOCK, os.O_RDONLY)  # never made here: no lock yet, not judged
        except OSError:
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # held: its process is alive
        finally:
            os.close(lock)
        shutil.rmtree(left, ignore_errors=True)


@lru_cache(maxsize=1)
def compiler() -> _Compiler:
    return _Compiler()


def render(note: dict, tagged: bool = False) -> bytes:
    [pdf] = render_all([note], tagged)
    if isinstance(pdf, RenderError):
        raise pdf
    return pdf


def compiled(note: dict, tagged: bool = False) -> bytes:
    """The note's compile as Typst wrote it, not cut: a huge note's page range, which
    assemble.merge joins with the others, copying each range's objects once."""
    try:
        return compiler().compile([note], tagged)
    except typst.TypstError as e:
        raise _failed(note, e) from None


def render_all(notes: list[dict], tagged: bool = False) -> list[bytes | RenderError]:
    """Each note's PDF, or why it could not be rendered, in order. A compile that fails is
    compiled again note by note, so one note's bad data fails only that note. Tagged notes
    are compiled one at a time: cutting pages out of a compile would drop its structure tree."""
    out: list[bytes | RenderError] = []
    for group in _groups(notes, 1 if tagged else BATCH_PAGES):
        try:
            out += split(compiler().compile(group, tagged), group)
        except (typst.TypstError, PaginationError) as e:
            if len(group) > 1:
                out += [pdf for note in group for pdf in render_all([note], tagged)]
            else:
                out.append(_failed(group[0], e))
    return out


def _failed(note: dict, e: Exception) -> RenderError:
    return RenderError(f"note {note['note']['number']}: {getattr(e, 'message', e)}")


def _groups(notes: list[dict], pages: int) -> list[list[dict]]:
    """Consecutive notes, at most `pages` pages a group (a longer note is a group alone)."""
    groups: list[list[dict]] = []
    size = 0
    for note in notes:
        n = len(note["pages"])
        if not groups or size + n > pages:
            groups.append([])
            size = 0
        groups[-1].append(note)
        size += n
    return groups
