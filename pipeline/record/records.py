"""The account record in Redis: one compact JSON value per account, the stage counters and
the failed and unconfirmed registries, all moved by one Lua call per batch.

An account's record holds the furthest stage it reached, its status, the events out of the
ordinary (failures, reruns) and its delivery attempts; the delivery log in storage is the
record of every mailing. Stage counters move only when an account reaches a stage for the
first time, inside the same call as the record write, so reruns and Ray's retries never
double count and counters stay O(1) to read. Writes are batched: one pipeline round trip
per shard.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterable, Iterator

import redis

from pipeline.record import keys
from pipeline.record.statuses import PAPER_REPLY, final_status

STAGES = ("validated", "rendered", "signed", "archived", "delivered")
FINAL_STATUSES = ("delivered", "unconfirmed", "failed", "rejected", "physical", "pending", "bounced", "deferred")
BOUNCE_KINDS = {"bounced": "b", "deferred": "d"}  # a permanent failure (5.x.x); a delay (4.x.x), not final


def rank(stage: str) -> int:
    """How far along a stage is: 1 for validated ... 5 for delivered (0: nowhere yet)."""
    return STAGES.index(stage) + 1


# An account's record is compact JSON, so that 1.5M of them fit a small head (issue 11: at
# most 400 bytes an account with the mail guard). The ucc is the field name, the Message-ID
# is derived from run and ucc ("m": 1 unkeyed, as a run before keyed ones; else its 24-digit
# digest alone, the rest follows from the ucc) and a stage is its rank:
#   r  furthest stage reached (0: none)   s  status code, absent when ok (STATUS_CODES)
#   f  rank of the stage that failed      e  reason          p  the relay's reply
#   t  time of the last outcome           n  delivery attempts, absent when 0
#   x  extra flags of the last outcome    h  the out-of-the-ordinary events only
#   b  the bounce that came back after delivery: [kind b|d, DSN status, reason, time]
# A later outcome never erases a recorded Message-ID or reply (a second attempt that found
# the mail claimed has neither), nor the possible-duplicate mark once set.
# A stage reached on the first try is not kept as an event: it follows from r. An event is
# kept when it failed, was refused, skipped or unconfirmed, or repeated a stage already
# reached: [stage rank, status code, reason, time, r before it]. An account is in at most one
# registry: failed (rerun --failed) or unconfirmed (reconcile). A delivered account is never on
# the unconfirmed one: a forced mail whose answer was lost has the earlier mail's Message-ID,
# which the relay's log shows accepted, and `rerun --unconfirmed` does not mail it again.
# One call records a batch: KEYS: accounts, counts, failed, unconfirmed. ARGV: now, ttl, then
# per account: ucc, record json, stage rank, stage, registry (f, u or empty)
# Each account's final status (final_status below) is counted too, in the counts hash as
# st:{status}, moved from the old status to the new one by the call that changes it: the
# statuses add up to the run's accounts after any mix of restore, rerun, reconcile, bounces.
# So is the count of the accounts owed a paper note (statuses.owes_paper), as PAPER_OWED.
_FINAL = """
local function final(rec)
  if (rec['r'] or 0) >= 5 then
    if type(rec['b']) == 'table' then return rec['b'][1] == 'b' and 'bounced' or 'deferred' end
    return 'delivered'
  end
  local named = {u = 'unconfirmed', f = 'failed', r = 'rejected', p = 'physical'}
  return named[rec['s'] or 'k'] or 'pending'
end
local function owes(rec, status)
  return status == 'physical' or status == 'bounced'
    or (status == 'failed' and string.find(rec['e'] or '', 'PAPER_REPLY', 1, true) ~= nil)
end
local function moved(counts, before, after, owed_before, owed_after)
  if owed_before ~= owed_after then redis.call('HINCRBY', counts, 'paper:owed', owed_after and 1 or -1) end
  if before == after then return end
  if before then redis.call('HINCRBY', counts, 'st:' .. before, -1) end
  redis.call('HINCRBY', counts, 'st:' .. after, 1)
end
"""
_FINAL = _FINAL.replace("PAPER_REPLY", PAPER_REPLY)  # the Lua twin of statuses.owes_paper
RECORD_FN = _FINAL + """
local function record(K, now, ttl, A, first)
if #A < first then return end
for i = first, #A, 5 do
  local ucc = A[i]
  local prev = redis.call('HGET', K[1], ucc)
  local rec = cjson.decode(A[i + 1])
  local g = rec['g']
  rec['g'] = nil
  local prev_rank, h, n, before, owed = 0, nil, 0, nil, false
  if prev then
    local p = cjson.decode(prev)
    before = final(p)
    owed = owes(p, before)
    prev_rank, h, n = p['r'] or p['rank'] or 0, p['h'], p['n'] or p['attempts'] or 0
    rec['m'], rec['p'], rec['b'] = rec['m'] or p['m'], rec['p'] or p['p'], p['b']
    if type(p['x']) == 'table' and p['x']['possible_duplicate'] then
      if type(rec['x']) ~= 'table' then rec['x'] = {} end
      rec['x']['possible_duplicate'] = true
    end
  end
  if (rec['s'] ~= nil and rec['s'] ~= 'p') or g <= prev_rank then
    h = h or {}
    table.insert(h, {g, rec['s'] or 'k', rec['e'] or '', rec['t'], prev_rank})
  end
  rec['h'] = h
  rec['n'] = n + (rec['n'] or 0)
  if rec['n'] == 0 then rec['n'] = nil end
  if prev_rank > rec['r'] then rec['r'] = prev_rank end
  redis.call('HSET', K[1], ucc, cjson.encode(rec))
  local after = final(rec)
  moved(K[2], before, after, owed, owes(rec, after))
  if tonumber(A[i + 2]) > prev_rank then redis.call('HINCRBY', K[2], A[i + 3], 1) end
  local registry = A[i + 4]
  if registry == 'u' and rec['r'] >= 5 then registry = '' end  -- a forced mail's lost answer: see above
  if registry == 'f' then redis.call('ZADD', K[3], now, ucc) else redis.call('ZREM', K[3], ucc) end
  if registry == 'u' then redis.call('ZADD', K[4], now, ucc) else redis.call('ZREM', K[4], ucc) end
end
for i = 1, 4 do redis.call('EXPIRE', K[i], ttl) end
end
"""
_RECORD = RECORD_FN + "record(KEYS, ARGV[1], ARGV[2], ARGV, 3)\n"
# The same for accounts Redis holds no record of, in the same call: the others are left as they
# are (an assembly run twice at once validates its accounts once, and never resets a later stage)
_RECORD_NEW = RECORD_FN + """
local new = {}
for i = 3, #ARGV, 5 do
  if not redis.call('HGET', KEYS[1], ARGV[i]) then
    for j = i, i + 4 do table.insert(new, ARGV[j]) end
  end
end
record(KEYS, ARGV[1], ARGV[2], new, 1)
"""
# A bounce lands on a mailed account only (delivered or unconfirmed), once: the same again
# changes nothing, a delay never replaces a permanent failure. KEYS: accounts, counts.
# ARGV: ttl, then per account: ucc, kind, status, reason, time. Returns a code per account:
# 1 applied, 0 already so, -1 no such account, -2 not mailed.
_BOUNCE = _FINAL + """
local out = {}
for i = 2, #ARGV, 5 do
  local raw = redis.call('HGET', KEYS[1], ARGV[i])
  if not raw then table.insert(out, -1) else
    local rec = cjson.decode(raw)
    local old = type(rec['b']) == 'table' and rec['b'][1] or nil
    if (rec['r'] or 0) < 5 and rec['s'] ~= 'u' then table.insert(out, -2)
    elseif old == 'b' or old == ARGV[i + 1] then table.insert(out, 0)
    else
      local before = final(rec)
      local owed = owes(rec, before)
      rec['b'] = {ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], tonumber(ARGV[i + 4])}
      redis.call('HSET', KEYS[1], ARGV[i], cjson.encode(rec))
      local after = final(rec)
      moved(KEYS[2], before, after, owed, owes(rec, after))
      if old then redis.call('HINCRBY', KEYS[2], old == 'b' and 'bounced' or 'deferred', -1) end
      redis.call('HINCRBY', KEYS[2], ARGV[i + 1] == 'b' and 'bounced' or 'deferred', 1)
      table.insert(out, 1)
    end
  end
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[1])
return out
"""
PAPER_OWED = "paper:owed"  # the counts hash's field of the accounts owed paper (owes() above)
RECORD_BATCH = 500  # accounts a call: a script blocks Redis while it runs, a few ms at most
STATUS_CODES = {"failed": "f", "rejected": "r", "physical": "p", "skipped": "s", "unconfirmed": "u", "ok": "k"}
_STATUSES = {c: s for s, c in STATUS_CODES.items()}
_BOUNCES = {c: k for k, c in BOUNCE_KINDS.items()}


def rejected_at_validation(records: dict[str, dict]) -> list[str]:
    """The accounts (of `records`, by ucc) no rerun takes: their input itself is wrong, and a
    rerun reads the same input."""
    return sorted(u for u, r in records.items() if r.get("failed_at") == "validated")


@dataclass
class Outcome:
    """What happened to one account at one stage."""

    ucc: str
    stage: str
    status: str = "ok"  # ok | failed | rejected | physical | skipped | unconfirmed
    reason: str = ""
    message_id: str = ""
    reply: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.status in ("failed", "rejected")

    @property
    def registry(self) -> str:
        return "f" if self.failed else "u" if self.status == "unconfirmed" else ""



def stamp() -> float:
    """Now, to the millisecond, never before now: a rerun counts the records made since its start,
    and one made 0.4 ms after it, rounded to the nearest millisecond, read as made before it."""
    return math.ceil(time.time() * 1000) / 1000


_SCRIPTS = {script: hashlib.sha1(script.encode()).hexdigest() for script in (_RECORD, _RECORD_NEW)}


class Records:
    """The record-keeping part of a RunState (which gives it `r`, `run_id` and `ttl_s`)."""

    def record(self, outcomes: Iterable[Outcome], only_new: bool = False) -> None:
        """One round trip for the lot, one script call per RECORD_BATCH accounts (EVALSHA in a
        pipeline; the script is loaded again only if the server lost it, e.g. after a restart).
        `only_new`: only the accounts Redis holds no record of (one atomic check each)."""
        now = stamp()
        args = list(self._record_args(outcomes, now))
        if not args:
            return
        script = _RECORD_NEW if only_new else _RECORD
        try:
            self._eval_all(_SCRIPTS[script], args, now)
        except redis.exceptions.NoScriptError:
            self.r.script_load(script)
            self._eval_all(_SCRIPTS[script], args, now)

    def _eval_all(self, sha: str, args: list, now: float) -> None:
        step = 5 * RECORD_BATCH
        with self.r.pipeline(transaction=False) as p:
            for i in range(0, len(args), step):
                p.evalsha(sha, 4, *self._record_keys(), now, self.ttl_s, *args[i:i + step])
            p.execute()

    def _record_keys(self) -> list[str]:
        return [keys.run_accounts(self.run_id), keys.run_counts(self.run_id), keys.run_failed(self.run_id),
                keys.run_unconfirmed(self.run_id)]

    def _record_args(self, outcomes: Iterable[Outcome], now: float) -> Iterator:
        for o in outcomes:
            reached = 0 if o.registry else rank(o.stage)  # failed or unconfirmed: the stage was not reached
            tries = o.extra.get("attempts", 1 if o.stage == "delivered" and o.status != "skipped" else 0)
            rec = {"r": reached, "g": rank(o.stage), "t": now, "n": tries, "s": STATUS_CODES[o.status],
                   "f": rank(o.stage) if o.failed else 0, "e": o.reason, "p": o.reply,
                   "m": _compact_mid(self.run_id, o.ucc, o.message_id),
                   "x": {k: v for k, v in o.extra.items() if k != "attempts"}}
            rec = {k: v for k, v in rec.items() if v or k in ("r", "g", "t")}
            if rec.get("s") == "k":
                del rec["s"]
            yield from (o.ucc, json.dumps(rec, separators=(",", ":")), reached, o.stage if reached else "", o.registry)

    def _decode(self, ucc: str, raw: str) -> dict:
        """The record as every reader sees it (field names of the report and the API)."""
        c = json.loads(raw)
        if "rank" in c:  # written before the compact record, by a run still within the retention
            return {**c, "ucc": ucc, "events": []}
        r, mid = c["r"], c.get("m", "")
        rec = {"ucc": ucc, "stage": STAGES[r - 1] if r else "", "rank": r, "status": _STATUSES[c.get("s", "k")],
               "failed_at": STAGES[c["f"] - 1] if "f" in c else "", "reason": c.get("e", ""),
               "message_id": _full_mid(self.run_id, ucc, mid), "reply": c.get("p", ""),
               "attempts": c.get("n", 0), "updated": c["t"], "events": c.get("h", [])}
        if "x" in c:
            rec["extra"] = c["x"]
        if "b" in c:
            kind, status, reason, at = c["b"]
            rec["bounce"] = {"kind": _BOUNCES[kind], "status": status, "reason": reason, "at": at}
        return rec

    def bounce(self, bounces: list[tuple[str, str, str, str, float]]) -> list[int]:
        """(ucc, kind, DSN status, reason, time) each; returns _BOUNCE's code for each."""
        args = [a for ucc, kind, status, reason, at in bounces for a in (ucc, BOUNCE_KINDS[kind], status, reason, at)]
        codes: list[int] = []
        for i in range(0, len(args), 5 * RECORD_BATCH):
            codes += self.r.eval(_BOUNCE, 2, keys.run_accounts(self.run_id), keys.run_counts(self.run_id), self.ttl_s,
                                 *args[i:i + 5 * RECORD_BATCH])
        return codes

    def statuses(self) -> dict[str, int]:
        """How many accounts stand at each final status (final_status): they add up to the
        accounts Redis holds. O(1): kept by the same calls that write the records."""
        found = {s: 0 for s in FINAL_STATUSES}
        found.update({k[3:]: int(v) for k, v in self.r.hgetall(keys.run_counts(self.run_id)).items()
                      if k.startswith("st:")})
        return found

    def paper_owed(self) -> int:
        """How many accounts are owed a paper note (statuses.owes_paper), kept as statuses() is."""
        return int(self.r.hget(keys.run_counts(self.run_id), PAPER_OWED) or 0)

    def accounts(self, uccs: list[str]) -> dict[str, dict]:
        if not uccs:
            return {}
        raw = self.r.hmget(keys.run_accounts(self.run_id), uccs)
        return {u: self._decode(u, v) for u, v in zip(uccs, raw) if v}

    def all_accounts(self) -> Iterator[dict]:
        for u, v in self.r.hscan_iter(keys.run_accounts(self.run_id), count=1000):
            yield self._decode(u, v)

    def page(self, cursor: int, limit: int, status: str | None = None, closed: bool = False) -> tuple[list[dict], int]:
        """A page of account records (HSCAN: stable under writes, O(page)); cursor 0 = done.
        `status` is the final one (`closed`: the run's bounce window ended, final_status)."""
        found: list[dict] = []
        while True:
            cursor, chunk = self.r.hscan(keys.run_accounts(self.run_id), cursor, count=limit)
            found += [r for r in (self._decode(u, v) for u, v in chunk.items())
                      if status is None or final_status(r, closed) == status]
            if cursor == 0 or len(found) >= limit:
                return found, cursor

    def failed(self) -> list[str]:
        return self.r.zrange(keys.run_failed(self.run_id), 0, -1)

    def unconfirmed(self) -> list[str]:
        return self.r.zrange(keys.run_unconfirmed(self.run_id), 0, -1)


def history(record: dict) -> list[dict]:
    """Every outcome of an account in order: the stages it reached on the first try (not
    stored: they follow from its furthest stage, without a time) around the events kept."""
    shown, out = 0, []
    for stage, code, reason, at, before in record["events"]:
        out += [{"stage": s, "status": "ok"} for s in STAGES[shown:before]]
        shown = max(shown, before)
        out.append({"stage": STAGES[stage - 1], "status": _STATUSES[code], "reason": reason, "at": at})
    out += [{"stage": s, "status": "ok"} for s in STAGES[shown:record["rank"]]]
    if record["rank"] > shown:  # the last outcome reached a stage: it is the record itself
        out[-1].update({"status": record["status"], "reason": record["reason"], "at": record["updated"],
                        "reply": record["reply"]})
    return out


@lru_cache(maxsize=1024)  # a shard's worth: a report of 1.5M accounts must not keep them all
def _message_id(run_id: str, ucc: str) -> str:
    return keys.message_id(run_id, ucc)


def _compact_mid(run_id: str, ucc: str, mid: str) -> str | int:
    """What a record keeps of a Message-ID: 1 for the unkeyed one, the digest of a keyed one
    of ours (the rest follows from the ucc), anything else whole."""
    if not mid:
        return mid
    if mid == _message_id(run_id, ucc):
        return 1
    digest = mid[1:25]
    return digest if keys.message_id_of(digest, ucc) == mid and "<" not in digest else mid


def _full_mid(run_id: str, ucc: str, kept: str | int) -> str:
    if kept == 1:
        return _message_id(run_id, ucc)
    return keys.message_id_of(kept, ucc) if kept and not kept.startswith("<") else kept


class StateWriter:
    """Batches outcome writes: flushed at `size` outcomes, or `max_age_s` after the first one
    still waiting, so a slow trickle (a shard with a 2000-page note) is never stuck in a
    buffer. A relay's reply does not come through here: it rides with the mailer's next claim
    (stages._record), 5 ms at most after it came."""

    def __init__(self, state: Records, size: int = 200, max_age_s: float = 0.5):
        self.state, self.size, self.max_age_s = state, size, max_age_s
        self._pending: list[Outcome] = []
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def add(self, outcome: Outcome) -> None:
        with self._lock:
            self._pending.append(outcome)
            if len(self._pending) >= self.size:
                self._flush_locked()
            elif self._timer is None:
                self._timer = threading.Timer(self.max_age_s, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pending:
            pending, self._pending = self._pending, []
            self.state.record(pending)

    def __enter__(self) -> "StateWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.flush()
