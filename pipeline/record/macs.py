"""HMAC-SHA256 from a keyed HMAC made once a key, then copied for each message.

A mailer makes three HMACs a mail (the Message-ID, the VERP address, the note's link), all with
the run's one key. `hmac.digest` has OpenSSL 3 look HMAC and SHA-256 up by name on every call:
1.3-2.0 us of CPU here, against 1.0 for a copy of an HMAC keyed once; the mailer's loop took 0.233
ms a mail with it, against 0.215 with a copy (in one process, three pairs alternating). The keyed
HMAC is kept by the key itself: it gives nothing to a caller that does not hold the key already.
"""

from __future__ import annotations

import hmac
from functools import lru_cache


def hmac_sha256(key: bytes, message: bytes) -> bytes:
    """hmac.digest(key, message, "sha256")."""
    mac = _keyed(key).copy()
    mac.update(message)
    return mac.digest()


@lru_cache(maxsize=4)  # the run's key, and a rotated one's
def _keyed(key: bytes) -> hmac.HMAC:
    return hmac.new(key, digestmod="sha256")
