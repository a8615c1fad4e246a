"""`status RUN`: one run at a glance, in the same shape whether Redis still holds it or only its
report in storage does (a cluster's Redis ends with the cluster).

The shape's own keys (`trade_date` ... `next`, times in ISO 8601 as the report's, India time) come first; the sources'
raw keys follow as earlier releases printed them (`meta`, `counts`, `relays` from Redis; `report`
from storage), for the scripts that read those.
"""

from __future__ import annotations

from pipeline.followup.seal_state import SEALED, run_phase
from pipeline.record import report
from pipeline.record.statuses import HEADLINE


def from_redis(run_id: str, where: dict, meta: dict, counts: dict, final: dict, relays: dict,
               seal: str) -> dict:
    """`final`: RunState.final_counts(); `counts` the stage counters, as earlier releases printed them."""
    shape = _shape(run_id, "redis", where, meta.get("date", ""), meta.get("input", ""), final, meta.get("relays", ""),
                   _iso(meta.get("started")), _iso(meta.get("last_started")), _iso(meta.get("finished")),
                   report.bounce_window(meta), seal)
    return {**shape, "meta": meta, "counts": counts, "relays": relays}


def from_report(run_id: str, where: dict, run_report: dict, seal: str) -> dict:
    shape = _shape(run_id, "storage", where, run_report.get("trade_date", ""), run_report.get("input", ""),
                   report.final_counts(run_report), run_report.get("relays", ""), _iso(report.started_at(run_report)),
                   _iso(run_report.get("last_started_at")), _iso(run_report.get("finished_at")),
                   run_report.get("bounce_window", {}), seal)
    return {**shape, "relays": {}, "report": run_report}


def _shape(run_id: str, source: str, where: dict, trade_date: str, input_url: str, final: dict, relay: str,
           started: str, last_started: str, finished: str, window: dict, seal: str) -> dict:
    statuses = {k: final[k] for k in sorted(HEADLINE) if final[k]}
    sealed = seal == SEALED
    shape = {"run_id": run_id, "source": source, **where, "trade_date": trade_date, "input": input_url,
             **final, "statuses": statuses, "relay": relay, "started_at": started, "last_started_at": last_started,
             "finished_at": finished, "bounce_window": window, "sealed": sealed,
             "state": run_phase(bool(finished), bool(window.get("closed_at")), seal)}
    return {**shape, "next": next_step(shape)}


def next_step(run: dict) -> str:
    """What the operator does next, in the order it matters: a failure first, the seal last; only
    commands that change something (a closed run mails and settles nothing more: no rerun, no
    reconcile; a rejected account is rerun by correcting its input, not by `rerun`)."""
    rid, window = run["run_id"], run["bounce_window"]
    steps = []
    if not run["finished_at"]:
        return "wait: the run has not finished (its driver runs, or was lost: `runs`, then `run --run-id` resumes it)"
    closed = run["state"] in ("closing", "sealed")  # Redis's word, or the close's objects in storage
    if run["failed"] and not closed:
        steps.append(f"rerun {rid} --failed ({run['failed']} failed)")
    if run["unconfirmed"] and not closed:
        steps.append(f"reconcile {rid} --relay-log FILE, then rerun {rid} --unconfirmed ({run['unconfirmed']} "
                     "unconfirmed)")
    if run["paper_owed"]:
        steps.append(f"post {run['paper_owed']} paper notes (reports/{rid}.paper.csv)")
    if run["sealed"]:
        steps.append(f"verify {rid} (sealed)")
    elif closed:
        steps.append(f"close {rid} again: its close began and did not seal")
    elif window.get("closes_at"):
        steps.append(f"bounces {rid} ... until {window['closes_at']}, then close {rid}")
    return "; ".join(steps)


def table(run: dict) -> str:
    rows = [("run", f"{run['run_id']} (from {run['source']}: {run.get('store', '')})"),
            ("trade date", run["trade_date"]), ("accounts", str(run["accounts"])),
            ("statuses", ", ".join(f"{k} {v}" for k, v in run["statuses"].items()) or "none yet"),
            ("paper owed", str(run["paper_owed"])), ("relay", run["relay"] or "-"),
            ("state", run["state"]), ("started", _started(run)), ("finished", run["finished_at"] or "-"),
            ("bounce window", _window(run["bounce_window"], run["sealed"])), ("next", run["next"] or "nothing")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _started(run: dict) -> str:
    """The run's first start, and a rerun's when there was one: the run's time is not the rerun's."""
    first, last = run["started_at"] or "-", run["last_started_at"]
    return f"{first} (last rerun {last})" if last and last != run["started_at"] else first


def _window(window: dict, sealed: bool) -> str:
    if sealed:
        return f"closed {window.get('closed_at', '')}, sealed"
    if window.get("closed_at"):
        return f"closed {window['closed_at']}, not sealed"
    return f"open until {window['closes_at']}" if window.get("closes_at") else window.get("state", "-")


def _iso(epoch) -> str:
    """Epoch seconds (Redis, a report's `finished_at`) as the report's other times are."""
    try:
        return report.iso(float(epoch)) if epoch not in (None, "") else ""
    except (TypeError, ValueError):
        return str(epoch)
