"""The R6 password hash in C (hash_2b.c, built by pipeline/native.py). ctypes lets go of the
GIL for the call, so signer threads hash in parallel; a machine that cannot build it hashes in
Python (each hash ~1.5x the CPU) and says so.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

from pipeline import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("hash_2b.c")


@functools.cache
def hash_2b():
    """cn_hash_2b(password, len, salt, udata, len, out) -> 0, or None when it cannot be built."""
    lib = native.load(SOURCE)
    if isinstance(lib, str):
        log.warning("the R6 password hash runs in Python (~1.5x the CPU of each hash): %s", lib)
        return None
    fn = lib.cn_hash_2b
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                   ctypes.c_char_p]
    fn.restype = ctypes.c_int
    return fn
