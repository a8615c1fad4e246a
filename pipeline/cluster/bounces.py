"""`bounces RUN_ID --imap URL | --maildir DIR | --mbox FILE [--watch]`: the bounces that came
back to the run's VERP addresses, each mapped to its account and recorded.

A permanent failure makes the account `bounced` (a paper note is owed, by its due date), a
delay `deferred` (not final). Each result is written to the delivery log first (the record,
chained), then to Redis, then to the report; one already recorded is skipped, so the same
bounce read twice changes nothing. The report is written whole (it costs the day's accounts,
not the bounces': ~30 s at 1.5M), so `--watch` writes it at most every REPORT_EVERY_S, and
when it stops. A bounce with a forged or mangled token, for another run,
for no account of the run, too big or unreadable is reported and changes no account.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pipeline import credentials
from pipeline.cluster import located, restore
from pipeline.day.split import load_manifest
from pipeline.mail import bounce, verp
from pipeline.mail.mailbox import Message, describe, open_source
from pipeline.record import delivery_log, keys, report
from pipeline.record.lease import held
from pipeline.record.state import RunNotFound, RunState
from pipeline.settings import Settings

log = logging.getLogger("pipeline.bounces")
REPORT_EVERY_S = 300.0
BATCH = 2000  # messages read, then recorded, at a time
APPENDS = 16  # delivery-log appends in flight on S3 (one per shard a poll's bounces fall in)
CODES = {1: "applied", 0: "already recorded", -1: "no such account in the run", -2: "not mailed in the run"}


class RunClosed(RuntimeError):
    pass


@dataclass
class Tally:
    read: int = 0
    applied: dict[str, int] = field(default_factory=lambda: {"bounced": 0, "deferred": 0})
    unchanged: int = 0
    refused: int = 0
    refused_first: list[dict] = field(default_factory=list)  # {"message", "why"}: the first 50

    def refuse(self, name: str, why: str) -> None:
        self.refused += 1
        if len(self.refused_first) < 50:
            self.refused_first.append({"message": name, "why": why})


def collect(settings: Settings, run_id: str, sources: list[str], watch: bool = False, every_s: float = 30.0,
            on_applied=lambda kind, n: None, store_url: str | None = None) -> dict:
    """On the run's own store and HMAC key (located.py), unless `store_url` names a copy of its record."""
    found = located.locate(settings, run_id, store_url, writes=True, command="bounces")
    settings, store = credentials.resolve(found.settings), found.store  # the secret's token_key checks the tokens
    state = RunState(settings.redis_url, run_id, settings.state_ttl_s)
    split = load_manifest(store, run_id)
    if split is None:
        raise RunNotFound(f"no run {run_id!r} in {settings.store_url}")
    if not state.exists():  # its Redis is gone (a cluster's ends with the cluster): the record has it
        with held(state, settings.lease_s):
            restore.from_storage(store, state, run_id)
    if state.meta().get("closed_at"):
        raise RunClosed(f"run {run_id} was closed (its bounce window ended): a bounce now changes nothing")
    boxes = [open_source(s, settings.bounce_max_bytes) for s in sources]
    v, tally = verp.Verp(settings.bounce_local, settings.bounce_domain, settings.hmac_key()), Tally()
    changed, written = False, time.monotonic()
    try:
        while True:  # --watch ends with Ctrl-C or SIGTERM (cmd_bounces): what was read is recorded
            for box in boxes:
                unseen = box.unseen()
                while messages := list(itertools.islice(unseen, BATCH)):  # memory: a batch, not the mailbox
                    changed |= apply(store, state, split.shard_count, v, messages, tally, on_applied,
                                     settings.bounce_max_bytes)
                    box.seen(messages)
            if changed and (not watch or time.monotonic() - written > REPORT_EVERY_S):
                report.rewrite(store, state, run_id, settings.paper_due_days)
                changed, written = False, time.monotonic()
            if not watch:
                break
            time.sleep(every_s)
    except KeyboardInterrupt:
        if not watch:
            raise
    finally:
        for box in boxes:
            box.close()
        if changed:  # stopped while watching: what was recorded reaches the report
            report.rewrite(store, state, run_id, settings.paper_due_days)
    return {"run_id": run_id, "store": store.url, "store_from": found.source,
            "sources": [describe(s) for s in sources], "read": tally.read,
            "bounced": tally.applied["bounced"], "deferred": tally.applied["deferred"],
            "unchanged": tally.unchanged, "refused": tally.refused, "refused_first": tally.refused_first}


def apply(store, state: RunState, shards: int, v: verp.Verp, messages: list[Message], tally: Tally,
          on_applied=lambda kind, n: None, max_bytes: int = 5_000_000) -> bool:
    """Parses, maps, then records a poll's worth of bounces: the log, then Redis. True if an
    account changed (the report is then due)."""
    found: dict[str, tuple[bounce.Bounce, str]] = {}
    pattern = v.pattern()
    for m in messages:
        tally.read += 1
        if m.raw is None:
            tally.refuse(m.name, f"{m.size:,} bytes, over CN_BOUNCE_MAX_BYTES: not read")
            continue
        try:
            b = bounce.read(m.raw, pattern, max_bytes)
        except bounce.NotABounce as e:
            tally.refuse(m.name, str(e))
            continue
        ucc, why = _account(b, v.key, state.run_id)
        if ucc is None:
            tally.refuse(m.name, why)
            continue
        if ucc in found and found[ucc][0].kind == "bounced":
            continue  # a permanent failure is what counts; a delay after it changes nothing
        found[ucc] = (b, m.name)
    if not found:
        return False
    records = state.accounts(sorted(found))
    fresh = {}
    for ucc, (b, name) in found.items():
        rec = records.get(ucc)
        if rec is None:
            tally.refuse(name, CODES[-1])
            continue
        old = (rec.get("bounce") or {}).get("kind")
        if old == "bounced" or old == b.kind:
            tally.unchanged += 1
            continue
        if rec.get("stage") != "delivered" and rec.get("status") != "unconfirmed":
            tally.refuse(name, CODES[-2])
            continue
        fresh[ucc] = (b, name)
    now = round(time.time(), 3)
    by_shard = defaultdict(list)
    for ucc, (b, _) in fresh.items():  # the record first
        by_shard[keys.shard_of(ucc, shards)].append(
            {"ucc": ucc, "status": b.kind, "dsn_status": b.status, "reason": b.reason, "message_id": b.message_id,
             "token": b.token, "at": now})
    def append(item: tuple[int, list[dict]]) -> None:
        delivery_log.append(store, state.run_id, *item)

    if store.url.startswith("s3://"):  # each append is a LIST, a GET and a PUT: waited on together
        with ThreadPoolExecutor(APPENDS) as pool:
            list(pool.map(append, by_shard.items()))
    else:  # a folder is faster without threads
        for item in by_shard.items():
            append(item)
    codes = state.bounce([(ucc, b.kind, b.status, b.reason, now) for ucc, (b, _) in fresh.items()])
    for (b, name), code in zip(fresh.values(), codes):
        if code == 1:
            tally.applied[b.kind] += 1
            on_applied(b.kind, 1)
        elif code == 0:
            tally.unchanged += 1
        else:
            tally.refuse(name, CODES[code])
    log.info("run %s: %d bounced, %d deferred so far; %d unchanged, %d refused", state.run_id,
             tally.applied["bounced"], tally.applied["deferred"], tally.unchanged, tally.refused)
    return 1 in codes


def _account(b: bounce.Bounce, key: bytes, run_id: str) -> tuple[str | None, str]:
    """The account a bounce is for, by its VERP token, else by the original Message-ID."""
    if b.token:
        t = verp.parse(b.token)
        if t is None:
            return None, "a mangled VERP token"
        if t.run_tag != verp.run_tag(run_id):
            return None, "a bounce for another run"
        if not verp.genuine(key, run_id, t):
            return None, "a forged VERP token (its HMAC does not match)"
        return t.ucc, ""
    if b.message_id:
        local = b.message_id.strip("<>").partition("@")[0]
        digest, _, ucc = local.partition(".")
        if ucc and keys.message_id(run_id, ucc) == b.message_id:
            return ucc, ""
        return None, "a Message-ID that is not the run's"
    return None, "no VERP token and no original Message-ID in it"
