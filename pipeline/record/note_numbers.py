"""Contract note numbers: one sequence per financial year, never issued twice.

Redis hands them out (atomic across a run's split tasks and concurrent runs); storage keeps the
highest number reserved so far, next to the run manifests, written before any of them is
used. Every reservation raises Redis's counter to that mark first, so a Redis restarted
without its data, or flushed, carries on above every number already printed.
"""

from __future__ import annotations

import hashlib
import json

from pipeline.record import keys
from pipeline.record.state import RunState
from pipeline.record.storage import StorageError, Store, read_json


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
    writing the mark one step, so the mark in storage never moves down."""
    with _sequence_held(state, fy):
        return _reserved(store, state, fy, count)


def reserve_for(store: Store, state: RunState, fy: str, accounts: list[str]) -> int:
    """The first of a block of numbers for `accounts`, in their order. An assembly that Ray runs
    again (its node lost midway, or a value it returned lost with a node) asks for the same
    accounts in the same order: it takes back the block the attempt before reserved and writes
    the very files that attempt wrote, so the year's sequence keeps no gap. Redis keeps the block
    for CN_STATE_TTL_S from its reservation. A new block is reserved when Redis lost it, when the
    attempt before died between reserving and keeping it, or when the accounts differ (a resumed
    split leaves out the shards already written): the files first written stand (create-only),
    and the numbers of the block before that no file took are skipped, never issued twice."""
    block = keys.note_block(fy, hashlib.sha256("\n".join([state.run_id, *accounts]).encode()).hexdigest())
    with _sequence_held(state, fy):
        held = state.r.get(block)
        if held is not None:
            return int(held)
        first = _reserved(store, state, fy, len(accounts))
        state.r.set(block, first, ex=state.ttl_s)
        return first


def _sequence_held(state: RunState, fy: str):
    return state.r.lock(keys.note_sequence_lock(fy), timeout=120, blocking_timeout=600)


def _reserved(store: Store, state: RunState, fy: str, count: int) -> int:
    high = high_water_mark(store, fy)
    first = state.next_note_numbers(fy, count, floor=high)
    high = max(high, first + count - 1)
    store.put(keys.note_sequence_key(fy), json.dumps({"fy": fy, "high": high}).encode())
    return first


def high_water_mark(store: Store, fy: str) -> int:
    key = keys.note_sequence_key(fy)
    if not store.exists(key):
        return 0
    high = read_json(store, key).get("high")
    if not isinstance(high, int) or high < 0:  # never guessed: a number issued twice is worse than a stopped run
        raise StorageError(f"{store.url}: object {key!r} has no note-number mark (edited?)")
    return high

