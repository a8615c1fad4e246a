"""Where bounces are read from: an IMAP mailbox (what the bounce domain's MX delivers to), a
maildir, or an mbox file. Each message comes with a name to report it by, and is marked
seen (IMAP \\Seen, maildir's S flag) only once its bounce has been recorded, so a reader
stopped half-way reads the rest next time; reading one again changes nothing anyway.

    imaps://user:password@imap.example.com/INBOX   (imap:// for loopback tests)
    /var/mail/bounces/            a maildir (has cur/ new/ tmp/)
    /var/mail/bounces.mbox        an mbox file
"""

from __future__ import annotations

import imaplib
import mailbox
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote, urlsplit

from pipeline.errors import CannotRun
from pipeline.settings import without_password


class MailboxError(CannotRun, RuntimeError):
    pass


@dataclass
class Message:
    name: str  # where it is, to report it by: "imap:INBOX uid 42", "maildir 1700000000.M1P2.host"
    raw: bytes | None  # None: over the size limit, not downloaded
    size: int
    ref: object = field(default=None, repr=False)


def open_source(source: str, max_bytes: int):
    if source.startswith(("imap://", "imaps://")):
        return ImapSource(source, max_bytes)
    path = Path(source)
    if (path / "cur").is_dir() and (path / "new").is_dir():
        return MaildirSource(path, max_bytes)
    if path.is_file():
        return MboxSource(path, max_bytes)
    if not path.exists():  # a typo, or a folder not made yet: not "the wrong kind"
        raise MailboxError(f"bounce source {source!r}: no such file or folder")
    raise MailboxError(f"bounce source {source!r}: not an imap(s):// URL, a maildir or an mbox file")


def describe(source: str) -> str:
    """The source without its password: what is logged and reported."""
    return without_password(source)


class ImapSource:
    def __init__(self, url: str, max_bytes: int):
        parts = urlsplit(url)
        self.url, self.max_bytes = describe(url), max_bytes
        self.folder = unquote(parts.path.lstrip("/")) or "INBOX"
        try:
            if parts.scheme == "imaps":
                self.imap = imaplib.IMAP4_SSL(parts.hostname, parts.port or 993, ssl_context=ssl.create_default_context())
            else:
                self.imap = imaplib.IMAP4(parts.hostname, parts.port or 143)
            self.imap.login(unquote(parts.username or ""), unquote(parts.password or ""))
            status, _ = self.imap.select(_quoted(self.folder))
        except (OSError, imaplib.IMAP4.error) as e:
            raise MailboxError(f"{self.url}: {e}") from None
        if status != "OK":
            raise MailboxError(f"{self.url}: no folder {self.folder!r}")

    def unseen(self) -> Iterator[Message]:
        self.imap.noop()  # a watching reader sees what arrived since the last poll
        _, data = self.imap.uid("SEARCH", None, "UNSEEN")
        uids = (data[0] or b"").split()
        if not uids:
            return
        _, meta = self.imap.uid("FETCH", b",".join(uids), "(RFC822.SIZE)")  # every size in one round trip
        sizes = _sizes(meta)
        for uid in uids:
            if uid not in sizes:  # expunged meanwhile
                continue
            size, raw = sizes[uid], None
            if size <= self.max_bytes:
                _, parts = self.imap.uid("FETCH", uid, "(BODY.PEEK[])")
                raw = next(p[1] for p in parts if isinstance(p, tuple))
            yield Message(f"{self.url} uid {uid.decode()}", raw, size, uid)

    def seen(self, messages: list[Message]) -> None:
        for m in messages:
            self.imap.uid("STORE", m.ref, "+FLAGS", "(\\Seen)")

    def close(self) -> None:
        try:
            self.imap.logout()
        except (OSError, imaplib.IMAP4.error):
            pass


class MaildirSource:
    """A message is seen when its name has the S flag (":2,S" in cur/), as every maildir
    reader marks it; a new one is moved to cur/ when seen."""

    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes

    def unseen(self) -> Iterator[Message]:
        for sub in ("new", "cur"):
            for f in sorted((self.path / sub).iterdir()):
                if f.name.startswith(".") or "S" in f.name.partition(":2,")[2]:
                    continue
                size = f.stat().st_size
                yield Message(f"maildir {f}", f.read_bytes() if size <= self.max_bytes else None, size, f)

    def seen(self, messages: list[Message]) -> None:
        for m in messages:
            base, _, flags = m.ref.name.partition(":2,")
            m.ref.rename(self.path / "cur" / f"{base}:2,{''.join(sorted(set(flags + 'S')))}")

    def close(self) -> None:
        pass


class MboxSource:
    """Read whole each time (mbox has no place to mark a message seen): idempotent anyway.
    Each message's size comes from the file's table of contents before it is read, so a 200 MB
    message costs nothing but its line in the report."""

    def __init__(self, path: Path, max_bytes: int):
        with path.open("rb") as f:
            first = f.readline()
        if first and not first.startswith(b"From "):
            raise MailboxError(f"{path}: not an mbox file (it does not start with a 'From ' line)")
        self.box, self.path, self.max_bytes = mailbox.mbox(path, create=False), path, max_bytes

    def unseen(self) -> Iterator[Message]:
        for n, key in enumerate(self.box.keys(), 1):
            start, stop = self.box._toc[key]  # the offsets mailbox.mbox found; reading the message is what costs
            size = stop - start
            raw = self.box.get_bytes(key) if size <= self.max_bytes else None
            yield Message(f"mbox {self.path} message {n}", raw, size, key)

    def seen(self, messages: list[Message]) -> None:
        pass

    def close(self) -> None:
        self.box.close()


def _sizes(meta: list) -> dict[bytes, int]:
    """UID -> RFC822.SIZE from a FETCH's lines (a server may give the two in either order)."""
    sizes = {}
    for line in meta:
        if isinstance(line, bytes):
            uid, size = re.search(rb"UID (\d+)", line), re.search(rb"RFC822\.SIZE (\d+)", line)
            if uid and size:
                sizes[uid.group(1)] = int(size.group(1))
    return sizes


def _quoted(folder: str) -> str:
    return '"' + folder.replace("\\", "\\\\").replace('"', '\\"') + '"'
