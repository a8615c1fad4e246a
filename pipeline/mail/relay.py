"""Pools of SMTP connections to the relays, their circuit breakers, and the retry policy.

The pool follows smtppool's features and avoids its two known bugs: a reused connection
starts with RSET (no "503 nested MAIL command", smtppool #8), and a connection that saw an
error or a 421 is closed, never handed out again (smtppool #18). A relay that cannot be
reached trips its circuit breaker: sends wait for it (or another relay) instead of burning
their attempts, and fail only once the outage has outlasted the patience.

A relay with a rate (SMTP_URL's ?rate=) and a domain in CN_DOMAIN_RATES are paced for the
whole cluster (pipeline/mail/pacing.py): each mail goes to the relay whose next send time is
soonest, so mail splits across relays as their rates do. A throttle reply cuts the rate and
the mail waits its turn again; a daily-quota reply takes the relay out for the day and its
mail goes to the others. Neither is an outage: the breaker stays closed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import aiosmtplib
from aiosmtplib.protocol import COMMAND_INJECTION_REGEX

from pipeline.mail.message import (
    ConnectError,
    PermanentMailError,
    QuotaError,
    RelayDownError,
    ThrottledError,
    TransientMailError,
    UnconfirmedMailError,
)
from pipeline.mail.pacing import Buckets, Pacer, relay_wide, reply_kind
from pipeline.mail.replies import Replies
from pipeline.settings import SmtpTarget, clock, gives_up_at

log = logging.getLogger("pipeline.mail.relay")


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


BDAT_FRESH_S = 2.0  # a connection whose relay replied longer ago than this gets DATA, not BDAT (_transaction)


@dataclass(frozen=True)
class PoolOptions:
    size: int = 4  # connections per relay
    idle_s: float = 30.0  # a connection unused this long is closed by the sweeper
    wait_s: float = 30.0  # how long a send may wait for a free connection
    max_messages: int = 1000  # messages per connection before it is replaced
    helo: str | None = None  # HELO/EHLO name; None: the machine's FQDN
    starttls: str = "auto"  # auto (if offered) | always | never; smtps:// is implicit TLS
    ca_file: str | None = None  # CA bundle to verify the relay's certificate (None: the system's)
    timeout_s: float = 30.0  # a transaction's deadline (MAIL to the reply after the message); a reply's when connecting
    connect_timeout_s: float = 10.0  # a relay that accepts TCP but never greets trips the breaker
    patience_s: float = 600.0  # the least sends wait out a relay outage before failing
    deadline_at: float = 0.0  # the run's deadline (epoch): an outage is waited out until then if that is later


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
    """A session aiosmtplib opened, its replies read from then on by `Replies`."""

    def __init__(self, smtp: aiosmtplib.SMTP, timeout_s: float):
        self.smtp, self.timeout_s, self.sent = smtp, timeout_s, 0
        self.replies = Replies(smtp.transport)
        self.pipelining = smtp.supports_extension("pipelining")
        self.chunking = self.pipelining and smtp.supports_extension("chunking")  # BDAT (RFC 3030), pipelined
        self.dirty: bool | None = False  # True: a transaction was left open, RSET before reuse; None: dead

    @property
    def live(self) -> bool:
        return self.dirty is not None and self.replies.live and not self.replies.unread


class RelayPool:
    """A bounded pool of live connections to one relay."""

    def __init__(self, target: SmtpTarget, options: PoolOptions, pacer: Pacer | None = None):
        self.target, self.options, self.pacer = target, options, pacer
        self.breaker = Breaker()
        self.throttles, self._quota_out = 0, False
        self.last_error = ""  # why it was last unreachable: the failed mail says it
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(options.size)

    @property
    def quota_out(self) -> bool:
        """Its daily quota is spent: said by its reply here, or by the cluster's bucket."""
        return self._quota_out or bool(self.pacer and self.pacer.quota_out)

    def out_of_quota(self, buckets: Buckets | None) -> None:
        self._quota_out = True
        if self.pacer:
            self.pacer.out_of_quota()
        elif buckets:
            buckets.stop_for_day(f"relay:{self.target.name}")

    def next_at(self, now: float) -> float:
        if self.quota_out:
            return math.inf
        return self.pacer.next_at(now) if self.pacer else now

    async def send(self, sender: str, recipient: str, message: bytes) -> str:
        if self._slots.locked():  # wait_for wraps the wait in a task of its own: only when there is a wait
            try:
                await asyncio.wait_for(self._slots.acquire(), self.options.wait_s)
            except asyncio.TimeoutError:
                raise TransientMailError(f"no free connection to {self.target.host} in {self.options.wait_s} s") from None
        else:
            await self._slots.acquire()  # a free slot: taken without yielding
        try:
            conn = await self._take()
            try:
                reply = await _transaction(conn, sender, recipient, message)
            except UnconfirmedMailError:
                _close(conn)
                raise
            except (PermanentMailError, TransientMailError):
                if not conn.live:
                    _close(conn)
                else:
                    self._give_back(conn)
                raise
            conn.sent += 1
            self._give_back(conn)
            return reply
        finally:
            self._slots.release()

    def sweep(self) -> None:
        """Closes connections idle longer than idle_s (the relay would drop them anyway): its last
        reply is when a connection was last used (Replies.answered)."""
        cutoff = time.monotonic() - self.options.idle_s
        stale = [c for c in self._idle if c.replies.answered < cutoff]
        self._idle = [c for c in self._idle if c.replies.answered >= cutoff]
        for conn in stale:
            _close(conn)

    def close(self) -> None:
        while self._idle:
            _close(self._idle.pop())

    def _give_back(self, conn: _Conn) -> None:
        if conn.sent >= self.options.max_messages:
            _close(conn)
            return
        self._idle.append(conn)

    async def _take(self) -> _Conn:
        """After a 250 the session is clean (RFC 5321 4.1.4); only an aborted transaction
        needs RSET, which is what avoids "503 nested MAIL command" on reuse."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.live:
                _close(conn)
                continue
            if not conn.dirty:
                return conn
            try:
                async with asyncio.timeout(conn.timeout_s):
                    conn.replies.write(b"RSET\r\n")
                    code, _ = await conn.replies.reply()
                if code == 250:
                    conn.dirty = False
                    return conn
            except (OSError, TimeoutError):
                pass
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
            if reply_kind(e.code, e.message):  # there, and answering: slow down, not an outage
                raise _classify(e.code, e.message) from None
            if 400 <= e.code < 500:  # 421 "try later": the relay is there but not taking mail
                raise ConnectError(f"{t.host}:{t.port} said {e.code} {e.message}") from None
            raise _classify(e.code, e.message) from None
        except (aiosmtplib.SMTPException, OSError, asyncio.TimeoutError) as e:
            smtp.close()
            raise ConnectError(f"cannot connect to {t.host}:{t.port}: {type(e).__name__}: {e}") from None
        return _Conn(smtp, o.timeout_s)


class SmtpPool:
    """One RelayPool per relay; each message goes to the relay with a closed breaker whose next
    send time is soonest (unpaced relays: at once, in turn), so load spreads and a relay that
    fails is skipped. When every relay is down, sends wait (one probes when its relay's pause
    is over) until one answers or the patience runs out (the later of `patience_s` from the outage's
    start and the run's deadline); `told` hears when such an outage begins (its start, epoch seconds)
    and ends (0.0). A sweeper task closes idle connections."""

    def __init__(self, targets: list[SmtpTarget], options: PoolOptions = PoolOptions(),
                 buckets: Buckets | None = None, domain_rates: dict[str, float] | None = None):
        self.relays = [RelayPool(t, options, Pacer(f"relay:{t.name}", t.rate, buckets, t.daily)
                                 if t.rate and buckets else None) for t in targets]
        self.domains = {d: Pacer(f"domain:{d}", r, buckets) for d, r in (domain_rates or {}).items()} if buckets else {}
        self.buckets, self.patience_s, self.deadline_at = buckets, options.patience_s, options.deadline_at
        self.told: Callable[[float], None] = lambda since: None
        self._telling = ThreadPoolExecutor(1, "told")  # one thread: told in order, off the loop
        self.down_at = 0.0  # when every relay was found down (epoch), while they still are
        self._turn = itertools.count()
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever(options.idle_s))

    async def send(self, sender: str, recipient: str, message: bytes) -> str:
        domain = self.domains.get(recipient.rpartition("@")[2].lower())
        throttled_since = None
        while True:
            if domain:
                await domain.slot(asyncio.sleep)
            relay = await self._relay()
            try:
                reply = await relay.send(sender, recipient, message)
            except ConnectError as e:
                relay.breaker.trip()
                relay.last_error = str(e)
                continue
            except ThrottledError as e:
                relay.breaker.probing = False
                throttled_since = throttled_since or time.monotonic()
                if time.monotonic() - throttled_since > self.patience_s:
                    raise TransientMailError(f"{relay.target.name} still throttling after {self.patience_s:.0f} s: {e}") from None
                await self._slow_down(relay, domain, e)
                continue
            except BaseException:
                relay.breaker.probing = False  # the relay answered, or the send was cancelled
                raise
            relay.breaker.reset()
            self._up()
            return reply

    async def _slow_down(self, relay: RelayPool, domain: Pacer | None, e: ThrottledError) -> None:
        """A quota reply takes the relay out for the day (the mail tries the others); a throttle
        cuts the rate of whoever is throttling: the receiving domain if it has a rate and the
        reply is not the relay's own limit, else the relay. A relay without a rate has none to
        cut: the reply is counted and the mail waits a moment."""
        relay.throttles += 1
        if e.quota:
            relay.out_of_quota(self.buckets)
            log.warning("%s: daily quota spent (%s); %d other relays left", relay.target.name, e,
                        sum(not r.quota_out for r in self.relays))
            return
        if domain and not relay_wide(e.text):
            domain.throttled()
        elif relay.pacer:
            relay.pacer.throttled()
        else:
            if self.buckets:  # counted for the page, off the loop (Redis may be away)
                await asyncio.to_thread(self.buckets.throttled, f"relay:{relay.target.name}", 0, 0)
            await asyncio.sleep(random.uniform(0.5, 2.0))

    async def ready(self) -> None:
        """Waits while every relay is down and none is due a probe: a mail is claimed only
        when it can leave. Returns at once when the patience is spent (the send then fails)."""
        while not any(r.breaker.closed() or r.breaker.probe_due() for r in self.relays) and not self._impatient():
            self._down()
            await asyncio.sleep(0.1)

    async def _relay(self) -> RelayPool:
        while True:
            live = [r for r in self.relays if not r.quota_out]
            if not live:
                raise QuotaError("daily quota spent at every relay (" + ", ".join(r.target.name for r in self.relays)
                                 + "): nothing sent; a rerun once the quota resets sends it")
            closed = [r for r in live if r.breaker.closed()]
            if closed:
                k = next(self._turn) % len(closed)
                now = time.monotonic()
                relay, at = min(((r, r.next_at(now)) for r in closed[k:] + closed[:k]), key=lambda p: p[1])
                if at == math.inf:  # its quota ran out as it was asked: `live` leaves it out now
                    continue
                if relay.pacer is None or await relay.pacer.take(at, asyncio.sleep):
                    return relay
                continue  # the cluster's bucket had no room before `at`: the relays are compared again
            due = [r for r in live if r.breaker.probe_due()]
            if due:
                due[0].breaker.probing = True
                return due[0]
            self._down()
            if self._impatient():
                down = "; ".join(r.last_error or r.target.name for r in live)
                raise RelayDownError(f"no relay reachable since {clock(self.down_at)}, past the later of "
                                     f"{self.patience_s:.0f} s (CN_SMTP_PATIENCE_S) and the run's deadline ({down})")
            await asyncio.sleep(0.1)

    def _since(self) -> float | None:
        """When every relay not out of quota went down (epoch), or None while one is up."""
        down = [r.breaker.down_since for r in self.relays if not r.quota_out]
        if not down or None in down:
            return None
        return time.time() - (time.monotonic() - min(down))

    def _impatient(self) -> bool:
        since = self._since()
        return since is not None and time.time() > gives_up_at(since, self.patience_s, self.deadline_at)

    def _down(self) -> None:
        """Every relay is down: said once an outage (the run's page: waiting for the mail relays)."""
        since = self._since()
        if since is not None and not self.down_at:
            self.down_at = since
            log.warning("waiting for the mail relays since %s, until %s", clock(since),
                        clock(gives_up_at(since, self.patience_s, self.deadline_at)))
            self._tell(since)

    def _up(self) -> None:
        if self.down_at:
            log.warning("a mail relay answers again after %.0f s", time.time() - self.down_at)
            self.down_at = 0.0
            self._tell(0.0)

    def _tell(self, since: float) -> None:
        self._telling.submit(self._told, since)  # a Redis call

    def _told(self, since: float) -> None:
        try:
            self.told(since)
        except Exception as e:  # the page's note is a courtesy: the mail does not wait on it
            log.warning("the relays' outage could not be noted: %s", e)

    def rates(self) -> dict[str, dict]:
        """Each paced relay's and domain's rate as this mailer last heard it, and the throttle
        replies it got (the metrics)."""
        shown = {r.target.name: {"rate": r.pacer.rate if r.pacer else 0.0, "throttles": r.throttles,
                                 "quota_out": r.quota_out} for r in self.relays}
        shown.update({d: {"rate": p.rate, "throttles": p.throttles, "quota_out": p.quota_out}
                      for d, p in self.domains.items()})
        return shown

    async def _sweep_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(max(0.05, every_s / 2))
            for relay in self.relays:
                relay.sweep()

    async def close(self) -> None:
        self._sweeper.cancel()
        for relay in self.relays:
            relay.close()
        await asyncio.to_thread(self._telling.shutdown)


async def _transaction(conn: _Conn, sender: str, recipient: str, message: bytes) -> str:
    """MAIL, RCPT and the message on the session aiosmtplib opened, the replies read (replies.py)
    under one deadline for the transaction (`timeout_s`). A relay offering PIPELINING (RFC
    2920: Postfix, Haraka) gets MAIL, RCPT and DATA in one write: two round trips a mail, not
    four. One offering CHUNKING too (RFC 3030: Postfix since 3.4) gets the message with them as
    `BDAT n LAST`: one round trip, on a connection that answered within BDAT_FRESH_S (the
    message leaves with the envelope, so an older one, which may have died unseen, proves itself
    with DATA's envelope first). The message is built CRLF-only with no line starting with ".",
    so it goes out as it is. A failure after MAIL leaves the transaction open: RSET before
    reuse; a 421, a lost connection, a deadline passed or a 354 to a failed group closes it.
    Lost once the message has left, and before the relay refused its envelope, the mail is
    unconfirmed."""
    replies = conn.replies
    if not replies.live:
        conn.dirty = None
        raise TransientMailError("connection lost before the transaction")
    mail_from, rcpt_to = sender.encode(), recipient.encode()
    if COMMAND_INJECTION_REGEX.search(mail_from) or COMMAND_INJECTION_REGEX.search(rcpt_to):
        raise PermanentMailError(501, "a control character in an envelope address")
    envelope = (((b"MAIL FROM:<" + mail_from + b">\r\n",), (250,)), ((b"RCPT TO:<" + rcpt_to + b">\r\n",), (250, 251)))
    if conn.chunking and time.monotonic() - replies.answered < BDAT_FRESH_S:
        steps = (*envelope, ((b"BDAT %d LAST\r\n" % len(message), message), (250,)))
        groups = (steps,)
    else:  # the message is not copied to add its dot
        steps = (*envelope, ((b"DATA\r\n",), (354,)), ((message, b".\r\n"), (250,)))
        groups = (steps[:3], steps[3:]) if conn.pipelining else tuple((s,) for s in steps)
    sent = False  # the message itself went out: a reply lost now leaves it unconfirmed
    failed = None  # the first reply not expected: what the mail failed on
    try:
        async with asyncio.timeout(conn.timeout_s):
            for group in groups:
                sent = group[-1] is steps[-1]
                replies.write(*(data for parts, _ in group for data in parts))  # one write a group
                for _, expected in group:
                    code, text = await replies.reply()
                    if code == 421:  # the relay is closing the session: no more replies
                        conn.dirty = None
                        raise _classify(code, text)
                    if failed is None and code not in expected:
                        failed = code, text
                if failed is not None:  # a 354 after a failed RCPT waits for data nobody will send
                    conn.dirty = None if code == 354 else True
                    raise _classify(*failed)
    except (OSError, TimeoutError) as e:
        conn.dirty = None
        if failed is not None:  # the relay refused the envelope: it holds no transaction to deliver
            raise _classify(*failed) from None
        if sent:
            raise UnconfirmedMailError(f"connection lost after the message was sent: {type(e).__name__}") from None
        raise TransientMailError(f"{type(e).__name__}: {e}") from None
    return text


async def send_with_retry(pool: SmtpPool, policy: RetryPolicy, sender: str, recipient: str,
                          message: bytes) -> tuple[str, int]:
    """Returns the relay's reply and the attempts used (on an error: its `attempts`); raises PermanentMailError,
    UnconfirmedMailError (never retried: the relay may have the message), RelayDownError, QuotaError, or
    the last TransientMailError once the attempts are spent."""
    for attempt in range(policy.attempts):
        try:
            return await pool.send(sender, recipient, message), attempt + 1
        except (RelayDownError, PermanentMailError, UnconfirmedMailError, QuotaError) as e:
            e.attempts = attempt + 1
            raise
        except TransientMailError as e:
            if attempt + 1 == policy.attempts:
                e.attempts = attempt + 1
                raise
            await asyncio.sleep(policy.delay(attempt))
    raise AssertionError("unreachable")


def _classify(code: int, text: str) -> Exception:
    kind = reply_kind(code, text)
    if kind:
        return ThrottledError(code, text, quota=kind == "quota")
    if 400 <= code < 500:
        return TransientMailError(f"{code} {text}")
    return PermanentMailError(code, text)


def _close(conn: _Conn) -> None:
    try:
        conn.smtp.close()
    except Exception:  # closing a broken transport may raise anything; it is gone either way
        pass
