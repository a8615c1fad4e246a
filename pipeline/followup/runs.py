"""`runs`: the runs a store holds, newest first, each in one line: what an operator looks at
before anything else (as `ray job list` or Airflow's grid). Read from storage alone, so it
answers after the cluster and its Redis are gone: a run with a manifest and no report yet is
running, or stopped before its end (`status RUN` says which, while Redis has it)."""

from __future__ import annotations

from pipeline.followup.seal_state import BEGAN, SEALED, seal_state
from pipeline.record import keys
from pipeline.record.storage import Store, StorageError, read_json

MANIFEST = ".manifest.json"


def list_runs(store: Store) -> list[dict]:
    found = [k[len("reports/"):-len(MANIFEST)] for k in store.keys("reports/") if k.endswith(MANIFEST)]
    rows = [_row(store, run_id) for run_id in found]
    return sorted(rows, key=lambda r: (r["finished_at"] is not None, -(r["finished_at"] or 0), r["run_id"]))


def _row(store: Store, run_id: str) -> dict:
    json_key = keys.report_keys(run_id)[0]
    try:
        report = read_json(store, json_key) if store.exists(json_key) else {}
    except StorageError as e:  # an edited report is named, not a reason to list nothing
        report = {"problem": str(e)}
    statuses, seal = report.get("statuses") or {}, seal_state(store, run_id).state
    return {"run_id": run_id, "date": report.get("trade_date") or run_id[:10], "accounts": report.get("accounts"),
            "delivered": statuses.get("delivered", 0), "failed": statuses.get("failed", 0),
            "unconfirmed": statuses.get("unconfirmed", 0), "bounced": statuses.get("bounced", 0),
            "paper": statuses.get("physical", 0) + statuses.get("bounced", 0),
            "sealed": seal == SEALED, "seal": seal, "finished_at": report.get("finished_at"),
            "state": report.get("problem") or ("finished" if report else "no report: running, or stopped")}


def table(rows: list[dict]) -> str:
    head = ("run", "date", "accounts", "delivered", "failed", "unconfirmed", "bounced", "paper", "sealed")
    lines = [[r["run_id"], r["date"], str(r["accounts"] if r["accounts"] is not None else "-"), str(r["delivered"]),
              str(r["failed"]), str(r["unconfirmed"]), str(r["bounced"]), str(r["paper"]),
              "yes" if r["sealed"] else "began" if r["seal"] == BEGAN else "no" if r["finished_at"] else r["state"]]
             for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *lines)] if lines else [len(h) for h in head]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *lines])
