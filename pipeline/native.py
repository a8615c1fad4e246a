"""Small C functions (a `*.c` beside the module that uses it), built on first use with the
machine's C compiler, once per machine and version of the source, and called through ctypes:
no Python headers, no wheel to publish, and ctypes lets go of the GIL for the call.
A function called a hundred times a note cannot pay ctypes' ~0.5 µs a call: such a source is an
extension module (EXTENSIONS: built against the running Python's headers, imported, then called
as any builtin is). cluster.yaml's setup builds them ahead of the day (`python -m pipeline.native`);
a machine that cannot build one runs its Python twin, and says so.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

from pipeline.settings import cache_dir

log = logging.getLogger(__name__)

PACKAGE = Path(__file__).parent
LINKED = {"hash_2b": ("-lcrypto",)}  # the libraries a source needs, by its name
EXTENSIONS = {"amounts", "padded", "rows"}  # the sources that are extension modules (PyInit_<name>), by their name


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


def extension(source: Path, instead: str) -> ModuleType | None:
    """The source's extension module, imported; None when it cannot be built, logged with `instead`."""
    target = built(source)
    if isinstance(target, str):
        log.warning("%s: %s", instead, target)
        return None
    try:
        spec = importlib.util.spec_from_file_location(source.stem, target)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as e:  # a cached build cut short, or not this Python's
        log.warning("%s: %s cannot be imported (%s)", instead, target, e)
        return None
    return module


def load(source: Path) -> ctypes.CDLL | str:
    """The built library, or why it cannot be built."""
    target = built(source)
    return target if isinstance(target, str) else ctypes.CDLL(str(target))


def built(source: Path) -> Path | str:
    """The source's shared object, built if it is not yet; or why it cannot be built. An extension
    module's name carries the ABI of the Python it was built for."""
    abi = sysconfig.get_config_var("SOABI") if source.stem in EXTENSIONS else ""
    version = hashlib.sha256(source.read_bytes() + abi.encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{version}.so"
    if not target.exists():
        problem = build(source, target)
        if problem:
            return problem
    return target


def _flags(source: Path) -> tuple[str, ...]:
    if source.stem in EXTENSIONS:
        return (f"-I{sysconfig.get_paths()['include']}",)
    return LINKED.get(source.stem, ())


def build(source: Path, target: Path) -> str:
    """Compiles `source` to `target` (atomically: workers may build at once); why not, or ""."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return "no C compiler (install gcc and libssl-dev)"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", partial, str(source), *_flags(source)],
                          capture_output=True, text=True)
    if done.returncode:
        os.unlink(partial)
        hint = " (libssl-dev installed?)" if "-lcrypto" in _flags(source) else (
            " (the Python headers installed?)" if source.stem in EXTENSIONS else "")
        return f"{cc} failed: {done.stderr.strip()[-300:]}{hint}"
    os.replace(partial, target)
    return ""


if __name__ == "__main__":  # `python -m pipeline.native`: build them all now (node setup)
    problems = {source.name: built(source) for source in sorted(PACKAGE.rglob("*.c"))}
    problems = {name: problem for name, problem in problems.items() if isinstance(problem, str)}
    for name, problem in problems.items():
        print(f"{name}: {problem}")
    raise SystemExit(1 if problems else 0)
