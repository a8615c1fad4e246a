"""A mailer's share of a rate the whole cluster keeps: send times reserved a batch at a time
from shared buckets (pipeline/record/rates.py on the run's Redis), and the relay replies that
say a rate or a quota was exceeded.

A reserved time is used once, from the start of the TICK_S it falls in (so the sends of one
tick wake the event loop once: a timer's wake-up costs ~0.2 ms of CPU on a VM); one more than
STALE_S late is given back unused rather than sent late, so a mailer that fell behind never
bursts: in any second the cluster sends at most rate x (1 + TICK_S + STALE_S) messages.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from typing import Protocol

TICK_S = 0.05
STALE_S = 0.05
BATCH_S = 0.2  # a batch is at least this much of the rate's time, and at least MIN_BATCH sends,
MIN_BATCH = 20
HOLD_S = 1.0  # but never more than this much: times a mailer holds and has no mail for are lost to all

# Amazon SES's "454 Throttling failure: Maximum sending rate exceeded", Gmail's "421 4.7.28 ...
# unusual rate", "421 4.7.0 ... try again later", Outlook's "451 4.7.650 ... rate limited",
# Postfix's anvil "450 4.7.1 Error: too much mail from ..."
_THROTTLE = re.compile(r"throttl|sending rate|4\.7\.28|4\.7\.650|4\.7\.0\b.*try again later|too much mail"
                       r"|too many messages|rate limit", re.I)
_QUOTA = re.compile(r"daily (message )?quota|quota exceeded", re.I)
_RELAY_WIDE = re.compile(r"throttling failure|sending rate|too much mail|too many messages", re.I)


def reply_kind(code: int, text: str) -> str | None:
    """"quota" (the relay takes no more mail today), "throttle" (slow down), or None. Only 4xx:
    a 5xx is the relay's final word on that message."""
    if not 400 <= code < 500:
        return None
    if _QUOTA.search(text):
        return "quota"
    return "throttle" if _THROTTLE.search(text) else None


def relay_wide(text: str) -> bool:
    """A throttle of the sender's account at the relay (SES), not of one receiving domain."""
    return bool(_RELAY_WIDE.search(text))


async def _wait_until(at: float, sleep) -> None:
    """Until the start of the tick that holds `at` (the event loop's clock is time.monotonic)."""
    delay = math.floor(at / TICK_S) * TICK_S - time.monotonic()
    if delay > 0:
        await sleep(delay)


def _next_tick(at: float) -> float:
    return (math.floor(at / TICK_S) + 1) * TICK_S


class Buckets(Protocol):
    def take(self, name: str, want: int, ceiling: float, daily: int, horizon_s: float,
             unused: int = 0) -> tuple[int, float, float]: ...

    def throttled(self, name: str, ceiling: float, pause_s: float) -> float: ...

    def stop_for_day(self, name: str) -> None: ...


class Pacer:
    """One relay's or one domain's send times, as this mailer holds them. Its Redis calls run
    in a thread, one at a time, never on the event loop: while Redis is away the mailer's
    loop goes on reading replies and answering the driver, and this pacer's sends wait for
    the answer a tick at a time; an error the call ended with is raised by the next send."""

    def __init__(self, name: str, ceiling: float, buckets: Buckets, daily: int = 0):
        self.name, self.ceiling, self.daily, self.buckets = name, ceiling, daily, buckets
        self.batch = min(max(MIN_BATCH, math.ceil(ceiling * BATCH_S)), math.ceil(ceiling * HOLD_S))
        self.horizon_s = max(1.0, 2 * self.batch / ceiling)  # how far ahead the cluster may reserve
        self.rate, self.quota_out, self.throttles = ceiling, False, 0
        self.calls = 0  # Redis calls, for bench/mail.py
        self._start = self._step = 0.0
        self._left = self._unused = 0
        self._room_at = 0.0
        self._asking: asyncio.Future | None = None
        self._error: BaseException | None = None

    def next_at(self, now: float) -> float:
        """When this pacer's next send may leave (inf: its quota is spent today). Asks Redis
        for a batch when none is held and the bucket had room at the last ask; until it
        answers, `now` (the caller waits a tick and asks again)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        self._drop_stale(now)
        if not self._left and not self.quota_out and now >= self._room_at and self._asking is None:
            unused = self._unused
            self._asking = self._ask(lambda n: self._refilled(unused, *n), self.buckets.take, self.name, self.batch,
                                     self.ceiling, self.daily, self.horizon_s, unused)
        if self.quota_out:
            return math.inf
        if self._left:
            return self._start
        return self._room_at if self._asking is None else now

    def _pop(self) -> float:
        at = self._start
        self._start += self._step
        self._left -= 1
        return at

    async def slot(self, sleep) -> None:
        """Waits for this pacer's next send time (none once its quota is spent: the relay's
        own reply then says so)."""
        while True:
            now = time.monotonic()
            at = self.next_at(now)
            if at == math.inf or await self.take(at, sleep):
                return

    async def take(self, at: float, sleep) -> bool:
        """With a send time held: waits for it and True. Without (the cluster's bucket is full
        until `at`): waits until then and False, for the caller to ask again."""
        if self._left:
            await _wait_until(self._pop(), sleep)
            return True
        await sleep(max(0.0, _next_tick(at) - time.monotonic()))
        return False

    def throttled(self) -> None:
        """The relay said slow down: the cluster's rate is cut; the times held at the old rate
        are given back."""
        self.throttles += 1
        self._ask(self._cut, self.buckets.throttled, self.name, self.ceiling, self.horizon_s)
        self._give_back()

    def out_of_quota(self) -> None:
        if not self.quota_out:
            self._ask(None, self.buckets.stop_for_day, self.name)
        self.quota_out = True
        self._give_back()

    def _ask(self, then, call, *args) -> asyncio.Future:
        self.calls += 1
        asking = asyncio.get_running_loop().run_in_executor(None, call, *args)
        asking.add_done_callback(lambda f: self._answered(f, then))
        return asking

    def _answered(self, answer: asyncio.Future, then) -> None:
        if answer is self._asking:
            self._asking = None
        if answer.exception() is not None:
            self._error = answer.exception()
        elif then is not None:
            then(answer.result())

    def _cut(self, rate: float) -> None:
        self.rate = rate

    def _refilled(self, unused: int, n: int, start_in: float, rate: float) -> None:
        """Redis's answer, timed from when it came (after an outage, long after the ask)."""
        now = time.monotonic()
        self.rate, self._unused = rate, self._unused - unused
        if n < 0:
            self.quota_out = True
        elif n == 0:
            self._room_at = now + start_in
        else:
            self._start, self._step, self._left = now + start_in, 1 / self.rate, n

    def _drop_stale(self, now: float) -> None:
        if self._left and self._start < now - STALE_S:
            late = min(self._left, int((now - STALE_S - self._start) / self._step) + 1)
            self._start += late * self._step
            self._left -= late
            self._unused += late

    def _give_back(self) -> None:
        self._unused += self._left
        self._left = 0
