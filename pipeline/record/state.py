"""A run's live state in Redis: its meta, counters and timeline, and the handle every reader
and writer uses. The handle is put together from parts by what each keeps (as redis-py puts
its client together from command sets): the account records (records.py), the mail guard
(guard.py) and the run's lease (lease.py), each beside the Lua script it calls.
"""

from __future__ import annotations

import json
import time
import uuid
from functools import lru_cache

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from pipeline.record import keys
from pipeline.record.waiting import NAMES, WAITING, PatientRetry
from pipeline.settings import Settings
from pipeline.errors import CannotRun
from pipeline.record.guard import MailGuard
from pipeline.record.lease import RunLease
from pipeline.record.records import PAPER_OWED, STAGES, Records
from pipeline.record.statuses import headline


class RunClosed(CannotRun, RuntimeError):
    """The run was closed and its record sealed: nothing is mailed or settled under it again."""


PATIENCE_RETRIES = 40  # waited out by time (waiting.PatientRetry); fewer: that many tries, for a reader that answers now


@lru_cache(maxsize=16)
def redis_client(url: str, patience_retries: int = PATIENCE_RETRIES, patience_s: float = Settings.redis_patience_s,
                 deadline_at: float = 0.0) -> redis.Redis:
    """One client (one connection pool) per URL, patience and process, shared by every RunState.
    A lost connection is waited for up to the later of `patience_s` and the run's deadline, so
    a Redis restart (a failover, an AOF reload) holds the run instead of failing the accounts
    in flight."""
    where = redis.connection.parse_url(url).get("host", "?")
    retry = PatientRetry(where, patience_s, deadline_at) if patience_retries >= PATIENCE_RETRIES \
        else Retry(ExponentialBackoff(cap=1.0, base=0.05), patience_retries)
    return redis.Redis.from_url(url, decode_responses=True, retry=retry,
                                retry_on_error=[redis.ConnectionError, redis.TimeoutError])


class RunState(Records, MailGuard, RunLease):
    def __init__(self, redis_url: str, run_id: str, ttl_s: int = 14 * 24 * 3600,
                 patience_retries: int = PATIENCE_RETRIES, patience_s: float = Settings.redis_patience_s,
                 deadline_at: float = 0.0):
        self.run_id, self.ttl_s, self.redis_url = run_id, ttl_s, redis_url
        self.r = redis_client(redis_url, patience_retries, patience_s, deadline_at)

    @classmethod
    def of(cls, settings: Settings, run_id: str, patience_retries: int = PATIENCE_RETRIES) -> "RunState":
        """The run's state as its driver and actors hold it: Redis waited for up to the run's deadline."""
        return cls(settings.redis_url, run_id, settings.state_ttl_s, patience_retries, settings.redis_patience_s,
                   settings.deadline_at)

    def start(self, meta: dict) -> str:
        """A rerun of the run keeps its first start time (the run's duration is from it) and its
        epoch; returns the epoch, which mail claims are checked against. The notes delivered
        before this start are kept beside it: a rerun's rate counts its own notes, not the run's.
        A run brought back from storage gives its recorded `started` (and `last_started`)."""
        now = time.time()
        first = float(meta.get("started") or now)
        before = int(self.r.hget(keys.run_counts(self.run_id), "delivered") or 0)
        meta = {"run_id": self.run_id, "last_started": now, "delivered_at_start": before, **meta}
        meta.pop("started", None)
        with self.r.pipeline() as p:
            p.zadd(keys.RUNS, {self.run_id: first}, nx=True)
            p.hsetnx(keys.run_meta(self.run_id), "started", str(first))
            p.hsetnx(keys.run_meta(self.run_id), "epoch", uuid.uuid4().hex)
            p.hset(keys.run_meta(self.run_id), mapping={k: str(v) for k, v in meta.items()})
            p.expire(keys.run_meta(self.run_id), self.ttl_s)
            p.hget(keys.run_meta(self.run_id), "epoch")
            return p.execute()[-1]

    def epoch(self) -> str:
        return self.r.hget(keys.run_meta(self.run_id), "epoch") or ""

    def update_meta(self, **values) -> None:
        self.r.hset(keys.run_meta(self.run_id), mapping={k: str(v) for k, v in values.items()})

    def meta(self) -> dict:
        return self.r.hgetall(keys.run_meta(self.run_id))

    def note_wait(self, what: str, since: float) -> None:
        """The run waits for `what` (hsm, relay) since `since` (epoch), kept if an earlier
        waiter said it first; 0: no longer (waiting.waits reads it back)."""
        if since:
            self.r.hsetnx(keys.run_meta(self.run_id), WAITING + what, str(since))
        else:
            self.r.hdel(keys.run_meta(self.run_id), WAITING + what)

    def clear_waits(self) -> None:
        """No note of an outage: a run starts and ends waiting for nothing."""
        self.r.hdel(keys.run_meta(self.run_id), *(WAITING + what for what in NAMES))

    def snapshot(self) -> None:
        """Appends the counters, with the time, to the run's timeline (for charts of
        throughput over time); the driver calls it about once a second."""
        point = json.dumps({"at": time.time(), **self.counts()})
        with self.r.pipeline(transaction=False) as p:
            p.rpush(keys.run_timeline(self.run_id), point)
            p.expire(keys.run_timeline(self.run_id), self.ttl_s)
            p.execute()

    def timeline(self) -> list[dict]:
        return [json.loads(p) for p in self.r.lrange(keys.run_timeline(self.run_id), 0, -1)]

    def keep(self) -> None:
        """Every key of the run lives `ttl_s` from now: called when a run or a restore ends."""
        with self.r.pipeline(transaction=False) as p:
            for key in (keys.run_meta, keys.run_counts, keys.run_accounts, keys.run_failed, keys.run_unconfirmed,
                        keys.run_mailguard, keys.run_timeline):
                p.expire(key(self.run_id), self.ttl_s)
            p.execute()

    def exists(self) -> bool:
        return bool(self.r.exists(keys.run_meta(self.run_id)))

    def counts(self) -> dict[str, int]:
        counts = {s: 0 for s in STAGES}
        counts.update({k: int(v) for k, v in self.r.hgetall(keys.run_counts(self.run_id)).items()
                       if not k.startswith("st:") and k != PAPER_OWED})  # statuses(), paper_owed()
        counts["failed"] = self.r.zcard(keys.run_failed(self.run_id))
        counts["unconfirmed"] = self.r.zcard(keys.run_unconfirmed(self.run_id))
        return counts

    def final_counts(self, meta: dict | None = None) -> dict[str, int]:
        """The run's counts by final status and its paper owed (statuses.headline), from Redis's
        counters: O(1), whatever the size of the run."""
        meta = self.meta() if meta is None else meta
        return headline(self.statuses(), bool(meta.get("closed_at")), self.paper_owed(), int(meta.get("accounts") or 0))

    def issued_note_numbers(self, sequence: str) -> int:
        """The highest note number Redis has issued of a store's year (keys.note_sequence; 0:
        none, or it lost them)."""
        return int(self.r.get(sequence) or 0)

    def next_note_numbers(self, sequence: str, count: int, floor: int = 0) -> int:
        """Reserve `count` contract note numbers of a store's year (keys.note_sequence); returns
        the first. The counter is first raised to `floor` (the highest number ever issued, from
        storage), so a Redis that lost it never hands out a number twice."""
        last = self.r.eval(_RESERVE, 1, sequence, count, floor)
        return int(last) - count + 1


_RESERVE = """
if tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[2]) then redis.call('SET', KEYS[1], ARGV[2]) end
return redis.call('INCRBY', KEYS[1], ARGV[1])
"""
