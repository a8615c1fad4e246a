"""The split on the cluster: one Ray task per byte range of the dumps, then one per group of shards.

Every range is read and validated at once on the render CPUs; one task works out the trades
that moved between clients from every range's moves; each group of shards is then assembled by
its own task as soon as every range has dealt it its rows, and a shard's render task waits on its
group's object ref alone, so notes are rendered while other groups are still being assembled.
The driver holds refs and counts per shard, never rows.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Iterable, Iterator

import ray

from pipeline.day import moves
from pipeline.day.split import Plan, assemble, make_plan, read_range, result, row_offsets

from pipeline.record import made_with
from pipeline.record.manifest import SplitResult
from pipeline.record.state import RunState
from pipeline.record.storage import Store, open_store
from pipeline.settings import Settings
from pipeline.stages import broker

log = logging.getLogger(__name__)

HANDED_TRADES = 200_000  # the day's first shards, by their trades, whose files an assembly hands to their render
# tasks through Ray's object store as it writes them (~50 MB there): each render reads no file, and the rest
# of a 1.5M day's rows never wait in the object store for their turn
GROUP_SHARDS_MAX = 500  # the most shards one assembly task holds the rows of (50,000 accounts at 100 a shard)


def group_count(shards: int, cpus: int, ranges: int) -> int:
    """Two groups a CPU, so every core assembles; and however big the day, no group of more
    than GROUP_SHARDS_MAX shards: an assembly holds its group's share of the day's rows. With two
    groups a CPU alone, 1.5M accounts on two cores made four groups, and one assembly task held
    6.9 GB after 8.6 minutes, nothing rendered meanwhile (bench/fullday.py). Each range deals
    its rows to every group: at most four groups a range keep its buckets from getting tiny."""
    return max(1, min(shards, max(2 * max(1, cpus), math.ceil(shards / GROUP_SHARDS_MAX)), ranges * 4))


@ray.remote(num_cpus=1, resources={"render": 1}, max_retries=3)
def read_task(inputs: Store, rng, columns: list[int], shards: int, groups: int, trade_date: str, closes: dict,
              closed: dict, segments: frozenset | None = None, left_to: dict | None = None):
    """The range's meta, its moves (for owners_task alone), then its bucket for each group."""
    meta, buckets = read_range(inputs, rng, columns, shards, groups, trade_date, closes, closed=closed,
                               segments=segments, left_to=left_to)
    return (meta, meta.pop("moves"), *buckets)


@ray.remote(num_cpus=1, resources={"render": 1}, max_retries=3)
def owners_task(*changes) -> moves.Owners:
    """The day's moved trades, once (every range's moves, in the plan's order), for every assembly."""
    return moves.owners(changes)


@ray.remote(num_cpus=1, resources={"render": 1}, max_retries=3)
def assemble_task(settings: Settings, run_id: str, trade_date: str, offsets: dict, reuse: bool, numbered: dict,
                  handed: tuple[int, ...], owners: moves.Owners, *parts):
    """The group's result, then the file of each `handed` shard (None: no file, every account
    rejected), each a return of its own (num_returns) for its render tasks to take. Run again
    for a lost return, it hands the files first written (split.assemble writes each once)."""
    state = RunState.of(settings, run_id)
    done = assemble(open_store(settings.store_url, run=settings), state, run_id, trade_date, broker(settings.broker_file)["note_prefix"],
                    list(parts), offsets, reuse, numbered, frozenset(handed), owners)
    if not handed:
        return done
    rows = done.pop("rows")
    return (done, *[rows.get(shard) for shard in handed])


def tally(metas: Iterable[dict]) -> tuple[list[dict], dict[int, int]]:
    """Each range's meta without its trades per shard, and those counts summed over the ranges,
    a range at a time. Every range counts every shard: kept per range, the 72 ranges of a 1.5M-
    account day held 1.1 million counts in the driver (72 MB, against 1 MB for 150,000 accounts'
    9 ranges), and its peak RSS grew 1.70x for 10x the accounts (bench/fullday.py)."""
    kept, weights = [], {}
    for meta in metas:
        for shard, n in meta.pop("weights").items():
            weights[shard] = weights.get(shard, 0) + n
        kept.append(meta)
    return kept, weights


def cancel_tasks(refs: list[ray.ObjectRef | None]) -> None:
    """The tasks of these refs cancelled, where they have not ended (a stopped run's: a Ray that
    lives on, a notebook's, is not left running them); a ref that is None is skipped."""
    for ref in refs:
        if ref is not None:
            try:
                ray.cancel(ref)
            except Exception as e:  # ended already, or put rather than made by a task
                log.debug("%s not cancelled: %s", ref, e)


def _arriving(waiting: list[ray.ObjectRef], watch: Callable[[], None]) -> Iterator[dict]:
    """Each value as its task ends, its ref let go once read (a small value lives in the
    driver's own memory while a ref to it does)."""
    while waiting:
        ready, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=1.0)
        while ready:
            yield ray.get(ready.pop())
        if waiting:
            watch()


class Split:
    """A split under way. `start` returns once every range is read (their row counts fix the
    row numbers, their trade counts the order of the work); the groups then assemble while
    the driver fans out."""

    def __init__(self, plan: Plan, metas: list[dict], groups: int, assembling: dict[int, ray.ObjectRef],
                 weights: dict[int, int], recorded: dict[str, str]):
        self.plan, self.metas, self.groups, self.assembling, self.weights = plan, metas, groups, assembling, weights
        self.recorded = recorded  # what the notes are made with (made_with.recorded), for the manifest
        self.rows: dict[int, ray.ObjectRef] = {}  # shard -> its file's bytes, as its assembly wrote it (HANDED_TRADES)
        self.owners: ray.ObjectRef | None = None  # the day's moved trades (owners_task)
        self.changes: list[ray.ObjectRef] = []  # each range's moves, held so a lost owners is made again from them

    @classmethod
    def start(cls, settings: Settings, run_id: str, trade_date: str, input_url: str, cpus: int, reuse: bool,
              watch: Callable[[], None], plan: Plan | None = None, numbered: Callable[[], dict] = dict,
              groups: int = 0, shards: int = 0) -> "Split":
        """`plan`: the one the driver's first notes were read with, if they were; `numbered`: their
        note numbers ({ucc: number}), asked for once every range is read. `groups` and `shards`: a
        resumed split's, as the split it resumes had them (on other CPUs, with another
        CN_SHARD_SIZE), so each group asks for the accounts it asked for then and takes back its
        block of note numbers, and each account is in the shard whose file it may already be in."""
        inputs = open_store(input_url, run=settings)
        plan = plan or make_plan(inputs, trade_date, settings.shard_size, parts=max(1, cpus),
                                 holidays_file=settings.holidays_file, entity=broker(settings.broker_file),
                                 shards=shards)
        groups = groups or group_count(plan.shard_count, cpus, len(plan.ranges))
        closes = ray.put(plan.closes)
        reads = [read_task.options(num_returns=groups + 2, name=f"split {r.file}").remote(
            inputs, r, plan.columns[r.file], plan.shard_count, groups, trade_date, closes, plan.closed,
            plan.segments, plan.left_to) for r in plan.ranges]
        split = None
        try:
            metas, weights = tally(_arriving([refs.pop(0) for refs in reads], watch))
            split = cls(plan, metas, groups, {}, weights, made_with.recorded(settings))
            split.changes = [refs.pop(0) for refs in reads]
            split.owners = owners = owners_task.options(name="split owners").remote(*split.changes)
            offsets, numbered = row_offsets(metas), ray.put(numbered())
            heaviest = {}  # group -> its heaviest shard's trades: the group holding a huge account goes first
            for shard, n in split.weights.items():
                heaviest[shard % groups] = max(heaviest.get(shard % groups, 0), n)
            handed = split.handed()
            for g in sorted(range(groups), key=lambda g: -heaviest.get(g, 0)):
                mine = tuple(s for s in handed if s % groups == g)
                made = assemble_task.options(name="split assemble", num_returns=1 + len(mine)).remote(
                    settings, run_id, trade_date, offsets, reuse, numbered, mine, owners, *[refs[g] for refs in reads])
                split.assembling[g], *rows = made if mine else [made]
                split.rows.update(zip(mine, rows))
            return split
        except BaseException:  # the run stopped in its split (the watch's CapacityError, a notebook's interrupt)
            cancel_tasks([refs[0] for refs in reads])  # a read's other values name its task too
            if split is not None:
                split.cancel()
            raise

    def handed(self) -> list[int]:
        """The first shards the fan-out takes (heaviest first), up to HANDED_TRADES trades."""
        handed, trades = [], 0
        for shard in self.shards():
            trades += self.weights[shard]
            if trades > HANDED_TRADES:
                break
            handed.append(shard)
        return handed

    def lead(self, watch: Callable[[], None]) -> int | None:
        """The lightest shard of the group assembled first: its first notes can go out soonest.
        Waits for that group (the fan-out could not start before it anyway)."""
        groups = {ref: g for g, ref in self.assembling.items()}
        waiting = list(groups)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1, timeout=1.0)
            for ref in ready:
                try:
                    written = ray.get(ref)["shards"]  # not a shard whose every account was rejected
                except ray.exceptions.RayError:  # the split's end says why
                    continue
                mine = [s for s in self.weights if s % self.groups == groups[ref] and s in written]
                if mine:
                    return min(mine, key=lambda s: (self.weights[s], s))
            watch()
        return None

    def shards(self) -> list[int]:
        """The shards with trades, heaviest first (a shard may still turn out empty: all rejected)."""
        return sorted(self.weights, key=lambda s: (-self.weights[s], s))

    def partial(self) -> SplitResult:
        """The manifest while the split is under way: a run resumed from it splits again,
        keeping the shards already written (and the note numbers in them)."""
        return SplitResult(shards=self.shards(), shard_count=self.plan.shard_count, complete=False, groups=self.groups,
                           made_with=self.recorded)

    def after(self, shard: int) -> ray.ObjectRef:
        return self.assembling[shard % self.groups]

    def clients(self) -> int:
        return sum(m["rows"] for m in self.metas if m["file"] == "clients.csv")

    def cancel(self) -> None:
        """The run stopped: its assemblies not yet run are not left queued in a Ray that lives on (a
        notebook's). One cut short leaves what a node lost midway leaves, which the run resumed takes on."""
        cancel_tasks([self.owners, *self.assembling.values()])

    def done(self, block: bool = False) -> SplitResult | None:
        """The finished split once every group is assembled (raises if a group failed for good)."""
        refs = list(self.assembling.values())
        if not block and len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
            return None
        return dataclasses.replace(result(self.plan, self.metas, ray.get(refs)), made_with=self.recorded)
