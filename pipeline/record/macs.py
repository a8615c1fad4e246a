"""HMAC-SHA256 with the key's two pads hashed once, then copied for each message.

A mailer makes three HMACs a mail (the Message-ID, the VERP address, the note's link), all with
the run's one key. `hmac.digest` has OpenSSL 3 look HMAC and SHA-256 up by name on every call:
~1.4 us alone here, ~6 us of a mailer's CPU among its storage threads (its loop's CPU 0.233 ms a
mail against 0.215 with this, in one process, three pairs alternating). RFC 2104's construction on
two copied SHA-256 states is the same digest without the lookups. The pads are kept by the key
itself: they give nothing to a caller that does not hold the key already.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

BLOCK = 64  # SHA-256's block, in bytes
_INNER = bytes(b ^ 0x36 for b in range(256))
_OUTER = bytes(b ^ 0x5C for b in range(256))


def hmac_sha256(key: bytes, message: bytes) -> bytes:
    """hmac.digest(key, message, "sha256")."""
    inner, outer = _pads(key)
    inner, outer = inner.copy(), outer.copy()
    inner.update(message)
    outer.update(inner.digest())
    return outer.digest()


@lru_cache(maxsize=4)  # the run's key, and a rotated one's
def _pads(key: bytes) -> tuple:
    key = (hashlib.sha256(key).digest() if len(key) > BLOCK else key).ljust(BLOCK, b"\0")
    return hashlib.sha256(key.translate(_INNER)), hashlib.sha256(key.translate(_OUTER))
