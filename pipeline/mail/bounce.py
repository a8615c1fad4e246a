"""What a bounce says: whose mail it was, and whether the failure is permanent.

A bounce comes back to the message's VERP address (pipeline/mail/verp.py), which names the
run and the account. GNU Mailman's detectors (flufl.bounce) know the real-world shapes:
RFC 3464 DSNs and the providers' own (Exim, qmail, Microsoft, Yahoo, ...), and whether the
failure is permanent or a delay. The status code (5.1.1, 4.2.2) and the diagnostic come from
the RFC 3464 `message/delivery-status` part when there is one (the stdlib reads it), else
from the text. Without a token, the original Message-ID in the returned headers names the
mail. Parsing only: nothing here changes an account.
"""

from __future__ import annotations

import email
import email.policy
import logging
import re
from dataclasses import dataclass
from email.message import Message

from flufl.bounce import all_failures

STATUS = re.compile(r"\b([245])\.(\d{1,3})\.(\d{1,3})\b")
MESSAGE_ID = re.compile(r"^Message-ID:\s*(<[^<>\s]{1,250}>)", re.IGNORECASE | re.MULTILINE)
PARSED_BYTES = 256 * 1024
logging.getLogger("flufl.bounce").setLevel(logging.CRITICAL)  # a detector tripped by a broken message: we report it
TOKEN_HEADERS = ("Delivered-To", "X-Original-To", "Envelope-To", "X-Envelope-To", "To", "X-Failed-Recipients")


class NotABounce(ValueError):
    """Reported with the message's place in its mailbox; changes no account."""


@dataclass(frozen=True)
class Bounce:
    kind: str  # bounced (permanent, 5.x.x) | deferred (a delay, 4.x.x: not final)
    status: str  # the DSN status code, "" when the bounce gives none
    reason: str  # the diagnostic, at most 300 characters
    token: str = ""  # the VERP token it came back to, "" if none
    message_id: str = ""  # the original message's Message-ID, "" if none returned


def read(raw: bytes, token_pattern: re.Pattern, max_bytes: int) -> Bounce:
    if len(raw) > max_bytes:
        raise NotABounce(f"{len(raw):,} bytes, over CN_BOUNCE_MAX_BYTES ({max_bytes:,}): not read")
    if len(raw) > PARSED_BYTES and b"\n\n" not in raw[:PARSED_BYTES] and b"\n\r\n" not in raw[:PARSED_BYTES]:
        raise NotABounce(f"too large: its headers alone pass {PARSED_BYTES // 1024} KB (no bounce needs that many)")
    try:
        # the report parts come first; a returned original (a 60 KB note) need not be parsed whole
        msg = email.message_from_bytes(raw[:PARSED_BYTES], policy=email.policy.compat32)
        temporary, permanent = all_failures(msg)
        parts = [(part.get_content_type(), part) for part in msg.walk()]  # once: each look below is a pass
        fields = _delivery_status(parts)
        text = _text(parts)
        token, returned = _token(msg, parts, token_pattern), _returned_message_id(parts, text)
    except Exception as e:  # a broken message (MIME nested 500 deep too) may trip the parser or a detector anywhere
        raise NotABounce(f"not a readable message ({type(e).__name__})") from None
    action = fields.get("action", "").lower()
    status = STATUS.search(fields.get("status", "")) or STATUS.search(fields.get("diagnostic-code", "")) \
        or STATUS.search(text)
    code = status.group(0) if status else ""
    if permanent or action.startswith("fail") or (not temporary and code.startswith("5") and fields):
        kind = "bounced"
    elif temporary or action.startswith("delay"):
        kind = "deferred"
    else:
        raise NotABounce("no failed or delayed recipient in it (an auto-reply, or a success notice)")
    if code[:1] not in ("", "4", "5") or (kind == "bounced" and code.startswith("4")):
        code = code if kind == "deferred" else ""
    reason = fields.get("diagnostic-code") or _first_error_line(text) or ("permanent failure" if kind == "bounced"
                                                                          else "delivery delayed")
    return Bounce(kind, code, " ".join(reason.split())[:300], token, returned)


def _delivery_status(parts: list[tuple[str, Message]]) -> dict[str, str]:
    """The first recipient block of a message/delivery-status part (RFC 3464), lower-cased names."""
    for kind, part in parts:
        if kind == "message/delivery-status" and part.is_multipart():
            blocks = part.get_payload()
            for block in blocks[1:] or blocks:  # the first block is about the reporting MTA
                if block.get("Action") or block.get("Status"):
                    return {k.lower(): str(v) for k, v in block.items()}
    return {}


def _text(parts: list[tuple[str, Message]], limit: int = 200_000) -> str:
    """The human-readable parts, as text (what heuristic shapes put the reason in)."""
    out = []
    for kind, part in parts:
        if kind.startswith("text/") and not part.is_multipart():
            payload = part.get_payload(decode=True) or b""
            out.append(payload[:limit].decode("utf-8", "replace"))
    return "\n".join(out)


def _token(msg: Message, parts: list[tuple[str, Message]], pattern: re.Pattern) -> str:
    for name in TOKEN_HEADERS:
        for value in msg.get_all(name, []):
            m = pattern.search(str(value))
            if m:
                return m.group(1).lower()
    for kind, part in parts:  # the returned headers carry the original Return-Path
        if kind in ("text/rfc822-headers", "message/rfc822"):
            m = pattern.search(part.as_string()[:100_000])
            if m:
                return m.group(1).lower()
    return ""


def _returned_message_id(parts: list[tuple[str, Message]], text: str) -> str:
    for kind, part in parts:
        if kind == "message/rfc822" and part.is_multipart():
            mid = part.get_payload(0).get("Message-ID")
            if mid:
                return str(mid).strip()
        if kind == "text/rfc822-headers":
            m = MESSAGE_ID.search(part.get_payload(decode=True).decode("utf-8", "replace"))
            if m:
                return m.group(1)
    m = MESSAGE_ID.search(text)
    return m.group(1) if m else ""


WHY = re.compile(r"unknown|not recognized|no such|does not exist|not found|no mailbox|mailbox full|quota|"
                 r"rejected|blocked|spam", re.IGNORECASE)


def _first_error_line(text: str) -> str:
    lines = text.splitlines()
    for line in lines:
        if STATUS.search(line) or re.search(r"\b[45]\d\d\b", line):
            return line.strip()
    return next((line.strip() for line in lines if WHY.search(line)), "")
