"""`verify`'s check that the archive is what the client got: every archived note against the
hashes its mailings logged.

Each "sending" and "delivered" entry of the delivery log names the SHA-256 of the exact note
it attached (stages._attach), and "sending" its MD5 too. A note is archived once, create-only,
and every attempt mails the archived bytes, so each hash a run logged for an account must be
its archived note's: a note replaced in the archive after mailing, or a mail that carried
other bytes, is named with the log object that says what was mailed. Entries from before the
hashes were logged prove nothing and are passed over.

The archive is not read note by note (1.5M GETs, 50 GB, on a broker's day): a listing of a
partition's notes gives each one's MD5 (S3's ETag, a page per 1,000 notes), and an account
whose one logged SHA-256 came with an MD5 equal to its listed one is what was mailed. Only
where they disagree (a note that differs, an ETag that is not an MD5 under SSE-KMS, an entry
with no MD5) is the note read and its SHA-256 compared.

The log's objects are read again here, a shard at a time, spread over processes as the chain
walk is (record/spread.py), a partition's shards together: each process lists a partition's
archive once and holds that partition's listing alone (an MD5 of 16 bytes a note).
"""

from __future__ import annotations

import hashlib
import re
import threading
from contextlib import closing
from typing import Iterator

from pipeline.record import delivery_log, keys, spread
from pipeline.record.storage import NoObject, NotAsWritten, StorageError, Store

PROVES = ("sending", "delivered")  # the entries that name the bytes attached
_HEX32 = re.compile(r"[0-9a-f]{32}")


def first_difference(store: Store, run_id: str, trade_date: str, shards: list[int]) -> list[str]:
    """The first archived note, in partition then shard order, that is not what was mailed, as
    verify's problem line; none without a trade date (a run with no report yet: its archive's
    folder is not known)."""
    if not trade_date:
        return []
    with _listing_lock:
        _listed.clear()  # listed by an earlier verify in this process: the archive is listed anew
    listed = delivery_log.run_chain_keys(store, run_id)
    ordered = sorted(shards, key=lambda s: (s % keys.PARTITIONS, s))
    jobs = ((s, trade_date, listed.get(s, [])) for s in ordered)
    with closing(spread.each(shard_notes, store, jobs, len(shards))) as found:  # the processes end with the first
        return next(([p] for p in found if p), [])


def shard_notes(store: Store, shard: int, trade_date: str, found: list[str]) -> str:
    """One shard's mailed notes against the archive (`found`: its chain's keys, as listed): the
    first that differs, or ""."""
    archive = _listing(store, trade_date, shard % keys.PARTITIONS)
    for ucc, (hashes, md5s) in sorted(_mailed(store, found).items()):
        key = keys.signed_pdf_key(trade_date, ucc)
        if len(hashes) == 1 and md5s and md5s == {archive.get(ucc)}:
            continue  # the one note mailed is the one the archive lists
        try:
            archived = hashlib.sha256(store.get(key)).hexdigest()
        except NotAsWritten:  # changed in the bucket, its metadata kept
            archived = "not as written"
        except NoObject:  # removed; a read that failed (S3 or a disk failing) stops verify instead, exit 2
            archived = ""
        for sha, where in hashes.items():
            if sha != archived:
                what = "differs from what was mailed" if archived else "removed from the archive after it was mailed"
                return f"{key}: {what} (delivery log shard {shard} seq {delivery_log.seq_of(where)})"
    return ""


_listed: dict[tuple, dict[str, bytes]] = {}  # this process's one partition listing: (store, date, partition) -> it
_listing_lock = threading.Lock()


def _listing(store: Store, trade_date: str, partition: int) -> dict[str, bytes]:
    """ucc -> its archived note's MD5 (16 bytes; absent: not archived, or no MD5 listed), for
    one partition of the day's archive, listed once a process while its shards come (they come
    together: first_difference orders them so)."""
    which = (store.url, trade_date, partition)
    with _listing_lock:
        if which not in _listed:
            _listed.clear()
            _listed[which] = {key.rpartition("/")[2].removesuffix(".pdf"): bytes.fromhex(md5)
                              for key, md5 in store.md5s(keys.signed_pdf_prefix(trade_date, partition)) if md5}
        return _listed[which]


def _mailed(store: Store, found: list[str]) -> dict[str, tuple[dict[str, str], set[bytes]]]:
    """ucc -> (each SHA-256 its mailings logged -> the first object that logged it, the MD5s
    logged beside them). An object that is not a log object is passed over: the chain walk
    names it."""
    mailed: dict[str, tuple[dict[str, str], set[bytes]]] = {}
    for key in found:
        for e in _entries(store, key):
            if e["status"] in PROVES and isinstance(e.get("sha256"), str):
                hashes, md5s = mailed.setdefault(e["ucc"], ({}, set()))
                hashes.setdefault(e["sha256"], key)
                if isinstance(e.get("md5"), str):
                    md5s.add(bytes.fromhex(e["md5"]) if _HEX32.fullmatch(e["md5"]) else b"?")
    return mailed


def _entries(store: Store, key: str) -> Iterator[dict]:
    try:
        data = store.get(key)
    except (NoObject, NotAsWritten):  # gone since listed, or changed: the chain walk, reading it too, says so
        return
    try:
        yield from list(delivery_log.parse(store, key, data.decode("utf-8", "surrogateescape").splitlines()))
    except StorageError:  # not a log object: the chain walk names it
        return
