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
the 72-hour window does not stop a rerun). A reader and `close` never write the record at once
(_recording): a batch is read and recorded under a hold close also takes, and gives way to a
close that waits. Many runs may share one bounce mailbox: a message
for another run (its run tag is in the VERP token) is left unseen for that run; only messages
this run recorded, or that no run can ever use, are marked seen. A bounce with a forged or
mangled token, for no account of the run, too big or unreadable is reported and changes no
account; any error reading one message refuses that message, never the batch. A DSN whose
token names one account and whose returned Message-ID another is recorded for the token's
account and flagged `token_mismatch`. After `close`, a genuine bounce is logged as refused
after close (all the seal allows) and counted, and changes nothing else.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator

from pipeline import credentials
from pipeline.errors import CannotRun, RunNotFound
from pipeline.followup import opened
from pipeline.mail import bounce, verp
from pipeline.mail.mailbox import Message, describe, open_source
from pipeline.record import delivery_log, keys, report
from pipeline.record.lease import LeaseHeldError, held, reader
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
    left_unseen: int = 0  # genuine, for accounts Redis had no record of: read again by the next poll
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
    proven: bool = True  # by the run's HMAC (a token, or a keyed Message-ID): the run mailed this account


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
                try:
                    for box in boxes:
                        unseen = box.unseen()
                        while True:  # the record held, then a batch read (a stop heeded as each is read) and recorded
                            with _recording(run, settings.lease_s) as meta:
                                if messages := _taken(unseen, stopped):
                                    box.seen(apply(store, state, split.shard_count, v, messages, tally, on_applied,
                                                   settings.bounce_max_bytes, meta.get("message_ids") == "keyed",
                                                   bool(meta.get("closed_at"))))
                            if not messages or stopped():
                                break
                        if stopped():
                            break
                    if not watch or time.monotonic() - written > REPORT_EVERY_S:
                        with _recording(run, settings.lease_s):
                            _report_level(store, state, run_id, settings.paper_due_days)
                        written = time.monotonic()
                except NotNow as e:  # what this poll read stays unseen, for the next
                    if not watch:
                        raise
                    log.warning("%s: this poll's bounces are left unseen for the next", e)
                if not watch or _stopped_within(every_s, stop):
                    break
        except KeyboardInterrupt:  # a second Ctrl-C or SIGTERM: at once
            if not watch:
                raise
        finally:
            for box in boxes:
                box.close()
            if watch:  # stopped while watching: what was recorded reaches the report
                with contextlib.suppress(NotNow), _recording(run, settings.lease_s):
                    _report_level(store, state, run_id, settings.paper_due_days)
    return {"read": tally.read,
            "bounced": tally.applied["bounced"], "deferred": tally.applied["deferred"],
            "unchanged": tally.unchanged, "refused": tally.refused, "token_mismatch": tally.token_mismatch,
            "refused_after_close": tally.refused_after_close, "left_for_other_runs": tally.left_for_other_runs,
            "left_unseen": tally.left_unseen,
            "refused_first": tally.refused_first}


class NotNow(CannotRun, RuntimeError):
    """This reader cannot record now: what it read is left unseen, for its next poll (or the next reader)."""


@contextlib.contextmanager
def _recording(run: opened.OpenRun, lease_s: float) -> Iterator[dict]:
    """The run's meta, read while this reader holds the run's record against `close`
    (keys.run_recording, which close holds throughout): a bounce is logged as a bounce only
    while the run is open, and as refused after close once its close is done, never in
    between, where the seal would end before it or the sealed report miss it. A Redis that
    lost the run (restarted without its data) gets it back from storage first, as any
    follow-up brings it back: the accounts are there to record bounces against, not refused."""
    state = run.state
    if state.r.exists(keys.run_close_waiting(state.run_id)):  # a close waits for the record: it goes first
        raise NotNow(f"run {state.run_id}: a close is waiting to seal the run's record")
    with contextlib.ExitStack() as fenced:
        try:
            fenced.enter_context(reader(state.r, keys.run_recording(state.run_id), f"run {state.run_id}'s record",
                                        lease_s, by="being sealed by close",
                                        one="bounces are recorded before or after it, not during"))
        except LeaseHeldError as e:
            raise NotNow(str(e)) from None
        yield state.meta() or _brought_back(run, lease_s)


def _brought_back(run: opened.OpenRun, lease_s: float) -> dict:
    try:
        with held(run.state, lease_s):  # as open_run brings a run back: no driver rebuilds it meanwhile
            return run.meta()
    except (LeaseHeldError, RunNotFound) as e:  # a driver resuming it rebuilds it; or no report yet (mid-day)
        raise NotNow(f"Redis no longer holds run {run.state.run_id}, and it is not brought back now: {e}") from None


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
        unrecorded = _record(store, state, shards, found, tally, on_applied, closed)
        seen = [m for m in seen if m.name not in unrecorded]
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
            return Found(ucc, b, m.name, False, proven=keyed), "", False
        return None, "a Message-ID that is not the run's", True
    return None, "no VERP token and no original Message-ID in it", False


def _ucc_of(message_id: str) -> str:
    """The account a Message-ID of ours names (<digest.UCC@domain>), "" for any other."""
    digest, _, ucc = message_id.strip("<>").partition("@")[0].partition(".")
    return ucc if len(digest) == 24 else ""


def _record(store, state: RunState, shards: int, found: dict[str, Found], tally: Tally, on_applied,
            closed: bool) -> set[str]:
    """Returns the messages left unseen: a bounce the run's HMAC proves (its token, or a keyed
    Message-ID) names an account the run mailed, so one Redis has no record of is Redis's loss
    (an older snapshot), not the bounce's: it waits for the record, never dropped. An unkeyed
    Message-ID (a run from before the keys) proves nothing: refused, as anyone could make it."""
    records = state.accounts(sorted(found))
    fresh, unrecorded = {}, set()
    for ucc, f in found.items():
        rec = records.get(ucc)
        if rec is None:
            if f.proven:
                unrecorded.add(f.name)
            else:
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
    tally.left_unseen += len(unrecorded)
    if unrecorded:
        log.warning("run %s: %d bounces for accounts Redis has no record of: left unseen", state.run_id, len(unrecorded))
    if closed:
        tally.refused_after_close += len(fresh)
        return unrecorded
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
    return unrecorded


def _reason(f: Found) -> str:
    return f"[{MISMATCH}: the returned Message-ID names another account] {f.bounce.reason}"[:300] if f.mismatch \
        else f.bounce.reason
