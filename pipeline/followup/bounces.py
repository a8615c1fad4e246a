"""`bounces RUN_ID --imap URL | --maildir DIR | --mbox FILE [--watch]`: the bounces that came
back to the run's VERP addresses, each mapped to its account and recorded.

A permanent failure makes the account `bounced` (a paper note is owed, by its due date), a
delay `deferred` (not final). Each result is written to the delivery log first (the record,
chained), then to Redis, then to the report. The log is the truth: a bounce it already holds
is never logged again (a reader killed between the log and Redis, run again, logs nothing
twice), and every pass leaves the report's bounce counts equal to what is recorded. The report
is written whole (it costs the day's accounts, not the bounces': ~30 s at 1.5M), so `--watch`
writes it at most every REPORT_EVERY_S, and when it stops.

One reader a run at a time (a lock of its own in Redis, not the run's lease: a reader watching
the 72-hour window does not stop a rerun). Many runs may share one bounce mailbox: a message
for another run (its run tag is in the VERP token) is left unseen for that run; only messages
this run recorded, or that no run can ever use, are marked seen. A bounce with a forged or
mangled token, for no account of the run, too big or unreadable is reported and changes no
account; any error reading one message refuses that message, never the batch. A DSN whose
token names one account and whose returned Message-ID another is recorded for the token's
account and flagged `token_mismatch`. After `close`, a genuine bounce is logged as refused
after close (all the seal allows) and counted, and changes nothing else.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator

from pipeline import credentials
from pipeline.followup import opened
from pipeline.mail import bounce, verp
from pipeline.mail.mailbox import Message, describe, open_source
from pipeline.record import delivery_log, keys, report
from pipeline.record.lease import reader
from pipeline.record.records import stamp
from pipeline.record.state import RunState
from pipeline.record.storage import read_json
from pipeline.settings import Settings

log = logging.getLogger("pipeline.bounces")
REPORT_EVERY_S = 300.0
BATCH = 2000  # messages read, then recorded, at a time
APPENDS = 16  # delivery-log reads and appends in flight on S3 (one per shard a poll's bounces fall in)
CODES = {1: "applied", 0: "already recorded", -1: "no such account in the run", -2: "not mailed in the run"}
MISMATCH = "token_mismatch"


@dataclass
class Tally:
    read: int = 0
    applied: dict[str, int] = field(default_factory=lambda: {"bounced": 0, "deferred": 0})
    unchanged: int = 0
    refused: int = 0
    token_mismatch: int = 0
    refused_after_close: int = 0
    left_for_other_runs: int = 0
    refused_first: list[dict] = field(default_factory=list)  # {"message", "why"}: the first 50

    def refuse(self, name: str, why: str) -> None:
        self.refused += 1
        if len(self.refused_first) < 50:
            self.refused_first.append({"message": name, "why": why})


@dataclass(frozen=True)
class Found:
    """A message mapped to an account of the run."""

    ucc: str
    bounce: bounce.Bounce
    name: str
    mismatch: bool  # its token names this account, its returned Message-ID another


def collect(settings: Settings, run_id: str, sources: list[str], watch: bool = False, every_s: float = 30.0,
            on_applied=lambda kind, n: None, store_url: str | None = None,
            stop: Callable[[], bool] = lambda: False) -> dict:
    """On the run's own store and HMAC key (located.py), unless `store_url` names a copy of its record.
    A watch ends once `stop()` is true, once what it has read is recorded: its bounces recorded,
    counted and marked seen (a stop raised inside it could leave one in Redis that the summary does
    not count); a backlog's rest stays unseen for the next reader."""
    with opened.open_run(settings, run_id, store_url, command="bounces", hold=False, sealed_ok=True) as run:
        return {"run_id": run_id, **run.where(), "sources": [describe(s) for s in sources],
                **_collect(run, sources, watch, every_s, on_applied, stop)}


def _collect(run: opened.OpenRun, sources: list[str], watch: bool, every_s: float, on_applied,
             stop: Callable[[], bool]) -> dict:
    """Not under the run's lease: bounces are read while a rerun mails (`reader` keeps it to one reader)."""
    settings = credentials.resolve(run.settings)  # the secret's token_key checks the tokens
    store, state, split, run_id = run.store, run.state, run.split, run.state.run_id
    boxes = [open_source(s, settings.bounce_max_bytes) for s in sources]
    v, tally = verp.Verp(settings.bounce_local, settings.bounce_domain, settings.hmac_key()), Tally()
    written = time.monotonic()
    with reader(state.r, keys.run_bounce_reader(run_id), f"run {run_id}'s bounces", settings.lease_s):
        try:
            stopped = lambda: watch and stop()  # noqa: E731
            while True:  # --watch ends with Ctrl-C or SIGTERM (cmd_bounces: `stop`): what was read is recorded
                meta = state.meta()
                for box in boxes:
                    unseen = box.unseen()
                    while messages := _taken(unseen, stopped):
                        box.seen(apply(store, state, split.shard_count, v, messages, tally, on_applied,
                                       settings.bounce_max_bytes, meta.get("message_ids") == "keyed",
                                       bool(meta.get("closed_at"))))
                        if stopped():
                            break
                    if stopped():
                        break
                if not watch or time.monotonic() - written > REPORT_EVERY_S:
                    _report_level(store, state, run_id, settings.paper_due_days)
                    written = time.monotonic()
                if not watch or _stopped_within(every_s, stop):
                    break
        except KeyboardInterrupt:  # a second Ctrl-C or SIGTERM: at once
            if not watch:
                raise
        finally:
            for box in boxes:
                box.close()
            if watch:  # stopped while watching: what was recorded reaches the report
                _report_level(store, state, run_id, settings.paper_due_days)
    return {"read": tally.read,
            "bounced": tally.applied["bounced"], "deferred": tally.applied["deferred"],
            "unchanged": tally.unchanged, "refused": tally.refused, "token_mismatch": tally.token_mismatch,
            "refused_after_close": tally.refused_after_close, "left_for_other_runs": tally.left_for_other_runs,
            "refused_first": tally.refused_first}


def _taken(unseen: Iterator[Message], stopped: Callable[[], bool]) -> list[Message]:
    """The next batch: BATCH messages (memory: a batch, not the mailbox), fewer once `stopped()`,
    so a stop ends a backlog's poll at the message being read (IMAP fetches one a round trip: a
    whole batch from a distant server could outlast a service manager's patience)."""
    batch = []
    for m in itertools.islice(unseen, BATCH):
        batch.append(m)
        if stopped():
            break
    return batch


def _stopped_within(seconds: float, stop: Callable[[], bool]) -> bool:
    """Whether `stop()` came true within `seconds`, asked every 0.1 s (a flag a signal handler
    sets: an Event's lock taken in a handler can deadlock its own thread)."""
    until = time.monotonic() + seconds
    while not stop():
        if time.monotonic() >= until:
            return False
        time.sleep(min(0.1, max(0.0, until - time.monotonic())))
    return True


def _report_level(store, state: RunState, run_id: str, due_days: int) -> None:
    """The report again if its bounce counts are not what Redis holds (a bounce recorded, or a
    pass after a reader died between Redis and the report). A closed run's report is sealed."""
    json_key = keys.report_keys(run_id)[0]
    if not store.exists(json_key) or state.meta().get("closed_at"):
        return
    counts, said = state.final_counts(), read_json(store, json_key)
    if (said.get("bounced", 0), said.get("deferred", 0)) != (counts["bounced"], counts["deferred"]):
        report.rewrite(store, state, run_id, due_days)


def apply(store, state: RunState, shards: int, v: verp.Verp, messages: list[Message], tally: Tally,
          on_applied=lambda kind, n: None, max_bytes: int = 5_000_000, keyed: bool = True,
          closed: bool = False) -> list[Message]:
    """Parses, maps, then records a poll's worth of bounces: the log, then Redis. Returns the
    messages to mark seen: those recorded for this run, or that no run can ever use (a message
    for another run is left for it)."""
    found: dict[str, Found] = {}
    seen, pattern = [], v.pattern()
    for m in messages:
        tally.read += 1
        try:
            mapped, why, usable_elsewhere = _map(m, v, pattern, state.run_id, keyed, max_bytes)
        except Exception as e:  # whatever one message does (RecursionError included), the batch goes on
            mapped, why, usable_elsewhere = None, f"not a readable message ({type(e).__name__})", False
        if mapped is None and usable_elsewhere:
            tally.left_for_other_runs += 1
            continue
        seen.append(m)
        if mapped is None:
            tally.refuse(m.name, why)
        elif not (mapped.ucc in found and found[mapped.ucc].bounce.kind == "bounced"):
            found[mapped.ucc] = mapped  # a permanent failure is what counts; a delay after it changes nothing
    if found:
        _record(store, state, shards, found, tally, on_applied, closed)
    return seen


def _map(m: Message, v: verp.Verp, pattern, run_id: str, keyed: bool, max_bytes: int) -> tuple[Found | None, str, bool]:
    """(the account it is for, or None with why, and whether another run may use it)."""
    if m.raw is None:
        return None, f"{m.size:,} bytes, over CN_BOUNCE_MAX_BYTES: not read", False
    try:
        b = bounce.read(m.raw, pattern, max_bytes)
    except bounce.NotABounce as e:
        return None, str(e), False
    if b.token:
        t = verp.parse(b.token)
        if t is None:
            return None, "a mangled VERP token", False
        if t.run_tag != verp.run_tag(run_id):
            return None, "a bounce for another run", True
        if not verp.genuine(v.key, run_id, t):
            return None, "a forged VERP token (its HMAC does not match)", False
        named = _ucc_of(b.message_id)
        return Found(t.ucc, b, m.name, bool(named) and named != t.ucc), "", False
    if b.message_id:
        ucc = _ucc_of(b.message_id)
        domain = b.message_id.rsplit("@", 1)[-1].rstrip(">")  # the digest is the proof; the domain is the run's
        if ucc and keys.message_id(run_id, ucc, v.key if keyed else b"", domain) == b.message_id:
            return Found(ucc, b, m.name, False), "", False
        return None, "a Message-ID that is not the run's", True
    return None, "no VERP token and no original Message-ID in it", False


def _ucc_of(message_id: str) -> str:
    """The account a Message-ID of ours names (<digest.UCC@domain>), "" for any other."""
    digest, _, ucc = message_id.strip("<>").partition("@")[0].partition(".")
    return ucc if len(digest) == 24 else ""


def _record(store, state: RunState, shards: int, found: dict[str, Found], tally: Tally, on_applied,
            closed: bool) -> None:
    records = state.accounts(sorted(found))
    fresh = {}
    for ucc, f in found.items():
        rec = records.get(ucc)
        if rec is None:
            tally.refuse(f.name, CODES[-1])
            continue
        old = (rec.get("bounce") or {}).get("kind")
        if not closed and (old == "bounced" or old == f.bounce.kind):
            tally.unchanged += 1
            continue
        if rec.get("stage") != "delivered" and rec.get("status") != "unconfirmed":
            tally.refuse(f.name, CODES[-2])
            continue
        fresh[ucc] = f
    by_shard = defaultdict(dict)
    for ucc, f in fresh.items():
        by_shard[keys.shard_of(ucc, shards)][ucc] = f
    now = stamp()

    def log_new(item: tuple[int, dict[str, Found]]) -> None:
        """The shard's new entries, after what its log holds (the log is the truth)."""
        shard, mine = item
        held, end = delivery_log.scan(store, state.run_id, shard, ("bounced", "deferred", "refused_after_close"))
        logged = defaultdict(set)
        for e in held:
            logged[e["ucc"]].add((e["status"] == "refused_after_close", e.get("kind", e["status"])))
        entries = []
        for ucc, f in mine.items():
            kind = f.bounce.kind
            if (closed, kind) in logged[ucc] or (not closed and (False, "bounced") in logged[ucc]):
                continue
            entry = {"ucc": ucc, "status": "refused_after_close" if closed else kind, "kind": kind,
                     "dsn_status": f.bounce.status, "reason": f.bounce.reason, "message_id": f.bounce.message_id,
                     "token": f.bounce.token, "at": now}
            entries.append(entry | ({MISMATCH: True} if f.mismatch else {}))
            logged[ucc].add((closed, kind))
        if entries:
            delivery_log.append(store, state.run_id, shard, entries, end)

    if store.url.startswith("s3://"):  # each shard is a LIST, GETs and a PUT: waited on together
        with ThreadPoolExecutor(APPENDS) as pool:
            list(pool.map(log_new, by_shard.items()))
    else:  # a folder is faster without threads
        for item in by_shard.items():
            log_new(item)
    tally.token_mismatch += sum(f.mismatch for f in fresh.values())
    if closed:
        tally.refused_after_close += len(fresh)
        return
    codes = state.bounce([(ucc, f.bounce.kind, f.bounce.status, _reason(f), now) for ucc, f in fresh.items()])
    for f, code in zip(fresh.values(), codes):
        if code == 1:
            tally.applied[f.bounce.kind] += 1
            on_applied(f.bounce.kind, 1)
        elif code == 0:
            tally.unchanged += 1
        else:
            tally.refuse(f.name, CODES[code])
    log.info("run %s: %d bounced, %d deferred so far; %d unchanged, %d refused", state.run_id,
             tally.applied["bounced"], tally.applied["deferred"], tally.unchanged, tally.refused)


def _reason(f: Found) -> str:
    return f"[{MISMATCH}: the returned Message-ID names another account] {f.bounce.reason}"[:300] if f.mismatch \
        else f.bounce.reason
