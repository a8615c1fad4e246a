"""`status RUN`: one run at a glance, in the same shape whether Redis still holds it or only its
report in storage does (a cluster's Redis ends with the cluster).

The shape's own keys (`trade_date` ... `next`, times in ISO 8601 as the report's, India time) come first; the sources'
raw keys follow as earlier releases printed them (`meta`, `counts`, `relays` from Redis; `report`
from storage), for the scripts that read those.
"""

from __future__ import annotations

from pipeline.record import report

PAPER = ("physical", "bounced")  # the statuses whose note is owed on paper


def from_redis(run_id: str, where: dict, meta: dict, counts: dict, statuses: dict, relays: dict,
               sealed: bool) -> dict:
    window = report.bounce_window(meta)
    shape = _shape(run_id, "redis", where, meta.get("date", ""), meta.get("input", ""), statuses,
                   counts.get("failed", 0), counts.get("unconfirmed", 0), meta.get("relays", ""),
                   _iso(meta.get("started")), _iso(meta.get("finished")), window, sealed)
    return {**shape, "meta": meta, "counts": counts, "relays": relays}


def from_report(run_id: str, where: dict, run_report: dict, sealed: bool) -> dict:
    statuses = run_report.get("statuses", {})
    shape = _shape(run_id, "storage", where, run_report.get("trade_date", ""), run_report.get("input", ""), statuses,
                   statuses.get("failed", 0), statuses.get("unconfirmed", 0), run_report.get("relays", ""),
                   _iso(_started(run_report)), _iso(run_report.get("finished_at")),
                   run_report.get("bounce_window", {}), sealed)
    return {**shape, "relays": {}, "report": run_report}


def _shape(run_id: str, source: str, where: dict, trade_date: str, input_url: str, statuses: dict, failed: int,
           unconfirmed: int, relay: str, started: str, finished: str, window: dict, sealed: bool) -> dict:
    statuses = {k: int(v) for k, v in sorted(statuses.items()) if int(v)}
    shape = {"run_id": run_id, "source": source, **where, "trade_date": trade_date, "input": input_url,
             "accounts": sum(statuses.values()), "statuses": statuses, "failed": failed, "unconfirmed": unconfirmed,
             "bounced": statuses.get("bounced", 0), "paper_owed": sum(statuses.get(s, 0) for s in PAPER),
             "relay": relay, "started_at": started, "finished_at": finished, "bounce_window": window,
             "sealed": sealed}
    return {**shape, "next": next_step(shape)}


def next_step(run: dict) -> str:
    """What the operator does next, in the order it matters: a failure first, the seal last."""
    rid, window = run["run_id"], run["bounce_window"]
    steps = []
    if not run["finished_at"]:
        return "wait: the run has not finished (its driver runs, or was lost: `runs`, then `run --run-id` resumes it)"
    if run["failed"]:
        steps.append(f"rerun {rid} --failed ({run['failed']} failed)")
    if run["unconfirmed"]:
        steps.append(f"reconcile {rid} --relay-log FILE, then rerun {rid} --unconfirmed ({run['unconfirmed']} "
                     "unconfirmed)")
    if run["paper_owed"]:
        steps.append(f"post {run['paper_owed']} paper notes (reports/{rid}.paper.csv)")
    if run["sealed"]:
        steps.append(f"verify {rid} (sealed)")
    elif window.get("closed_at"):
        steps.append(f"close {rid} again: its close began and did not seal")
    elif window.get("closes_at"):
        steps.append(f"bounces {rid} ... until {window['closes_at']}, then close {rid}")
    return "; ".join(steps)


def table(run: dict) -> str:
    rows = [("run", f"{run['run_id']} (from {run['source']}: {run.get('store', '')})"),
            ("trade date", run["trade_date"]), ("accounts", str(run["accounts"])),
            ("statuses", ", ".join(f"{k} {v}" for k, v in run["statuses"].items()) or "none yet"),
            ("paper owed", str(run["paper_owed"])), ("relay", run["relay"] or "-"),
            ("started", run["started_at"] or "-"), ("finished", run["finished_at"] or "-"),
            ("bounce window", _window(run["bounce_window"], run["sealed"])), ("next", run["next"] or "nothing")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _window(window: dict, sealed: bool) -> str:
    if sealed:
        return f"closed {window.get('closed_at', '')}, sealed"
    if window.get("closed_at"):
        return f"closed {window['closed_at']}, not sealed"
    return f"open until {window['closes_at']}" if window.get("closes_at") else window.get("state", "-")


def _started(run_report: dict):
    try:
        return float(run_report["finished_at"]) - float(run_report["elapsed_s"])
    except (KeyError, TypeError, ValueError):
        return None


def _iso(epoch) -> str:
    """Epoch seconds (Redis, a report's `finished_at`) as the report's other times are."""
    try:
        return report.iso(float(epoch)) if epoch not in (None, "") else ""
    except (TypeError, ValueError):
        return str(epoch)
