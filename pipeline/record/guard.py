"""The mail guard: a claim per account, taken in Redis just before its e-mail leaves, so that an
account is mailed at most once per run, whatever Ray retries.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from functools import lru_cache
from typing import Awaitable, Callable, Iterable

import hiredis
import redis
import redis.asyncio

from pipeline.errors import CannotRun
from pipeline.record import keys
from pipeline.record.lease import LeaseLostError
from pipeline.record.records import RECORD_FN, Outcome, stamp


class StateLostError(CannotRun, RuntimeError):
    """Redis no longer holds this run (flushed, or restarted without persistence): mailing
    on would resend what the lost mail guard was protecting."""


# The mail guard holds the claim's token: a claim retried after its reply was lost (a Redis
# restart) still finds it its own. It is taken only while the run's epoch (set when the run
# first starts) is in Redis: a Redis that lost the run answers -1 instead of handing out
# claims it forgot. Only the driver holding the run's lease claims (lease.py): a second driver,
# or the leftover work of one that was taken over, answers -2. The call first records the
# mailer's outcomes since its last claim (records.py), so that a mail costs one round trip.
# A token begins with the first 8 characters of its driver's lease token, then the time it was
# taken (claim_token: a forced rerun tells its own attempt's outcome from the run's). A resend
# (`rerun --force`, `--unconfirmed`) takes over a claim made under another lease (an earlier
# mailing's, or one restored) in the same step as the lease check: never one of its own
# driver's, so a batch resent to another mailer does not mail the account twice.
# KEYS: meta, guard, lease, then the record's four. ARGV: ucc, epoch, ttl, token, lease token,
# now, resend (1 or 0), then the record's five per account
_CLAIM = RECORD_FN + """
record({KEYS[4], KEYS[5], KEYS[6], KEYS[7]}, ARGV[6], ARGV[3], ARGV, 8)
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[2] then return -1 end
if redis.call('HGET', KEYS[3], 'token') ~= ARGV[5] then return -2 end
local held = redis.call('HGET', KEYS[2], ARGV[1])
if held == ARGV[4] then return 1 end
if held and (ARGV[7] ~= '1' or string.sub(held, 1, 8) == string.sub(ARGV[4], 1, 8)) then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1
"""
# A claim let go after a definite non-delivery: only while it is still this mailing's own.
_RELEASE_OWN = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


_CLAIM_SHA = hashlib.sha1(_CLAIM.encode()).hexdigest()


class MailGuard:
    """The mail-guard part of a RunState (which gives it `r`, `run_id`, `ttl_s` and, from
    Records, the record's keys and arguments)."""

    def claim_mail(self, ucc: str, message_id: str, epoch: str, lease: str,
                   recording: Iterable[Outcome] = (), token: str = "", resend: bool = False) -> bool:
        """Atomic: True for exactly one caller per run and account, whatever retries Ray
        makes; raises StateLostError if Redis no longer knows the run of this epoch, and
        LeaseLostError if the run's lease is not `lease` (another driver holds the run).
        `recording`: outcomes written by the same call, first (a mailer's replies since its
        last claim: one round trip a mail, not two). `token`: the claim's (claim_token), which
        release_mail is given; `resend`: take over a claim made under another lease (_CLAIM)."""
        return self._claimed(self._claim_patiently(self._claim_args(ucc, epoch, lease, recording, token, resend)))

    async def claim_mail_async(self, ucc: str, message_id: str, epoch: str, lease: str,
                               recording: Iterable[Outcome], in_thread: Callable[..., Awaitable],
                               token: str = "", resend: bool = False) -> bool:
        """claim_mail on a mailer's event loop, which it never holds: on a connection of the
        loop's own, which awaits Redis's reply rather than blocking for it. A connection that
        fails (Redis restarting) hands the same call to the client's patient retries in a
        thread (`in_thread`); the claim's token makes it safe to repeat."""
        args = self._claim_args(ucc, epoch, lease, recording, token, resend)
        try:
            claimed = await self._evalsha_async(args)
        except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.NoScriptError, OSError):
            claimed = await in_thread(self._claim_patiently, args)
        return self._claimed(claimed)

    def _claim_args(self, ucc: str, epoch: str, lease: str, recording: Iterable[Outcome], token: str = "",
                    resend: bool = False) -> list:
        now = stamp()
        return [keys.run_meta(self.run_id), keys.run_mailguard(self.run_id), keys.run_lease(self.run_id),
                *self._record_keys(), ucc, epoch, self.ttl_s, token or claim_token(lease), lease, now,
                1 if resend else 0, *self._record_args(recording, now)]  # Records, beside it in RunState

    def _claim_patiently(self, args: list) -> int:
        try:
            return _evalsha(self.r, args)
        except redis.exceptions.NoScriptError:
            return self.r.eval(_CLAIM, 7, *args)

    def _claimed(self, claimed: int) -> bool:
        if claimed == -2:
            raise LeaseLostError(f"run {self.run_id}: this work's driver no longer holds the run's lease: not mailed")
        if claimed == -1:
            raise StateLostError(f"Redis no longer holds run {self.run_id} (flushed, or restarted without "
                                 "persistence): mailing stopped; run the same run id again to rebuild its state "
                                 "from the delivery log in storage")
        return bool(claimed)

    async def _evalsha_async(self, args: list) -> int:
        """One connection at a time from this loop's own pool, kept between claims (as _evalsha's).
        The whole claim (a connection, the call, its reply) is within one timeout, the socket
        timeout redis-py would take (the URL's socket_timeout, else its default); its TimeoutError
        (an OSError) hands the claim to the patient client, as a lost connection does. redis-py's
        own, a wait_for on the write (a task) and a timeout on the read, cost a claim 29 µs of
        CPU, eight at once on uvloop; this one 21."""
        loop = asyncio.get_running_loop()
        if getattr(self, "_aio", (None,))[0] is not loop:
            pool = redis.asyncio.ConnectionPool.from_url(self.redis_url)
            timeout_s = pool.connection_kwargs.get("socket_timeout") or redis.asyncio.connection.DEFAULT_SOCKET_TIMEOUT
            pool.connection_kwargs["socket_timeout"] = None  # the claim's one timeout is its connections' too
            self._aio = (loop, pool, [], timeout_s)
        _, pool, spares, timeout_s = self._aio
        async with asyncio.timeout(timeout_s):
            conn = spares.pop() if spares else await pool.get_connection()
            try:
                await conn.send_packed_command([hiredis.pack_command(("EVALSHA", _CLAIM_SHA, 7, *args))],
                                               check_health=False)
                claimed = await conn.read_response()
            except redis.ResponseError:  # the reply was read whole: the connection is clean
                spares.append(conn)
                raise
            except BaseException:  # lost, or cancelled with a reply unread: never used again
                await conn.disconnect()
                raise
        spares.append(conn)
        return claimed

    def claimed(self, uccs: list[str]) -> set[str]:
        return {u for u, token in self.claim_tokens(uccs).items() if token}

    def claim_tokens(self, uccs: list[str]) -> dict[str, str]:
        """Each account's claim token as the guard holds it ("": none)."""
        if not uccs:
            return {}
        return {u: v or "" for u, v in zip(uccs, self.r.hmget(keys.run_mailguard(self.run_id), uccs))}

    def restore_claims(self, uccs: Iterable[str]) -> None:
        """Puts back mail guards that a lost Redis forgot. Render tasks call it too, and they may
        add a guard but not expire one (redis_acl.py): the run's end sets the TTL (RunState.keep)."""
        guard = keys.run_mailguard(self.run_id)
        with self.r.pipeline(transaction=False) as p:
            for ucc in uccs:
                p.hsetnx(guard, ucc, "restored")
            p.execute()

    def claim_time(self, ucc: str) -> float:
        """When the claim the guard holds for `ucc` was taken (claimed_at)."""
        return claimed_at(self.r.hget(keys.run_mailguard(self.run_id), ucc))

    def release_mail(self, ucc: str, token: str) -> None:
        """Only after a definite non-delivery (5xx, or a 4xx we stopped retrying): a rerun may try
        again. Only while the guard still holds the claim's `token`: a mailing whose claim
        another driver's resend took over never frees that one's."""
        self.r.eval(_RELEASE_OWN, 1, keys.run_mailguard(self.run_id), ucc, token)


def claim_token(lease: str) -> str:
    """A claim's token: its driver's lease first (what _CLAIM's resend compares), then when it was
    taken (claimed_at: its mailer records the relay's answer after it, on the same clock), then
    its own."""
    return lease[:8].ljust(8, "-") + f"{round(time.time() * 1000):011x}" + os.urandom(4).hex()


def claimed_at(token: str | None) -> float:
    """When a claim was taken (epoch seconds), from its token; 0.0 when the token does not say
    (one restored from storage, or made by a version before the time was in it)."""
    try:
        return int(token[8:19], 16) / 1000 if token and len(token) == 27 else 0.0
    except ValueError:
        return 0.0


def _evalsha(r: redis.Redis, args: list):
    """The claim's script on a connection kept for claims: redis-py's execute_command spends
    60-110 us of CPU around a 30-50 us call (its pool, retry wrapper and metrics), the largest
    part of a mail's cost in the mailer. A connection error falls back to the client, whose
    retries wait out a Redis restart; the claim's token makes the call safe to repeat."""
    spares = _spare_connections(r)
    conn = spares.pop() if spares else r.connection_pool.get_connection()
    try:
        conn.send_packed_command([hiredis.pack_command(("EVALSHA", _CLAIM_SHA, 7, *args))], check_health=False)
        return conn.read_response()
    except redis.ResponseError:  # the reply was read whole: the connection is clean
        raise
    except (redis.ConnectionError, redis.TimeoutError):
        conn.disconnect()
        return r.evalsha(_CLAIM_SHA, 7, *args)
    except BaseException:  # a reply may be left unread: never read by the next claim
        conn.disconnect()
        raise
    finally:
        spares.append(conn)


@lru_cache(maxsize=16)
def _spare_connections(r: redis.Redis) -> list:
    """Connections taken from `r`'s pool for claims and kept (list.pop and append are atomic)."""
    return []
