"""The delivery log: what each mailing of a shard did, kept in storage beside the signed archive.

One object per mailing of a shard, under the shard's fixed partition prefix. It is written
twice: before the first mail of the batch is claimed, with every account about to be tried
as "sending"; then, once the batch's replies are in, with each account's outcome
(Message-ID, relay reply, time, attempts). Two PUTs per shard of ~100 notes. Reconciling
with a relay's log adds an object of its own.

Redis is live state; this is the record. When Redis has lost a run, the mail guard and the
account stages are rebuilt from it before anything is mailed again. For each account the
entry with the latest time wins; a "sending" left behind by a mailing that died means the
mail may have left: unconfirmed, never resent blindly.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Container, Iterable, Iterator

from pipeline.record import keys
from pipeline.record.records import Outcome
from pipeline.record.storage import StorageError, Store

STATUSES = ("sending", "delivered", "unconfirmed", "failed")


def new_key(run_id: str, shard: int) -> str:
    """Unique per mailing; keys sort by the time the mailing began."""
    return f"{keys.delivery_log_prefix(run_id, shard)}{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.jsonl"


def sending(ucc: str, message_id: str) -> dict:
    return {"ucc": ucc, "status": "sending", "message_id": message_id, "at": time.time()}


def entry(o: Outcome) -> dict:
    """A mail outcome as the log keeps it; a mail skipped because an earlier attempt
    delivered it is logged as delivered again (that attempt may have died before logging)."""
    status = {"ok": "delivered", "skipped": "delivered"}.get(o.status, o.status)
    e = {"ucc": o.ucc, "status": status, "message_id": o.message_id, "reply": o.reply, "reason": o.reason,
         "at": time.time(), "attempts": o.extra.get("attempts", 0)}
    if o.extra.get("possible_duplicate"):
        e["possible_duplicate"] = True
    return e


def write(store: Store, key: str, entries: Iterable[dict]) -> None:
    """Written whole each time: the outcomes replace the "sending" list (even with nothing,
    when the batch stopped before its first claim)."""
    store.put(key, "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in entries).encode())


def entries(store: Store, run_id: str, shard: int | None = None) -> Iterator[dict]:
    """Every entry of a shard's mailings (or of the whole run), oldest mailing first."""
    prefixes = ([keys.delivery_log_prefix(run_id, shard)] if shard is not None else
                [f"{p}-delivery-log/{run_id}/" for p in range(keys.PARTITIONS)])
    for prefix in prefixes:
        for key in store.keys(prefix):
            for n, line in enumerate(store.lines(key), 1):  # streamed: an object is never held whole
                if line.strip():
                    yield _entry(store, key, n, line)


def _entry(store: Store, key: str, n: int, line: str) -> dict:
    try:
        e = json.loads(line)
        ok = isinstance(e, dict) and isinstance(e["ucc"], str) and e["status"] in STATUSES and float(e["at"]) >= 0
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:  # the record was edited or cut short: say where, and trust none of it
        raise StorageError(f"{store.url}: object {key!r} line {n}: not a delivery-log entry (truncated or edited?)")
    return e


def latest(log: Iterable[dict], accounts: Container[str] | None = None) -> dict[str, dict]:
    """Each account's latest entry (by time; a later mailing wins a tie), of `accounts` only
    when given: memory follows the shard, not the log's length."""
    found: dict[str, dict] = {}
    for e in log:
        if accounts is not None and e["ucc"] not in accounts:
            continue
        if e["ucc"] not in found or e["at"] >= found[e["ucc"]]["at"]:
            found[e["ucc"]] = e
    return found
