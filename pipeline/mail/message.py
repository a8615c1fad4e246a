"""The e-mail as MIME bytes, from prepared templates, and what can go wrong sending it.

Building with email.message.EmailMessage costs ~5 ms per message here, more than signing
it; the prepared template below is filled with a few header values and base64 bodies in
~0.2 ms. Lines end in CRLF throughout (strict relays reject bare LF). Header values that
come from client data are stripped of control characters and RFC 2047-encoded, so they
cannot add headers; HTML gets the name escaped.
"""

from __future__ import annotations

import base64
import ctypes
import html
import re
import struct
import time
from dataclasses import dataclass
from email.header import Header
from email.utils import formataddr, formatdate
from functools import lru_cache
from itertools import chain
from pathlib import Path

from pipeline import native
from pipeline.record.keys import message_id  # noqa: F401  (derived from run and account, as record keys are)
from pipeline.settings import TEMPLATES

CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MIXED = "=_cn-mixed-7f3a9c"
ALT = "=_cn-alt-7f3a9c"
SKELETON = (
    "From: {sender}\r\nReply-To: {reply_to}\r\nTo: {to}\r\nSubject: {subject}\r\nDate: {date}\r\n"
    "Message-ID: {message_id}\r\nMIME-Version: 1.0\r\n"
    f"Content-Type: multipart/mixed; boundary=\"{MIXED}\"\r\n\r\n"
    f"--{MIXED}\r\nContent-Type: multipart/alternative; boundary=\"{ALT}\"\r\n\r\n"
    f"--{ALT}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Transfer-Encoding: base64\r\n\r\n"
    "{text}\r\n"
    f"--{ALT}\r\nContent-Type: text/html; charset=utf-8\r\nContent-Transfer-Encoding: base64\r\n\r\n"
    "{html}\r\n"
    f"--{ALT}--\r\n"
    f"--{MIXED}\r\nContent-Type: application/pdf; name=\"{{filename}}\"\r\n"
    "Content-Transfer-Encoding: base64\r\nContent-Disposition: attachment; filename=\"{filename}\"\r\n\r\n"
)
END = f"\r\n--{MIXED}--\r\n".encode("ascii")  # after the attachment


class PermanentMailError(RuntimeError):
    def __init__(self, code: int, text: str):
        super().__init__(f"{code} {text}")
        self.code, self.text = code, text


class TransientMailError(RuntimeError):
    pass


class ConnectError(TransientMailError):
    """No session with the relay: nothing of the message left, so it is not an attempt."""


class RelayDownError(TransientMailError):
    """Every relay has been unreachable for longer than the patience."""


class ThrottledError(TransientMailError):
    """The relay (or the domain behind it) said slow down: the rate is cut, the mail waits its
    turn again; not an outage, not an attempt."""

    def __init__(self, code: int, text: str, quota: bool = False):
        super().__init__(f"{code} {text}")
        self.code, self.text, self.quota = code, text, quota  # quota: no more mail today through that relay


class QuotaError(RuntimeError):
    """Every relay has said its daily quota is spent: nothing was sent; a rerun once the quota
    resets sends it."""


class UnconfirmedMailError(RuntimeError):
    """The connection was lost after the message left (DATA's final dot, or its BDAT chunk): the
    relay may have taken it. Never retried blindly; the account becomes `unconfirmed` with its
    Message-ID."""


@dataclass(frozen=True)
class Letter:
    """Who the mail is from and what it says around the attachment."""

    sender: str
    reply_to: str
    broker: str = "Example Securities Private Limited"
    support: str = "support@broker.example.com"  # where a reply goes: the Reply-To's address


def attachment_name(ucc: str, trade_date: str) -> str:
    return f"ContractNote_{_safe(ucc)}_{trade_date.replace('-', '')}.pdf"


@lru_cache(maxsize=1)
def _texts() -> tuple[str, str, str]:
    read = lambda name: (TEMPLATES / name).read_text(encoding="utf-8")  # noqa: E731
    crlf = lambda text: "\r\n".join(text.splitlines()) + "\r\n"  # noqa: E731
    return read("email_subject.txt").strip(), crlf(read("email_body.txt")), crlf(read("email_body.html"))


def build_message(letter: Letter, to_name: str, to_addr: str, trade_date: str, ucc: str,
                  msg_id: str, pdf: bytes, link: str = "") -> bytes | bytearray:
    """`link`: the client's own link to the note (pipeline/mail/link.py), said in the text."""
    subject, text, page = _texts()
    name, code = _header_text(to_name), _safe(ucc)
    online = f"Your own link to this note, for a copy at any time (it expires): {link}" if link else ""
    values = dict(name=name, date=trade_date, ucc=code, broker=letter.broker, support=letter.support, link=link,
                  online=online)
    safe_values = {k: html.escape(v) for k, v in values.items()}
    head = SKELETON.format(
        sender=letter.sender, reply_to=letter.reply_to,
        to=formataddr((name, _safe_addr(to_addr)), charset="utf-8"),
        subject=_encoded(subject.format(**values)), date=_date(int(time.time())), message_id=msg_id,
        text=_b64(text.format(**values).encode()).decode("ascii"),
        html=_b64(page.format(**safe_values).encode()).decode("ascii"), filename=attachment_name(ucc, trade_date),
    ).encode("ascii")
    return _with_body(head, pdf)


def _with_body(head: bytes, pdf: bytes) -> bytes | bytearray:
    """head + the attachment's base64 lines + END, the lines written by C into their place in
    the one buffer: no 48 KB body made first and then copied into the message."""
    c = _encoder()
    if c is None or not pdf:
        return b"".join((head, _b64(pdf), END))
    size, encode = c
    h, body = len(head), size(len(pdf))
    out = bytearray(h + body + len(END))
    out[:h] = head
    encode(pdf, len(pdf), ctypes.addressof(_BYTE.from_buffer(out)) + h)
    out[h + body:] = END
    return out


_LINES = struct.Struct("76s" * 32)  # a block of base64 lines, cut by one C call
_BYTE = ctypes.c_char * 1  # a bytearray's first byte: its address is the buffer's


def _b64(data: bytes) -> bytes | bytearray:
    """76-character lines joined by CRLF, in C (mime_b64.c) where it was built."""
    c = _encoder()
    if c is None or not data:
        return _b64_python(data)
    size, encode = c
    out = bytearray(size(len(data)))
    encode(data, len(data), ctypes.addressof(_BYTE.from_buffer(out)))
    return out


def _b64_python(data: bytes) -> bytes:
    """The same in Python: the lines are cut by struct, 32 at a time (a slice each cost 0.14 ms
    a note; base64.encodebytes is slower still)."""
    b = base64.b64encode(data)
    whole = len(b) - len(b) % _LINES.size
    blocks = chain.from_iterable(_LINES.iter_unpack(memoryview(b)[:whole]))
    return b"\r\n".join(chain(blocks, [b[i:i + 76] for i in range(whole, len(b), 76)]))


@lru_cache(maxsize=1)
def _encoder():
    """(cn_mime_b64_size, cn_mime_b64), or None when mime_b64.c cannot be built."""
    return native.functions(Path(__file__).with_name("mime_b64.c"), {
        "cn_mime_b64_size": ([ctypes.c_size_t], ctypes.c_size_t),
        "cn_mime_b64": ([ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p], ctypes.c_size_t),
    }, "the attachments' base64 runs in Python (~0.1 ms more a mail)")


@lru_cache(maxsize=2)
def _date(second: int) -> str:
    """The Date header, made once a second (formatdate costs ~2 us a call)."""
    return formatdate(second, localtime=False)


def _encoded(text: str) -> str:
    return text if text.isascii() else Header(text, "utf-8").encode()


def _header_text(value: str) -> str:
    return CONTROL.sub(" ", value).strip()


def _safe(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", value)


def _safe_addr(addr: str) -> str:
    if CONTROL.search(addr) or any(c in addr for c in "<>,;\" "):
        raise PermanentMailError(0, "malformed recipient address")  # the address itself is PII: not logged
    return addr
