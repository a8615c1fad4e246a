"""Stage 1: read the dumps in byte ranges, validate each row, and write one shard file per group of accounts.

Independent steps, so the split runs on every core of the cluster
(pipeline/cluster/split_tasks.py) or in one process (split_day, tests and benchmarks):
- read_range validates the rows of one byte range of one dump (a ranged GET on S3) and deals
  them into buckets, one per shard group, with the range's modified and cancelled trades;
- moves.owners works out, from every range's, the trades that moved to another client;
- assemble takes one group's buckets from every range, builds each shard's accounts (trades
  grouped by account, cancellations and modifications applied, moved trades with their new
  client), reserves their contract note numbers and writes the shards to storage.
Row numbers stay the file's own: a range counts its rows, and the errors it found are moved
by the rows of the ranges before it once every range is read. A bad row rejects its account
with the file, row and field named; the rest of the run goes on.
"""

from __future__ import annotations

import csv
import ctypes
import functools
import io
import itertools
import json
import math
import operator
from collections import Counter, defaultdict
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Container, Iterator

from pipeline import native
from pipeline.day import bhavcopy, moves, trading_calendar
from pipeline.day.dumps import (
    CLIENT_FIELDS,
    MAX_FIELD,
    LOT_FIELDS,
    REFERENCE_FILE,
    SEGMENTS,
    SEP,
    TRADE_COLUMNS,
    UCC,
    InputError,
    RowError,
    check_header,
    effective,
    parse_client,
    trade_row,
)
from pipeline.record import keys, note_numbers
from pipeline.record.manifest import SplitResult, load_manifest
from pipeline.record.records import Outcome
from pipeline.record.state import RunState
from pipeline.record.storage import StorageError, Store, write_once

MAX_LISTED_ERRORS = 1000
NAMED = 1000  # the accounts with no note due that the manifest and the report name (all are counted)
RANGE_BYTES_MIN = 4 << 20  # a smaller range is not worth its own GET and task (a 2,000-account day: 3 ranges, not 7)
RANGE_BYTES_MAX = 64 << 20  # a range's parsed rows stay a few hundred MB in its worker
DUMPS = {"clients.csv": CLIENT_FIELDS, "trades.csv": TRADE_COLUMNS}
RS = "\x1e"  # ends a bucket line's kind and account: like SEP, never inside an accepted field
# A field longer than MAX_FIELD is a row error, not a csv.Error that ends the file
csv.field_size_limit(max(csv.field_size_limit(), 64 * MAX_FIELD * 1024))


@dataclass(frozen=True)
class Range:
    """Rows whose first byte lies in [start, end) of a dump; `index` orders a file's ranges."""

    file: str
    index: int
    start: int
    end: int


@dataclass
class Plan:
    """What every split task needs, worked out once by whoever starts the split."""

    shard_count: int
    ranges: list[Range]
    columns: dict[str, list[int]]  # per dump: where each expected field is in its rows
    closes: dict  # the bhavcopy's closing prices, and RBI's reference rates (dumps.reference_key)
    input_errors: list[dict]  # the bhavcopy's
    closed: dict[str, str] = field(default_factory=dict)  # exchanges shut on the day, and why: their trades rejected
    # the issuing entity's memberships, where it is not every one (broker.json's segments): a trade on
    # another is rejected, unless `left_to` names the entity whose own run makes its notes
    segments: frozenset[str] | None = None
    left_to: dict[str, str] = field(default_factory=dict)


MIN_SHARDS = 2 * keys.PARTITIONS
_SEGMENTS = frozenset(SEGMENTS)
_CHANGED = ("12", "13")  # a trade modified or cancelled: the row names its client as it now stands


def find_account(store: Store, run_id: str, ucc: str) -> dict | None:
    """One account's shard entry (client block and trades), or None."""
    split = load_manifest(store, run_id)
    if split is None or not split.shard_count:
        return None
    shard = keys.shard_of(ucc, split.shard_count)
    if shard not in split.shards:
        return None
    for line in store.get(keys.shard_key(run_id, shard)).decode().splitlines():
        account = json.loads(line)
        if account["ucc"] == ucc:
            return account
    return None


def shard_count(clients: int, shard_size: int) -> int:
    """A multiple of the partition count, so every shard sits in one fixed S3 prefix, and at
    least two per partition, so even a small day keeps more shards in flight than cores."""
    shards = max(MIN_SHARDS, math.ceil(clients / max(1, shard_size)))
    return math.ceil(shards / keys.PARTITIONS) * keys.PARTITIONS


def split_day(inputs: Store, store: Store, state: RunState, run_id: str, trade_date: str,
              shard_size: int, note_prefix: str, entity: dict | None = None) -> SplitResult:
    """The whole split in this process, one range per dump and one group (`entity`: make_plan's).
    Raises InputError when a file is missing or unusable; a bad row only rejects its account."""
    plan = make_plan(inputs, trade_date, shard_size, parts=1, entity=entity)
    metas, parts = [], []
    for rng in plan.ranges:
        meta, (bucket,) = read_range(inputs, rng, plan.columns[rng.file], plan.shard_count, 1, trade_date,
                                     plan.closes, closed=plan.closed, segments=plan.segments, left_to=plan.left_to)
        metas.append(meta)
        parts.append(bucket)
    assembled = assemble(store, state, run_id, trade_date, note_prefix, parts, row_offsets(metas),
                         owners=moves.owners(m.pop("moves") for m in metas))
    return result(plan, metas, [assembled])


def make_plan(inputs: Store, trade_date: str, shard_size: int, parts: int, holidays_file: str = "",
              entity: dict | None = None, shards: int = 0) -> Plan:
    """Raises InputError when a dump is missing or lacks a column. The shard count comes from
    the size of clients.csv and its first rows (exact for a file under 256 KB): counting a
    day's clients exactly would mean reading the file twice; `shards`, a resumed split's count,
    as the split it resumes planned it (its files were written by it). `holidays_file`: the broker's
    calendar (CN_HOLIDAYS_FILE), which says which exchanges were shut that day; `entity`: the
    issuing entity's broker.json (its `segments`, and `left_to`: the segments another entity's
    own run makes notes for)."""
    columns = {name: _columns(inputs, name, fields) for name, fields in DUMPS.items()}
    errors: list[dict] = []
    closes = _closing_prices(inputs, trade_date, errors)
    sizes = {name: inputs.size(name) for name in DUMPS}
    target = min(RANGE_BYTES_MAX, max(RANGE_BYTES_MIN, sum(sizes.values()) // max(1, 4 * parts)))
    ranges = []
    for name, size in sizes.items():
        n = max(1, round(size / target))
        ranges += [Range(name, i, size * i // n, size * (i + 1) // n) for i in range(n)]
    held = frozenset((entity or {}).get("segments") or SEGMENTS)
    return Plan(shards or shard_count(_estimate_rows(inputs, "clients.csv", sizes["clients.csv"]), shard_size), ranges,
                columns, closes, errors, trading_calendar.closed_exchanges(trade_date, holidays_file),
                None if held == frozenset(SEGMENTS) else held, dict((entity or {}).get("left_to") or {}))


def read_range(inputs: Store, rng: Range, columns: list[int], shards: int, groups: int, trade_date: str,
               closes: dict, wanted: Container[str] | None = None, closed: dict[str, str] | None = None,
               segments: frozenset[str] | None = None, left_to: dict[str, str] | None = None
               ) -> tuple[dict, list[dict[int, str]]]:
    """Validates one range's rows. Returns what the range saw (its row count, the errors that
    name no account, trades per shard) and one bucket per group of shards: {shard: its rows as
    text}, a line per row, `kind ucc RS payload`: c (a client as JSON), t (a trade: its
    identity, its place on the note and its status joined by SEP, then the row as JSON), each
    ending in `RS range:row` (its row in this range: a rejection no single row causes names its rows),
    or e (an error rejecting the account, as JSON). Text, because a range's rows as Python lists cost
    seconds to pickle to the assembly tasks; JSON, because that is how the shard file holds them.
    The meta's "moves": each trade row modified or cancelled (status 12 or 13), in file order
    (moves.packed), for moves.owners: a trade may move to another client's code.
    `wanted`: only these accounts' rows, the rest counted but not validated (the first notes),
    but for the moves. `closed`: the exchanges shut that day (Plan.closed), whose trades are
    rejected; `segments` and `left_to`: the issuing entity's memberships (Plan.segments): a trade
    of a segment left to another entity is counted and left out, one of a segment no entity holds
    rejects its account."""
    kind, name = rng.file[0], rng.file
    at = DUMPS[name].index("ucc")
    status = DUMPS[name].index("status") if kind == "t" else -1
    if wanted is None:
        reader = csv.reader(_range_lines(inputs, rng))
        if rng.index == 0:
            next(reader, None)  # the header
        rows = _rows(reader)
    else:
        rows = _wanted_rows(inputs, rng, wanted, column=columns[status] if kind == "t" else -1,
                            marks=[code.encode() for code in _CHANGED])
    lines: dict[int, list[str]] = defaultdict(list)
    weights: dict[int, int] = defaultdict(int)
    present = [c for c in columns if c >= 0]  # a missing optional column is -1
    pad = ("",) * (len(columns) - len(present))
    pick, width = operator.itemgetter(*present), max(present) + 1
    if columns[:len(present)] != present:  # a missing column before one given (the settlement type without
        pick = _picker(columns)  # the lot's terms): each in its place, an empty text where it is missing
        pad, present = (), columns
    shard_of, contracts = {}, {}  # an account's rows and a contract's trades repeat: work each out once
    errors, n = [], 0
    at_range = f"{RS}{rng.index}:"  # each line ends in RS range:row; this part once a range
    entity = kind == "t" and (segments is not None or bool(left_to))
    left: dict[str, int] = defaultdict(int)
    changes: list[tuple[int, int]] = []
    for n, raw in rows:
        try:
            if raw is None:
                if wanted is not None:  # it names no account (or it is _wanted_rows's count)
                    continue
                raise RowError(name, n, "", "is not a CSV row (a stray quote or a NUL byte)")
            values = (pick(raw) if len(raw) >= width else tuple(raw[i] if 0 <= i < len(raw) else "" for i in present)) + pad
            if status >= 0 and values[status].strip() in _CHANGED and (move := moves.move(values, at)):
                changes.append(move)  # valid or not: the first notes never validate another account's row
            if wanted is not None and values[at].strip() not in wanted:  # the parsers strip the ucc too
                continue
            if entity and (segment := f"{values[1].strip()}-{values[2].strip()}") in _SEGMENTS:
                if left_to and segment in left_to:
                    left[segment] += 1
                    continue
                if segments is not None and segment not in segments:
                    ucc = values[at].strip()
                    raise RowError(name, n, "segment", f"{segment} is not a membership of the issuing entity (its broker "
                                                       "file's segments), nor left to another's (left_to)",
                                   ucc if UCC.match(ucc) else "")
            if kind == "t":
                r = trade_row(name, n, values, trade_date, closes, contracts, closed)
                ucc = r[4]  # what assembly needs of a trade, worked out here: the trade, the order on the note
                line = f"{r[1]}{SEP}{r[2]}{SEP}{r[7]}{RS}{r[1]}{SEP}{r[2]}{SEP}{r[3]}{SEP}{r[8]}{SEP}{r[7]}{RS}{r[19]}" \
                       f"{RS}{_json_row(r)}{at_range}{n}"
            else:
                client = parse_client(name, n, dict(zip(CLIENT_FIELDS, values)))
                ucc, line = client.ucc, f"{json.dumps(vars(client), separators=(',', ':'))}{at_range}{n}"
            shard = shard_of.get(ucc)
            if shard is None:
                shard = shard_of[ucc] = keys.shard_of(ucc, shards)
            lines[shard].append(f"{kind}{ucc}{RS}{line}")
            if kind == "t":
                weights[shard] += 1
        except RowError as e:
            if e.ucc:
                error = json.dumps({**e.as_dict(), "range": rng.index})  # JSON escapes every control character
                lines[keys.shard_of(e.ucc, shards)].append(f"e{e.ucc}{RS}{error}")
            elif len(errors) < MAX_LISTED_ERRORS:
                errors.append({**e.as_dict(), "range": rng.index})
    buckets: list[dict[int, str]] = [{} for _ in range(groups)]
    for shard, rows in lines.items():
        buckets[shard % groups][shard] = "\n".join(rows)
    return {"file": name, "index": rng.index, "rows": n, "errors": errors, "weights": dict(weights),
            "left_to": dict(left), "moves": moves.packed(changes)}, buckets


def row_offsets(metas: list[dict]) -> dict[tuple[str, int], int]:
    """(file, range index) -> the data rows of that file before the range."""
    offsets, seen = {}, defaultdict(int)
    for meta in sorted(metas, key=lambda m: (m["file"], m["index"])):
        offsets[(meta["file"], meta["index"])] = seen[meta["file"]]
        seen[meta["file"]] += meta["rows"]
    return offsets


def assemble(store: Store, state: RunState, run_id: str, trade_date: str, note_prefix: str,
             parts: list[list[tuple]], offsets: dict, reuse: bool = False, numbered: dict[str, str] | None = None,
             hand: Container[int] = (), owners: moves.Owners | None = None) -> dict:
    """One group's shards from its buckets (`parts`, in the plan's range order). Note numbers
    are reserved for the whole group in one block, shard after shard, each account numbered by
    its place in it; an account in `numbered` (the run's first notes, made before the split)
    keeps the number it was mailed with. With `reuse` (a split run again after it was cut
    short), a shard already in storage is kept as written: its notes may have gone out with
    those numbers. A shard file is written once (create-only). If this assembly runs again (Ray
    remaking what a lost node held, or a resumed split), it takes back the block the attempt
    before reserved (note_numbers.reserve_for, which says when it cannot): the files written now
    are those the attempt before would have written, with no gap beside the files it did write,
    and the accounts of a file the lost attempt wrote without recording them are recorded now.
    An account is validated by its first record alone: an attempt still running beside another
    (its node cut off, not dead) never resets one. Returns {shard: (accounts, trades)}, the
    rejected, and the clients whose every trade was cancelled or moved (no note is due); with `hand`,
    "rows": those shards' files as written, for their render tasks (split_tasks.HANDED_TRADES).
    `owners`: the day's trades that moved between clients (moves.owners)."""
    numbered = numbered or {}
    by_shard: dict[int, list[str]] = defaultdict(list)
    for part in parts:  # in range order: a later row of a trade or client comes later
        for shard, text in part.items():
            by_shard[shard].append(text)
    done, fresh, rejected, cancelled, rows, block = {}, [], 0, [], {}, []
    for shard in sorted(by_shard):
        accounts, rejects, nothing = _accounts("\n".join(by_shard.pop(shard)).split("\n"), offsets, owners)
        rejected += len(rejects)
        cancelled += nothing
        state.record(rejects, only_new=True)  # an assembly run again, or a resumed split, finds them recorded
        if not accounts:
            continue
        block += [ucc for ucc, _, _ in accounts if ucc not in numbered]
        key = keys.shard_key(run_id, shard)
        if reuse and store.exists(key):  # recorded when written, unless the split writing it was cut short then
            data = store.get(key)
            kept = [json.loads(line) for line in data.decode().splitlines()]
            state.record((Outcome(a["ucc"], "validated") for a in kept if a["ucc"] not in numbered), only_new=True)
            done[shard] = (len(kept), sum(len(a["trades"]) for a in kept))
            if shard in hand:
                rows[shard] = data
        else:
            fresh.append((shard, accounts))
    if fresh:
        place = note_numbers.reserve_for(store, state, note_numbers.financial_year(trade_date), block,
                                         [u for _, a in fresh for u, _, _ in a if u not in numbered] if reuse else None)
        for shard, accounts in fresh:
            body = []
            for ucc, client, trades in accounts:
                note_no = numbered[ucc] if ucc in numbered else note_numbers.note_number(note_prefix, trade_date,
                                                                                         place[ucc])
                body.append(shard_line(ucc, client, trades, note_no))
            data = "".join(body).encode()
            written = write_once(store, keys.shard_key(run_id, shard), data)
            if written == data:  # else recorded by the assembly that wrote it; an attempt before, or one
                # running beside this one (a node cut off, not dead), may have recorded them: not twice
                state.record((Outcome(ucc, "validated") for ucc, _, _ in accounts if ucc not in numbered),
                             only_new=True)
            done[shard] = (len(accounts), sum(len(trades) for _, _, trades in accounts))
            if shard in hand:
                rows[shard] = written
    return {"shards": done, "rejected": rejected, "nothing_due": len(cancelled), "nothing_due_accounts": cancelled[:NAMED],
            **({"rows": rows} if hand else {})}


def shard_line(ucc: str, client: str, trades: list[str], note_no: str) -> str:
    """An account's line of its shard file, put together from its JSON parts."""
    return f'{{"ucc":"{ucc}","client":{client},"trades":[{",".join(trades)}],"note_no":{json.dumps(note_no)}}}\n'


def first_accounts(inputs: Store, plan: Plan, trade_date: str, count: int) -> tuple[int, list[tuple[str, str, list[str]]]]:
    """Up to `count` accounts of one shard, exactly as the split will make them, found before
    it: the clients near the top of clients.csv, every row of the day read and only theirs
    validated, in the plan's own ranges (a stray quote parses as the split parses it). The
    shard most of them share, and its accounts that pass; none when the sample names none."""
    at, sample = plan.columns["clients.csv"][CLIENT_FIELDS.index("ucc")], inputs.read_range("clients.csv", 0, 256 * 1024)
    by_shard: dict[int, list[str]] = defaultdict(list)
    for row in list(csv.reader(io.StringIO(sample.decode("utf-8", "replace"), newline="")))[1:-1]:  # the last: cut
        ucc = row[at].strip() if len(row) > at else ""
        if UCC.match(ucc) and ucc not in by_shard[shard := keys.shard_of(ucc, plan.shard_count)]:
            by_shard[shard].append(ucc)
    if not by_shard:
        return 0, []
    shard = max(by_shard, key=lambda s: min(count, len(by_shard[s])))  # the first of the fullest
    wanted, metas, lines = set(by_shard[shard][:count]), [], []
    ends = {rng.file: max(r.end for r in plan.ranges if r.file == rng.file) for rng in plan.ranges}
    with closing(OneRead(inputs, ends)) as one:  # the ranges in order: a GET a dump, not a GET a range
        for rng in plan.ranges:
            meta, (bucket,) = read_range(one, rng, plan.columns[rng.file], plan.shard_count, 1, trade_date,
                                         plan.closes, wanted, plan.closed, plan.segments, plan.left_to)
            metas.append(meta)
            if shard in bucket:
                lines.append(bucket[shard])
    accounts, _, _ = _accounts("\n".join(lines).split("\n") if lines else [], row_offsets(metas),
                               moves.owners(m.pop("moves") for m in metas))
    return shard, accounts


def result(plan: Plan, metas: list[dict], assembled: list[dict]) -> SplitResult:
    offsets = row_offsets(metas)
    shards = sorted((s, n) for a in assembled for s, n in a["shards"].items())
    errors = list(plan.input_errors)
    for meta in sorted(metas, key=lambda m: (m["file"] != "clients.csv", m["index"])):
        errors += [_moved(e, offsets) for e in meta["errors"]]
    left: dict[str, int] = defaultdict(int)
    for meta in metas:
        for segment, count in meta.get("left_to", {}).items():
            left[segment] += count
    return SplitResult(shards=[s for s, _ in shards], shard_count=plan.shard_count,
                       accounts=sum(n for _, (n, _) in shards), rejected=sum(a["rejected"] for a in assembled),
                       nothing_due=sum(a["nothing_due"] for a in assembled),
                       nothing_due_accounts=sorted(u for a in assembled for u in a["nothing_due_accounts"])[:NAMED],
                       input_errors=errors[:MAX_LISTED_ERRORS], trades=[t for _, (_, t) in shards],
                       left_to_others={s: {"entity": plan.left_to[s], "trades": n} for s, n in sorted(left.items())})


def check_inputs(inputs: Store, trade_date: str = "") -> set[str]:
    """Before anything starts: both dumps are there and have every column, and the trades are
    the run's day (InputError if not). Returns the exchanges of the trades of that day in the
    first and last rows of trades.csv (empty without a date, or without such rows)."""
    for name, fields in DUMPS.items():
        columns = _columns(inputs, name, fields)
    if trade_date:
        return _dated(inputs, "trades.csv", columns[fields.index("trade_date")], trade_date,
                      columns[fields.index("exchange")])
    return set()


def _dated(inputs: Store, name: str, column: int, trade_date: str, exchange: int,
           sample: int = 256 * 1024) -> set[str]:
    """The first and last rows of `name` (a sample of each end: the file may be GBs) carry
    `trade_date`, or at least one of them does; a date none of them carries is a mistyped --date,
    refused in one line rather than every account rejected one by one. Returns the exchanges of
    the sampled rows of that date."""
    size = inputs.size(name)
    rows = inputs.read_range(name, 0, min(size, sample)).decode("utf-8", "replace").split("\n")[1:]  # past the header
    if size > sample:  # the head's cut last line, the tail's cut first one
        rows = rows[:-1] + inputs.read_range(name, max(sample, size - sample), size).decode(
            "utf-8", "replace").split("\n")[1:]
    parsed = [row for row in csv.reader(r for r in rows if r.strip()) if len(row) > column]
    dates = Counter(row[column] for row in parsed)
    if dates and trade_date not in dates:
        seen = ", ".join(d for d, _ in dates.most_common(3))
        raise InputError(f"{name}: no trade in its first and last rows is dated {trade_date} (they are dated "
                         f"{seen}): is the run's date right?")
    return {row[exchange].strip() for row in parsed if row[column] == trade_date and len(row) > exchange} & set(
        trading_calendar.ALL_EXCHANGES)


def _columns(inputs: Store, name: str, fields: list[str]) -> list[int]:
    if not inputs.exists(name):
        raise InputError(f"{name}: not found in the input {getattr(inputs, 'url', '')}")
    header = next(csv.reader(_csv_lines(inputs, name)), [])
    check_header(name, header, fields)
    columns = [header.index(f) if f in header else -1 for f in fields]
    if len({f in header for f in LOT_FIELDS}) > 1 and fields is TRADE_COLUMNS:
        raise InputError(f"{name}: give the columns {', '.join(LOT_FIELDS)} together or neither")
    return columns


def _estimate_rows(inputs: Store, name: str, size: int) -> int:
    sample = inputs.read_range(name, 0, 256 * 1024)
    lines = sample.count(b"\n") + (not sample.endswith(b"\n") and bool(sample))
    if len(sample) >= size:
        return max(0, lines - 1)
    return max(1, round(size * lines / len(sample)) - 1)


def _closing_prices(inputs: Store, trade_date: str, errors: list[dict]) -> dict:
    """The bhavcopy's prices; without one, every derivatives trade is rejected (its row says why).
    With them RBI's reference rates, if the input has reference_rates.csv: only a cross-currency
    trade needs one, and without it that trade's row says so."""
    if not inputs.exists(bhavcopy.FILE):
        errors.append(RowError(bhavcopy.FILE, 0, "", "file not found: derivatives trades have no closing price").as_dict())
        closes = {}
    else:
        closes = bhavcopy.read(_csv_lines(inputs, bhavcopy.FILE), trade_date, errors, MAX_LISTED_ERRORS)
    if inputs.exists(REFERENCE_FILE):
        closes.update(bhavcopy.read_reference_rates(_csv_lines(inputs, REFERENCE_FILE), trade_date, errors,
                                                    MAX_LISTED_ERRORS))
    return closes


CHUNK = 1 << 20  # bytes of a range read at a time: io.StringIO holds them as 4 bytes a character
LOOK_AHEAD = 64 * 1024  # read past a range's end in its one GET: its last line's end, not a GET of its own


def _range_lines(inputs: Store, rng: Range, chunk: int = CHUNK) -> Iterator[str]:
    """The range's own lines: from the first line starting at or after `start` (the header's,
    for the first range) to the end of the line holding byte end-1. Lines are split as
    io.StringIO(newline="") splits them, for the csv module."""
    for whole, first in _range_chunks(inputs, rng, chunk):
        yield from _lines(whole, first)


def _wanted_rows(inputs: Store, rng: Range, wanted: Container[str], chunk: int = CHUNK, column: int = -1,
                 marks: list[bytes] = ()) -> Iterator[tuple[int, list[str] | None]]:
    """The first notes' read of a range: (row number, row) for the rows that may be the wanted
    accounts', the others counted, not parsed, and last (the range's row count, None). A chunk
    with no quote, lone CR, NUL or blank line holds a row a line, as the csv module parses it:
    its rows are its lines, and only a line naming a wanted account is parsed, or one with one of
    `marks` in its field number `column` (a trade modified or cancelled: it may move a wanted
    account's trade). A 20,000-account day's 62 MB, the whole first notes' read: 0.49 s of CPU
    with wanted.c (0.39 s before the moves were read too), 1.75 s in Python. From the first chunk
    that is not a row a line, the rest of the range is parsed whole, as the split parses it."""
    needles = [ucc.encode() for ucc in wanted if ucc]  # a substring finds the ucc however the row pads it
    chunks, n = _range_chunks(inputs, rng, chunk), 0
    for whole, first in chunks:
        if first:  # the header: left out, as read_range leaves it out
            whole = whole.removeprefix(b"\xef\xbb\xbf")
            header = whole.find(b"\n") + 1 or len(whole)
            parsed = not _a_row_a_line(whole[:header])
            whole = whole if parsed else whole[header:]
        else:
            parsed = False
        if parsed or (held := _lines_holding(whole, needles, column, marks)) is None:
            reader = csv.reader(itertools.chain(_lines(whole, False), (
                line for more, _ in chunks for line in _lines(more, False))))
            if parsed:
                next(reader, None)
            counted = n
            for n, row in _rows(reader, counted):
                yield n, row
            break
        newlines, lines = held
        for before, start in lines:
            end = whole.find(b"\n", start) + 1 or len(whole)
            yield n + before + 1, next(csv.reader([whole[start:end].decode("utf-8", "surrogateescape")]))
        n += newlines + (whole[-1:] not in (b"\n", b""))
    yield n, None


def _lines_holding(whole: bytes, needles: list[bytes], column: int = -1,
                   marks: list[bytes] = ()) -> tuple[int, list[tuple[int, int]]] | None:
    """The chunk's newlines, and (newlines before it, its start) of each line holding a needle, or
    one of `marks` in its field number `column` (-1: none), in order; None when the chunk is not a
    row a line (so no field holds a quoted comma). In C (wanted.c) where it builds, in one call."""
    scan = _wanted_lines()
    if scan is None:
        if not _a_row_a_line(whole):
            return None
        held = {whole.rfind(b"\n", 0, hit) + 1 for needle in needles for hit in _finds(whole, needle)}
        start = 0
        for line in whole.split(b"\n") if column >= 0 else ():
            fields = line.split(b",")
            if len(fields) > column and any(mark and mark in fields[column] for mark in marks):
                held.add(start)
            start += len(line) + 1
        lines, before, at = [], 0, 0  # the newlines before `at`, counted a stretch at a time
        for start in sorted(held):
            before, at = before + whole.count(b"\n", at, start), start
            lines.append((before, start))
        return whole.count(b"\n"), lines
    joined, lengths = b"".join(needles), (ctypes.c_long * len(needles))(*map(len, needles))
    cap = 64 + len(whole) // 256  # room for the lines of a few percent of trades modified, scanned once
    marked, mark_lengths = b"".join(marks), (ctypes.c_long * len(marks))(*map(len, marks))
    while True:
        starts, rows, newlines = (ctypes.c_long * cap)(), (ctypes.c_long * cap)(), ctypes.c_long()
        held = scan(whole, len(whole), joined, lengths, len(needles), column, marked, mark_lengths, len(marks),
                    starts, rows, cap, ctypes.byref(newlines))
        if held == -1:
            return None
        if held >= 0:
            return newlines.value, list(zip(rows[:held], starts[:held]))
        cap = newlines.value  # a heavy account's lines, or many trades modified: room for every hit


@functools.cache
def _wanted_lines():
    """wanted.c's cn_wanted_lines, or None when it cannot be built."""
    long, longs = ctypes.c_long, ctypes.POINTER(ctypes.c_long)
    built = native.functions(Path(__file__).with_name("wanted.c"), {"cn_wanted_lines": (
        [ctypes.c_char_p, long, ctypes.c_char_p, longs, long, long, ctypes.c_char_p, longs, long, longs, longs, long,
         longs], long)},
        "the first notes read the day's lines in Python (~0.3 s more at 20,000 accounts)")
    return built[0] if built else None


def _a_row_a_line(data: bytes) -> bool:
    """Whether the csv module reads these whole lines as one row each (CRLF endings too)."""
    return not (b'"' in data or b"\0" in data or data.count(b"\r") != data.count(b"\r\n") or b"\n\n" in data
                or b"\n\r\n" in data or data[:1] == b"\n" or data[:2] == b"\r\n")


def _finds(data: bytes, needle: bytes) -> Iterator[int]:
    at = data.find(needle)
    while at >= 0:
        yield at
        at = data.find(needle, at + 1)


def _range_chunks(inputs: Store, rng: Range, chunk: int = CHUNK) -> Iterator[tuple[bytes, bool]]:
    """The range's bytes a chunk of whole lines at a time, and whether the chunk is the file's
    first. Read in one request (on LOOK_AHEAD past its end for the line that runs on), CHUNK
    bytes at a time, each cut at its last newline: a range is never held whole (a 20,000-account
    day's trades as text were most of the driver's memory, read for its first notes)."""
    at, left, skip, first = max(0, rng.start - 1), b"", rng.start > 0, rng.start == 0
    asked, ended = rng.end + LOOK_AHEAD, False
    for data in inputs.stream_range(rng.file, at, asked, chunk):
        begin, at = at, at + len(data)
        if at >= rng.end:  # the range's last line ends at the first newline from byte end-1 on
            cut = data.find(b"\n", max(0, rng.end - 1 - begin))
            if cut >= 0:
                data, ended = data[:cut + 1], True
        if skip:  # the line that began before `start` is the previous range's
            cut = data.find(b"\n")
            data, skip = (data[cut + 1:], False) if cut >= 0 else (b"", True)
        cut = data.rfind(b"\n")
        if cut >= 0:
            whole, left = left + data[:cut + 1], data[cut + 1:]
            yield whole, first
            first = False
        else:
            left += data
        if ended:
            return
    if skip or not left:
        return
    if at < asked:  # the file ends in this range's last line, without its newline
        yield left, first
        return
    while True:  # the range's last line runs on past its end
        more = inputs.read_range(rng.file, at, at + LOOK_AHEAD)
        cut = more.find(b"\n")
        if cut >= 0 or not more:
            left += more[:cut + 1] if cut >= 0 else more
            break
        left, at = left + more, at + len(more)
    yield left, first


class OneRead:
    """A dump's ranges read one after another through one GET of the dump, where each range was
    a GET of its own (the first notes' read: 11 of a 2,000-account day's 24 ranged GETs of
    trades.csv on S3). What _range_chunks asks of a store, in its order: a range from a byte
    before its start, and on LOOK_AHEAD past its end for the line that runs on (held: the next
    range starts a byte before this one's end).
    Only the bytes from a byte before the last one handed out are held, so a range is never held
    whole; a read that starts before them is the store's own. `ends`: each dump's size."""

    def __init__(self, inputs: Store, ends: dict[str, int]):
        self.inputs, self.ends = inputs, ends
        self.name, self.body, self.at, self.held = "", iter(()), 0, b""  # held: the bytes from `at` on

    def stream_range(self, key: str, start: int, end: int, chunk: int) -> Iterator[bytes]:
        if key != self.name:
            self.close()
            self.name, self.at, self.held = key, start, b""
            self.body = iter(self.inputs.stream_range(key, start, self.ends.get(key, end), chunk))
        elif start < self.at:
            yield from self.inputs.stream_range(key, start, end, chunk)
            return
        self._drop_before(start - 1)
        pos = start
        while pos < end and self._has(pos):
            piece = self.held[pos - self.at:end - self.at]
            pos += len(piece)
            self._drop_before(min(pos, end - LOOK_AHEAD) - 1)  # the next range begins a byte before this one's end
            yield piece

    def read_range(self, key: str, start: int, end: int) -> bytes:
        if key != self.name or start < self.at:
            return self.inputs.read_range(key, start, end)
        self._has(end - 1)
        return self.held[start - self.at:end - self.at]

    def _has(self, pos: int) -> bool:
        """Whether the byte at `pos` is held, the body read on up to it."""
        while pos >= self.at + len(self.held):
            data = next(self.body, b"")
            if not data:
                return False
            self.held += data
        return True

    def _drop_before(self, pos: int) -> None:
        cut = min(len(self.held), max(0, pos - self.at))
        self.held, self.at = self.held[cut:], self.at + cut

    def close(self) -> None:
        close = getattr(self.body, "close", None)
        if close is not None:
            close()


def _lines(data: bytes, first: bool) -> Iterator[str]:
    text = data.decode("utf-8", "surrogateescape")
    return iter(io.StringIO(text.removeprefix("\ufeff") if first else text, newline=""))


def _csv_lines(inputs: Store, name: str):
    try:
        yield from inputs.lines(name)
    except (StorageError, OSError) as e:
        raise InputError(f"{name}: cannot be read: {e}") from None


def _rows(reader, n: int = 0):
    """(row number, row) for each data row after the first `n`, blank lines skipped; a row the
    csv module cannot parse is (n, None), and the file goes on. A field over the csv module's
    limit reaches the length check instead."""
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error:
            n += 1
            yield n, None
            continue
        if row:
            n += 1
            yield n, row


def _moved(error: dict, offsets: dict) -> dict:
    """A range's error with its row number counted from the top of the file."""
    error = dict(error)
    index = error.pop("range")
    if error["row"] != "":
        error["row"] += offsets[(error["file"], index)]
    return error


def _picker(columns: list[int]):
    """The row's fields in `columns`' order, "" for a column the file lacks (-1)."""
    def pick(raw):
        return tuple(raw[i] if i >= 0 else "" for i in columns)
    return pick


def _json_row(row: list[str]) -> str:
    """json.dumps(row) at a third of the cost for fields with no quote or backslash (validated
    fields hold no control character, the only other thing JSON escapes)."""
    text = '","'.join(row)
    if text.count('"') == 2 * (len(row) - 1) and "\\" not in text:
        return f'["{text}"]'
    return json.dumps(row)


# a trade's bucket line after its kind and account: identity, order on the note, status, row
_IDENTITY, _ORDER, _STATUS = operator.itemgetter(0), operator.itemgetter(1), operator.itemgetter(2)
_AT = 4  # then its range and row


def _accounts(lines: list[str], offsets: dict, owners: moves.Owners | None = None
              ) -> tuple[list[tuple[str, str, list[str]]], list[Outcome], list[str]]:
    """One shard's accounts from its rows (read_range's lines, in file order): (ucc, client as
    JSON, the note's trades as JSON), the rejected, and the clients whose every trade was
    cancelled, or moved to another client (`owners`): no trade stands, so no note is due (they
    were in no count before, a day of 1.5M synthetic accounts showed 183 of them). A trade last
    modified by a row naming no valid client code rejects the accounts holding it."""
    clients: dict[str, str] = {}
    client_at: dict[str, str] = {}  # its bucket line's range:row, a row's number worked out only when named
    trades: dict[str, list[list[str]]] = defaultdict(list)
    errors: dict[str, list[dict]] = defaultdict(list)
    for line in lines:
        head, payload = line.split(RS, 1)
        kind, ucc = head[0], head[1:]
        if kind == "t":
            trades[ucc].append(payload.split(RS))
        elif kind == "c":
            client, at = payload.rsplit(RS, 1)
            if ucc in clients:
                errors[ucc].append({"file": "clients.csv", "row": _row("clients.csv", at, offsets), "field": "ucc",
                                    "error": f"duplicate client (also row {_row('clients.csv', client_at[ucc], offsets)})"})
            else:
                clients[ucc], client_at[ucc] = client, at
        else:
            errors[ucc].append(_moved(json.loads(payload), offsets))
    owner: dict[str, int] = {}  # a trade's identity -> its owner (moves.client_key), where the trade moved
    if owners:  # one lookup for the shard's trades
        mine = list({_IDENTITY(t) for rows in trades.values() for t in rows})
        owner = {i: o for i, o in zip(mine, owners.of([moves.row_key(i) for i in mine]).tolist()) if o}
    accounts, rejects, cancelled = [], [], []
    for ucc in sorted(set(trades) | set(errors)):
        if ucc not in clients and ucc in trades:
            errors[ucc].append({"file": "trades.csv", "row": _row("trades.csv", trades[ucc][0][_AT], offsets),
                                "field": "ucc", "error": "trades for an account with no valid client record "
                                                         "(its first trade row)"})
        if twice := _original_twice(trades.get(ucc, ())):  # which of the two is the trade is not ours to guess
            first, again = twice
            errors[ucc].append({"file": "trades.csv", "row": _row("trades.csv", again[_AT], offsets), "field": "trade_no",
                                "error": "{} {} trade {} is given twice as an original (status 11), also row {}: a trade "
                                         "number is unique within its exchange and segment".format(
                                             *_IDENTITY(again).split(SEP), _row("trades.csv", first[_AT], offsets))})
        rows = trades.get(ucc, [])
        if owner:  # a trade whose last modification or cancellation names another client is not this one's
            me = moves.client_key(ucc)
            if lost := next((t for t in rows if owner.get(_IDENTITY(t)) == moves.NOBODY), None):
                errors[ucc].append({"file": "trades.csv", "row": _row("trades.csv", lost[_AT], offsets), "field": "trade_no",
                                    "error": "{} {} trade {} was last modified or cancelled by another row, whose client "
                                             "code is not valid: whose trade it is now is not known".format(
                                                 *_IDENTITY(lost).split(SEP))})
            rows = [t for t in rows if owner.get(_IDENTITY(t), me) == me]
        if errors[ucc]:
            rejects.append(Outcome(ucc, "validated", "rejected", reason=_describe(errors[ucc])))
            continue
        kept = effective(rows, _IDENTITY, _STATUS, _ORDER)
        if kept:
            accounts.append((ucc, clients[ucc], [t[3] for t in kept]))
        else:
            cancelled.append(ucc)
    return accounts, rejects, cancelled


def _original_twice(rows) -> tuple[list[str], list[str]] | None:
    """The first trade (exchange, segment, number) with two original rows: those two rows."""
    seen: dict[str, list[str]] = {}
    for t in rows:
        if _STATUS(t) == "11":
            if _IDENTITY(t) in seen:
                return seen[_IDENTITY(t)], t
            seen[_IDENTITY(t)] = t
    return None


def _row(file: str, at: str, offsets: dict) -> int:
    """A bucket line's `range:row` as the row's number in its file."""
    index, row = at.split(":")
    return offsets[(file, int(index))] + int(row)


def _describe(errors: list[dict]) -> str:
    first = errors[0]
    where = f"{first['file']} row {first['row']}" if first["row"] != "" else first["file"]
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where} field '{first['field']}': {first['error']}{more}"
