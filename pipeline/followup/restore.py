"""A run brought back into Redis from its record in storage, for a rerun or a look at it after
the Redis that ran it is gone (a cluster's Redis ends with the cluster).

The report holds every account's final status, the stage it reached and its Message-ID; each
shard's delivery log (stages.restore_from_log) adds whatever happened after the report was
written. Mail guards come back with the statuses, so an account that was delivered, or may
have been, is not mailed again by a plain rerun.
"""

from __future__ import annotations

import csv
import datetime as dt
import itertools
import json

from pipeline.day.dumps import UCC
from pipeline.record import keys, made_with
from pipeline.errors import RunNotFound
from pipeline.record.manifest import load_manifest
from pipeline.record.records import Outcome
from pipeline.record.report import read_report, started_at as report_started_at
from pipeline.record.state import RunState
from pipeline.record.storage import StorageError, Store
from pipeline.stages import load_shard, restore_from_log

PAGE = 1000  # report rows a Redis round trip: the day is never held whole
STATUSES = ("delivered", "unconfirmed", "failed", "rejected", "physical", "pending", "bounced", "deferred")


def from_storage(store: Store, state: RunState, run_id: str) -> dict:
    """Writes the run's account records, then its meta, into Redis; returns the meta. Until
    the meta is written Redis holds no run: a restore stopped by an edited object is done again
    in full, never taken for the run."""
    json_key, csv_key = keys.report_keys(run_id)
    if not store.exists(json_key) or not store.exists(csv_key):
        raise RunNotFound(f"no run {run_id!r} in Redis, and no report for it in storage")
    report = read_report(store, json_key)
    rows = csv.DictReader(store.lines(csv_key))
    while page := [_row(store, csv_key, rows.line_num, row) for row in itertools.islice(rows, PAGE)]:
        state.record(o for row in page for o in _outcomes(row))
        state.restore_claims(r["ucc"] for r in page if r["status"] in ("delivered", "unconfirmed", "bounced", "deferred"))
        state.bounce([(r["ucc"], r["status"], r["bounce_status"], r["bounce_reason"], r["bounced_at"])
                      for r in page if r["status"] in ("bounced", "deferred") and r["bounced_at"]])
    split = load_manifest(store, run_id)
    made = {k: v for k, v in report.items() if k in made_with.KEYS}  # else: not recorded
    made = made_with.stronger(made, split.made_with) if made and split else made
    for shard in split.shards if split else []:  # what happened after the report (a later rerun, reconcile, a bounce)
        restore_from_log(store, state, run_id, shard, {a["ucc"] for a in load_shard(store, run_id, shard)},
                         report.get("records_read_at") or _number(report.get("finished_at")) or None)
    window = report.get("bounce_window", {})
    closed = window.get("closed_at") or ""
    started = report_started_at(report)  # the run's first start, not this rebuild's (None: not recorded)
    last = _number(report.get("last_started_at")) or started
    state.start({"date": report["trade_date"], "input": report.get("input", ""), "config": json.dumps({}),
                 **({"started": started, "last_started": last} if started else {}),
                 "relays": report.get("relays", ""), "finished": _number(report.get("finished_at")),
                 "notes_per_s": _number(report.get("notes_per_s")),
                 "message_ids": report.get("message_ids", ""),  # keyed: a bounce's returned Message-ID is checked so
                 **made,
                 "bounce_window_h": _number(window.get("hours")),
                 "closed_at": dt.datetime.fromisoformat(closed).timestamp() if closed else "",
                 "restored_from": json_key, **{f: report.get(f, "") for f in keys.RECORD_FIELDS},
                 "store_url": store.url})
    state.update_meta(accounts=report["accounts"])
    state.keep()
    return state.meta()


def _row(store: Store, key: str, line: int, row: dict) -> dict:
    row = {k: _plain(v) for k, v in row.items()}
    ok = UCC.match(row.get("ucc") or "") and row.get("status") in STATUSES
    try:
        row["bounced_at"] = dt.datetime.fromisoformat(row["bounced_at"]).timestamp() if row.get("bounced_at") else ""
    except ValueError:
        ok = False
    if not ok:
        raise StorageError(f"{store.url}: object {key!r} line {line}: not a report row (its ucc, status or bounced_at "
                           "was edited)")
    return row


def _outcomes(row: dict) -> list[Outcome]:
    ucc, status, stage = row["ucc"], row["status"], row["stage"]
    reached = [Outcome(ucc, stage)] if stage and stage != "delivered" else []
    if status in ("delivered", "bounced", "deferred"):
        return [Outcome(ucc, "delivered", message_id=row["message_id"], reply=row["reply"],
                        extra={"attempts": int(row["attempts"] or 1)})]
    if status == "unconfirmed":
        return [*reached, Outcome(ucc, "delivered", "unconfirmed", row["reason"], message_id=row["message_id"],
                                  extra={"possible_duplicate": True} if row["possible_duplicate"] else {})]
    if status in ("failed", "rejected", "physical"):
        return [*reached, Outcome(ucc, row["failed_at"] or stage or "validated", status, row["reason"])]
    return reached  # pending: the same run id, run again, takes it from where it is


def _number(value) -> float | str:
    return float(value) if isinstance(value, (int, float)) else ""


def _plain(value: str) -> str:
    """Undoes report._inert: the quote put before a cell a spreadsheet would run."""
    return value[1:] if value[:2] in ("'=", "'+", "'-", "'@", "'\t", "'\r") else value
