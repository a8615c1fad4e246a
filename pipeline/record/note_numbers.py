"""Contract note numbers: one sequence per financial year and store (an issuing entity), never
issued twice.

Redis hands them out (atomic across a run's split tasks and concurrent runs); storage keeps the
highest number reserved so far (noteseq/), written before any of them is used. Every
reservation raises Redis's counter to that mark first, so a Redis restarted without its data,
or flushed, carries on above every number already printed.

Each reservation leaves a mark of its own, created once and never overwritten, named by the
highest number it issued; the year's high-water mark is the highest mark. One overwritten
object could move down: a reservation that outlived the lock (a store stalled past its 120 s)
wrote its mark after a later one had written a higher mark, and a Redis that lost its counter
then would issue the numbers between them again. A reservation lists only the marks above
what Redis has issued, so it reads none unless Redis lost its counter or came back older.
The one object is still written, with the highest mark a reservation saw, for a version before
the marks (rolled back to) to read; it alone can still move down, after a reservation outlived
its lock, so a broker going back to such a version sets it to the highest mark first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from contextlib import contextmanager
from typing import Iterator

from redis.exceptions import LockError, LockNotOwnedError

from pipeline.record import keys
from pipeline.record.state import RunState
from pipeline.record.storage import StorageError, Store, read_json, write_once

MARK = re.compile(r"(\d{12})\.json")  # keys.note_mark_key's name
LOCK_S = 120
log = logging.getLogger(__name__)


def financial_year(trade_date: str) -> str:
    """2026-11-20 -> '2026-27' (April to March)."""
    year, month = int(trade_date[:4]), int(trade_date[5:7])
    start = year if month >= 4 else year - 1
    return f"{start}-{(start + 1) % 100:02d}"


def note_number(prefix: str, trade_date: str, sequence: int) -> str:
    """A note of 2026-11-20 is in FY 2026-27: CNT-26/27-0001234."""
    start = int(financial_year(trade_date)[:4])
    return f"{prefix}-{start % 100:02d}/{(start + 1) % 100:02d}-{sequence:07d}"


def reserve(store: Store, state: RunState, fy: str, count: int) -> int:
    """The first of `count` fresh numbers; the storage mark covers all of them on return.
    Split tasks reserve side by side: a Redis lock makes reading the mark, reserving and
    writing the mark one step."""
    with _sequence_held(store, state, fy):
        return _reserved(store, state, fy, count)


def reserve_for(store: Store, state: RunState, fy: str, accounts: list[str],
                fresh: list[str] | None = None) -> dict[str, int]:
    """Each account's number, from a block for `accounts` in their order. An assembly that Ray
    runs again (its node lost midway, or a value it returned lost with a node), or a resumed
    split's, asks for the same accounts in the same order: it takes back the block the attempt
    before reserved and writes the very files that attempt would have, so the year's sequence
    keeps no gap. Redis keeps the block for CN_STATE_TTL_S from its reservation. `fresh`: those
    of `accounts` no file has numbered yet (a resumed split); when Redis no longer holds the
    block, a block for them alone is reserved (taken back the same way by an attempt that finds
    the same accounts still to number: not by one run after a file more was written). A new
    block is reserved when Redis lost it, when the attempt before died between reserving and
    keeping it, or when the accounts differ (the day's input changed): the files first written
    stand (create-only), and the numbers of the block before that no file took are skipped,
    never issued twice. No account to number (a group of first notes alone) reserves nothing."""
    if not accounts:
        return {}
    with _sequence_held(store, state, fy):
        held = state.r.get(block := _block(state, fy, accounts))
        if held is None and fresh is not None:
            accounts = fresh
            if not accounts:
                return {}
            held = state.r.get(block := _block(state, fy, accounts))
        if held is None:
            held = _reserved(store, state, fy, len(accounts))
            state.r.set(block, held, ex=state.ttl_s)
    return {ucc: int(held) + i for i, ucc in enumerate(accounts)}


def _block(state: RunState, fy: str, accounts: list[str]) -> str:
    return keys.note_block(fy, hashlib.sha256("\n".join([state.run_id, *accounts]).encode()).hexdigest())


class NumbersTaken(StorageError):
    """Another reservation was issued some of these numbers: none of them is used."""


@contextmanager
def _sequence_held(store: Store, state: RunState, fy: str) -> Iterator[None]:
    """The store's year's reservations one at a time. One that outlives the lock (its store
    stalled past LOCK_S) keeps its numbers once its mark shows no other reservation was issued
    any of them."""
    lock = state.r.lock(keys.note_sequence_lock(fy, store.url), timeout=LOCK_S, blocking_timeout=600)
    if not lock.acquire():
        raise LockError(f"the note numbers of {fy}: another reservation held them for 600 s (Redis "
                        f"{keys.note_sequence_lock(fy, store.url)})")
    try:
        yield
    finally:
        try:
            lock.release()
        except LockNotOwnedError:
            log.warning("a reservation of %s's note numbers outlived its lock (%d s)", fy, LOCK_S)


def _reserved(store: Store, state: RunState, fy: str, count: int) -> int:
    """Each mark is written, then the marks at or above its first number are listed: of two
    reservations issued the same numbers (Redis lost its counter while one of them outlived the
    lock), the later to list finds the other's mark and uses none of them."""
    if count < 1:  # a mark of none would be named as the reservation before it
        raise ValueError(f"a reservation of {count} note numbers")
    sequence = keys.note_sequence(fy, store.url)
    high = high_water_mark(store, fy, above=state.issued_note_numbers(sequence))
    first = state.next_note_numbers(sequence, count, floor=high)
    last = first + count - 1
    key, mark = keys.note_mark_key(fy, last), {"fy": fy, "first": first, "high": last, "by": os.urandom(8).hex()}
    data = json.dumps(mark).encode()
    taken = NumbersTaken(f"{store.url}: note numbers {first}-{last} of {fy} were issued to another reservation too "
                         "(Redis lost its counter while a reservation outlived its lock): none of them is used")
    if write_once(store, key, data) != data:  # another reservation's mark of the same last number
        raise taken
    later = [(k, n) for k, n in _marks(store, fy, first - 1) if k != key]
    if any(read_json(store, k).get("first", 0) <= last for k, _ in later):
        raise taken
    high = max(high, last, *(n for _, n in later))  # the marks seen: a later reservation's, if one wrote before this
    store.put(keys.note_sequence_key(fy), json.dumps({"fy": fy, "high": high}).encode())  # for a version before
    return first  # the marks, rolled back to: it reads this object alone


def high_water_mark(store: Store, fy: str, above: int = 0) -> int:
    """The highest note number of the year storage holds a mark of, of those above `above` (0
    if none is): a mark the listing names is trusted by its name (an object not named as a mark
    is none), and the object that versions before the marks overwrote is read too."""
    return max(_overwritten_mark(store, fy), *(last for _, last in _marks(store, fy, above)), 0)


def _marks(store: Store, fy: str, above: int) -> Iterator[tuple[str, int]]:
    """The year's marks of numbers above `above`: (key, the highest number it marks)."""
    for key in store.keys(keys.note_marks(fy), after=keys.note_mark_key(fy, above)):
        if found := MARK.fullmatch(key.rsplit("/", 1)[-1]):
            yield key, int(found[1])


def _overwritten_mark(store: Store, fy: str) -> int:
    key = keys.note_sequence_key(fy)
    if not store.exists(key):
        return 0
    high = read_json(store, key).get("high")
    if not isinstance(high, int) or high < 0:  # never guessed: a number issued twice is worse than a stopped run
        raise StorageError(f"{store.url}: object {key!r} has no note-number mark (edited?)")
    return high

