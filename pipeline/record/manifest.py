"""What a run's split produced (its manifest in storage): read by a rerun, which reuses its
shards and their note numbers, and by `verify` and `close`, which need no more of the split.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from pipeline.record import keys
from pipeline.record.storage import Garbled, Store, read_json


@dataclass
class SplitResult:
    shards: list[int]  # the shards that hold accounts
    shard_count: int = 0  # what stable_hash is taken modulo
    accounts: int = 0
    rejected: int = 0
    nothing_due: int = 0  # clients whose every trade was cancelled or moved to another: no contract note is due, none is made
    nothing_due_accounts: list[str] = field(default_factory=list)  # the first NAMED of them
    input_errors: list[dict] = field(default_factory=list)  # rows naming no usable account
    trades: list[int] = field(default_factory=list)  # per shard of `shards`: its trades, heaviest first
    complete: bool = True  # False while the split is under way: a run resumed from here splits again
    groups: int = 0  # while under way, the assembly groups: a resumed split's are the same (their note-number blocks)
    # the trade rows of segments whose notes another entity's run makes: segment -> its entity and rows
    left_to_others: dict[str, dict] = field(default_factory=dict)
    made_with: dict = field(default_factory=dict)  # made_with.recorded: what a resumed run makes its notes with

    def heaviest_first(self, shards: list[int]) -> list[int]:
        """A shard holding a huge account starts first, so it never sets the day's end."""
        weight = dict(zip(self.shards, self.trades))
        return sorted(shards, key=lambda s: -weight.get(s, 0))


FIELDS = {f.name for f in fields(SplitResult)}


def load_manifest(store: Store, run_id: str) -> SplitResult | None:
    """What a run's split produced; a rerun reuses it (and the note numbers in its shards)."""
    key = keys.manifest_key(run_id)
    if not store.exists(key):
        return None
    try:  # a field a later version added is not this version's (it reads the manifest as it did before)
        split = SplitResult(**{k: v for k, v in read_json(store, key).items() if k in FIELDS})
    except TypeError:
        split = None
    if split is None or not isinstance(split.shard_count, int) or not isinstance(split.groups, int) or \
            not all(isinstance(s, int) for s in split.shards):
        raise Garbled(store.url, key, "is not a run manifest (edited?)")
    return split


def load_first_notes(store: Store, run_id: str) -> dict | None:
    """The first notes a run made in its driver ({"shard": n, "shard_count": of the plan they were
    read with, "made_with": made_with.recorded (a run from before: neither), "numbers": {ucc:
    note number}}), or None."""
    key = keys.first_notes_key(run_id)
    return read_json(store, key) if store.exists(key) else None


def record_made_with(store: Store, run_id: str, made_with: dict) -> None:
    """A finished run's manifest with its `made_with` replaced, every other field as it was
    written (a later version's too)."""
    key = keys.manifest_key(run_id)
    store.put(key, json.dumps({**read_json(store, key), "made_with": made_with}).encode())


def save_manifest(store: Store, run_id: str, split: SplitResult) -> None:
    """`groups` only while the split is under way: a version before it reads a finished run."""
    store.put(keys.manifest_key(run_id), json.dumps({k: v for k, v in split.__dict__.items()
                                                     if k != "groups" or v}).encode())
