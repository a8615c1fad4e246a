"""Stage 1: stream the dumps, validate each row, and write one shard file per group of accounts.

Rows are spooled per shard to local disk in buffered appends, so memory stays flat however
large the day; each shard is then assembled (trades grouped by account, cancellations and
modifications applied, note numbers reserved) and written to storage. A bad row rejects
its account with the file, row and field named; the rest of the run goes on.
"""

from __future__ import annotations

import csv
import json
import math
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import bhavcopy, keys, note_numbers
from pipeline.dumps import (CLIENT_FIELDS, MAX_FIELD, TRADE_FIELDS, InputError, RowError, Trade, check_header,
                            effective_trades, parse_client, parse_trade)
from pipeline.state import Outcome, RunState
from pipeline.storage import StorageError, Store

FLUSH_ROWS = 50_000
MAX_LISTED_ERRORS = 1000
# A field longer than MAX_FIELD is a row error, not a csv.Error that ends the file
csv.field_size_limit(max(csv.field_size_limit(), 64 * MAX_FIELD * 1024))


@dataclass
class SplitResult:
    shards: list[int]  # the shards that hold accounts
    shard_count: int = 0  # what stable_hash is taken modulo
    accounts: int = 0
    rejected: int = 0
    input_errors: list[dict] = field(default_factory=list)  # rows naming no usable account
    trades: list[int] = field(default_factory=list)  # per shard of `shards`: its trades, heaviest first

    def heaviest_first(self, shards: list[int]) -> list[int]:
        """A shard holding a huge account starts first, so it never sets the day's end."""
        weight = dict(zip(self.shards, self.trades))
        return sorted(shards, key=lambda s: -weight.get(s, 0))


MIN_SHARDS = 2 * keys.PARTITIONS


def load_manifest(store: Store, run_id: str) -> SplitResult | None:
    """What a run's split produced; a rerun reuses it (and the note numbers in its shards)."""
    key = keys.manifest_key(run_id)
    return SplitResult(**json.loads(store.get(key))) if store.exists(key) else None


def save_manifest(store: Store, run_id: str, split: SplitResult) -> None:
    store.put(keys.manifest_key(run_id), json.dumps(split.__dict__).encode())


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
              shard_size: int, note_prefix: str) -> SplitResult:
    """Raises InputError when a file is missing or unusable; a bad row only rejects its account."""
    check_inputs(inputs)
    clients = sum(1 for _ in inputs.lines("clients.csv")) - 1
    shards = shard_count(clients, shard_size)
    result = SplitResult(shards=[], shard_count=shards)
    closes = _closing_prices(inputs, trade_date, result)
    reserve = note_numbers.reserver(store, state, note_numbers.financial_year(trade_date))
    with tempfile.TemporaryDirectory(prefix=f"split-{run_id}-") as tmp:
        spool = _Spool(Path(tmp))
        _spool_rows(inputs, "clients.csv", CLIENT_FIELDS, shards, spool, result,
                    lambda n, row: parse_client("clients.csv", n, row))
        _spool_rows(inputs, "trades.csv", TRADE_FIELDS, shards, spool, result,
                    lambda n, row: parse_trade("trades.csv", n, row, trade_date, closes))
        spool.flush()
        for shard in range(shards):
            accounts, rejects = _assemble(spool, shard)
            result.rejected += len(rejects)
            state.record(rejects)
            if not accounts:
                continue
            first = reserve(len(accounts))
            for i, account in enumerate(accounts):
                account["note_no"] = note_numbers.note_number(note_prefix, trade_date, first + i)
            body = "".join(json.dumps(a, separators=(",", ":")) + "\n" for a in accounts)
            store.put(keys.shard_key(run_id, shard), body.encode())
            state.record(Outcome(a["ucc"], "validated") for a in accounts)
            result.shards.append(shard)
            result.trades.append(sum(len(a["trades"]) for a in accounts))
            result.accounts += len(accounts)
    return result


def check_inputs(inputs: Store) -> None:
    """Before anything starts: both dumps are there and have every column (InputError if not)."""
    for name, fields in (("clients.csv", CLIENT_FIELDS), ("trades.csv", TRADE_FIELDS)):
        if not inputs.exists(name):
            raise InputError(f"{name}: not found in the input {getattr(inputs, 'url', '')}")
        check_header(name, next(csv.reader(_csv_lines(inputs, name)), []), fields)


def _closing_prices(inputs: Store, trade_date: str, result: SplitResult) -> dict:
    """The bhavcopy's prices; without one, every derivatives trade is rejected (its row says why)."""
    if not inputs.exists(bhavcopy.FILE):
        result.input_errors.append(
            RowError(bhavcopy.FILE, 0, "", "file not found: derivatives trades have no closing price").as_dict())
        return {}
    return bhavcopy.read(_csv_lines(inputs, bhavcopy.FILE), trade_date, result.input_errors, MAX_LISTED_ERRORS)


def _spool_rows(inputs: Store, name: str, fields: list[str], shards: int, spool: "_Spool",
                result: SplitResult, parse) -> None:
    reader = csv.DictReader(_csv_lines(inputs, name))
    check_header(name, reader.fieldnames or [], fields)
    kind = name[0]
    for n, row in _rows(reader):
        try:
            if row is None:
                raise RowError(name, n, "", "is not a CSV row (a stray quote or a NUL byte)")
            record = parse(n, row)
            spool.add(keys.shard_of(record.ucc, shards), [kind, record.ucc, _as_list(record)])
        except RowError as e:
            if e.ucc:
                spool.add(keys.shard_of(e.ucc, shards), ["e", e.ucc, e.as_dict()])
            elif len(result.input_errors) < MAX_LISTED_ERRORS:
                result.input_errors.append(e.as_dict())


def _csv_lines(inputs: Store, name: str):
    try:
        yield from inputs.lines(name)
    except (StorageError, OSError) as e:
        raise InputError(f"{name}: cannot be read: {e}") from None


def _rows(reader: csv.DictReader):
    """(row number, row) for each data row; a row the csv module cannot parse is (n, None), and
    the file goes on. A field over the csv module's limit reaches the length check instead."""
    n = 0
    while True:
        n += 1
        try:
            yield n, next(reader)
        except StopIteration:
            return
        except csv.Error:
            yield n, None


def _as_list(record) -> list:
    if isinstance(record, Trade):
        return record.as_row()
    return [getattr(record, f) for f in CLIENT_FIELDS]


def _assemble(spool: "_Spool", shard: int) -> tuple[list[dict], list[Outcome]]:
    clients: dict[str, list] = {}
    trades: dict[str, list[Trade]] = defaultdict(list)
    errors: dict[str, list[dict]] = defaultdict(list)
    for kind, ucc, payload in spool.read(shard):
        if kind == "c":
            if ucc in clients:
                errors[ucc].append({"file": "clients.csv", "row": "", "field": "ucc", "error": "duplicate client"})
            clients[ucc] = payload
        elif kind == "t":
            trades[ucc].append(Trade.from_row(payload))
        else:
            errors[ucc].append(payload)
    accounts, rejects = [], []
    for ucc in sorted(set(trades) | set(errors)):
        if ucc not in clients and ucc in trades:
            errors[ucc].append({"file": "clients.csv", "row": "", "field": "ucc",
                                "error": "trades for an account with no valid client record"})
        if errors[ucc]:
            rejects.append(Outcome(ucc, "validated", "rejected", reason=_describe(errors[ucc])))
            continue
        kept = effective_trades(trades[ucc])
        if kept:
            client = dict(zip(CLIENT_FIELDS, clients[ucc]))
            accounts.append({"ucc": ucc, "client": client, "trades": [t.as_row() for t in kept]})
    return accounts, rejects


def _describe(errors: list[dict]) -> str:
    first = errors[0]
    where = f"{first['file']} row {first['row']}" if first["row"] != "" else first["file"]
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where} field '{first['field']}': {first['error']}{more}"


class _Spool:
    """Per-shard JSON-lines files on local disk, appended in large buffered batches."""

    def __init__(self, root: Path):
        self.root, self.buffers, self.pending = root, defaultdict(list), 0

    def add(self, shard: int, item: list) -> None:
        self.buffers[shard].append(json.dumps(item, separators=(",", ":")))
        self.pending += 1
        if self.pending >= FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        for shard, lines in self.buffers.items():
            with (self.root / f"{shard}.jsonl").open("a") as f:
                f.write("\n".join(lines) + "\n")
        self.buffers.clear()
        self.pending = 0

    def read(self, shard: int):
        path = self.root / f"{shard}.jsonl"
        if path.exists():
            with path.open() as f:
                for line in f:
                    yield json.loads(line)
