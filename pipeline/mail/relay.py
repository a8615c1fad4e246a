"""Pools of SMTP connections to the relays, their circuit breakers, and the retry policy.

The pool follows smtppool's features and avoids its two known bugs: a reused connection
starts with RSET (no "503 nested MAIL command", smtppool #8), and a connection that saw an
error or a 421 is closed, never handed out again (smtppool #18). A relay that cannot be
reached trips its circuit breaker: sends wait for it (or another relay) instead of burning
their attempts, and fail only once the outage has outlasted the patience.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass

import aiosmtplib

from pipeline.mail.message import (
    ConnectError,
    PermanentMailError,
    RelayDownError,
    TransientMailError,
    UnconfirmedMailError,
)
from pipeline.settings import SmtpTarget


@dataclass(frozen=True)
class RetryPolicy:
    """The one retry policy for mail: transient failures (network, 421, other 4xx, pool
    exhausted) retry with exponential backoff and full jitter, bounded; 5xx are permanent
    and never retried."""

    attempts: int = 4
    base_s: float = 0.2
    cap_s: float = 5.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.cap_s, self.base_s * 2 ** attempt))


@dataclass(frozen=True)
class PoolOptions:
    size: int = 4  # connections per relay
    idle_s: float = 30.0  # a connection unused this long is closed by the sweeper
    wait_s: float = 30.0  # how long a send may wait for a free connection
    max_messages: int = 1000  # messages per connection before it is replaced
    helo: str | None = None  # HELO/EHLO name; None: the machine's FQDN
    starttls: str = "auto"  # auto (if offered) | always | never; smtps:// is implicit TLS
    ca_file: str | None = None  # CA bundle to verify the relay's certificate (None: the system's)
    timeout_s: float = 30.0
    connect_timeout_s: float = 10.0  # a relay that accepts TCP but never greets trips the breaker
    patience_s: float = 600.0  # how long sends wait out a relay outage before failing


class Breaker:
    """One per relay, shared by every send of the pool: after a failed connection the relay
    is left alone, then probed by one send at a time with growing pauses (0.5 s to 15 s)."""

    def __init__(self, base_s: float = 0.5, cap_s: float = 15.0):
        self.base_s, self.cap_s = base_s, cap_s
        self.down_since: float | None = None
        self.retry_at, self.pause, self.probing = 0.0, base_s, False

    def closed(self) -> bool:
        return self.down_since is None

    def probe_due(self) -> bool:
        return not self.probing and time.monotonic() >= self.retry_at

    def trip(self) -> None:
        now = time.monotonic()
        if self.down_since is None:
            self.down_since, self.pause = now, self.base_s
        self.retry_at, self.pause, self.probing = now + self.pause, min(self.cap_s, self.pause * 2), False

    def reset(self) -> None:
        self.down_since, self.pause, self.probing = None, self.base_s, False


class _Conn:
    def __init__(self, smtp: aiosmtplib.SMTP):
        self.smtp, self.sent, self.last_used = smtp, 0, time.monotonic()
        self.dirty: bool | None = False  # True: a transaction was left open, RSET before reuse; None: dead


class RelayPool:
    """A bounded pool of live connections to one relay."""

    def __init__(self, target: SmtpTarget, options: PoolOptions):
        self.target, self.options = target, options
        self.breaker = Breaker()
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(options.size)

    async def send(self, sender: str, recipient: str, message: bytes) -> str:
        try:
            await asyncio.wait_for(self._slots.acquire(), self.options.wait_s)
        except asyncio.TimeoutError:
            raise TransientMailError(f"no free connection to {self.target.host} in {self.options.wait_s} s") from None
        try:
            conn = await self._take()
            try:
                reply = await _transaction(conn, sender, recipient, message)
            except UnconfirmedMailError:
                _close(conn)
                raise
            except (PermanentMailError, TransientMailError):
                if conn.dirty is None or not conn.smtp.is_connected:
                    _close(conn)
                else:
                    self._give_back(conn)
                raise
            except (aiosmtplib.SMTPException, OSError, asyncio.TimeoutError) as e:
                _close(conn)
                raise TransientMailError(f"{type(e).__name__}: {e}") from None
            conn.sent += 1
            self._give_back(conn)
            return reply
        finally:
            self._slots.release()

    def sweep(self) -> None:
        """Closes connections idle longer than idle_s (the relay would drop them anyway)."""
        cutoff = time.monotonic() - self.options.idle_s
        stale = [c for c in self._idle if c.last_used < cutoff]
        self._idle = [c for c in self._idle if c.last_used >= cutoff]
        for conn in stale:
            _close(conn)

    def close(self) -> None:
        while self._idle:
            _close(self._idle.pop())

    def _give_back(self, conn: _Conn) -> None:
        if conn.sent >= self.options.max_messages:
            _close(conn)
            return
        conn.last_used = time.monotonic()
        self._idle.append(conn)

    async def _take(self) -> _Conn:
        """After a 250 the session is clean (RFC 5321 4.1.4); only an aborted transaction
        needs RSET, which is what avoids "503 nested MAIL command" on reuse."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.smtp.is_connected:
                _close(conn)
                continue
            if not conn.dirty:
                return conn
            try:
                await conn.smtp.rset()
                conn.dirty = False
                return conn
            except (aiosmtplib.SMTPException, OSError, asyncio.TimeoutError):
                _close(conn)
        return await self._connect()

    async def _connect(self) -> _Conn:
        t, o = self.target, self.options
        starttls = {"auto": None, "always": True, "never": False}[o.starttls] if not t.implicit_tls else False
        smtp = aiosmtplib.SMTP(hostname=t.host, port=t.port, use_tls=t.implicit_tls, start_tls=starttls,
                               local_hostname=o.helo, timeout=o.timeout_s, cert_bundle=o.ca_file)
        try:
            await smtp.connect(timeout=o.connect_timeout_s)
            if t.username:
                await smtp.login(t.username, t.password or "")
            elif smtp.last_ehlo_response is None:
                await smtp.ehlo()
        except aiosmtplib.SMTPResponseException as e:
            smtp.close()
            if 400 <= e.code < 500:  # 421 "try later": the relay is there but not taking mail
                raise ConnectError(f"{t.host}:{t.port} said {e.code} {e.message}") from None
            raise _classify(e.code, e.message) from None
        except (aiosmtplib.SMTPException, OSError, asyncio.TimeoutError) as e:
            smtp.close()
            raise ConnectError(f"cannot connect to {t.host}:{t.port}: {type(e).__name__}: {e}") from None
        return _Conn(smtp)


class SmtpPool:
    """One RelayPool per relay; messages go round-robin over the relays whose breaker is
    closed, so load spreads and a relay that fails is skipped. When every relay is down,
    sends wait (one probes when its relay's pause is over) until one answers or the
    patience runs out. A sweeper task closes idle connections."""

    def __init__(self, targets: list[SmtpTarget], options: PoolOptions = PoolOptions()):
        self.relays = [RelayPool(t, options) for t in targets]
        self.patience_s = options.patience_s
        self._next = itertools.cycle(self.relays)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever(options.idle_s))

    async def send(self, sender: str, recipient: str, message: bytes) -> str:
        while True:
            relay = await self._relay()
            try:
                reply = await relay.send(sender, recipient, message)
            except ConnectError:
                relay.breaker.trip()
                continue
            except BaseException:
                relay.breaker.probing = False  # the relay answered, or the send was cancelled
                raise
            relay.breaker.reset()
            return reply

    async def ready(self) -> None:
        """Waits while every relay is down and none is due a probe: a mail is claimed only
        when it can leave. Returns at once when the patience is spent (the send then fails)."""
        while not any(r.breaker.closed() or r.breaker.probe_due() for r in self.relays) and not self._impatient():
            await asyncio.sleep(0.1)

    async def _relay(self) -> RelayPool:
        while True:
            for _ in self.relays:
                relay = next(self._next)
                if relay.breaker.closed():
                    return relay
            due = [r for r in self.relays if r.breaker.probe_due()]
            if due:
                due[0].breaker.probing = True
                return due[0]
            if self._impatient():
                down = ", ".join(f"{r.target.host}:{r.target.port}" for r in self.relays)
                raise RelayDownError(f"no relay reachable for over {self.patience_s:.0f} s ({down})")
            await asyncio.sleep(0.1)

    def _impatient(self) -> bool:
        down = [r.breaker.down_since for r in self.relays]
        return None not in down and time.monotonic() - min(down) > self.patience_s

    async def _sweep_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(max(0.05, every_s / 2))
            for relay in self.relays:
                relay.sweep()

    async def close(self) -> None:
        self._sweeper.cancel()
        for relay in self.relays:
            relay.close()


async def _transaction(conn: _Conn, sender: str, recipient: str, message: bytes) -> str:
    """MAIL, RCPT and DATA with aiosmtplib's execute_command; the body then goes out with the
    protocol's write/read_response as it is. It is built CRLF-only with no line starting
    with "." (headers, base64 bodies, "--" boundaries), so aiosmtplib's regular-expression
    pass over every 50 KB message (~0.6 ms) is skipped. The pool gives a connection to one
    coroutine at a time, so nothing else speaks on it meanwhile. A failure after MAIL
    leaves the transaction open: RSET before reuse; a 421 closes it (aiosmtplib does)."""
    smtp = conn.smtp
    for command, expected in (((b"MAIL", b"FROM:<" + sender.encode() + b">"), (250,)),
                              ((b"RCPT", b"TO:<" + recipient.encode() + b">"), (250, 251)),
                              ((b"DATA",), (354,)), (None, (250,))):
        if command is None:
            protocol = smtp.protocol
            if protocol is None or not smtp.is_connected:
                conn.dirty = None
                raise TransientMailError("connection lost before the message was sent")
            try:
                protocol.write(message + b".\r\n")
                response = await protocol.read_response(timeout=smtp.timeout)
            except (aiosmtplib.SMTPException, OSError, asyncio.TimeoutError) as e:
                conn.dirty = None
                raise UnconfirmedMailError(f"connection lost after the message was sent: {type(e).__name__}") from None
        else:
            response = await smtp.execute_command(*command)
        if response.code not in expected:
            conn.dirty = None if response.code == 421 or not smtp.is_connected else True
            raise _classify(response.code, response.message)
    return response.message


async def send_with_retry(pool: SmtpPool, policy: RetryPolicy, sender: str, recipient: str,
                          message: bytes) -> tuple[str, int]:
    """Returns the relay's reply and the attempts used (on an error: its `attempts`); raises PermanentMailError,
    UnconfirmedMailError (never retried: the relay may have the message), RelayDownError, or
    the last TransientMailError once the attempts are spent."""
    for attempt in range(policy.attempts):
        try:
            return await pool.send(sender, recipient, message), attempt + 1
        except (RelayDownError, PermanentMailError, UnconfirmedMailError) as e:
            e.attempts = attempt + 1
            raise
        except TransientMailError as e:
            if attempt + 1 == policy.attempts:
                e.attempts = attempt + 1
                raise
            await asyncio.sleep(policy.delay(attempt))
    raise AssertionError("unreachable")


def _classify(code: int, text: str) -> Exception:
    if 400 <= code < 500:
        return TransientMailError(f"{code} {text}")
    return PermanentMailError(code, text)


def _close(conn: _Conn) -> None:
    try:
        conn.smtp.close()
    except Exception:  # closing a broken transport may raise anything; it is gone either way
        pass
