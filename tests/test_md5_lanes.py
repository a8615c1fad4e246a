"""The attachments' MD5s by md5_lanes.c, eight messages at a time, are hashlib's: every padding
case (a message ending just before, at and after a block's last 8 bytes), groups of any size and
mixed lengths, in the batch's own order."""

from __future__ import annotations

import hashlib
import random

from pipeline.mail import md5s

EDGES = [0, 1, 55, 56, 57, 63, 64, 65, 119, 120, 121, 127, 128, 129]


def test_the_compiled_lanes_are_the_ones_in_use():
    assert md5s._lanes() is not None, "pipeline/native.py builds it (gcc), and this CPU has AVX2"
    assert md5s._in_lanes([b"a", b"b", b"c"]) is not None


def test_a_batch_s_md5s_are_hashlib_s_whatever_its_size_and_lengths():
    rng = random.Random(73)
    for _ in range(300):
        batch = [rng.randbytes(rng.choice([*EDGES, rng.randint(0, 400), rng.randint(30_000, 40_000)]))
                 for _ in range(rng.randint(0, 20))]
        assert md5s.md5_hex_all(batch) == [hashlib.md5(data).hexdigest() for data in batch]


def test_a_message_not_held_as_bytes_is_hashed_by_hashlib_in_its_place():
    batch = [b"x" * 100, bytearray(b"y" * 100), b"z" * 5000, memoryview(b"w" * 64)]
    assert md5s.md5_hex_all(batch) == [hashlib.md5(data).hexdigest() for data in batch]
