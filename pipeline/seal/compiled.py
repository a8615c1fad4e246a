"""The R6 password hash in C (hash_2b.c, built by pipeline/native.py). ctypes lets go of the
GIL for the call, so signer threads hash in parallel.
"""

from __future__ import annotations

import functools
from ctypes import POINTER, c_char_p, c_int, c_size_t
from pathlib import Path

from pipeline import native

SOURCE = Path(__file__).with_name("hash_2b.c")


@functools.cache
def hash_2b():
    """cn_hash_2b(n, passwords, ends, salts, udata, udata_len, out) -> 0, or None when it cannot be built."""
    fns = native.functions(SOURCE, {"cn_hash_2b": ([c_size_t, c_char_p, POINTER(c_size_t), c_char_p, c_char_p, c_size_t,
                                                    c_char_p], c_int)},
                           "the R6 password hash runs in Python (~1.5x the CPU of each hash)")
    return fns[0] if fns else None
