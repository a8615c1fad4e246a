"""An account's final status, worked out from its record: kept apart from records.py (the
record's Redis side) so that the report, and `verify` through it, load no Redis client.
"""

from __future__ import annotations


def final_status(rec: dict) -> str:
    """Where an account stands: delivered, unconfirmed (the mail may have reached the relay:
    settle it with `reconcile` or `rerun --unconfirmed`), failed, rejected (bad input),
    physical (no e-mail consent or address: paper), or pending (on its way). A delivered
    mail that came back is bounced (paper), or deferred while the recipient's server retries."""
    if rec.get("stage") == "delivered":
        return rec["bounce"]["kind"] if rec.get("bounce") else "delivered"
    status = rec.get("status")
    return status if status in ("unconfirmed", "failed", "rejected", "physical") else "pending"
