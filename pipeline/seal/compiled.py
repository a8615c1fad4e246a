"""The R6 password hash in C (hash_2b.c), built on first use with the machine's C compiler
against OpenSSL's libcrypto, once per machine and version of the source, and called through
ctypes: no Python headers, no wheel to publish, and ctypes lets go of the GIL for the call, so
signer threads hash in parallel. `scripts/install.sh` and cluster.yaml's setup build it ahead
of the day; a machine that cannot build it hashes in Python (each hash ~1.5x the CPU) and says so.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from pipeline.settings import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("hash_2b.c")


@functools.cache
def hash_2b():
    """cn_hash_2b(password, len, salt, udata, len, out) -> 0, or None when it cannot be built."""
    target = cache_dir() / f"hash_2b-{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]}.so"
    if not target.exists():
        problem = build(target)
        if problem:
            log.warning("the R6 password hash runs in Python (~1.5x the CPU of each hash): %s", problem)
            return None
    fn = ctypes.CDLL(str(target)).cn_hash_2b
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                   ctypes.c_char_p]
    fn.restype = ctypes.c_int
    return fn


def build(target: Path) -> str:
    """Compiles the source to `target` (atomically: workers may build at once); why not, or ""."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return "no C compiler (install gcc and libssl-dev)"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", partial, str(SOURCE), "-lcrypto"],
                          capture_output=True, text=True)
    if done.returncode:
        os.unlink(partial)
        return f"{cc} failed: {done.stderr.strip()[-300:]} (libssl-dev installed?)"
    os.replace(partial, target)
    return ""


if __name__ == "__main__":  # `python -m pipeline.seal.compiled`: build now (install, node setup)
    raise SystemExit(0 if hash_2b() else 1)
