"""`verify`'s check that the archive is what the client got: every archived note against the
SHA-256 its mailings logged.

Each "sending" and "delivered" entry of the delivery log names the SHA-256 of the exact note
it attached (stages._attach). A note is archived once, create-only, and every attempt mails the
archived bytes, so each hash a run logged for an account must be its archived note's: a note
replaced in the archive after mailing, or a mail that carried other bytes, is named with the
log object that says what was mailed. Entries from before the hash was logged prove nothing
and are passed over.

The log's objects are read again here, a shard at a time, spread over processes as the chain
walk is (record/spread.py): one GET an object, then one GET a mailed note, each shard's in a
thread of its own. Nothing is held but a shard's hashes.
"""

from __future__ import annotations

import hashlib
from contextlib import closing
from typing import Iterator

from pipeline.record import delivery_log, keys, spread
from pipeline.record.storage import StorageError, Store

PROVES = ("sending", "delivered")  # the entries that name the bytes attached


def first_difference(store: Store, run_id: str, trade_date: str, shards: list[int]) -> list[str]:
    """The first archived note, in shard order, that is not what was mailed, as verify's
    problem line; none without a trade date (a run with no report yet: its archive's folder is
    not known)."""
    if not trade_date:
        return []
    listed = delivery_log.run_chain_keys(store, run_id)
    jobs = ((s, trade_date, listed.get(s, [])) for s in sorted(shards))
    with closing(spread.each(shard_notes, store, jobs, len(shards))) as found:  # the processes end with the first
        return next(([p] for p in found if p), [])


def shard_notes(store: Store, shard: int, trade_date: str, found: list[str]) -> str:
    """One shard's mailed notes against the archive (`found`: its chain's keys, as listed): the
    first that differs, or ""."""
    for ucc, hashes in sorted(_mailed(store, found).items()):
        key = keys.signed_pdf_key(trade_date, ucc)
        try:
            archived = hashlib.sha256(store.get(key)).hexdigest()
        except StorageError:
            archived = ""
        for sha, where in hashes.items():
            if sha != archived:
                what = "differs from what was mailed" if archived else "removed from the archive after it was mailed"
                return f"{key}: {what} (delivery log shard {shard} seq {delivery_log.seq_of(where)})"
    return ""


def _mailed(store: Store, found: list[str]) -> dict[str, dict[str, str]]:
    """ucc -> each SHA-256 its mailings logged -> the first object that logged it. An object
    that is not a log object is passed over: the chain walk names it."""
    mailed: dict[str, dict[str, str]] = {}
    for key in found:
        for e in _entries(store, key):
            if e["status"] in PROVES and isinstance(e.get("sha256"), str):
                mailed.setdefault(e["ucc"], {}).setdefault(e["sha256"], key)
    return mailed


def _entries(store: Store, key: str) -> Iterator[dict]:
    try:
        yield from list(delivery_log.parse(store, key, store.get(key).decode("utf-8", "surrogateescape").splitlines()))
    except StorageError:
        return
