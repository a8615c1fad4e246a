"""An account's final status, and a run's count of them, worked out from its record: kept apart
from records.py (the record's Redis side) so that the report, and `verify` through it, load no
Redis client. Every view of a run (the run's summary, `status`, `runs`, the live page, the
report, the notebook) counts through `headline`, so no two of them can disagree.
"""

from __future__ import annotations

from typing import Mapping

# A run's final statuses, in the order every view lists them
HEADLINE = ("delivered", "bounced", "deferred", "failed", "unconfirmed", "rejected", "physical", "pending")
PAPER_REPLY = "smtp permanent"  # a failed mail whose relay refused the address for good: owed on paper too


def final_status(rec: dict, closed: bool = False) -> str:
    """Where an account stands: delivered, unconfirmed (the mail may have reached the relay:
    settle it with `reconcile` or `rerun --unconfirmed`), failed, rejected (bad input),
    physical (no e-mail consent or address: paper), or pending (on its way). A delivered
    mail that came back is bounced (paper), or deferred while the recipient's server retries;
    once the run is `closed` (its bounce window ended) a deferred mail is delivered, final."""
    if rec.get("stage") == "delivered":
        status = rec["bounce"]["kind"] if rec.get("bounce") else "delivered"
        return "delivered" if closed and status == "deferred" else status
    status = rec.get("status")
    return status if status in ("unconfirmed", "failed", "rejected", "physical") else "pending"


def owes_paper(status: str, reason: str) -> bool:
    """A note owed on paper: no e-mail consent or address, a bounce, or a relay's permanent refusal."""
    return status in ("physical", "bounced") or (status == "failed" and PAPER_REPLY in reason)


def headline(statuses: Mapping[str, int], closed: bool, paper_owed: int, accounts: int = 0) -> dict[str, int]:
    """A run's counts by final status and the paper notes it owes, from a count of its accounts'
    statuses as they were recorded (Redis's counters, or the report's tally): the one place that
    says what a closed run's deferred mail is (delivered: close made it final). `accounts`, the
    run's own count once its split is done: those with no record yet are pending."""
    counts = {s: int(statuses.get(s) or 0) for s in HEADLINE}
    if closed:
        counts["delivered"], counts["deferred"] = counts["delivered"] + counts["deferred"], 0
    counts["pending"] += max(0, int(accounts or 0) - sum(counts.values()))
    return {"accounts": sum(counts.values()), **counts, "paper_owed": int(paper_owed or 0)}


def phase(finished: bool, closed: bool, sealed: bool) -> str:
    """Where a run is in its life, as `runs` and `status` name it: running (or stopped before its
    end), finished (its bounce window open), closing (a close began and did not seal), sealed."""
    return "sealed" if sealed else "closing" if closed else "finished" if finished else "running"
