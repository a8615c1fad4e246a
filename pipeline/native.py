"""Small C functions (a `*.c` beside the module that uses it), built on first use with the
machine's C compiler, once per machine and version of the source, and called through ctypes:
no Python headers, no wheel to publish, and ctypes lets go of the GIL for the call.
cluster.yaml's setup builds them ahead of the day (`python -m pipeline.native`); a machine
that cannot build one runs its Python twin, and says so.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from pipeline.settings import cache_dir

log = logging.getLogger(__name__)

PACKAGE = Path(__file__).parent
LINKED = {"hash_2b": ("-lcrypto",)}  # the libraries a source needs, by its name


def functions(source: Path, signatures: dict[str, tuple[list, type]], instead: str) -> list | None:
    """The source's functions, typed by `signatures` (name: argtypes, restype); None when it
    cannot be built, logged with `instead` (what runs in their place)."""
    lib = load(source)
    if isinstance(lib, str):
        log.warning("%s: %s", instead, lib)
        return None
    typed = []
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
        typed.append(fn)
    return typed


def load(source: Path) -> ctypes.CDLL | str:
    """The built library, or why it cannot be built."""
    target = cache_dir() / f"{source.stem}-{hashlib.sha256(source.read_bytes()).hexdigest()[:16]}.so"
    if not target.exists():
        problem = build(source, target)
        if problem:
            return problem
    return ctypes.CDLL(str(target))


def build(source: Path, target: Path) -> str:
    """Compiles `source` to `target` (atomically: workers may build at once); why not, or ""."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return "no C compiler (install gcc and libssl-dev)"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", partial, str(source), *LINKED.get(source.stem, ())],
                          capture_output=True, text=True)
    if done.returncode:
        os.unlink(partial)
        hint = " (libssl-dev installed?)" if "-lcrypto" in LINKED.get(source.stem, ()) else ""
        return f"{cc} failed: {done.stderr.strip()[-300:]}{hint}"
    os.replace(partial, target)
    return ""


if __name__ == "__main__":  # `python -m pipeline.native`: build them all now (node setup)
    problems = {source.name: load(source) for source in sorted(PACKAGE.rglob("*.c"))}
    problems = {name: problem for name, problem in problems.items() if isinstance(problem, str)}
    for name, problem in problems.items():
        print(f"{name}: {problem}")
    raise SystemExit(1 if problems else 0)
