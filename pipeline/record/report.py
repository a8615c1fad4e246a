"""The run report: totals and timings as JSON, one CSV row per account, and the paper list
(reports/{run}.paper.csv: each account owed a physical note, why, and by when).

Written a page of accounts at a time (HSCAN) into local files, then uploaded (multipart on
S3), so writing it takes the same memory at 2,000 accounts as at 1.5 million; the JSON names
at most PAPER_IN_JSON of the accounts owed paper (physical_dispatch, the first met) with their
count, so it stays the same size too: the live page and `status` read it whole. Rows come in
Redis's scan order; sort the CSV by its first column for an alphabetical list. It is written
again whenever something changes an account after the run (reconcile, a bounce, close).
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import re
import tempfile
import time
from typing import TYPE_CHECKING, Iterator

from pipeline.record import keys
from pipeline.record.statuses import final_status, headline, owes_paper
from pipeline.record.storage import Garbled, NoObject, Store, read_json

if TYPE_CHECKING:  # the report's writers hold one; `verify`, which reads it, loads no Redis client
    from pipeline.record.state import RunState

CSV_FIELDS = ["ucc", "status", "stage", "failed_at", "reason", "message_id", "reply", "attempts", "physical_dispatch",
              "possible_duplicate", "bounced_at", "bounce_status", "bounce_reason", "due_date"]
PAPER_FIELDS = ["ucc", "why", "known_on", "due_date"]
PAGE = 1000
PAPER_IN_JSON = 1000  # the paper accounts the JSON names; the paper list names them all
DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}\Z")
IST = dt.timezone(dt.timedelta(hours=5, minutes=30))  # the exchanges' day, and the paper's due date


def paper_key(run_id: str) -> str:
    return f"reports/{run_id}.paper.csv"


def write(store: Store, state: RunState, run_id: str, summary: dict, input_errors: list[dict],
          due_days: int = 1) -> str:
    """Stores reports/{run}.csv, .paper.csv and .json; returns the JSON's key. `summary`
    needs the run's trade_date: the day an address-less client's paper note is owed from."""
    json_key, csv_key = keys.report_keys(run_id)
    tally = {"statuses": {}, "physical_dispatch": [], "paper_owed": 0}
    read_at = time.time()  # a delivery-log entry from then on may be news to it (restore.from_storage)
    meta = state.meta()
    with tempfile.NamedTemporaryFile("w", suffix=".csv", newline="", encoding="utf-8") as f, \
            tempfile.NamedTemporaryFile("w", suffix=".csv", newline="", encoding="utf-8") as paper:
        for chunk in csv_chunks(state, tally, summary.get("trade_date", ""), due_days, meta, paper):
            f.write(chunk)
        f.flush()
        paper.flush()
        store.put_file(csv_key, f.name)
        store.put_file(paper_key(run_id), paper.name)
    report = {**summary, "statuses": tally["statuses"], "stage_counts": state.counts(),
              "physical_dispatch": tally["physical_dispatch"], "physical_dispatch_count": tally["paper_owed"],
              "paper_list": paper_key(run_id),
              "bounce_window": bounce_window(meta), "input_errors": input_errors, "records_read_at": read_at}
    report.update(final_counts(report))  # the headline from the accounts just written, whatever the summary said
    store.put(json_key, json.dumps(report, indent=2, default=str).encode())
    return json_key


def rewrite(store: Store, state: RunState, run_id: str, due_days: int = 1, changed: dict | None = None) -> None:
    """The report again, after the run (reconcile, bounces, close, a rerun that stopped): the
    run's totals as it wrote them but for `changed`, its counts from its accounts now (write)."""
    json_key, _ = keys.report_keys(run_id)
    if not store.exists(json_key):
        return
    previous = read_json(store, json_key)
    summary = {k: v for k, v in previous.items() if k not in ("statuses", "stage_counts", "physical_dispatch",
                                                             "physical_dispatch_count", "input_errors", "bounce_window", "paper_list")}
    write(store, state, run_id, {**summary, **(changed or {})}, previous.get("input_errors", []), due_days)


def final_counts(report: dict) -> dict[str, int]:
    """A report's counts by final status and its paper owed: statuses.headline over the tally
    the report wrote, as the live views count Redis's (RunState.final_counts)."""
    window = report.get("bounce_window") or {}
    return headline(report.get("statuses") or {}, bool(window.get("closed_at")),
                    report.get("physical_dispatch_count", 0), report.get("accounts") or 0)


def started_at(report: dict) -> float | None:
    """When the run first started (a rerun's report keeps it); a report from before that field,
    its end less its duration (the last rerun's, if any)."""
    try:
        return float(report["started_at"]) if report.get("started_at") else \
            float(report["finished_at"]) - float(report["elapsed_s"])
    except (KeyError, TypeError, ValueError):
        return None


def window_h(meta: dict) -> float | None:
    """The bounce window the run recorded, in hours (0 included: a demo's), or None: a rerun and
    a close keep the run's own, never the shell's CN_BOUNCE_WINDOW_H."""
    value = meta.get("bounce_window_h")
    return None if value in (None, "") else float(value)


def bounce_window(meta: dict) -> dict:
    """Open until `closes_at` (the run's end plus CN_BOUNCE_WINDOW_H), then closed by `close`:
    every mailed account with no bounce is delivered, final."""
    window = {"hours": float(meta.get("bounce_window_h") or 0)}
    if meta.get("finished"):
        window["closes_at"] = iso(float(meta["finished"]) + window["hours"] * 3600)
    window["closed_at"] = iso(float(meta["closed_at"])) if meta.get("closed_at") else ""
    window["state"] = "closed" if window["closed_at"] else "open" if meta.get("finished") else "run not finished"
    return window


def csv_chunks(state: RunState, tally: dict | None = None, trade_date: str = "", due_days: int = 1,
               meta: dict | None = None, paper=None) -> Iterator[str]:
    """The CSV, a page of accounts at a time. `tally` (statuses, physical_dispatch, paper_owed)
    is filled as the pages go by: the count of each status, and of the accounts to print and
    post, the first PAPER_IN_JSON of them named; each of those is also written to `paper`, with
    the date its note is due."""
    meta = state.meta() if meta is None else meta
    closed = bool(meta.get("closed_at"))
    final = f"delivered, no bounce within {float(meta.get('bounce_window_h') or 0):g} h"
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")  # not DictWriter: a row's values, not its record's every field
    writer.writerow(CSV_FIELDS)
    papers = csv.DictWriter(paper, PAPER_FIELDS, lineterminator="\n") if paper is not None else None
    if papers:
        papers.writeheader()
    for n, rec in enumerate(state.all_accounts(), 1):
        status = final_status(rec, closed)
        bounce = rec.get("bounce") or {}
        if closed and status == "delivered":  # no permanent bounce within the window: final
            rec = {**rec, "reason": final}
        needs_paper = owes_paper(status, rec.get("reason", ""))
        known = _day(bounce["at"]) if status == "bounced" else trade_date
        due = _days_after(known, due_days) if needs_paper and known else ""
        if tally is not None:
            tally["statuses"][status] = tally["statuses"].get(status, 0) + 1
            if needs_paper:
                tally["paper_owed"] += 1
                if len(tally["physical_dispatch"]) < PAPER_IN_JSON:
                    tally["physical_dispatch"].append(rec["ucc"])
        if needs_paper and papers:
            why = f"bounced {bounce['status']}: {bounce['reason']}" if status == "bounced" else rec.get("reason", "")
            papers.writerow({k: _inert(v) for k, v in
                             {"ucc": rec["ucc"], "why": why, "known_on": known, "due_date": due}.items()})
        duplicate = "Y" if rec.get("extra", {}).get("possible_duplicate") else ""  # resent with the same Message-ID
        row = {**rec, "status": status, "physical_dispatch": "Y" if needs_paper else "", "possible_duplicate": duplicate,
               "bounced_at": iso(bounce["at"]) if bounce else "", "bounce_status": bounce.get("status", ""),
               "bounce_reason": bounce.get("reason", ""), "due_date": due}
        writer.writerow([_inert(row.get(k, "")) for k in CSV_FIELDS])
        if n % PAGE == 0:
            yield buf.getvalue()
            buf.seek(0)
            buf.truncate()
    yield buf.getvalue()


def due_date(known_at: float, due_days: int) -> str:
    """When a bounced client's paper note is due: days after the bounce, on the exchanges' calendar day."""
    return _days_after(_day(known_at), due_days)


def _days_after(day: str, days: int) -> str:
    return (dt.date.fromisoformat(day) + dt.timedelta(days=days)).isoformat()


def iso(at: float) -> str:
    """A time as every report and status gives it: ISO 8601, India time."""
    return dt.datetime.fromtimestamp(at, IST).isoformat(timespec="seconds")


def _day(at: float) -> str:
    return dt.datetime.fromtimestamp(at, IST).date().isoformat()


def _inert(value):
    """A cell a spreadsheet would run as a formula (= + - @, tab, CR first) gets a leading quote."""
    if isinstance(value, str) and value.startswith(_FORMULA):
        return "'" + value
    return value


_FORMULA = ("=", "+", "-", "@", "\t", "\r")


def of_run(store: Store, run_id: str) -> dict | None:
    """The run's stored report (read_report), None where none was written (yet)."""
    try:
        return read_report(store, keys.report_keys(run_id)[0])
    except NoObject:
        return None


def read_report(store: Store, key: str) -> dict:
    """The report's fields that go into keys and Redis, as the run wrote them: a date (it names
    the archive's folder), a count, strings. An edited report stops here, naming itself."""
    report = read_json(store, key)
    try:
        dt.date.fromisoformat(report["trade_date"])
        ok = DATE.match(report["trade_date"]) and isinstance(report["accounts"], int)
        window = report.get("bounce_window", {})
        if window.get("closed_at"):
            dt.datetime.fromisoformat(window["closed_at"])
    except (KeyError, TypeError, ValueError, AttributeError):
        ok = False
    if not ok or not all(isinstance(report.get(k, ""), str) for k in ("input", "relays")):
        raise Garbled(store.url, key, "is not a run report (its trade_date, accounts, input, relays or bounce "
                      "window were edited)")
    return report
