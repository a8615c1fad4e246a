"""Settling unconfirmed mails from the relay's own log: `reconcile RUN_ID --relay-log FILE...`.

An account is unconfirmed when its mail may have reached the relay (the connection dropped
after the message left, or the mailer died between claim and reply). The relay knows: each
unconfirmed account whose Message-ID its log shows as accepted becomes delivered, in the
delivery log first (the record), then in Redis, and the run report is written again. The
rest stay unconfirmed for `rerun --unconfirmed`, which resends them with the same Message-ID.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from pipeline.followup import opened
from pipeline.mail import relay_log
from pipeline.record import delivery_log, keys, report
from pipeline.record.records import Outcome
from pipeline.settings import Settings


def reconcile(settings: Settings, run_id: str, relay_logs: list[Path], store: str | None = None) -> dict:
    """Under the run's lease: no driver mails the run while its accounts are settled. On the
    run's own store (located.py) unless `store` names a copy of its record."""
    with opened.open_run(settings, run_id, store, command="reconcile") as run:
        return {**_reconcile(run, relay_logs), **run.where()}


def _reconcile(run: opened.OpenRun, relay_logs: list[Path]) -> dict:
    run_id, state, store, settings = run.state.run_id, run.state, run.store, run.settings
    accepted = relay_log.accepted_ids(relay_logs)
    unconfirmed = state.unconfirmed()
    records = state.accounts(unconfirmed)
    names = ", ".join(p.name for p in relay_logs)
    settled = [Outcome(u, "delivered", message_id=records[u]["message_id"],
                       reply=f"accepted, per the relay's log ({names})"[:300],
                       extra={"reconciled": True, **_duplicate(records[u])})
               for u in unconfirmed if records.get(u, {}).get("message_id") in accepted]
    by_shard = defaultdict(list)
    for o in settled:
        by_shard[keys.shard_of(o.ucc, run.split.shard_count)].append(delivery_log.entry(o))
    for shard, entries in by_shard.items():
        delivery_log.append(store, run_id, shard, entries)
    state.record(settled)
    report.rewrite(store, state, run_id, settings.paper_due_days)
    return {"run_id": run_id, "relay_logs": [str(p) for p in relay_logs], "accepted_ids_in_logs": len(accepted),
            "unconfirmed_before": len(unconfirmed), "reconciled": len(settled),
            "still_unconfirmed": len(unconfirmed) - len(settled)}


def _duplicate(record: dict) -> dict:
    """A resend's mark goes into the log with the settlement: the log is what a lost Redis is rebuilt from."""
    return {"possible_duplicate": True} if record.get("extra", {}).get("possible_duplicate") else {}
