"""VERP envelope senders: each message's MAIL FROM names its run and account, so a bounce that
comes back hours later says whose mail it was.

    MAIL FROM:<bounces+TOKEN@bounces.broker.example.com>
    TOKEN = base32(ucc) "-" run tag "-" HMAC

Lower case only (a relay may fold the local part's case), well inside the local part's 64
characters. The run tag is the first 8 hex digits of the run id's SHA-256: enough to tell a
bounce for another run. The HMAC (64 bits, keyed with the secret's token_key) makes a forged
or mangled address worthless: it names no account.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from dataclasses import dataclass
from functools import lru_cache

from pipeline.record.macs import hmac_sha256

_TOKEN = re.compile(r"^([a-z2-7]{1,40})-([0-9a-f]{8})-([0-9a-f]{16})$")


@dataclass(frozen=True)
class Verp:
    local: str
    domain: str
    key: bytes

    def address(self, run_id: str, ucc: str) -> str:
        return f"{self.local}+{token(self.key, run_id, ucc)}@{self.domain}"

    def pattern(self) -> re.Pattern:
        """Finds this broker's VERP addresses in a bounce's headers, in any case."""
        return re.compile(rf"{re.escape(self.local)}\+([a-z2-7]+-[0-9a-f]{{8}}-[0-9a-f]{{16}})@{re.escape(self.domain)}",
                          re.IGNORECASE)


@dataclass(frozen=True)
class Token:
    ucc: str
    run_tag: str
    mac: str


@lru_cache(maxsize=16)
def run_tag(run_id: str) -> str:
    return hashlib.sha256(run_id.encode()).hexdigest()[:8]


def token(key: bytes, run_id: str, ucc: str) -> str:
    code = base64.b32encode(ucc.encode()).decode().rstrip("=").lower()
    return f"{code}-{run_tag(run_id)}-{_mac(key, run_id, ucc)}"


def parse(text: str) -> Token | None:
    """The token's parts, or None when it is not one of ours in shape."""
    m = _TOKEN.match(text.lower())
    if not m:
        return None
    code = m.group(1).upper()
    try:
        ucc = base64.b32decode(code + "=" * (-len(code) % 8)).decode("ascii")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return Token(ucc, m.group(2), m.group(3))


def genuine(key: bytes, run_id: str, t: Token) -> bool:
    return t.run_tag == run_tag(run_id) and hmac.compare_digest(t.mac, _mac(key, run_id, t.ucc))


def _mac(key: bytes, run_id: str, ucc: str) -> str:
    return hmac_sha256(key, f"verp\0{run_id}\0{ucc}".encode()).hex()[:16]
