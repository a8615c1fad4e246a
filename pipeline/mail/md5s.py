"""The MD5s of a batch's attachments (the delivery log's `md5`, which `verify` holds to S3's
listing), eight at a time in C (md5_lanes.c): a quarter of hashlib's CPU a note. A group costs
what its longest message does in all eight lanes, so the messages are grouped by length, and a
group of fewer than LANES_FROM goes to hashlib's one at a time; so does everything where the
source cannot be built or the CPU has no AVX2.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
from pathlib import Path

from pipeline import native

log = logging.getLogger(__name__)
LANES = 8
LANES_FROM = 3  # two 35 KB notes cost as much in the lanes (~95 us) as by hashlib's, one after the other


def md5_hex_all(datas: list[bytes]) -> list[str]:
    """Each message's MD5, hex, in order."""
    order = sorted(range(len(datas)), key=lambda i: len(datas[i]))
    digests: list[str] = [""] * len(datas)
    for at in range(0, len(order), LANES):
        group = order[at:at + LANES]
        hexes = _in_lanes([datas[i] for i in group])
        if hexes is None:
            hexes = [hashlib.md5(datas[i]).hexdigest() for i in group]
        for i, digest in zip(group, hexes):
            digests[i] = digest
    return digests


def _in_lanes(group: list[bytes]) -> list[str] | None:
    """The group's MD5s from the lanes; None where hashlib's one by one are as cheap, or the
    only way: too few messages, one not held as bytes (a c_char_p points into bytes alone), or
    no lanes here."""
    lanes = _lanes()
    if lanes is None or len(group) < LANES_FROM or not all(type(data) is bytes for data in group):
        return None
    n, out = len(group), ctypes.create_string_buffer(16 * len(group))
    if lanes((ctypes.c_char_p * n)(*group), (ctypes.c_size_t * n)(*map(len, group)), n, out) != 0:
        return None  # more messages than the C's lanes: nothing written
    raw = out.raw
    return [raw[16 * j:16 * j + 16].hex() for j in range(n)]


@functools.cache
def _lanes():
    """cn_md5_lanes(data, lens, n, out) -> 0; None when it cannot be built or the CPU has no AVX2."""
    fns = native.functions(Path(__file__).with_name("md5_lanes.c"), {
        "cn_md5_lanes": ([ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t), ctypes.c_int,
                          ctypes.c_char_p], ctypes.c_int)}, "the attachments' MD5s are hashlib's, one at a time")
    if fns and fns[0](None, None, 0, None) != 0:
        log.warning("the attachments' MD5s are hashlib's, one at a time: this CPU has no AVX2")
        return None
    return fns[0] if fns else None
