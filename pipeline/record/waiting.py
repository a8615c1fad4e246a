"""Waiting out a lost Redis, and the note a run keeps of what it waits for.

A Redis restart, a failover or an AOF reload is an outage like the HSM's or a relay's: the
calls wait for it up to the later of CN_REDIS_PATIENCE_S from the outage's start and the run's
deadline (settings.gives_up_at), so the day holds instead of failing the accounts in flight.
The process says so at WARNING once an outage, and when Redis is back.

While a signer waits for its HSM, or a mailer for its relays, the run's meta holds
`waiting:<what>` = since (epoch seconds): the live page and the driver's log say what the day
waits for (`waits`, `note_wait`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from redis import ConnectionError as RedisConnectionError
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from pipeline.settings import clock, gives_up_at, waited_past

log = logging.getLogger("pipeline.record.waiting")
WAITING = "waiting:"  # the meta fields' prefix: waiting:hsm, waiting:relay
NAMES = {"hsm": "the HSM", "relay": "the mail relays", "redis": "Redis", "store": "the store"}


class RedisGone(RedisConnectionError):
    """Redis stayed unreachable past the wait the run gives it: the run stops (one line, exit 2)
    and the same run id, run again once Redis is back, goes on where it stopped."""


class PatientRetry(Retry):
    """redis-py's Retry, bounded by time rather than a count: a call that finds Redis gone is
    tried again with backoff (to 1 s) until `gives_up_at` the outage's start, then raises. One
    object for all of a client's connections (redis-py copies it into each), so an outage is
    said once."""

    def __init__(self, where: str, patience_s: float, deadline_at: float):
        super().__init__(ExponentialBackoff(cap=1.0, base=0.05), -1)
        self.where, self.patience_s, self.deadline_at = where, patience_s, deadline_at
        self.down_since = 0.0
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> "PatientRetry":
        return self

    def call_with_retry(self, do: Callable[[], Any], fail: Callable, is_retryable: Callable | None = None,
                        with_failure_count: bool = False) -> Any:
        failures, since = 0, 0.0
        while True:
            try:
                result = do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                fail(error, failures) if with_failure_count else fail(error)
                since = since or self._lost(error)
                if isinstance(error, RedisGone):  # a connect's own retries gave up: said once
                    raise
                if time.time() >= gives_up_at(since, self.patience_s, self.deadline_at):
                    raise self._gone(since, error) from error
                time.sleep(self._backoff.compute(failures))
                continue
            if since:
                self._back()
            return result

    def _lost(self, error: Exception) -> float:
        """The outage's start (this process's first failed call of it), said once."""
        with self._lock:
            if self.down_since:
                return self.down_since
            self.down_since = time.time()
        log.warning("waiting for Redis (%s) since %s, until %s: %s", self.where, clock(self.down_since),
                    clock(gives_up_at(self.down_since, self.patience_s, self.deadline_at)), error)
        return self.down_since

    def _gone(self, since: float, error: Exception) -> RedisGone:
        past = waited_past(since, self.patience_s, self.deadline_at, "CN_REDIS_PATIENCE_S")
        return RedisGone(f"Redis ({self.where}) unreachable since {clock(since)}, past {past}: {error}")

    def _back(self) -> None:
        with self._lock:
            since, self.down_since = self.down_since, 0.0
        if since:
            log.warning("Redis (%s) is back after %.0f s", self.where, time.time() - since)


def waits(meta: dict) -> dict[str, float]:
    """What the run waits for now, from its meta: {"hsm": since, ...}."""
    return {k[len(WAITING):]: float(v) for k, v in meta.items() if k.startswith(WAITING) and v}


def said(what: str, since: float) -> str:
    """The page's words: "waiting for the HSM since 07:41:02 UTC"."""
    return f"waiting for {NAMES.get(what, what)} since {clock(since)}"
