"""The relay's replies on a session aiosmtplib opened (greeting, EHLO, STARTTLS, AUTH).

aiosmtplib's protocol keeps one reply in hand and drops what arrives while nobody waits for
one ("response data will be lost" if commands are written without awaiting each), so it cannot
read the replies of pipelined commands (RFC 2920). Once the session is open, the connection's
transport is handed to this protocol instead: every reply is parsed as it arrives and queued,
so a group of replies in one segment, or one reply cut over two, reads the same. A waiting
send is woken by a plain future, not a `wait_for` a reply.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

MAX_LINE = 8192  # RFC 5321 4.5.3.1.5 allows 512 octets a reply line; a relay past this is broken


class RelayClosed(ConnectionError):
    """The relay closed the connection, or spoke something that is not SMTP."""


class Replies(asyncio.Protocol):
    def __init__(self, transport: asyncio.Transport):
        self.transport = transport
        self.answered = time.monotonic()  # when the relay last replied: the session was opened just now
        self._buffer = bytearray()
        self._lines: list[bytes] = []  # the lines so far of a multi-line reply
        self._replies: deque[tuple[int, str]] = deque()
        self._waiter: asyncio.Future | None = None
        self.lost: Exception | None = None
        self._loop = asyncio.get_running_loop()
        transport.set_protocol(self)

    @property
    def live(self) -> bool:
        return self.lost is None and not self.transport.is_closing()

    @property
    def unread(self) -> bool:
        """A reply nobody asked for (a relay's "421 idle timeout"): the session is not clean."""
        return bool(self._replies or self._buffer)

    def write(self, *data: bytes) -> None:
        """The parts go out in one call: a pipelined group, or a message and its end mark, not
        joined into a copy first where the loop writes them vectored (uvloop's, the mailer's)."""
        if not self.live:
            raise RelayClosed("connection lost")
        if len(data) == 1:
            self.transport.write(data[0])
        else:
            self.transport.writelines(data)

    async def reply(self) -> tuple[int, str]:
        while not self._replies:
            if self.lost is not None:
                raise self.lost
            self._waiter = self._loop.create_future()  # the loop kept: get_running_loop asks getpid() each call (3.11)
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._replies.popleft()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        start = 0
        while (end := self._buffer.find(b"\n", start)) >= 0:
            line, start = bytes(self._buffer[start:end]).rstrip(b"\r"), end + 1
            if len(line) < 3 or not line[:3].isdigit() or line[3:4] not in (b"", b" ", b"-"):
                self._fail(RelayClosed(f"not an SMTP reply: {line[:40]!r}"))
                return
            self._lines.append(line)
            if line[3:4] != b"-":
                text = "\n".join(part[4:].decode("utf-8", "replace") for part in self._lines)
                self._replies.append((int(line[:3]), text))
                self._lines = []
                self.answered = time.monotonic()
        del self._buffer[:start]
        if len(self._buffer) > MAX_LINE:
            self._fail(RelayClosed("a reply line longer than any relay sends"))
            return
        self._wake()

    def eof_received(self) -> bool:
        self._fail(RelayClosed("the relay closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RelayClosed(f"connection lost: {exc}") if exc else RelayClosed("connection closed"))

    def _fail(self, error: Exception) -> None:
        if self.lost is None:
            self.lost = error
        self.transport.close()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
