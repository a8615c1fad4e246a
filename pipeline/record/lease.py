"""The run lease: one driver at a time works on a run id.

Two drivers on one run id (an operator retrying a job that still runs, a notebook rerun over
a scheduled run, Ray Jobs restarting a driver) would both split the day, issue note numbers
twice and sign notes again after they were mailed. So a driver takes the run's lease in Redis
before it splits or renders anything, renews it while it lives, and every mail claim and
archive write checks it (the token travels with each batch). A lease whose holder stopped
renewing for `lease_s` (it died) is taken over, and the takeover is recorded in the run's meta.
Times are Redis's own (TIME), so the drivers' clocks do not matter.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from pipeline.errors import CannotRun
from pipeline.record import keys

log = logging.getLogger("pipeline.record.lease")


class LeaseHeldError(CannotRun, RuntimeError):
    """Another live driver holds the run: this one must not start (exit status 2)."""


class LeaseLostError(CannotRun, RuntimeError):
    """This driver stopped renewing for longer than the lease and another took the run over."""


# KEYS: lease, meta. ARGV: token, host, pid, lease_s, ttl. Returns {0, holder json} when a live
# driver holds it, {1} when taken, {2, previous holder json} when taken over from a dead one.
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local held = redis.call('HGET', KEYS[1], 'holder')
local result = {1}
if held then
  local h = cjson.decode(held)
  if h['token'] ~= ARGV[1] then
    if now - tonumber(redis.call('HGET', KEYS[1], 'renewed')) < tonumber(ARGV[4]) then return {0, held} end
    h['taken_over_at'] = now
    redis.call('HSET', KEYS[2], 'lease_takeover', cjson.encode(h))
    result = {2, cjson.encode(h)}
  end
end
local me = cjson.encode({token = ARGV[1], host = ARGV[2], pid = tonumber(ARGV[3]), since = now})
redis.call('HSET', KEYS[1], 'holder', me, 'token', ARGV[1], 'renewed', tostring(now))
redis.call('EXPIRE', KEYS[1], ARGV[5])
return result
"""
# KEYS: lease. ARGV: token. 1 while still ours, 0 when another holds it, -1 when Redis lost it
# (then the run's epoch is gone too, and the driver stops on that: StateLostError).
_RENEW = """
local held = redis.call('HGET', KEYS[1], 'token')
if not held then return -1 end
if held ~= ARGV[1] then return 0 end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'renewed', tostring(tonumber(t[1]) + tonumber(t[2]) / 1e6))
return 1
"""
_RELEASE = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


@dataclass
class Lease:
    token: str
    lost: bool = False
    taken_over_from: dict | None = None


class RunLease:
    """The lease part of a RunState (which gives it `r`, `run_id` and `ttl_s`)."""

    def take_lease(self, lease_s: float) -> Lease:
        token = uuid.uuid4().hex
        args = [token, socket.gethostname(), os.getpid(), lease_s, self.ttl_s]
        code, *holder = self.r.eval(_TAKE, 2, keys.run_lease(self.run_id), keys.run_meta(self.run_id), *args)
        if code == 0:
            h = json.loads(holder[0])
            raise LeaseHeldError(f"run {self.run_id} is held by a driver on {h['host']} (pid {h['pid']}) since "
                                 f"{_when(h['since'])}: wait for it to end, or for {lease_s:.0f} s "
                                 "(CN_LEASE_S) after it stops renewing")
        lease = Lease(token, taken_over_from=json.loads(holder[0]) if code == 2 else None)
        if lease.taken_over_from:
            h = lease.taken_over_from
            log.warning("run %s: taken over from a driver on %s (pid %s, since %s) that stopped renewing its lease",
                        self.run_id, h["host"], h["pid"], _when(h["since"]))
        return lease

    def renew_lease(self, token: str) -> bool:
        """False only when another driver holds the run (a Redis that lost it is the epoch's to tell)."""
        return self.r.eval(_RENEW, 1, keys.run_lease(self.run_id), token) != 0

    def release_lease(self, token: str) -> None:
        self.r.eval(_RELEASE, 1, keys.run_lease(self.run_id), token)

    def holds_lease(self, token: str) -> bool:
        return bool(token) and self.r.hget(keys.run_lease(self.run_id), "token") == token

    def lease_holder(self) -> dict | None:
        held = self.r.hget(keys.run_lease(self.run_id), "holder")
        return json.loads(held) if held else None

    def live_holder(self, lease_s: float) -> dict | None:
        """The driver holding the run if it renewed within `lease_s` by Redis's clock (as _TAKE
        judges it): a driver that would refuse another, or None."""
        with self.r.pipeline(transaction=False) as p:
            p.hmget(keys.run_lease(self.run_id), "holder", "renewed")
            p.time()
            (holder, renewed), (s, us) = p.execute()
        return json.loads(holder) if holder and s + us / 1e6 - float(renewed or 0) < lease_s else None


@contextmanager
def held(state: RunLease, lease_s: float) -> Iterator[Lease]:
    """The run's lease, renewed every third of `lease_s` by a thread until the block ends;
    `lost` turns True if a renewal finds it taken (the driver then stops: exit status 2)."""
    lease = state.take_lease(lease_s)
    done = threading.Event()

    def renew() -> None:
        while not done.wait(lease_s / 3):
            try:
                if not state.renew_lease(lease.token):
                    lease.lost = True
                    return
            except Exception as e:  # Redis restarting: the claims wait for it too; try again
                log.warning("run lease not renewed (%s); trying again", e)

    thread = threading.Thread(target=renew, name="run-lease", daemon=True)
    thread.start()
    try:
        yield lease
    finally:
        done.set()
        thread.join()
        if not lease.lost:
            state.release_lease(lease.token)


def _when(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(float(epoch_s)))


# One `bounces` reader a run: a key holding the reader's JSON, kept while it renews. Not the
# run's lease: a reader watching a 72-hour window must not stop a rerun of the run meanwhile.
_READER_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
_READER_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


@contextmanager
def reader(r, key: str, what: str, lease_s: float, wait_s: float = 0.0, by: str = "being read by another reader",
           one: str = "one reader at a time") -> Iterator[Callable[[], bool]]:
    """Held while the block runs (renewed every third of `lease_s`); LeaseHeldError naming the
    holder if another live holder has it after `wait_s`; one that died frees it after `lease_s`.
    Yields whether it is still held, asked of Redis (one restarted without its data forgot it)."""
    me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(), "id": uuid.uuid4().hex})
    ms, until = int(lease_s * 1000), time.monotonic() + wait_s
    while not r.set(key, me, nx=True, px=ms):
        if time.monotonic() < until:
            time.sleep(0.2)
            continue
        held = r.get(key)
        h = json.loads(held) if held else {"host": "?", "pid": "?", "since": time.time()}
        raise LeaseHeldError(f"{what} is {by} on {h['host']} (pid {h['pid']}) since {_when(h['since'])}: {one}; "
                             f"wait for it to end, or for {lease_s:.0f} s (CN_LEASE_S) after it stops")
    done = threading.Event()

    def renew() -> None:
        while not done.wait(lease_s / 3):
            try:
                r.eval(_READER_RENEW, 1, key, me, ms)
            except Exception as e:  # Redis restarting: try again
                log.warning("%s: reader's lock not renewed (%s); trying again", what, e)

    thread = threading.Thread(target=renew, name=f"held {key}", daemon=True)
    thread.start()
    try:
        yield lambda: r.get(key) == me
    finally:
        done.set()
        thread.join()
        r.eval(_READER_RELEASE, 1, key, me)
