"""A run brought back into Redis from its record in storage, for a rerun or a look at it after
the Redis that ran it is gone (a cluster's Redis ends with the cluster).

The report holds every account's final status, the stage it reached and its Message-ID; each
shard's delivery log (stages.restore_from_log) adds whatever happened after the report was
written. Mail guards come back with the statuses, so an account that was delivered, or may
have been, is not mailed again by a plain rerun.
"""

from __future__ import annotations

import csv
import itertools
import json

from pipeline.day.split import load_manifest
from pipeline.record import keys
from pipeline.record.records import Outcome
from pipeline.record.state import RunNotFound, RunState
from pipeline.record.storage import Store
from pipeline.stages import restore_from_log

PAGE = 1000  # report rows a Redis round trip: the day is never held whole


def from_storage(store: Store, state: RunState, run_id: str) -> dict:
    """Writes the run's meta and account records into Redis; returns the meta."""
    json_key, csv_key = keys.report_keys(run_id)
    if not store.exists(json_key) or not store.exists(csv_key):
        raise RunNotFound(f"no run {run_id!r} in Redis, and no report for it in storage")
    report = json.loads(store.get(json_key))
    meta = {"date": report["trade_date"], "input": report.get("input", ""), "config": json.dumps({}),
            "relays": report.get("relays", ""), "finished": "", "restored_from": json_key}
    state.start(meta)
    state.update_meta(accounts=report["accounts"])
    rows = csv.DictReader(store.lines(csv_key))
    while page := [{k: _plain(v) for k, v in row.items()} for row in itertools.islice(rows, PAGE)]:
        state.record(o for row in page for o in _outcomes(row))
        state.restore_claims(r["ucc"] for r in page if r["status"] in ("delivered", "unconfirmed"))
    split = load_manifest(store, run_id)
    for shard in split.shards if split else []:  # what happened after the report (a later rerun, reconcile)
        restore_from_log(store, state, run_id, shard)
    return state.meta()


def _outcomes(row: dict) -> list[Outcome]:
    ucc, status, stage = row["ucc"], row["status"], row["stage"]
    reached = [Outcome(ucc, stage)] if stage and stage != "delivered" else []
    if status == "delivered":
        return [Outcome(ucc, "delivered", message_id=row["message_id"], reply=row["reply"],
                        extra={"attempts": int(row["attempts"] or 1)})]
    if status == "unconfirmed":
        return [*reached, Outcome(ucc, "delivered", "unconfirmed", row["reason"], message_id=row["message_id"],
                                  extra={"possible_duplicate": True} if row["possible_duplicate"] else {})]
    if status in ("failed", "rejected", "physical"):
        return [*reached, Outcome(ucc, row["failed_at"] or stage or "validated", status, row["reason"])]
    return reached  # pending: the same run id, run again, takes it from where it is


def _plain(value: str) -> str:
    """Undoes report._inert: the quote put before a cell a spreadsheet would run."""
    return value[1:] if value[:2] in ("'=", "'+", "'-", "'@", "'\t", "'\r") else value
