"""Synthetic end-of-day dumps shaped like exchange trade files.

Trades per client are heavy-tailed (Pareto: median ~4, 99th percentile in the hundreds),
as on a real day; a share of clients (10% unless told) also trade currency derivatives (NSE,
BSE), commodity derivatives (MCX; NCDEX's agricultural contracts) and BSE's SENSEX and BANKEX
options. Those choices draw on a random stream of their own, so the rest of a seed's day is
the day it always was; e-mail addresses are only on reserved domains, so nothing can reach a
real person. Some names carry Typst syntax and non-Latin scripts on purpose.

On an expiry day (a Thursday NSE trades: synth's equity derivatives expire on Thursdays) a
share of clients (SETTLE_SHARE) also have expiring positions settled: index options exercised
(the holder's) or assigned (the writer's), stock futures and options going to delivery, rows of
settlement_type EX, AS and DL after their trades, from a stream and number range of their own:
the day's other rows are those of any other day of the seed, and trades.csv has the
settlement_type column only on such a day (every other day's files are as they were).
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import random
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from pipeline.day import bhavcopy, trading_calendar
from pipeline.day.dumps import CLIENT_FIELDS, REFERENCE_FILE, TRADE_COLUMNS, TRADE_FIELDS
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
BSE_INDICES = [("SENSEX", 80000, 20), ("BANKEX", 60000, 30)]  # symbol, level, lot
# symbol, quote (rupees a unit, JPYINR's per 100 yen; a cross pair's in its second currency), ticks a unit
# of the quote (0.0025 rupee; EURUSD and GBPUSD 0.0001 dollar; USDJPY 0.01 yen), option strikes' step
CURRENCIES = [("USDINR", 84.1, 400, 0.25), ("EURINR", 90.5, 400, 0.25), ("GBPINR", 106.2, 400, 0.25),
              ("JPYINR", 55.6, 400, 0.25), ("EURUSD", 1.085, 10_000, 0.005), ("GBPUSD", 1.27, 10_000, 0.005),
              ("USDJPY", 150.2, 100, 0.5)]
CURRENCY_TICKS = {symbol: ticks for symbol, _, ticks, _ in CURRENCIES}
# RBI's reference rates a synthetic day's cross pairs settle at: currency -> (units, rupees)
REFERENCE_RATES = {"USD": ("1", "84.1234"), "JPY": ("100", "55.6000")}
# symbol, exchange, price, multiplier (quoted units a lot), agricultural, options traded
COMMODITIES = [
    ("GOLD", "MCX", 76500, 100, "N", True),  # per 10 g, a 1 kg lot
    ("SILVER", "MCX", 92000, 30, "N", False),  # per kg, a 30 kg lot
    ("CRUDEOIL", "MCX", 6000, 100, "N", True),  # per barrel, 100 barrels
    ("NATURALGAS", "MCX", 250, 1250, "N", False),  # per mmBtu, 1,250 mmBtu
    ("GUARSEED10", "NCDEX", 5400, 100, "Y", True),  # per quintal, a 10 t lot
    ("DHANIYA", "NCDEX", 7500, 50, "Y", False),  # per quintal, a 5 t lot
]
MIXED_TRADES = 0.3  # of a mixed client's trades, the share in the other segments
SETTLE_SHARE = 0.1  # on an expiry day, the clients whose expiring positions are settled
SETTLE_NUMBERS = 5 * 10**15  # settlement rows' order and trade numbers start here: synth's trades' never reach it


@dataclass
class SynthOptions:
    trade_date: dt.date
    accounts: int
    seed: int = 1
    volatile: bool = False
    volatile_trades: int = 60_000  # the volatile client's trades (a bench's smoke run takes fewer)
    segment_share: float = 0.1  # clients who also trade currency, commodities and BSE's index options
    holidays_file: str = ""  # the broker's calendar (CN_HOLIDAYS_FILE): no trades on an exchange shut that day


def write_dumps(out: Path, opts: SynthOptions) -> tuple[Path, Path]:
    """clients.csv and trades.csv, and bhavcopy.csv with a closing price for every contract traded."""
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(opts.seed)
    clients_path, trades_path = out / "clients.csv", out / "trades.csv"
    contracts: dict[tuple, str] = {}
    day = _Day(opts.trade_date, opts.holidays_file, random.Random(opts.seed + 104_729))
    expiry = expiry_day(day)
    settling, settle_numbers = random.Random(opts.seed + 15_485_863), _Numbers(None, SETTLE_NUMBERS)
    with clients_path.open("w", newline="") as cf, trades_path.open("w", newline="") as tf:
        clients, trades = csv.writer(cf), csv.DictWriter(tf, TRADE_COLUMNS if expiry else TRADE_FIELDS)
        clients.writerow(CLIENT_FIELDS)
        trades.writeheader()
        counter = _Numbers(rng)
        mixing = random.Random(opts.seed + 7919)
        for i in range(opts.accounts):
            ucc = f"C{i + 1:07d}"
            clients.writerow(_client(rng, ucc, i))
            n = opts.volatile_trades if (opts.volatile and i == 0) else _trade_count(rng)
            drawn = mixing.random() < opts.segment_share  # drawn for every client: the stream stays the seed's
            # the volatile client trades every segment too, unless the day has none but equity
            mix = mixing if drawn or (opts.volatile and i == 0 and opts.segment_share > 0) else None
            rows = day.held(_trades(rng, opts.trade_date, ucc, n, counter, mix))
            _note_contracts(rows, contracts)
            if expiry and settling.random() < SETTLE_SHARE:  # valued at their own settlement price: no bhavcopy row
                rows += _settlements(settling, opts.trade_date, ucc, settle_numbers)
            trades.writerows(rows)
    with (out / bhavcopy.FILE).open("w", newline="") as f:
        _write_bhavcopy(f, opts.trade_date, contracts)
    with (out / REFERENCE_FILE).open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(bhavcopy.REFERENCE_FIELDS)
        writer.writerows([opts.trade_date.isoformat(), c, units, rate] for c, (units, rate) in REFERENCE_RATES.items())
    return clients_path, trades_path


class _Day:
    """The exchanges that trade on the date, by the calendar: a row on a shut exchange becomes a
    trade on a commodity exchange that trades (MCX, on an equity holiday in its evening session),
    from a stream of its own, so a client keeps its count of trades; on a day every exchange is
    shut there is nothing to make. An exchange whose list for the year is not given trades if
    NSE does (or NSE's list is not given either)."""

    def __init__(self, date: dt.date, holidays_file: str, rng: random.Random):
        said = trading_calendar.sessions(date.isoformat(), holidays_file)
        default = "regular" if said.get("NSE", "regular") != "shut" else "shut"
        self.sessions = {ex: said.get(ex, default) for ex in trading_calendar.ALL_EXCHANGES}
        self.open = {ex for ex, s in self.sessions.items() if s != "shut"}
        if not self.open:
            raise ValueError(f"no exchange trades on {date.isoformat()}: nothing to synthesize")
        self.commodities = [c for c in COMMODITIES if c[1] in self.open]
        self.date, self.rng = date, rng

    def held(self, rows) -> list[dict]:
        if self.open == set(trading_calendar.ALL_EXCHANGES) and "evening" not in self.sessions.values():
            return list(rows)  # an ordinary day: every row as it was drawn
        out, moved = [], {}
        for row in rows:
            key = (row["order_no"], row["trade_no"])  # a cancellation or modification follows its trade
            if key not in moved:
                made = row
                if row["exchange"] not in self.open:
                    if not self.commodities:
                        continue
                    made = {**row, "isin": "", "strike": "", "option_type": "",
                            **_commodity(self.rng, self.date, self.commodities)}
                    made["settlement_no"] = f"COM{self.date:%Y}{self.date.timetuple().tm_yday:03d}"
                if self.sessions[made["exchange"]] == "evening" and made["trade_time"] < "17:00:00":
                    made = {**made, **_evening(self.rng, self.date)}
                moved[key] = made
            out.append({**moved[key], "status": row["status"]})
        return out


def closing_prices(trade_date: dt.date, trade_rows: list[dict]) -> dict:
    """What the split's plan would give for the contracts in `trade_rows` (trades built in
    memory): the bhavcopy's prices and the day's reference rates."""
    buf = io.StringIO()
    _write_bhavcopy(buf, trade_date, _note_contracts(trade_rows, {}))
    closes = bhavcopy.read(buf.getvalue().splitlines(), trade_date.isoformat(), [])
    rates = [",".join(bhavcopy.REFERENCE_FIELDS)] + [f"{trade_date.isoformat()},{c},{units},{rate}"
                                                     for c, (units, rate) in REFERENCE_RATES.items()]
    return {**closes, **bhavcopy.read_reference_rates(rates, trade_date.isoformat(), [])}


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
    """A contract as the bhavcopy prices it (the multiplier is the contract's, the same on every row)."""
    return (row["exchange"], row["segment"], row["instrument"], row["symbol"], row["isin"], row["expiry"],
            row["strike"], row["option_type"])


def _bhav_row(trade_date: dt.date, contract: tuple, traded_price: str) -> dict:
    """A closing price within 1% of a price traded that day, on the 0.05 tick, the same on every run."""
    exchange, segment, instrument, symbol, isin, expiry, strike, option_type = contract
    move = Decimal(10_000 + keys.stable_hash(repr(contract)) % 201 - 100) / 10_000
    per_rupee, places = (CURRENCY_TICKS[symbol], Decimal("0.0001")) if segment == "CDS" else (20, Decimal("0.01"))
    ticks = max(Decimal(1), (Decimal(traded_price) * move * per_rupee).to_integral_value())
    close = str((ticks / per_rupee).quantize(places))
    kind = bhavcopy.UDIFF_TYPES.get(instrument, "STK")
    return {"TradDt": trade_date.isoformat(), "BizDt": trade_date.isoformat(), "Sgmt": bhavcopy.SGMT.get(segment, segment),
            "Src": exchange,
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
    """16-digit order and trade numbers, some with leading zeros (they are strings); `start`: a
    range of their own (settlement rows'), drawing nothing from `rng`."""

    def __init__(self, rng: random.Random | None, start: int | None = None):
        self.next = rng.randrange(10**14) if start is None else start

    def take(self) -> str:
        self.next += 7
        return f"{self.next:016d}"


def _trades(rng, date, ucc, n, numbers, mix: random.Random | None = None):
    """`mix`: this client also trades the other segments, drawn from that stream; a mixed trade
    takes the place of one the client's own stream made, so its count (and the tail) stays."""
    base = dt.datetime.combine(date, dt.time(9, 15))
    for _ in range(n):
        row = _one_trade(rng, date, ucc, numbers, base + dt.timedelta(seconds=rng.randrange(22_500)))
        if mix is not None and mix.random() < MIXED_TRADES:
            row = _other_segment(mix, date, row)
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


def _other_segment(rng: random.Random, date: dt.date, row: dict) -> dict:
    """The same trade's identity (client, numbers, times, side) in currency, commodity or BSE index options."""
    kind = rng.random()
    other = _currency(rng, date) if kind < 0.4 else _commodity(rng, date) if kind < 0.75 else _bse_index_option(rng, date)
    other = {**row, "isin": "", "strike": "", "option_type": "", "multiplier": "", "agri": "", **other}
    if other["exchange"] == "MCX" and rng.random() < 0.4:
        other.update(_evening(rng, date))
    other["settlement_no"] = f"{other['segment']}{date:%Y}{date.timetuple().tm_yday:03d}"
    return other


def _currency(rng: random.Random, date: dt.date) -> dict:
    """USDINR and the other INR pairs: lots of 1,000, quotes to 4 places on a 0.0025 tick."""
    symbol, spot, ticks, step = rng.choice(CURRENCIES)
    row = dict(exchange="NSE" if rng.random() < 0.8 else "BSE", segment="CDS", symbol=symbol,
               expiry=_month_end(date).isoformat(), product=rng.choice(["NRML", "MIS"]),
               quantity=str(rng.randrange(1, 50)), multiplier="1000")
    if rng.random() < 0.7:
        return {**row, "instrument": "FUTCUR", "price": _quote(rng, spot, ticks)}
    strike = round(spot / step) * step + step * rng.randrange(-4, 5)
    return {**row, "instrument": "OPTCUR", "strike": f"{strike:.4f}", "option_type": rng.choice(["CE", "PE"]),
            "price": _quote(rng, max(0.05 if ticks == 400 else 2 / ticks, spot * 0.003), ticks)}


def _commodity(rng: random.Random, date: dt.date, among: list[tuple] = COMMODITIES) -> dict:
    """An MCX or NCDEX future (options on its futures where the exchange lists them), a few lots."""
    symbol, exchange, spot, multiplier, agri, options = rng.choice(among)
    row = dict(exchange=exchange, segment="COM", symbol=symbol, expiry=_month_end(date, 1).isoformat(),
               product="NRML", quantity=str(rng.randrange(1, 6)), multiplier=str(multiplier), agri=agri)
    if not options or rng.random() < 0.75:
        return {**row, "instrument": "FUTCOM", "price": _price(rng, spot)}
    step = 100 if spot > 10_000 else 50
    return {**row, "instrument": "OPTFUT", "strike": str(round(spot / step) * step + step * rng.randrange(-3, 4)),
            "option_type": rng.choice(["CE", "PE"]), "price": _price(rng, spot * 0.015)}


def _bse_index_option(rng: random.Random, date: dt.date) -> dict:
    """SENSEX and BANKEX options, weekly, on BSE's F&O segment."""
    symbol, spot, lot = rng.choice(BSE_INDICES)
    expiry = (date + dt.timedelta(days=(1 - date.weekday()) % 7 or 7)).isoformat()  # a Tuesday
    strike = round(spot / 100) * 100 + 100 * rng.randrange(-5, 6)
    return dict(exchange="BSE", segment="FO", symbol=symbol, instrument="OPTIDX", expiry=expiry, strike=str(strike),
                option_type=rng.choice(["CE", "PE"]), product="NRML", quantity=str(lot * rng.randrange(1, 5)),
                price=_price(rng, spot * 0.005))


def expiry_day(day: "_Day") -> bool:
    """Synth's equity derivatives expire on Thursdays (_derivative): on one NSE trades, expiring
    positions settle."""
    return day.date.weekday() == 3 and "NSE" in day.open


def _settlements(rng: random.Random, date: dt.date, ucc: str, numbers: "_Numbers") -> list[dict]:
    """One to three of a client's positions expiring today, settled: an index option in the money
    exercised (side B, its holder) or assigned (side S, its writer), a stock future or option
    going to delivery (B takes it, S gives it). The price is the settlement price."""
    rows = []
    for _ in range(rng.randrange(1, 4)):
        row = dict.fromkeys(TRADE_COLUMNS, "")
        row.update(trade_date=date.isoformat(), exchange="NSE", segment="FO", ucc=ucc, order_no=numbers.take(),
                   trade_no=numbers.take(), order_time="15:30:00", trade_time="15:30:00", expiry=date.isoformat(),
                   product="NRML", status="11", settlement_no=f"FO{date:%Y}{date.timetuple().tm_yday:03d}")
        kind = rng.random()
        if kind < 0.6:
            symbol, spot, lot = rng.choice(INDICES)
            step, isin, instrument = 100, "", "OPTIDX"
            settlement = rng.choice(["EX", "AS"])
            side = "B" if settlement == "EX" else "S"
        else:
            symbol, isin, spot = rng.choice(EQUITIES)
            lot, step, settlement, side = 250, 20, "DL", rng.choice("BS")
            instrument = "FUTSTK" if kind < 0.85 else "OPTSTK"
        price = _price(rng, spot)
        row.update(symbol=symbol, isin=isin, instrument=instrument, side=side, price=price, settlement_type=settlement,
                   quantity=str(lot * rng.randrange(1, 5)))
        if instrument.startswith("OPT"):  # in the money at the settlement price: a strike below it for a call
            option_type, below = rng.choice(["CE", "PE"]), int(Decimal(price)) // step * step
            strike = below - step * rng.randrange(1, 6) if option_type == "CE" else below + step * rng.randrange(1, 6)
            row.update(strike=str(strike), option_type=option_type)
        rows.append(row)
    return rows


def _evening(rng: random.Random, date: dt.date) -> dict:
    """MCX trades on after equity closes, in its evening session (to 23:30 here)."""
    when = dt.datetime.combine(date, dt.time(17, 0)) + dt.timedelta(seconds=rng.randrange(23_400))
    return {"trade_time": when.strftime("%H:%M:%S"),
            "order_time": (when - dt.timedelta(seconds=rng.randrange(1, 30))).strftime("%H:%M:%S")}


def _month_end(date: dt.date, months_ahead: int = 0) -> dt.date:
    """The last weekday of this month (or one after): near enough to an expiry for a synthetic day."""
    first = dt.date(date.year + (date.month + months_ahead) // 12, (date.month + months_ahead) % 12 + 1, 1)
    last = first - dt.timedelta(days=1)
    while last.weekday() > 4:
        last -= dt.timedelta(days=1)
    return last if last >= date else _month_end(date, months_ahead + 1)


def _quote(rng: random.Random, around: float, per_rupee: int) -> str:
    """A price on a tick of 1/per_rupee of its unit (400: an INR pair's 0.0025 rupee), to 4 places."""
    ticks = max(1, int(around * rng.uniform(0.97, 1.03) * per_rupee))
    return str((Decimal(ticks) / per_rupee).quantize(Decimal("0.0001")))


def _price(rng: random.Random, around: float) -> str:
    ticks = int(around * rng.uniform(0.97, 1.03) * 20)
    return str(Decimal(max(ticks, 1)) / 20)
