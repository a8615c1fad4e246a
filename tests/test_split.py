"""The split in parts: byte ranges cut anywhere give the rows and row numbers of one pass; the
fast trade check agrees with parse_trade on every row, good or bad; note numbers reserved side
by side never repeat and their mark in storage never moves down."""

from __future__ import annotations

import csv
import datetime as dt
import functools
import io
import json
import os
import random
import threading
import time
from collections import defaultdict

import pytest

from pipeline import stages
from pipeline.day import bhavcopy, moves
from pipeline.day.dumps import TRADE_FIELDS, Client, RowError, parse_trade, trade_row
from pipeline.day.split import (
    Range, _json_row, assemble, find_account, first_accounts, make_plan, read_range, result, row_offsets, split_day,
)
from pipeline.day.synth import SynthOptions, write_dumps
from pipeline.record import keys, note_numbers, report
from pipeline.record.manifest import SplitResult, load_manifest, save_manifest
from pipeline.record.records import Outcome
from pipeline.record.state import RunState
from pipeline.record.storage import FolderStore, open_store
from tests.test_first_notes import _Counted
from tests.test_hostile_input import INNOCENTS, POISONED, split_with, trades_for
from tests.test_note_correctness import DATE, HAND_MADE, write_day


def ranged_split(inputs, store, state, run_id: str, cut_every: int, groups: int = 3):
    """The split with every dump cut into ranges of `cut_every` bytes, read in reverse order."""
    plan = make_plan(inputs, DATE, 4, parts=1)
    plan.ranges = [Range(name, i, a, min(a + cut_every, inputs.size(name)))
                   for name in ("clients.csv", "trades.csv")
                   for i, a in enumerate(range(0, inputs.size(name), cut_every))]
    metas, buckets = [], []
    for rng in reversed(plan.ranges):
        meta, parts = read_range(inputs, rng, plan.columns[rng.file], plan.shard_count, groups, DATE, plan.closes)
        metas.insert(0, meta)
        buckets.insert(0, parts)
    offsets, owners = row_offsets(metas), moves.owners(m.pop("moves") for m in metas)
    assembled = [assemble(store, state, run_id, DATE, "CNT", [b[g] for b in buckets], offsets, owners=owners)
                 for g in range(groups)]
    return result(plan, metas, assembled)


@pytest.mark.parametrize("cut_every", [1, 37, 400])
def test_ranges_cut_anywhere_give_the_rows_and_row_numbers_of_one_pass(tmp_path, redis_url, cut_every):
    split_with(tmp_path, redis_url, {"price": "1e30"})  # the poisoned account's first trade is row 13
    inputs = open_store(str(tmp_path / "in"))
    run = f"ranges-{os.urandom(3).hex()}"
    one = split_day(inputs, open_store(str(tmp_path / "one")), RunState(redis_url, run + "a"), run + "a", DATE, 4, "CNT")
    state = RunState(redis_url, run + "b")
    counted = _Counted(inputs)
    cut = ranged_split(counted, open_store(str(tmp_path / "cut")), state, run + "b", cut_every)
    ranges = sum(-(-inputs.size(name) // cut_every) for name in ("clients.csv", "trades.csv"))
    assert len(counted.reads) == ranges + 1  # a GET a range on S3 (its last line read in the same), and the plan's look
    assert (cut.accounts, cut.rejected, cut.shards, cut.trades) == (one.accounts, one.rejected, one.shards, one.trades)
    assert state.accounts(["BAD1"])["BAD1"]["reason"].startswith("trades.csv row 13 field 'price'")
    strip = lambda folder: sorted(  # noqa: E731 (the note numbers differ: each split reserved its own)
        line.split('"note_no"')[0] for p in (tmp_path / folder).rglob("shard-*.jsonl") for line in p.read_text().splitlines())
    assert strip("cut") == strip("one")


def test_a_row_that_names_no_account_keeps_its_row_number_in_any_range(tmp_path, redis_url):
    split_with(tmp_path, redis_url, raw=b'x,"unterminated\x00')  # row 13 of trades.csv
    inputs = open_store(str(tmp_path / "in"))
    cut = ranged_split(inputs, open_store(str(tmp_path / "cut")), RunState(redis_url, "nameless"), "nameless", 53)
    assert [e["row"] for e in cut.input_errors] == [13], cut.input_errors


MUTATIONS = [("price", "1e30"), ("price", "0.001"), ("price", " 820.00"), ("quantity", "0010"), ("quantity", "0"),
             ("quantity", "1_000"), ("symbol", "SB IN"), ("symbol", "S" * 300), ("isin", ""), ("expiry", "2026-13-01"),
             ("expiry", "2026-11-19"), ("strike", "abc"), ("option_type", "XX"), ("trade_date", "2026-11-19"),
             ("instrument", "FUTSTK"), ("product", "NRML"), ("status", "14"), ("settlement_no", "A\x85B"),
             ("settlement_no", "x" * 300), ("order_time", "24:00:00"), ("segment", "XX"), ("ucc", "ÄB")]


def test_the_fast_trade_check_agrees_with_parse_trade_on_every_row(tmp_path):

    write_dumps(tmp_path, SynthOptions(dt.date.fromisoformat(DATE), 40, seed=5))
    closes = bhavcopy.read((tmp_path / "bhavcopy.csv").open(), DATE, [], 10)
    rows = list(csv.DictReader((tmp_path / "trades.csv").open()))[:300] + HAND_MADE
    cases = rows + [{**r, f: v} for r in rows[::25] + HAND_MADE for f, v in MUTATIONS]
    for n, raw in enumerate(cases, 1):
        values = [raw.get(f, "") for f in TRADE_FIELDS]
        try:
            want = parse_trade("trades.csv", n, raw, DATE, closes).as_row()
        except RowError as e:
            with pytest.raises(RowError) as got:
                trade_row("trades.csv", n, values, DATE, closes, {})
            assert str(got.value) == str(e)
            continue
        assert trade_row("trades.csv", n, values, DATE, closes, {}) == want, raw


def test_note_numbers_reserved_side_by_side_never_repeat_and_the_mark_never_drops(tmp_path, redis_url):
    store, state, fy = open_store(str(tmp_path)), RunState(redis_url, "reserve"), f"t{os.urandom(3).hex()}"
    firsts = []

    def reserve():
        for _ in range(5):
            firsts.append(note_numbers.reserve(store, state, fy, 10))

    threads = [threading.Thread(target=reserve) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    issued = sorted(n for f in firsts for n in range(f, f + 10))
    assert issued == list(range(1, 301))
    assert note_numbers.high_water_mark(store, fy) == 300


class _Stalling(FolderStore):
    """A store whose first write of a note-number mark waits, past the lock's life, until `go`."""

    def __init__(self, root):
        super().__init__(root)
        self.stalled, self.go = threading.Event(), threading.Event()

    def put_new(self, key, data):
        if key.startswith("noteseq/") and not self.stalled.is_set():
            self.stalled.set()
            assert self.go.wait(30)
        return super().put_new(key, data)


def _outlived(tmp_path, redis_url, count: int, between) -> tuple[list, int, RunState, str]:
    """A reserves `count` numbers and its store stalls on A's mark; Redis expires the lock, then
    `between(state, fy)` runs and B reserves 30; A's write then lands. (A's numbers or error, B's.)"""
    store, fy, state = _Stalling(str(tmp_path)), f"t{os.urandom(3).hex()}", RunState(redis_url, "outlived")
    a = []

    def reserve_a():
        try:
            a.append(note_numbers.reserve(store, state, fy, count))
        except note_numbers.NumbersTaken as e:
            a.append(e)

    thread = threading.Thread(target=reserve_a)
    thread.start()
    try:
        assert store.stalled.wait(30)
        state.r.delete(keys.note_sequence_lock(fy, str(tmp_path)))  # its 120 s are up
        between(state, fy)
        b = note_numbers.reserve(open_store(str(tmp_path)), state, fy, 30)
    finally:
        store.go.set()
        thread.join(30)
    return a, b, state, fy


def test_a_reservation_that_outlives_its_lock_never_lowers_the_mark_a_redis_that_lost_its_counter_reads(
        tmp_path, redis_url):
    """B reserves the next block while A's mark is stalled, and A's write lands after B's: a
    Redis that then loses its counter carries on above B's numbers (with one overwritten mark,
    A's write had moved it down, and B's numbers were issued again)."""
    a, b, state, fy = _outlived(tmp_path, redis_url, 50, lambda state, fy: None)
    store = open_store(str(tmp_path))
    assert json.loads(store.get(keys.note_sequence_key(fy)))["high"] == 80, "A's late write moved the old object down"
    state.r.delete(keys.note_sequence(fy, str(tmp_path)))  # Redis restarted without its data

    assert note_numbers.reserve(open_store(str(tmp_path)), state, fy, 10) == 81, "B's numbers issued again"
    assert note_numbers.high_water_mark(open_store(str(tmp_path)), fy) == 90
    assert (a, b) == ([1], 51), "A keeps the numbers it was issued"


def test_numbers_issued_twice_while_a_reservation_outlived_its_lock_are_used_by_one_of_the_two(
        tmp_path, redis_url):
    """A's mark is stalled past the lock's life and Redis loses its counter meanwhile: B is issued
    A's numbers again. A finds B's mark over its numbers and uses none of them."""
    a, b, state, fy = _outlived(tmp_path, redis_url, 50,
                                lambda state, fy: state.r.delete(keys.note_sequence(fy, str(tmp_path))))
    assert b == 1 and len(a) == 1 and isinstance(a[0], note_numbers.NumbersTaken), a
    assert "1-50" in str(a[0])
    assert note_numbers.reserve(open_store(str(tmp_path)), state, fy, 10) == 51


def test_two_entities_on_one_redis_each_number_from_their_own_last(tmp_path, redis_url):
    """Each issuing entity keeps its own store, and so its own note numbers: on one Redis (one
    machine, a head kept for both), the second's first note was numbered after the first's last."""
    state, fy = RunState(redis_url, f"run-{os.urandom(3).hex()}"), f"fy-{os.urandom(3).hex()}"
    broking, commodities = open_store(str(tmp_path / "broking")), open_store(str(tmp_path / "commodities"))
    assert note_numbers.reserve(broking, state, fy, 1000) == 1
    assert note_numbers.reserve(commodities, state, fy, 10) == 1, "its own sequence, not after the other's"
    assert note_numbers.reserve(broking, state, fy, 5) == 1001


def test_a_group_with_no_account_to_number_reserves_nothing(tmp_path, redis_url):
    """A group whose shards hold first notes alone (numbered before the split), or a resumed
    split's with every account already in a file: no block, no mark, no error; the sequence goes
    on where it was."""
    store, fy, state = open_store(str(tmp_path)), f"t{os.urandom(3).hex()}", RunState(redis_url, "none")
    assert note_numbers.reserve(store, state, fy, 10) == 1
    assert note_numbers.reserve_for(store, state, fy, []) == {}
    assert note_numbers.reserve_for(store, state, fy, ["A", "B"], fresh=[]) == {}
    with pytest.raises(ValueError):
        note_numbers.reserve(store, state, fy, 0)
    assert note_numbers.reserve_for(store, state, fy, ["A", "B"]) == {"A": 11, "B": 12}


def test_a_store_a_version_before_the_marks_wrote_is_read_and_kept_for_it(tmp_path, redis_url):
    """Its one overwritten object is read (a Redis that lost its counter carries on above it),
    and still written, for that version to read if the broker goes back to it."""
    store, fy, state = open_store(str(tmp_path)), f"t{os.urandom(3).hex()}", RunState(redis_url, "before")
    store.put(keys.note_sequence_key(fy), json.dumps({"fy": fy, "high": 700}).encode())
    assert note_numbers.reserve(store, state, fy, 10) == 701
    assert json.loads(store.get(keys.note_sequence_key(fy)))["high"] == 710


class _NodeLost(BaseException):
    """The process is gone: nothing of the assembly after this runs, not even an `except Exception`."""


class _LostAfterWrites:
    """A store on a node that is lost just after its `n`th shard file is written: that file
    lands, its accounts are never recorded."""

    def __init__(self, store, n: int):
        self.store, self.left = store, n

    def put_new(self, key, data):
        made = self.store.put_new(key, data)
        if "shard-" in key:
            self.left -= 1
            if not self.left:
                raise _NodeLost(key)
        return made

    def __getattr__(self, name):
        return getattr(self.store, name)


def _group(tmp_path):
    """A 60-account day read for one assembly group: the store, the assembly's arguments."""
    write_dumps(tmp_path / "in", SynthOptions(dt.date.fromisoformat(DATE), 60, seed=3))
    inputs = open_store(str(tmp_path / "in"))
    plan = make_plan(inputs, DATE, 10, parts=1)
    metas, buckets = zip(*(read_range(inputs, r, plan.columns[r.file], plan.shard_count, 1, DATE, plan.closes)
                           for r in plan.ranges))
    return open_store(str(tmp_path / "out")), ("again", DATE, "CNT", [b[0] for b in buckets], row_offsets(list(metas)))


def _files(tmp_path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (tmp_path / "out").rglob("shard-*.jsonl")}


def _validated_once(state: RunState, accounts: int) -> None:
    records = list(state.all_accounts())
    assert len(records) == accounts and state.counts()["validated"] == accounts
    assert [r for r in records if r["stage"] != "validated" or r["events"]] == []  # no account validated twice


def test_an_assembly_run_again_keeps_the_shard_files_first_written_and_hands_them_on(tmp_path, redis_url):
    """Ray runs an assembly task again when a node holding a shard file's bytes it handed on is
    lost: its notes may be mailed by then, so the files (their note numbers) first written stand,
    the bytes handed on again are theirs, and no account is validated twice."""
    store, args = _group(tmp_path)
    state = RunState(redis_url, f"again-{os.urandom(3).hex()}")
    made = [assemble(store, state, *args, hand=range(100)) for _ in range(2)]
    files = _files(tmp_path)
    assert made[0]["rows"] == made[1]["rows"] and len(made[0]["rows"]) == len(files) > 3
    assert sorted(made[1]["rows"].values()) == sorted(files.values())
    _validated_once(state, sum(len(data.splitlines()) for data in files.values()))


def test_an_assembly_lost_with_its_node_midway_skips_no_note_number_when_run_again(tmp_path, redis_url):
    """Ray runs an assembly again on another node when its node is lost while it writes the
    group's shard files. The files written stand (their notes may be out by then); the same
    accounts in the same order take back the same block of note numbers, so the year's sequence
    has no gap where the lost attempt's block was, and every account is validated once, those of
    the file written just before the loss too."""
    store, args = _group(tmp_path)
    state = RunState(redis_url, f"lost-{os.urandom(3).hex()}")
    with pytest.raises(_NodeLost):
        assemble(_LostAfterWrites(store, 3), state, *args)
    written = _files(tmp_path)
    assert len(written) == 3
    assemble(store, state, *args)
    files = _files(tmp_path)
    assert {name: files[name] for name in written} == written and len(files) > 3
    numbers = sorted(int(json.loads(line)["note_no"].rpartition("-")[2])
                     for data in files.values() for line in data.splitlines())
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # none skipped, none twice
    _validated_once(state, len(numbers))


def test_a_resumed_split_validates_the_accounts_of_a_file_its_cut_short_attempt_wrote(tmp_path, redis_url):
    """A run stopped while its split wrote shard files is resumed, and the resumed split's
    assembly is lost with its node too, then run again: the files written are kept as they are
    (their notes may be out), and their accounts, which the attempts cut short never recorded,
    are validated now, once; the rest take the numbers their places had in the first attempt's
    block, so the year's sequence has no gap and no number twice."""
    store, args = _group(tmp_path)
    state = RunState(redis_url, f"resumed-{os.urandom(3).hex()}")
    with pytest.raises(_NodeLost):
        assemble(_LostAfterWrites(store, 3), state, *args)
    with pytest.raises(_NodeLost):
        assemble(_LostAfterWrites(store, 2), state, *args, reuse=True)
    assert len(_files(tmp_path)) == 5
    assemble(store, state, *args, reuse=True)
    numbers = sorted(int(json.loads(line)["note_no"].rpartition("-")[2])
                     for data in _files(tmp_path).values() for line in data.splitlines())
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # none skipped, none twice
    _validated_once(state, len(numbers))


def test_a_resumed_split_whose_block_redis_lost_numbers_only_what_no_file_has(tmp_path, redis_url):
    """Redis lost the first attempt's block (or it expired) before the resume: the files written
    stand, and a block for the accounts still to number alone is reserved, numbered in order:
    the only numbers skipped are the first block's that no file took."""
    store, args = _group(tmp_path)
    state = RunState(redis_url, f"lostblock-{os.urandom(3).hex()}")
    before = set(state.r.keys("cn:noteseq:*:block:*"))
    with pytest.raises(_NodeLost):
        assemble(_LostAfterWrites(store, 3), state, *args)
    kept = {name: data for name, data in _files(tmp_path).items()}
    state.r.delete(*set(state.r.keys("cn:noteseq:*:block:*")) - before)  # this run's
    assemble(store, state, *args, reuse=True)

    def numbers(files):
        return sorted(int(json.loads(line)["note_no"].rpartition("-")[2]) for data in files for line in data.splitlines())
    first, every = numbers(kept.values()), numbers(_files(tmp_path).values())
    assert len(every) == len(set(every))
    fresh = sorted(set(every) - set(first))
    assert fresh == list(range(fresh[0], fresh[0] + len(fresh))) and fresh[0] == first[0] + len(every)
    _validated_once(state, len(every))


def test_a_manifest_keeps_the_split_s_groups_while_it_is_under_way_and_versions_apart_read_each_other_s(tmp_path):
    """A split under way records its groups; a finished run's manifest is as the version before
    wrote it (that version, rolled back to, reads it), and a field a later version adds is not
    this one's."""
    store = open_store(str(tmp_path))
    save_manifest(store, "grouped", SplitResult(shards=[1, 4], shard_count=10, complete=False, groups=6))
    assert load_manifest(store, "grouped").groups == 6
    save_manifest(store, "done", SplitResult(shards=[1, 4], shard_count=10, accounts=9))
    assert "groups" not in json.loads(store.get(keys.manifest_key("done")))
    store.put(keys.manifest_key("older"), json.dumps({"shards": [1], "shard_count": 10, "complete": False}).encode())
    assert load_manifest(store, "older").groups == 0
    store.put(keys.manifest_key("later"), json.dumps({"shards": [2], "shard_count": 10, "wider": [1]}).encode())
    assert load_manifest(store, "later").shards == [2]


class _Stalled:
    """A store on a node cut off from the cluster, not dead: its writes wait until `go` is set."""

    def __init__(self, store, go: threading.Event):
        self.store, self.go = store, go

    def put_new(self, key, data):
        self.go.wait(30)
        return self.store.put_new(key, data)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_an_assembly_cut_off_and_run_again_beside_itself_never_resets_an_account_s_record(tmp_path, redis_url):
    """Ray runs an assembly again while the first attempt, on a node cut off, still runs: both
    take the same block and write the same files. The one that writes last must not validate
    the accounts again: that would reset a note that failed since, and take it off the failed
    list that `rerun --failed` reads."""
    store, args = _group(tmp_path)
    state = RunState(redis_url, f"beside-{os.urandom(3).hex()}")
    go, ended = threading.Event(), []
    cut_off = threading.Thread(target=lambda: ended.append(assemble(_Stalled(store, go), state, *args)))
    cut_off.start()
    time.sleep(0.3)  # it reserves first, most likely: either way both take one block
    assemble(store, state, *args)
    failed = json.loads(min(_files(tmp_path).values()).splitlines()[0])["ucc"]
    state.record([Outcome(failed, "signed", "failed", reason="sign: HSM refused")])
    go.set()
    cut_off.join(30)
    assert ended and len(ended[0]["shards"]) == len(_files(tmp_path))  # it wrote (found) every file, and ended
    assert state.failed() == [failed]
    assert [r["ucc"] for r in state.all_accounts() if r["events"]] == [failed]


def test_a_split_run_again_records_a_rejected_account_once(tmp_path, redis_url):
    """Its rejection is an event of its record: a second split of the same day (an assembly run
    again, a resumed run) found it recorded and recorded it again, a second event a time."""
    trades = trades_for(INNOCENTS + [POISONED])
    trades[-2] = {**trades[-2], "quantity": "abc"}
    inputs = open_store(str(write_day(tmp_path / "in", trades=trades, clients=INNOCENTS + [POISONED])))
    state = RunState(redis_url, f"rejected-{os.urandom(3).hex()}")
    for _ in range(2):
        split_day(inputs, open_store(str(tmp_path / "store")), state, state.run_id, DATE, 4, "CNT")
    record = state.accounts(["BAD1"])["BAD1"]
    assert (record["status"], len(record["events"]), state.statuses()["rejected"]) == ("rejected", 1, 1)


def test_the_report_is_written_in_pages_and_lists_every_account(tmp_path, redis_url):
    state = RunState(redis_url, f"pages-{os.urandom(3).hex()}")
    n = 2 * report.PAGE + 7
    state.record([Outcome(f"U{i}", "delivered", message_id=f"<m{i}>") for i in range(n - 3)]
                 + [Outcome(f"P{i}", "rendered", "physical", "no e-mail consent") for i in range(3)])
    store = open_store(str(tmp_path))
    key = report.write(store, state, state.run_id, {"run_id": state.run_id}, [])
    rows = list(csv.DictReader(io.StringIO(store.get(key.replace(".json", ".csv")).decode())))
    assert len(rows) == n and len({r["ucc"] for r in rows}) == n
    doc = json.loads(store.get(key))
    assert doc["statuses"] == {"delivered": n - 3, "physical": 3}
    assert sorted(doc["physical_dispatch"]) == ["P0", "P1", "P2"] and doc["physical_dispatch_count"] == 3


def test_the_report_json_stays_one_size_however_many_notes_are_owed_on_paper(tmp_path, redis_url, monkeypatch):
    """The live page and `status` read the JSON whole: it names the first accounts owed paper
    and counts them all; the paper list names every one (before: the JSON listed them all)."""
    monkeypatch.setattr(report, "PAPER_IN_JSON", 4)
    state = RunState(redis_url, f"paper-{os.urandom(3).hex()}")
    state.record([Outcome(f"P{i}", "rendered", "physical", "no e-mail consent") for i in range(10)])
    store = open_store(str(tmp_path))
    key = report.write(store, state, state.run_id, {"run_id": state.run_id, "trade_date": "2026-11-20"}, [])
    doc = json.loads(store.get(key))
    assert len(doc["physical_dispatch"]) == 4 and doc["physical_dispatch_count"] == 10
    paper = list(csv.DictReader(io.StringIO(store.get(report.paper_key(state.run_id)).decode())))
    assert sorted(r["ucc"] for r in paper) == sorted(f"P{i}" for i in range(10))



@pytest.mark.parametrize("field", ["plain", 'a"quote', "back\\slash", "Zoë", "", '"'])
def test_a_row_handed_to_assembly_as_text_reads_back_as_the_same_fields(field):
    row = ["2026-11-20", "NSE", field, "x,y"]
    assert json.loads(_json_row(row)) == row


def test_a_day_s_assembly_groups_stay_the_same_size_however_big_the_day():
    """The full-size day on two cores: four groups held 375,000 accounts each, one assembly
    task 6.9 GB (bench/fullday.py); a group now holds at most GROUP_SHARDS_MAX shards."""
    from pipeline.cluster.split_tasks import GROUP_SHARDS_MAX, group_count

    assert group_count(shards=20, cpus=2, ranges=2) == 4  # a small day: two groups a CPU, as before
    for shards, ranges in ((1_540, 8), (15_360, 72), (153_600, 700)):  # 150k, 1.5M and 15M accounts at 100 a shard
        groups = group_count(shards, cpus=2, ranges=ranges)
        assert groups >= 4 and -(-shards // groups) <= GROUP_SHARDS_MAX, (shards, groups)
    assert group_count(shards=15_360, cpus=64, ranges=72) == 128  # a cluster's cores: as many groups as before


def test_a_client_whose_every_trade_was_cancelled_is_counted_and_named_not_lost(tmp_path, redis_url):
    """No trade stands, so no note is due; the run says so. Before, such a client was in no count
    and no report (the full-size day: 183 of 1.5M accounts, bench/fullday.py)."""
    day = tmp_path / "in"
    write_dumps(day, SynthOptions(dt.date.fromisoformat(DATE), 30, seed=5))
    with (day / "trades.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    gone = rows[0]["ucc"]
    rows += [{**r, "status": "13"} for r in rows if r["ucc"] == gone]  # each of its trades, cancelled
    with (day / "trades.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, TRADE_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    run = f"cancelled-{os.urandom(3).hex()}"
    split = split_day(open_store(str(day)), open_store(str(tmp_path / "store")), RunState(redis_url, run), run, DATE,
                      4, "CNT")
    assert (split.nothing_due, split.nothing_due_accounts, split.accounts, split.rejected) == (1, [gone], 29, 0)
    assert RunState(redis_url, run).accounts([gone]) == {}  # no record: nothing was made for it


@pytest.mark.parametrize("cut_every", [97, 1 << 20])
def test_a_trade_modified_under_another_client_s_code_is_that_client_s_alone(tmp_path, redis_url, cut_every):
    """A modification (status 12) names the trade's client as it now stands. A trade given to
    another client code is that client's, off the first's note, wherever their rows are (other
    ranges, shards, groups); cancelled under the new code, it is off both; moved back, it is the
    first's, as last modified; a client whose every trade moved has no note due. Before, the
    first client kept the original and was charged for it too. The first notes, read before the
    split, are the split's; every figure agrees with tests/recompute.py."""
    from tests.recompute import check_text, recompute
    from tests.every_segment_day import note_text

    day = tmp_path / "in"
    write_dumps(day, SynthOptions(dt.date.fromisoformat(DATE), 40, seed=11))
    inputs = open_store(str(day))
    plan = make_plan(inputs, DATE, 4, parts=1)
    _, first = first_accounts(inputs, plan, DATE, 4)
    with (day / "trades.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    changed = {r["trade_no"] for r in rows if r["status"] != "11"}
    plain = defaultdict(list)  # an account's trades never modified nor cancelled
    for r in rows:
        if r["trade_no"] not in changed:
            plain[r["ucc"]].append(r)
    shard = functools.partial(keys.shard_of, shards=plan.shard_count)
    a = next(u for u, _, _ in first if len(plain[u]) > 1)  # one of the first notes' accounts loses a trade
    others = sorted(u for u in plain if u != a and shard(u) != shard(a) and len(plain[u]) > 1)
    b, c, d, e, f, g, h, x = others[:8]
    moved, gone, back, lost = plain[a][0], plain[c][0], plain[e][0], plain[x][0]
    rows += [{**moved, "ucc": b, "status": "12"},
             {**gone, "ucc": d, "status": "12"}, {**gone, "ucc": d, "status": "13"},
             {**back, "ucc": f, "status": "12"}, {**back, "ucc": e, "status": "12", "quantity": str(int(back["quantity"]) + 1)},
             {**lost, "ucc": "NO-CODE", "status": "12"}]  # whose trade it is now is not known: x is rejected
    unknown = len(rows)  # that row's number in the file
    rows += [{**t, "ucc": h, "status": "12"} for t in plain[g]]  # every trade of g, to h
    with (day / "trades.csv").open("w", newline="") as out:
        writer = csv.DictWriter(out, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    run, store = f"moved-{os.urandom(3).hex()}", open_store(str(tmp_path / "store"))
    split = ranged_split(inputs, store, RunState(redis_url, run), run, cut_every)
    save_manifest(store, run, split)
    assert (split.rejected, split.nothing_due_accounts) == (1, [g])
    assert [(i["row"], i["field"]) for i in split.input_errors] == [(unknown, "ucc")]  # the row naming no client
    assert "was last modified or cancelled by another row, whose client code is not valid" in \
        RunState(redis_url, run).accounts([x])[x]["reason"]

    def trades(ucc: str) -> dict[str, dict]:
        return {t[TRADE_FIELDS.index("trade_no")]: dict(zip(TRADE_FIELDS, t)) for t in find_account(store, run, ucc)["trades"]}

    assert moved["trade_no"] not in trades(a) and trades(b)[moved["trade_no"]]["ucc"] == b
    assert gone["trade_no"] not in trades(c) and gone["trade_no"] not in trades(d)
    assert back["trade_no"] not in trades(f) and trades(e)[back["trade_no"]]["quantity"] == str(int(back["quantity"]) + 1)
    assert find_account(store, run, g) is None and set(trades(h)) >= {t["trade_no"] for t in plain[g]}

    plan = make_plan(inputs, DATE, 4, parts=1)
    plan.ranges = [Range(name, i, x, min(x + cut_every, inputs.size(name))) for name in ("clients.csv", "trades.csv")
                   for i, x in enumerate(range(0, inputs.size(name), cut_every))]
    _, again = first_accounts(inputs, plan, DATE, 4)
    assert a in [u for u, _, _ in again]
    for ucc, _, made in again:
        assert [json.loads(t) for t in made] == find_account(store, run, ucc)["trades"], ucc

    expected = {u: figures for u, figures in recompute(day, DATE).items() if u != x}
    assert set(expected) == {a for a in {r["ucc"] for r in rows} if find_account(store, run, a)}
    for ucc, figures in expected.items():
        account = find_account(store, run, ucc)
        note = stages.note_data(account, Client(**account["client"]), DATE, {"NSE": "2026-11-23", "BSE": "2026-11-23"})
        assert check_text(note_text(note), figures) == [], ucc


def test_the_split_on_ray_moves_a_trade_to_the_client_it_was_given_to(ray_session, settings, tmp_path):
    """The same on Ray: each range's moves go to one task that works out the day's owners, which
    every assembly reads; the accounts are in other shards, groups and ranges."""
    from pipeline.cluster.split_tasks import Split

    day = tmp_path / "in"
    write_dumps(day, SynthOptions(dt.date.fromisoformat(DATE), 100, seed=9))
    with (day / "trades.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    inputs = open_store(str(day))
    shards = make_plan(inputs, DATE, 4, parts=1).shard_count
    moved = next(r for r in rows if r["status"] == "11" and sum(t["trade_no"] == r["trade_no"] for t in rows) == 1)
    to = next(u for u in sorted({r["ucc"] for r in rows})
              if keys.shard_of(u, shards) % 2 != keys.shard_of(moved["ucc"], shards) % 2)
    with (day / "trades.csv").open("a", newline="") as f:
        csv.DictWriter(f, list(rows[0])).writerow({**moved, "ucc": to, "status": "12"})
    plan = make_plan(inputs, DATE, 4, parts=1)
    plan.ranges = [Range(name, i, x, min(x + 8192, inputs.size(name))) for name in ("clients.csv", "trades.csv")
                   for i, x in enumerate(range(0, inputs.size(name), 8192))]
    run, store = f"moved-{os.urandom(3).hex()}", open_store(settings.store_url)
    split = Split.start(settings, run, DATE, str(day), 2, False, lambda: None, plan, groups=2)
    save_manifest(store, run, split.done(block=True))
    at = TRADE_FIELDS.index("trade_no")
    assert moved["trade_no"] not in [t[at] for t in find_account(store, run, moved["ucc"])["trades"]]
    assert moved["trade_no"] in [t[at] for t in find_account(store, run, to)["trades"]]


def test_the_driver_keeps_one_trade_count_a_shard_however_many_ranges_the_dumps_are_read_in(
        ray_session, settings, tmp_path):
    """Each range counts the trades of every shard it saw. Kept per range, the 72 ranges of a 1.5M-
    account day held 1.1 million counts in the driver, and its peak RSS grew 1.70x for 10x the
    accounts (bench/fullday.py); the driver now sums them as each range ends."""
    from pipeline.cluster.split_tasks import Split

    day = tmp_path / "in"
    write_dumps(day, SynthOptions(dt.date.fromisoformat(DATE), 300, seed=8))
    inputs = open_store(str(day))
    plan = make_plan(inputs, DATE, 1, parts=1)  # a shard an account
    plan.ranges = [Range(name, i, a, min(a + 4096, inputs.size(name))) for name in ("clients.csv", "trades.csv")
                   for i, a in enumerate(range(0, inputs.size(name), 4096))]
    run = f"tally-{os.urandom(3).hex()}"
    split = Split.start(settings, run, DATE, str(day), 2, False, lambda: None, plan)
    done = split.done(block=True)
    assert len(plan.ranges) > 20 and [m for m in split.metas if "weights" in m] == []
    counted: dict[int, int] = {}  # what each range counted, read here
    for rng in plan.ranges:
        meta, _ = read_range(inputs, rng, plan.columns[rng.file], plan.shard_count, 1, DATE, plan.closes)
        for shard, n in meta["weights"].items():
            counted[shard] = counted.get(shard, 0) + n
    assert split.weights == counted and len(counted) >= len(done.shards) > 100


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_a_range_read_a_chunk_at_a_time_gives_the_lines_of_the_range_read_whole(tmp_path, chunk):
    """split._range_lines reads a range CHUNK bytes at a time (a range is never held whole); its
    lines are exactly those of the range read whole and split as io.StringIO(newline="") does:
    a byte-order mark dropped at the top, CRLF and lone CR endings, a quoted field holding line
    breaks, a last line with no newline, ranges cut anywhere."""
    from pipeline.day import split

    text = ("\ufeffucc,name\r\nC1,\"two\nlines\"\r\nC2,plain\nC3,\"cr\rinside\"\rC4,é ünïcode\n\nC5,last").encode()
    (tmp_path / "f.csv").write_bytes(text)
    store = open_store(str(tmp_path))

    def whole(rng: Range) -> list[str]:
        data = text[max(0, rng.start - 1):rng.end]
        if rng.start > 0:
            cut = data.find(b"\n")
            data = data[cut + 1:] if cut >= 0 else b""
        if data and not data.endswith(b"\n"):
            rest = text[rng.end:]
            cut = rest.find(b"\n")
            data += rest[:cut + 1] if cut >= 0 else rest
        decoded = data.decode("utf-8", "surrogateescape")
        return list(io.StringIO(decoded.removeprefix("\ufeff") if rng.start == 0 else decoded, newline=""))

    for step in (3, 10, len(text)):
        cuts = list(range(0, len(text), step)) + [len(text)]
        ranges = [Range("f.csv", i, a, b) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
        got = [list(split._range_lines(store, r, chunk)) for r in ranges]
        assert got == [whole(r) for r in ranges], (step, chunk)
        assert "".join(line for lines in got for line in lines) == text.decode().removeprefix("\ufeff")


@pytest.mark.parametrize("text", [
    "ucc,x\nC1,a\nC2,C1b\nC3,c\nC1,d\n",  # a ucc inside another field: parsed, then left out
    "\ufeffucc,x\nC1,a\nC2,b\nC1,last",  # a byte-order mark, no newline at the end
    "ucc,x\nC1,a\n\nC2,b\nC1,c\n",  # a blank line: not a row
    "ucc,x\r\nC1,a\r\nC2,b\r\nC1,c\r\n",  # CRLF
    "ucc,x\r\nC1,a\r\n\r\nC2,b\r\nC1,c\rC1,d\r\n",  # CRLF, a blank line, a lone CR ending a row
    'ucc,x\nC2,b\nC1,a\nC3,"open\nC1,swallowed\nC1,"\nC1,after\n',  # a quoted field across lines
    '"ucc",x\nC1,a\nC2,b\n',  # a quoted header
    "ucc,x\nC2,b\nC1,\0nul\nC1,c\n",  # a NUL byte: csv refuses the row
    "ucc,x\nC1,C1 twice\nC2,b\n" + "C1,a heavy account\n" * 150,  # a line naming it twice; more lines than C's first room
])
@pytest.mark.parametrize("chunk", [1, 5, 4096])
@pytest.mark.parametrize("scan", ["C", "Python"])
def test_the_first_notes_read_of_a_range_gives_the_full_read_s_rows_of_the_wanted_accounts(
        tmp_path, text, chunk, scan, monkeypatch):
    """split._wanted_rows counts lines where a chunk is a row a line, parsing only those naming
    a wanted account; the row numbers, rows and count must be the full parse's, ranges cut anywhere.
    Each chunk's lines are found by wanted.c, or by its Python twin where it cannot be built."""
    from pipeline.day import split

    if scan == "C":
        assert split._wanted_lines() is not None, "wanted.c did not build"
    else:
        monkeypatch.setattr(split, "_wanted_lines", lambda: None)
    data = text.encode()
    (tmp_path / "f.csv").write_bytes(data)
    store = open_store(str(tmp_path))
    for step in (4, 11, len(data)):
        cuts = list(range(0, len(data), step)) + [len(data)]
        for rng in (Range("f.csv", i, a, b) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))):
            reader = csv.reader(split._range_lines(store, rng, chunk))
            if rng.index == 0:
                next(reader, None)
            full = list(split._rows(reader))
            got = list(split._wanted_rows(store, rng, {"C1"}, chunk))
            assert got[-1] == (full[-1][0] if full else 0, None), (step, rng)
            assert [(n, r) for n, r in got[:-1] if r is not None and r[0].strip() == "C1"] == \
                   [(n, r) for n, r in full if r is not None and r[0].strip() == "C1"], (step, rng)


def test_wanted_c_finds_the_lines_its_python_twin_finds_in_random_chunks():
    """wanted.c against split.py's own lines, on chunks of the bytes that decide a row a line
    (quotes, NULs, CRs, blank lines), codes inside one another, and marks in one field."""
    from pipeline.day import split

    scan = split._wanted_lines()
    assert scan is not None, "wanted.c did not build"
    rng = random.Random(73)
    held = 0
    for i in range(3000):
        alphabet = b'C12C12,,\n\n\r" a\0' if i % 3 == 0 else b"C12C12,,,  a\n"  # most chunks a row a line
        chunk = bytes(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
        needles = rng.sample([b"C1", b"C12", b"2", b"C", b"1,"], rng.randrange(0, 4))
        column, marks = rng.randrange(-1, 4), rng.sample([b"12", b"1", b"C", b" a"], rng.randrange(0, 3))
        with_c = split._lines_holding(chunk, needles, column, marks)
        with pytest.MonkeyPatch.context() as twin:
            twin.setattr(split, "_wanted_lines", lambda: None)
            in_python = split._lines_holding(chunk, needles, column, marks)
        assert with_c == in_python, (chunk, needles, column, marks)
        held += bool(with_c and with_c[1])
    assert held > 700, "too few chunks were a row a line with a code in them to compare"


def test_a_split_stopped_while_its_ranges_are_read_leaves_none_of_them_to_run(ray_session, settings, tmp_path):
    """A notebook's driver outlives its run. A run stopped while its split read the dumps (the
    capacity watch's CapacityError, the user's interrupt) left the reads queued on that Ray, and
    they ran after the run had ended, on its render slots. Both slots are held here, so every read
    waits; the run stops at the watch's first call; the slots are let go. Ray's own task events
    then show no read ever started."""
    import ray
    from ray.core.generated import common_pb2

    from pipeline.cluster.split_tasks import Split

    go = tmp_path / "go"

    @ray.remote(num_cpus=0, resources={"render": 1})
    def hold(flag: str) -> None:
        while not os.path.exists(flag):
            time.sleep(0.02)

    holders = [hold.remote(str(go)) for _ in range(2)]
    deadline = time.time() + 30
    while ray.available_resources().get("render", 0) > 0:
        assert time.time() < deadline, "the render slots were not taken"
        time.sleep(0.05)
    day = tmp_path / "in"
    write_dumps(day, SynthOptions(dt.date.fromisoformat(DATE), 100, seed=9))
    inputs = open_store(str(day))
    plan = make_plan(inputs, DATE, 4, parts=1)
    plan.ranges = [Range(name, i, a, min(a + 8192, inputs.size(name))) for name in ("clients.csv", "trades.csv")
                   for i, a in enumerate(range(0, inputs.size(name), 8192))]

    def stop() -> None:
        raise KeyboardInterrupt

    run, since = f"stopped-{os.urandom(3).hex()}", time.time_ns()
    with pytest.raises(KeyboardInterrupt):
        Split.start(settings, run, DATE, str(day), 2, False, stop, plan)
    deadline = time.time() + 60
    go.touch()
    ray.get(holders, timeout=60)

    def reads() -> list:  # this test's, not the session's others of the same name
        return [e for e in ray._private.state.state._get_all_task_events() if e.task_info.name.startswith("split ")
                and min(e.state_updates.state_ts_ns.values(), default=0) >= since]

    while len(reads()) < len(plan.ranges):  # Ray flushes its task events about once a second
        assert time.time() < deadline, f"Ray's task events hold {len(reads())} of the {len(plan.ranges)} reads"
        time.sleep(0.5)
    time.sleep(3)  # the reads left queued would have run by now, and their events been flushed
    ran = [e for e in reads() if e.state_updates.state_ts_ns.get(common_pb2.TaskStatus.RUNNING)]
    assert len(plan.ranges) > 5 and ran == [], f"{len(ran)} of the {len(plan.ranges)} reads ran after the stop"
