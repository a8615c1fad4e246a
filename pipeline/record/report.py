"""The run report: totals and timings as JSON, one CSV row per account; the permanent record.

Written a page of accounts at a time (HSCAN) into a local file, then uploaded (multipart on
S3), so writing it takes the same memory at 2,000 accounts as at 1.5 million. Rows come in
Redis's scan order; sort the CSV by its first column for an alphabetical list.
"""

from __future__ import annotations

import csv
import io
import json
import tempfile
from typing import Iterator

from pipeline.record import keys
from pipeline.record.records import final_status
from pipeline.record.state import RunState
from pipeline.record.storage import Store

CSV_FIELDS = ["ucc", "status", "stage", "failed_at", "reason", "message_id", "reply", "attempts", "physical_dispatch",
              "possible_duplicate"]
PAGE = 1000


def write(store: Store, state: RunState, run_id: str, summary: dict, input_errors: list[dict]) -> str:
    """Stores reports/{run}.csv and reports/{run}.json; returns the JSON's key."""
    json_key, csv_key = keys.report_keys(run_id)
    tally = {"statuses": {}, "physical_dispatch": []}
    with tempfile.NamedTemporaryFile("w", suffix=".csv", newline="", encoding="utf-8") as f:
        for chunk in csv_chunks(state, tally):
            f.write(chunk)
        f.flush()
        store.put_file(csv_key, f.name)
    report = {**summary, "statuses": tally["statuses"], "stage_counts": state.counts(),
              "physical_dispatch": tally["physical_dispatch"], "input_errors": input_errors}
    store.put(json_key, json.dumps(report, indent=2, default=str).encode())
    return json_key


def csv_chunks(state: RunState, tally: dict | None = None) -> Iterator[str]:
    """The CSV, a page of accounts at a time. `tally` (statuses, physical_dispatch) is filled
    as the pages go by: the accounts to print and post, and the count of each status."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for n, rec in enumerate(state.all_accounts(), 1):
        status = final_status(rec)
        needs_paper = status == "physical" or (status == "failed" and "smtp permanent" in rec.get("reason", ""))
        if tally is not None:
            tally["statuses"][status] = tally["statuses"].get(status, 0) + 1
            if needs_paper:
                tally["physical_dispatch"].append(rec["ucc"])
        duplicate = "Y" if rec.get("extra", {}).get("possible_duplicate") else ""  # resent with the same Message-ID
        row = {**rec, "status": status, "physical_dispatch": "Y" if needs_paper else "", "possible_duplicate": duplicate}
        writer.writerow({k: _inert(v) for k, v in row.items()})
        if n % PAGE == 0:
            yield buf.getvalue()
            buf.seek(0)
            buf.truncate()
    yield buf.getvalue()


def _inert(value):
    """A cell a spreadsheet would run as a formula (= + - @, tab, CR first) gets a leading quote."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value
