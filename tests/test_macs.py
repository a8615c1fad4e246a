"""pipeline/record/macs.py is HMAC-SHA256: the same bytes as the standard library's, for keys
shorter than, as long as, and longer than SHA-256's block (hashed first), several messages a key
(the keyed HMAC is copied, never spent)."""

from __future__ import annotations

import hmac
import os
import random

from pipeline.record.macs import hmac_sha256


def test_it_is_hmac_sha256_for_every_key_length_and_message():
    rng = random.Random(73)
    for length in [*range(0, 131), 1000]:  # shorter than, as long as and longer than SHA-256's 64-byte block
        key = os.urandom(length)
        for message in (b"", os.urandom(rng.randrange(1, 300)), b"verp\0run\0C0000001"):
            assert hmac_sha256(key, message) == hmac.digest(key, message, "sha256"), (length, message)

