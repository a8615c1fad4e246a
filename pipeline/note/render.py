"""Note data -> PDF bytes with Typst; one compiler per process, reused for every note.

Creating a compiler scans the fonts (tens of ms); compiling a typical note is a few ms.
Tagged PDF is off by default: it doubled compile time and grew files ~8x here, and the
archive of record is the signed PDF, not an accessibility edition.

The note reaches Typst as a file, not as `sys.inputs`: typst-py rebuilds and rehashes the
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

from pipeline.note.fonts import lean_font_dir
from pipeline.settings import TEMPLATES

TEMPLATE = TEMPLATES / "contract_note.typ"
NOTE_FILE = "note.json"  # the name the template reads, beside it
LOCK = ".held"  # locked by the process that renders in the directory


class RenderError(RuntimeError):
    pass


class _Compiler:
    """The template copied into a private directory, with the compiler that reads it there."""

    def __init__(self, parent: Path | None = None) -> None:
        shm = Path("/dev/shm")
        parent = parent or (shm if shm.is_dir() else Path(tempfile.gettempdir()))
        _sweep(parent)
        self.dir = Path(tempfile.mkdtemp(prefix="cn-render-", dir=parent))
        self._held = open(self.dir / LOCK, "w")  # noqa: SIM115 - held for the process's life
        fcntl.flock(self._held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        atexit.register(shutil.rmtree, self.dir, True)
        shutil.copy(TEMPLATE, self.dir / TEMPLATE.name)
        fonts = lean_font_dir()
        self.typst = typst.Compiler(str(self.dir / TEMPLATE.name), root=str(self.dir),
                                    font_paths=[str(fonts)] if fonts else [])
        self.lock = threading.Lock()  # one note file, and typst-py's compiler is not re-entrant

    def compile(self, note: dict, tagged: bool) -> bytes:
        path = self.dir / NOTE_FILE
        with self.lock:
            path.write_text(json.dumps(note))
            try:
                return self.typst.compile(format="pdf", pdf_tags=tagged)
            finally:
                os.unlink(path)


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
    try:
        return compiler().compile(note, tagged)
    except typst.TypstError as e:
        raise RenderError(f"note {note['note']['number']}: {e.message}") from None
