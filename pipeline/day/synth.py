"""Synthetic end-of-day dumps shaped like exchange trade files.

Trades per client are heavy-tailed (Pareto: median ~4, 99th percentile in the hundreds),
as on a real day; e-mail addresses are only on reserved domains, so nothing can reach a
real person. Some names carry Typst syntax and non-Latin scripts on purpose.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import random
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from pipeline.day import bhavcopy
from pipeline.day.dumps import CLIENT_FIELDS, TRADE_FIELDS
from pipeline.record import keys

STATES = [
    ("Karnataka", "29"), ("Maharashtra", "27"), ("Tamil Nadu", "33"), ("Delhi", "07"),
    ("Gujarat", "24"), ("West Bengal", "19"), ("Uttar Pradesh", "09"),
]
FIRST = ["Aarav", "Priya", "Rohan", "Ananya", "Vikram", "Meera", "Arjun", "Kavya", "Ishaan", "Diya"]
LAST = ["Sharma", "Iyer", "Patel", "Reddy", "Nair", "Gupta", "Mehta", "Rao", "Singh", "Das"]
ODD_NAMES = ["राहुल वर्मा", "கார்த்திக் சுப்ரமணியன்", "A*B [Traders] #1 $\\\"Q\"", "O'Neil & Sons_ <Ltd>"]
EQUITIES = [
    ("RELIANCE", "INE002A01018", 2900), ("TCS", "INE467B01029", 4100), ("INFY", "INE009A01021", 1800),
    ("HDFCBANK", "INE040A01034", 1700), ("ITC", "INE154A01025", 460), ("SBIN", "INE062A01020", 820),
    ("TATAMOTORS", "INE155A01022", 980), ("WIPRO", "INE075A01022", 560),
]
INDICES = [("NIFTY", 24500, 75), ("BANKNIFTY", 52000, 30)]


@dataclass
class SynthOptions:
    trade_date: dt.date
    accounts: int
    seed: int = 1
    volatile: bool = False
    volatile_trades: int = 60_000  # the volatile client's trades (a bench's smoke run takes fewer)


def write_dumps(out: Path, opts: SynthOptions) -> tuple[Path, Path]:
    """clients.csv and trades.csv, and bhavcopy.csv with a closing price for every contract traded."""
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(opts.seed)
    clients_path, trades_path = out / "clients.csv", out / "trades.csv"
    contracts: dict[tuple, str] = {}
    with clients_path.open("w", newline="") as cf, trades_path.open("w", newline="") as tf:
        clients, trades = csv.writer(cf), csv.DictWriter(tf, TRADE_FIELDS)
        clients.writerow(CLIENT_FIELDS)
        trades.writeheader()
        counter = _Numbers(rng)
        for i in range(opts.accounts):
            ucc = f"C{i + 1:07d}"
            clients.writerow(_client(rng, ucc, i))
            n = opts.volatile_trades if (opts.volatile and i == 0) else _trade_count(rng)
            rows = list(_trades(rng, opts.trade_date, ucc, n, counter))
            _note_contracts(rows, contracts)
            trades.writerows(rows)
    with (out / bhavcopy.FILE).open("w", newline="") as f:
        _write_bhavcopy(f, opts.trade_date, contracts)
    return clients_path, trades_path


def closing_prices(trade_date: dt.date, trade_rows: list[dict]) -> dict:
    """What bhavcopy.read would give for the contracts in `trade_rows` (trades built in memory)."""
    buf = io.StringIO()
    _write_bhavcopy(buf, trade_date, _note_contracts(trade_rows, {}))
    return bhavcopy.read(buf.getvalue().splitlines(), trade_date.isoformat(), [])


def _note_contracts(trade_rows: list[dict], contracts: dict[tuple, str]) -> dict[tuple, str]:
    """Each contract traded, with the first price it traded at."""
    for row in trade_rows:
        contracts.setdefault(_contract(row), row["price"])
    return contracts


def _write_bhavcopy(f, trade_date: dt.date, contracts: dict[tuple, str]) -> None:
    writer = csv.DictWriter(f, BHAV_FIELDS)
    writer.writeheader()
    writer.writerows(_bhav_row(trade_date, c, p) for c, p in sorted(contracts.items()))


# The UDiFF columns a real bhavcopy has; the reader needs only bhavcopy.FIELDS.
BHAV_FIELDS = ["TradDt", "BizDt", "Sgmt", "Src", "FinInstrmTp", "FinInstrmId", "ISIN", "TckrSymb", "SctySrs",
               "XpryDt", "StrkPric", "OptnTp", "ClsPric", "SttlmPric", "TtlTradgVol"]


def _contract(row: dict) -> tuple:
    return (row["exchange"], row["segment"], row["instrument"], row["symbol"], row["isin"], row["expiry"],
            row["strike"], row["option_type"])


def _bhav_row(trade_date: dt.date, contract: tuple, traded_price: str) -> dict:
    """A closing price within 1% of a price traded that day, on the 0.05 tick, the same on every run."""
    exchange, segment, instrument, symbol, isin, expiry, strike, option_type = contract
    move = Decimal(10_000 + keys.stable_hash(repr(contract)) % 201 - 100) / 10_000
    ticks = max(Decimal(1), (Decimal(traded_price) * move * 20).to_integral_value())
    close = str((ticks / 20).quantize(Decimal("0.01")))
    kind = bhavcopy.UDIFF_TYPES.get(instrument, "STK")
    return {"TradDt": trade_date.isoformat(), "BizDt": trade_date.isoformat(), "Sgmt": segment, "Src": exchange,
            "FinInstrmTp": kind, "FinInstrmId": "", "ISIN": isin, "TckrSymb": symbol,
            "SctySrs": "EQ" if segment == "CM" else "", "XpryDt": expiry, "StrkPric": strike,
            "OptnTp": option_type, "ClsPric": close, "SttlmPric": close, "TtlTradgVol": ""}


def _trade_count(rng: random.Random) -> int:
    return min(2000, int(2 * rng.paretovariate(0.9)))


def _client(rng: random.Random, ucc: str, i: int) -> list[str]:
    name = ODD_NAMES[i // 97 % len(ODD_NAMES)] if i % 97 == 13 else f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    state, code = rng.choice(STATES)
    pan = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(3)) + "P"
    pan += rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") + f"{rng.randrange(10000):04d}" + rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    domain = "example.com" if i % 2 else "clients.test"
    address = f"{rng.randrange(1, 400)}, {rng.choice(['MG Road', 'Link Road', 'Anna Salai', 'Park Street'])}, {state}"
    return [ucc, name, pan, f"{ucc.lower()}@{domain}", address, state, code, "Y"]


class _Numbers:
    """16-digit order and trade numbers, some with leading zeros (they are strings)."""

    def __init__(self, rng: random.Random):
        self.next = rng.randrange(10**14)

    def take(self) -> str:
        self.next += 7
        return f"{self.next:016d}"


def _trades(rng, date, ucc, n, numbers):
    base = dt.datetime.combine(date, dt.time(9, 15))
    for _ in range(n):
        row = _one_trade(rng, date, ucc, numbers, base + dt.timedelta(seconds=rng.randrange(22_500)))
        yield row
        roll = rng.random()
        if roll < 0.02:
            yield {**row, "status": "13"}
        elif roll < 0.04:
            yield {**row, "status": "12", "quantity": str(max(1, int(row["quantity"]) - 1))}


def _one_trade(rng, date, ucc, numbers, when):
    exchange = "NSE" if rng.random() < 0.8 else "BSE"
    kind = rng.random()
    row = dict.fromkeys(TRADE_FIELDS, "")
    row.update(trade_date=date.isoformat(), exchange=exchange, ucc=ucc, side=rng.choice("BS"),
               order_no=numbers.take(), trade_no=numbers.take(), status="11",
               order_time=(when - dt.timedelta(seconds=rng.randrange(1, 30))).strftime("%H:%M:%S"),
               trade_time=when.strftime("%H:%M:%S"))
    if kind < 0.65 or exchange == "BSE":
        symbol, isin, px = rng.choice(EQUITIES)
        row.update(segment="CM", instrument="EQ", symbol=symbol, isin=isin,
                   product=rng.choice(["CNC", "MIS"]), quantity=str(rng.randrange(1, 200)),
                   price=_price(rng, px))
    else:
        row.update(_derivative(rng, date, kind))
    row["settlement_no"] = f"{row['segment']}{date:%Y}{date.timetuple().tm_yday:03d}"
    return row


def _derivative(rng, date, kind):
    expiry = (date + dt.timedelta(days=(3 - date.weekday()) % 7 or 7)).isoformat()
    if rng.random() < 0.5:
        symbol, spot, lot = rng.choice(INDICES)
        isin, prefix = "", "IDX"
    else:
        symbol, isin, spot = rng.choice(EQUITIES)
        lot, prefix = 250, "STK"
    row = dict(segment="FO", symbol=symbol, isin=isin, expiry=expiry, product="NRML",
               quantity=str(lot * rng.randrange(1, 5)))
    if kind < 0.8:
        row.update(instrument="FUT" + prefix, price=_price(rng, spot))
    else:
        step = 100 if spot > 10_000 else 20
        strike = round(spot / step) * step + step * rng.randrange(-5, 6)
        row.update(instrument="OPT" + prefix, strike=str(strike), option_type=rng.choice(["CE", "PE"]),
                   price=_price(rng, max(5, spot * 0.01)))
    return row


def _price(rng: random.Random, around: float) -> str:
    ticks = int(around * rng.uniform(0.97, 1.03) * 20)
    return str(Decimal(max(ticks, 1)) / 20)
