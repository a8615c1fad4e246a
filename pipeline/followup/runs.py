"""`runs`: the runs a store holds, newest first, each in one line: what an operator looks at
before anything else (as `ray job list` or Airflow's grid). Read from storage, so it answers
after the cluster and its Redis are gone: a run with a manifest and no report yet is running,
or stopped before its end. Its counts are its report's, through report.final_counts; a run
Redis holds is shown as Redis has it (`live`), as `status` and the live page show it: a rerun
under way is running there, while its report still says finished."""

from __future__ import annotations

import time

import redis

from pipeline.followup.seal_state import BEGAN, SEALED, run_phase, seal_state
from pipeline.record import keys, report as reports
from pipeline.record.state import RunState
from pipeline.record.storage import Store, StorageError, read_json

MANIFEST = ".manifest.json"
PHASES = ("running", "finished", "closing", "sealed")  # run_phase's words
HEAD = ("run", "date", "accounts", "delivered", "failed", "unconfirmed", "bounced", "rejected", "paper", "start",
        "duration", "state", "sealed")


def list_runs(store: Store, known: dict[str, dict] | None = None) -> list[dict]:
    """`known`: rows read before, by run id; a sealed run's is taken from it (a seal is never
    undone: the live page lists the store every half minute, and a year's runs are sealed)."""
    known = known or {}
    found = [k[len("reports/"):-len(MANIFEST)] for k in store.keys("reports/") if k.endswith(MANIFEST)]
    rows = [known[run_id] if run_id in known and known[run_id]["sealed"] else _row(store, run_id) for run_id in found]
    return _newest_first(rows)


def live(rows: list[dict], redis_url: str) -> list[dict]:
    """Each row of a run Redis holds as Redis has it (its counts, its end, whether close told it);
    the seal as storage has it. All as storage has them where Redis does not answer at once."""
    try:  # a Redis gone with its cluster is passed over at once, not after a connection's timeout
        redis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=2).ping()
        shown = [_live(row, RunState(redis_url, row["run_id"], patience_retries=0)) for row in rows]
    except redis.RedisError:
        return rows
    return _newest_first(shown)


def run_rate(meta: dict, delivered: int, now: float) -> float:
    """The run's notes a second: once a driver has ended, the figure it recorded (its report's,
    a rerun's own); while one runs, the notes it delivered over its time so far. Never over the
    pause before a rerun: a day mailed in minutes and rerun hours later was not slow."""
    if meta.get("finished") and meta.get("notes_per_s"):
        return float(meta["notes_per_s"])
    since = float(meta.get("last_started") or meta.get("started") or 0)
    end = float(meta["finished"]) if meta.get("finished") else now
    done = delivered - int(meta.get("delivered_at_start") or 0)
    return round(done / (end - since), 2) if since and end > since else 0.0


def _newest_first(rows: list[dict]) -> list[dict]:
    """Those not finished (running, or stopped before their end) first, then by their end."""
    return sorted(rows, key=lambda r: (r["finished_at"] is not None, -(r["finished_at"] or 0), r["run_id"]))


def _live(row: dict, state: RunState) -> dict:
    meta = state.meta()
    if not meta:
        return row
    final, finished = state.final_counts(meta), float(meta["finished"]) if meta.get("finished") else None
    started = row["started_at"] or (float(meta["started"]) if meta.get("started") else None)
    return {**row, **final, "paper": final["paper_owed"], "started_at": started, "finished_at": finished,
            "duration_s": round(finished - started, 3) if finished and started else None,
            "notes_per_s": run_rate(meta, state.counts()["delivered"], time.time()),  # as the live page says it
            "state": run_phase(bool(finished), bool(meta.get("closed_at")), row["seal"]) if row["state"] in PHASES
            else row["state"]}  # an edited report, named


def _row(store: Store, run_id: str) -> dict:
    json_key = keys.report_keys(run_id)[0]
    try:
        report = read_json(store, json_key) if store.exists(json_key) else {}
    except StorageError as e:  # an edited report is named, not a reason to list nothing
        report = {"problem": str(e)}
    final = reports.final_counts(report)
    seal = seal_state(store, run_id).state
    started, finished, is_sealed = reports.started_at(report), report.get("finished_at"), seal == SEALED
    closed = bool((report.get("bounce_window") or {}).get("closed_at"))
    return {"run_id": run_id, "date": report.get("trade_date") or run_id[:10], **final,
            "accounts": report.get("accounts"), "paper": final["paper_owed"], "sealed": is_sealed, "seal": seal,
            "started_at": started, "finished_at": finished,
            "duration_s": round(float(finished) - started, 3) if finished and started else None,
            "notes_per_s": float(report.get("notes_per_s") or 0),  # the last driver's: a rerun's own
            "state": report.get("problem") or run_phase(bool(finished), closed, seal)}


def table(rows: list[dict]) -> str:
    lines = [[r["run_id"], r["date"], str(r["accounts"] if r["accounts"] is not None else "-"), str(r["delivered"]),
              str(r["failed"]), str(r["unconfirmed"]), str(r["bounced"]), str(r["rejected"]), str(r["paper"]),
              reports.iso(r["started_at"]) if r["started_at"] else "-", _duration(r["duration_s"]),
              r["state"], "yes" if r["sealed"] else "began" if r["seal"] == BEGAN else "no"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(HEAD, *lines)] if lines else [len(h) for h in HEAD]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [HEAD, *lines])


def _duration(seconds: float | None) -> str:
    """From the run's first start to its last end (a rerun's), as 1h02m, 3m12s or 42s."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
