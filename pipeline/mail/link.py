"""The client's own link to their note: https://notes.broker.example.com/notes/TOKEN.

TOKEN carries the run, the account, the trade date and an expiry, signed with an HMAC keyed
by the secret's token_key (domain-separated from the VERP tag). Anyone holding the link can
fetch the note, as anyone holding the e-mail can open the attachment: the PDF itself still
needs the client's PAN. The service checks a link with the key the run it names recorded: its
own, or that run's where the key was rotated since, and then only for that run's trade date. A
guess costs the server an HMAC or two, a Redis read and, for a run Redis does not know, a look
for its report in storage; a wrong one never reaches a note.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hmac
import re
import time
from dataclasses import dataclass

from pipeline.record.macs import hmac_sha256

NAME = re.compile(r"[A-Za-z0-9._-]{1,64}\Z")  # a run id or a client code: nothing that walks a path


@dataclass(frozen=True)
class NoteLink:
    run_id: str
    ucc: str
    trade_date: str
    expires: int


def make(key: bytes, run_id: str, ucc: str, trade_date: str, valid_s: float, now: float | None = None) -> str:
    expires = int((time.time() if now is None else now) + valid_s)
    payload = _b64(f"{run_id}\n{ucc}\n{trade_date}\n{expires}".encode())
    return f"{payload}.{_b64(_mac(key, payload))}"


def check(key: bytes, token: str, now: float | None = None) -> NoteLink | None:
    """The link's contents when it is genuine and not expired; None for anything else."""
    payload, _, mac = token.partition(".")
    if not payload or len(token) > 400 or not hmac.compare_digest(mac.encode(), _b64(_mac(key, payload)).encode()):
        return None
    try:
        run_id, ucc, trade_date, expires = _parts(payload)
        link = NoteLink(run_id, ucc, dt.date.fromisoformat(trade_date).isoformat(), int(expires))
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    if link.trade_date != trade_date or not NAME.match(ucc) or not NAME.match(run_id):
        return None  # signed, yet naming no note: the parts build storage keys, so they are checked first
    return link if link.expires > (time.time() if now is None else now) else None


def claimed_run(token: str) -> str | None:
    """The run a link names, not checked: which run's key is to check it, when the service's
    own key is not the one that run signed its links with (rotated since)."""
    payload = token.partition(".")[0]
    try:
        run_id = _parts(payload)[0] if payload and len(token) <= 400 else ""
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    return run_id if NAME.match(run_id) else None


def _parts(payload: str) -> list[str]:
    return base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)).decode().split("\n")


def _mac(key: bytes, payload: str) -> bytes:
    return hmac_sha256(key, b"note-link\0" + payload.encode())[:18]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")
