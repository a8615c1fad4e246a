"""The run report: totals and timings as JSON, one CSV row per account; the permanent record."""

from __future__ import annotations

import csv
import io
import json

from pipeline import keys
from pipeline.state import RunState, final_status
from pipeline.storage import Store

CSV_FIELDS = ["ucc", "status", "stage", "failed_at", "reason", "message_id", "reply", "attempts", "physical_dispatch",
              "possible_duplicate"]


def build(state: RunState, summary: dict, input_errors: list[dict]) -> tuple[dict, str]:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    statuses: dict[str, int] = {}
    physical = []
    for rec in sorted(state.all_accounts(), key=lambda r: r["ucc"]):
        status = final_status(rec)
        statuses[status] = statuses.get(status, 0) + 1
        needs_paper = status == "physical" or (status == "failed" and "smtp permanent" in rec.get("reason", ""))
        if needs_paper:
            physical.append(rec["ucc"])
        duplicate = "Y" if rec.get("extra", {}).get("possible_duplicate") else ""  # resent with the same Message-ID
        row = {**rec, "status": status, "physical_dispatch": "Y" if needs_paper else "", "possible_duplicate": duplicate}
        writer.writerow({k: _inert(v) for k, v in row.items()})
    report = {
        **summary,
        "statuses": statuses,
        "stage_counts": state.counts(),
        "physical_dispatch": physical,
        "input_errors": input_errors,
    }
    return report, buf.getvalue()


def _inert(value):
    """A cell a spreadsheet would run as a formula (= + - @, tab, CR first) gets a leading quote."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def write(store: Store, run_id: str, report: dict, rows_csv: str) -> tuple[str, str]:
    json_key, csv_key = keys.report_keys(run_id)
    store.put(json_key, json.dumps(report, indent=2, default=str).encode())
    store.put(csv_key, rows_csv.encode())
    return json_key, csv_key
