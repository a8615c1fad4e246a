"""Parse and validate the exchange dumps, one row at a time.

A bad row raises RowError naming the file, the row number (1 = first data row after the
header) and the field, so the account can be rejected and reported while the run goes on.
Order and trade numbers stay strings: they are identifiers, and leading zeros matter. They
are unique only within an exchange segment, so a trade is (exchange, segment, trade_no) and
an order (exchange, segment, order_no), everywhere.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, fields
from decimal import Decimal
from functools import lru_cache
from operator import attrgetter
from pathlib import Path
from sys import intern as _intern
from typing import Mapping

from pipeline import native
from pipeline.errors import CannotRun

CLIENT_FIELDS = ["ucc", "name", "pan", "email", "address", "state", "gst_state_code", "ecn_opt_in"]
TRADE_FIELDS = [
    "trade_date", "exchange", "segment", "settlement_no", "ucc", "order_no", "order_time",
    "trade_no", "trade_time", "symbol", "isin", "instrument", "expiry", "strike",
    "option_type", "side", "quantity", "price", "product", "status", "multiplier", "agri",
]
# The settlement-type column: T a trade (the default: a file without the column is all trades), EX an
# option's exercise, AS its assignment, DL a contract going to physical delivery. It is read from the
# file but kept out of TRADE_FIELDS, the shard row's positional layout: a trade's shard row stays what
# it was, and a settlement row carries its type after close and fx (Trade.as_row)
SETTLEMENT_FIELD = "settlement_type"
TRADE_COLUMNS = [*TRADE_FIELDS, SETTLEMENT_FIELD]  # what trades.csv may hold
# Columns a file may leave out: a day of equity alone has no use for the lot's terms, files written
# before currency and commodity segments came must still be read, and a day with no settlement rows
# needs no settlement type. LOT_FIELDS come together or not at all.
LOT_FIELDS = ("multiplier", "agri")
OPTIONAL_TRADE_FIELDS = (*LOT_FIELDS, SETTLEMENT_FIELD)
TRADE, EXERCISE, ASSIGNMENT, DELIVERY = "T", "EX", "AS", "DL"
SETTLEMENT_TYPES = {TRADE: "a trade", EXERCISE: "an exercise", ASSIGNMENT: "an assignment", DELIVERY: "a delivery"}
# What may be exercised or assigned in cash: index, currency and commodity options (stock options
# settle by delivery since 2018: a DL row); what may go to delivery: stock futures and options (NSE
# and BSE, physically settled since 2018) and commodity futures and options on them. Index and
# currency derivatives settle in cash and never go to delivery.
EXERCISABLE = {"OPTIDX", "OPTCUR", "OPTFUT"}
DELIVERABLE = {"FUTSTK", "OPTSTK", "FUTCOM", "OPTFUT"}

PAN = re.compile(r"^[A-Z]{5}[0-9]{4}[A-Z]\Z")
UCC = re.compile(r"^[A-Za-z0-9]{1,10}\Z")
# ASCII only: an address the relay cannot take without SMTPUTF8 goes to physical dispatch
EMAIL = re.compile(r"^[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]{1,64}@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+\Z")
ISIN = re.compile(r"^IN[A-Z0-9]{9}[0-9]\Z")
SYMBOL = re.compile(r"^[A-Z0-9][A-Z0-9&._-]{0,29}\Z")  # NSE symbols: M&M, BAJAJ-AUTO, NIFTY
QUANTITY = re.compile(r"^[0-9]{1,10}\Z")  # ASCII digits: int() would take "1_000" and Arabic-Indic digits
PRICE = re.compile(r"^[0-9]{1,9}(\.[0-9]{1,4})?\Z")  # no exponent, no sign, at most 4 places
# Guards against corrupt input, not exchange rules: the dearest NSE share (MRF) trades near
# Rs 1.5 lakh and the tick is 1 paisa, so a unit price of Rs 1 crore is ~60x headroom; no
# listed company's trade reaches 100 crore units. A value outside is a broken file.
MIN_PRICE, MAX_PRICE = Decimal("0.01"), Decimal("10000000")
MAX_QUANTITY = 10**9
MAX_FIELD = 256  # characters; names and addresses included
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
UNDECODED = re.compile(r"[\udc80-\udcff]")  # bytes that were not UTF-8 (surrogateescape)
NUMBER16 = re.compile(r"^[0-9]{16}\Z")
TIME = re.compile(r"^([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]\Z")
# Per segment: the exchanges that run it, its instruments and products. CDS is currency
# derivatives (NSE, BSE), COM commodity derivatives (MCX, NCDEX; OPTFUT an option on a future).
EXCHANGES = {"CM": {"NSE", "BSE"}, "FO": {"NSE", "BSE"}, "CDS": {"NSE", "BSE"}, "COM": {"MCX", "NCDEX"}}
INSTRUMENTS = {"CM": {"EQ"}, "FO": {"FUTSTK", "FUTIDX", "OPTSTK", "OPTIDX"}, "CDS": {"FUTCUR", "OPTCUR"},
               "COM": {"FUTCOM", "OPTFUT"}}
PRODUCTS = {"CM": {"CNC", "MIS"}, "FO": {"NRML", "MIS"}, "CDS": {"NRML", "MIS"}, "COM": {"NRML", "MIS"}}
DERIVATIVES = {"FO", "CDS", "COM"}
# every exchange-segment a note can hold, as a levies column names it: NSE-CM ... NCDEX-COM
SEGMENTS = [f"{exchange}-{segment}" for segment, exchanges in EXCHANGES.items() for exchange in sorted(exchanges)]
# A currency lot is 1,000 units of the base currency (JPYINR: 1,00,000 yen quoted per 100 yen):
# quantity is in lots, price in rupees per unit. A cross-currency pair (NSE's and BSE's EURUSD,
# GBPUSD, USDJPY: 1,000 of the base currency a lot) is quoted in its second currency and settles
# in rupees at RBI's reference rate for that currency on the trade date (reference_rates.csv).
CURRENCY_MULTIPLIER = 1000
_CURRENCY = str(CURRENCY_MULTIPLIER)
INR_PAIRS = frozenset({"USDINR", "EURINR", "GBPINR", "JPYINR"})  # what NSE and BSE list: another is no contract
CROSS_PAIRS = {"EURUSD": "USD", "GBPUSD": "USD", "USDJPY": "JPY"}  # pair -> the currency it is quoted in
# A cross-currency quote (about 1.1 or 150) is bounded well under MAX_PRICE, so its rupee value,
# the quote times a reference rate of at most 6 places, stays exact in Decimal's 28 digits
MAX_CROSS_PRICE = Decimal("10000")
MULTIPLIER = re.compile(r"^[1-9][0-9]{0,6}\Z")  # a commodity lot holds under a crore of price units
# Currency premiums are quoted to 4 places with a tick of 0.0025 rupee: under equity's 1 paisa
MIN_PRICES = {"CDS": Decimal("0.0001")}
STATUSES = {"11", "12", "13"}


class InputError(CannotRun, ValueError):
    """A whole input file is unusable (missing, unreadable, a column missing): the run cannot start."""


class RowError(ValueError):
    def __init__(self, file: str, row: int, field: str, problem: str, ucc: str = ""):
        super().__init__(f"{file} row {row} field {field!r}: {problem}")
        self.file, self.row, self.field, self.problem, self.ucc = file, row, field, problem, ucc

    def as_dict(self) -> dict:
        return {"file": self.file, "row": self.row, "field": self.field, "error": self.problem, "ucc": self.ucc}


@dataclass(frozen=True)
class Client:
    ucc: str
    name: str
    pan: str
    email: str
    address: str
    state: str
    gst_state_code: str
    ecn_opt_in: bool


@dataclass(frozen=True)
class Trade:
    trade_date: str
    exchange: str
    segment: str
    settlement_no: str
    ucc: str
    order_no: str
    order_time: str
    trade_no: str
    trade_time: str
    symbol: str
    isin: str
    instrument: str
    expiry: str
    strike: str
    option_type: str
    side: str
    quantity: int
    price: Decimal
    product: str
    status: str
    close: Decimal | None = None  # derivatives: the day's closing (futures: settlement) price
    # after close, so a Trade built by position as before stays what it was
    multiplier: int = 1  # price units a lot holds: 1,000 on currency, e.g. 100 on gold (10 g quotes, 1 kg lot)
    agri: str = ""  # commodities: Y for an agricultural contract (no CTT, SEBI's agricultural fee), else N
    # cross-currency pairs: rupees a unit of the quote currency (RBI's reference rate); None: quoted in rupees
    fx: Decimal | None = None
    # T a trade; EX, AS, DL an exercise, assignment or delivery (SETTLEMENT_TYPES): its price is then
    # the settlement price, and its value the settlement value (settlement_value)
    settlement: str = TRADE

    # Derived once, when the trade is made, not at each of their ~15 uses a trade (a 2,000-page note
    # asks for them 1.4 million times): slots beside the fields' __dict__, so equality, hash, repr
    # and a `Trade(**t.__dict__)` see the fields alone.
    # turnover: rupees, lots x multiplier x price (equity: shares x price, the multiplier being 1), a
    # cross-currency pair's value in its quote currency at the reference rate;
    # key: the trade (exchange, segment, trade_no); order_key: its order (exchange, segment, order_no);
    # exchange_segment: "NSE-CM", the note's section and levies column it goes in;
    # flow: B if the client pays the value, S if it is paid to the client (a trade's side; an
    # exercise is paid to its holder, an assignment paid by its writer)
    __slots__ = ("turnover", "key", "order_key", "exchange_segment", "flow", "__dict__", "__weakref__")

    def __post_init__(self) -> None:
        _derive(self, self.exchange, self.segment, self.trade_no, self.order_no, self.price, self.quantity,
                self.multiplier, self.fx, self.side, self.settlement)

    def __reduce__(self):
        """Pickled as its fields (the slots are derived again): frozen, it refuses pickle's setattr."""
        return type(self), tuple(self.__dict__[f] for f in _FIELDS)

    def as_row(self) -> list[str]:
        """A multiplier of 1 is written empty, as an equity row gives it: the fast path then
        passes those rows on as they came."""
        # not asdict(): it deep-copies, 10x slower
        row = [str(getattr(self, f)) for f in TRADE_FIELDS] + ["" if self.close is None else str(self.close)]
        if self.multiplier == 1:
            row[_AT_MULTIPLIER] = ""
        if self.fx is not None or self.settlement != TRADE:  # after close: a trade's row ends there
            row.append("" if self.fx is None else str(self.fx))  # a cross-currency pair's reference rate
        if self.settlement != TRADE:  # after fx: a trade's row is what it was before settlement rows came
            row.append(self.settlement)
        return row

    @classmethod
    def from_row(cls, row: list[str]) -> "Trade":
        """Rebuild a trade that was already validated (from a shard file): a trade's row whole by
        rows.c's made(); any other row (a settlement's, one written before the multiplier and agri
        columns), and every row where the C cannot be built, by its Python twin, from_row_in_python."""
        t = _made(row) if cls is Trade else None
        return from_row_in_python(cls, row) if t is None else t


# A shard row is TRADE_FIELDS, in order, then close; Trade's fields are the same but for close,
# which comes before multiplier and agri: from_row builds one by position (a 2,000-page note
# rebuilds 125,000), test_dumps holds the two orders and from_row's columns together
_AT_QUANTITY, _AT_PRICE, _AT_CLOSE = TRADE_FIELDS.index("quantity"), TRADE_FIELDS.index("price"), len(TRADE_FIELDS)
_AT_MULTIPLIER = TRADE_FIELDS.index("multiplier")
_AT_FX = _AT_CLOSE + 1
_AT_SETTLEMENT = _AT_FX + 1
_FIELDS = tuple(f.name for f in fields(Trade))
_new, _set_fields = object.__new__, Trade.__dict__["__dict__"].__set__
_set_turnover, _set_key, _set_order_key = Trade.turnover.__set__, Trade.key.__set__, Trade.order_key.__set__
_set_exchange_segment, _set_flow = Trade.exchange_segment.__set__, Trade.flow.__set__


def _derive(t: Trade, exchange: str, segment: str, trade_no: str, order_no: str, price: Decimal, quantity: int,
            multiplier: int, fx: Decimal | None, side: str, settlement: str) -> None:
    """A trade's slots from its fields: the one place they are worked out, however the trade is made.
    The turnover: price x quantity x multiplier (no multiplying by a multiplier of 1), then a
    cross-currency pair's times its reference rate, in that order (Decimal rounds each product);
    a settlement row's is its settlement value (settlement_value), and its flow who pays it."""
    if settlement == TRADE:
        value, flow = price * quantity * multiplier if multiplier != 1 else price * quantity, side
    else:
        value, flow = settlement_value(t)
    _set_turnover(t, value if fx is None else value * fx)
    _set_flow(t, flow)
    _set_key(t, (exchange, segment, trade_no))
    _set_order_key(t, (exchange, segment, order_no))
    _set_exchange_segment(t, f"{exchange}-{segment}")


_SHARED_DICT = Trade(*[""] * _AT_QUANTITY, 0, Decimal(0), "", "").__dict__  # keys shared with the class's
_OWN_FIELDS = {"order_no", "order_time", "trade_no", "trade_time", "side"}  # not interned: a trade's own
# (field, its column in a shard row, interned): a row's text fields, as from_row takes them
_TEXT_FIELDS = tuple((f, i, f not in _OWN_FIELDS) for i, f in enumerate(TRADE_FIELDS)
                     if f not in ("quantity", "price", "multiplier"))


def filled(template: dict, spec: tuple[tuple[str, int, bool], ...], row: list[str]) -> dict:
    """A copy of `template`, each (key, column, interned) of `spec` set to the row's column, interned
    if asked (rows.c does the same for a trade's row)."""
    d = template.copy()
    for key, column, interned in spec:
        d[key] = _intern(row[column]) if interned else row[column]
    return d


def _compiled_made():
    """rows.c's made, told what it builds with; where it cannot be built, None for every row (from_row
    then builds each in Python)."""
    module = native.extension(Path(__file__).with_name("rows.c"), "trades are rebuilt from their rows in Python")
    if module is None:
        return lambda row: None
    setters = (Trade.__dict__["__dict__"], Trade.turnover, Trade.key, Trade.order_key, Trade.exchange_segment,
               Trade.flow)
    columns = (_AT_QUANTITY, _AT_PRICE, _AT_MULTIPLIER, _AT_CLOSE, _AT_FX, _AT_SETTLEMENT)
    module.configure(Trade, _SHARED_DICT, _TEXT_FIELDS, Decimal, TRADE, setters, columns)
    return module.made


_made = _compiled_made()


def from_row_in_python(cls: type[Trade], row: list[str]) -> Trade:
    """Trade.from_row in Python: rows.c's made() is its C twin, for a trade's row."""
    if len(row) <= _AT_MULTIPLIER + 1:  # a shard written before the multiplier and agri columns
        row = [*row[:_AT_MULTIPLIER], "1", "", *row[_AT_MULTIPLIER:]]
    r, close = row, row[_AT_CLOSE] if len(row) > _AT_CLOSE else ""  # r[i]: TRADE_FIELDS[i]'s column
    # The dataclass's __init__ without its setattr a field: a copy of a trade's dict, whose keys
    # every trade's shares (a third of the memory of a dict of its own), each value replaced. The
    # fields of few values (exchange, segment, product, a contract's) are interned: JSON made each
    # row its own "NSE", and a 125,000-trade note's passes over its trades missed the cache on each
    # (~1.5 µs a trade); order and trade numbers and times are the trade's own
    d = filled(_SHARED_DICT, _TEXT_FIELDS, r)
    quantity, price, multiplier = int(r[16]), Decimal(r[17]), int(r[20] or 1)
    fx = Decimal(r[_AT_FX]) if len(r) > _AT_FX and r[_AT_FX] else None
    settlement = _intern(r[_AT_SETTLEMENT]) if len(r) > _AT_SETTLEMENT else TRADE
    d["quantity"], d["price"], d["close"] = quantity, price, Decimal(close) if close else None
    d["multiplier"], d["fx"], d["settlement"] = multiplier, fx, settlement
    t = _new(cls)
    _set_fields(t, d)
    _derive(t, d["exchange"], d["segment"], r[7], r[5], price, quantity, multiplier, fx, r[15],
            settlement)  # as __post_init__
    return t


def intrinsic(t: Trade) -> Decimal:
    """An option's value a unit at the settlement price (the row's price): a call's settlement
    price less its strike, a put's strike less its settlement price, never below zero."""
    gain = t.price - Decimal(t.strike) if t.option_type == "CE" else Decimal(t.strike) - t.price
    return max(gain, Decimal(0))


def settlement_value(t: Trade) -> tuple[Decimal, str]:
    """A settlement row's value (before a cross-currency pair's reference rate) and who pays it.
    EX and AS: the intrinsic value x units, paid to the holder who exercised (flow S), by the
    writer assigned (flow B). DL: the delivery's value, paid by the side taking delivery (B) to
    the side giving it (S): a future's at its settlement price, an option's at its strike (a
    call's holder buys the underlying at the strike, a put's holder sells at it)."""
    units = t.quantity * t.multiplier
    if t.settlement == EXERCISE:
        return intrinsic(t) * units, "S"
    if t.settlement == ASSIGNMENT:
        return intrinsic(t) * units, "B"
    if t.instrument.startswith("OPT"):
        return Decimal(t.strike) * units, t.side
    return t.price * units, t.side


def check_header(file: str, header: list[str], expected: list[str]) -> None:
    missing = [f for f in expected if f not in header and f not in OPTIONAL_TRADE_FIELDS]
    if missing:
        raise InputError(f"{file}: the header lacks column(s) {', '.join(missing)}")


def parse_client(file: str, row: int, raw: dict[str, str]) -> Client:
    ucc = (raw.get("ucc") or "").strip()
    fail = _failer(file, row, ucc if UCC.match(ucc) else "")
    values = _clean(raw, CLIENT_FIELDS, fail)
    if not UCC.match(ucc):
        fail("ucc", "must be 1-10 letters or digits")
    if not values["name"]:
        fail("name", "is empty")
    pan = values["pan"].upper()
    if not PAN.match(pan):
        fail("pan", "is not a valid PAN (AAAAA9999A)")
    opt_in = values["ecn_opt_in"].upper()
    if opt_in not in ("Y", "N"):
        fail("ecn_opt_in", "must be Y or N")
    if not re.fullmatch(r"[0-9]{2}", values["gst_state_code"]):
        fail("gst_state_code", "must be two digits")
    return Client(**{**values, "ucc": ucc, "pan": pan, "ecn_opt_in": opt_in == "Y"})


def parse_trade(file: str, row: int, raw: dict[str, str], trade_date: str,
                closes: Mapping[tuple, Decimal] | None = None, closed: Mapping[str, str] | None = None) -> Trade:
    """`closes` (from the bhavcopy) gives each derivatives contract its closing price, and each
    currency a cross-currency pair is quoted in its RBI reference rate (reference_key); a
    contract or rate missing from it is this row's error, since the note could not show it.
    `closed`: the exchanges shut on the trade date, and why: a trade on one is this row's error."""
    ucc = (raw.get("ucc") or "").strip()
    fail = _failer(file, row, ucc if UCC.match(ucc) else "")
    v = _clean(raw, TRADE_COLUMNS, fail)
    kind = v.pop(SETTLEMENT_FIELD) or TRADE
    if not UCC.match(v["ucc"]):
        fail("ucc", "must be 1-10 letters or digits")
    if v["trade_date"] != trade_date:
        fail("trade_date", f"is {v['trade_date']!r}, the run is for {trade_date}")
    if v["segment"] not in INSTRUMENTS:
        fail("segment", "must be CM, FO, CDS or COM")
    if v["exchange"] not in EXCHANGES[v["segment"]]:
        fail("exchange", f"must be {' or '.join(sorted(EXCHANGES[v['segment']]))} in segment {v['segment']}")
    if closed and v["exchange"] in closed:
        fail("exchange", f"{v['exchange']} held no session on {trade_date} ({closed[v['exchange']]})")
    if v["instrument"] not in INSTRUMENTS[v["segment"]]:
        fail("instrument", f"{v['instrument']!r} is not traded in segment {v['segment']}")
    if v["product"] not in PRODUCTS[v["segment"]]:
        fail("product", f"{v['product']!r} is not valid in segment {v['segment']}")
    for f in ("order_no", "trade_no"):
        if not NUMBER16.match(v[f]):
            fail(f, "must be a 16-digit number")
    for f in ("order_time", "trade_time"):
        if not TIME.match(v[f]):
            fail(f, "must be HH:MM:SS")
    if not SYMBOL.match(v["symbol"]):
        fail("symbol", "must be 1-30 capitals, digits or & . _ -")
    if v["isin"] and not ISIN.match(v["isin"]):
        fail("isin", "is not an Indian ISIN (IN + 9 letters or digits + a check digit)")
    if v["instrument"] == "EQ" and not v["isin"]:
        fail("isin", "is empty for an equity trade")
    if v["side"] not in ("B", "S"):
        fail("side", "must be B or S")
    if v["status"] not in STATUSES:
        fail("status", "must be 11, 12 or 13")
    if v["instrument"].startswith("OPT") and v["option_type"] not in ("CE", "PE"):
        fail("option_type", "must be CE or PE for an option")
    if v["segment"] in DERIVATIVES:
        expiry = _iso_date(v["expiry"], lambda p: fail("expiry", p))
        if expiry < trade_date:
            fail("expiry", f"{v['expiry']} is before the trade date")
    if v["instrument"].startswith("OPT"):
        _price(v["strike"], lambda p: fail("strike", p))
    if not QUANTITY.match(v["quantity"]) or not 0 < int(v["quantity"]) <= MAX_QUANTITY:
        fail("quantity", f"{v['quantity']!r} is not a whole number of units from 1 to {MAX_QUANTITY:,}")
    quantity = int(v["quantity"])
    price = _price(v["price"], lambda p: fail("price", p), MIN_PRICES.get(v["segment"], MIN_PRICE))
    multiplier = _lot_terms(v, fail)
    if quantity * multiplier > MAX_QUANTITY:  # a trade's value stays under 10^16 rupees: exact in Decimal's 28 digits
        fail("quantity", f"{quantity:,} lots of {multiplier:,} is over {MAX_QUANTITY:,} units")
    if kind != TRADE:
        _settlement_terms(v, kind, trade_date, fail)
    trade = Trade(**{**v, "quantity": quantity, "price": price, "multiplier": multiplier, "settlement": kind})
    if kind in (EXERCISE, ASSIGNMENT) and not intrinsic(trade):
        fail("price", f"the settlement price {price} leaves the {v['option_type']} at strike {v['strike']} out of the "
                      "money: there is nothing to exercise or assign")
    if closes is None or trade.segment not in DERIVATIVES:
        return trade
    close = None
    if kind == TRADE:  # a settlement row is valued at its own settlement price: no closing rate is shown
        close = closes.get(contract_id(trade))
        if close is None:
            fail("symbol", f"contract {describe_contract(trade)} is not in bhavcopy.csv (no closing price)")
    fx = None
    if trade.segment == "CDS" and (currency := CROSS_PAIRS.get(trade.symbol)):
        fx = closes.get(reference_key(currency))
        if fx is None:
            fail("symbol", f"{trade.symbol} settles in rupees at RBI's reference rate for {currency}, and "
                           f"{REFERENCE_FILE} gives none for {trade_date}")
    return Trade(**{**trade.__dict__, "close": close, "fx": fx})


REFERENCE_FILE = "reference_rates.csv"


def _settlement_terms(v: dict[str, str], kind: str, trade_date: str, fail) -> None:
    """A settlement row's checks: its type, and that its contract can settle so (docs/input.md).
    A row that does not fit rejects its account rather than be charged as something it is not."""
    if kind not in SETTLEMENT_TYPES:
        fail(SETTLEMENT_FIELD, f"{kind[:40]!r} is not T (trade), EX (exercise), AS (assignment) or DL (delivery)")
    name, instrument = SETTLEMENT_TYPES[kind], v["instrument"]
    if v["segment"] not in DERIVATIVES:
        fail(SETTLEMENT_FIELD, f"{name} is of a derivative: segment {v['segment']} has none")
    if kind in (EXERCISE, ASSIGNMENT):
        if instrument == "OPTSTK":
            fail(SETTLEMENT_FIELD, f"a stock option's {name[name.index(' ') + 1:]} settles by delivery (since 2018): give it as a DL row")
        if instrument not in EXERCISABLE:
            fail("instrument", f"{name} is of an option; {instrument} is not one")
        holder = "B" if kind == EXERCISE else "S"
        if v["side"] != holder:
            fail("side", f"{name} is of the option's {'holder' if holder == 'B' else 'writer'}: side {holder}")
    elif instrument not in DELIVERABLE:
        fail("instrument", f"{instrument} settles in cash: it never goes to delivery (physical delivery is of stock "
                           "futures and options, and commodity futures and options)")
    if v["expiry"] != trade_date:
        fail("expiry", f"{name} is of a contract expiring on the day ({trade_date}), not {v['expiry']}")
    if v["product"] != "NRML":
        fail("product", f"{name} settles a carried position (NRML), not {v['product']}")


def reference_key(currency: str) -> tuple[str, str]:
    """Where a currency's RBI reference rate (rupees a unit) sits among the closing prices."""
    return ("RBI", currency)


def _lot_terms(v: dict[str, str], fail) -> int:
    """The row's multiplier, checked against its segment (and its agricultural flag): a
    wrong multiplier misstates every rupee of the trade, so it is never guessed for a commodity."""
    segment, multiplier, agri = v["segment"], v["multiplier"], v["agri"]
    if segment == "COM":
        if not MULTIPLIER.match(multiplier):
            fail("multiplier", f"{multiplier[:40]!r} is not a whole number from 1 to 9,999,999 (a commodity "
                               "contract's price units a lot)")
        if agri not in ("Y", "N"):
            fail("agri", "must be Y (agricultural) or N for a commodity")
        return int(multiplier)
    if agri:
        fail("agri", f"is only for commodities (segment COM), not {segment}")
    if segment == "CDS":
        cross = v["symbol"] in CROSS_PAIRS
        if not cross and v["symbol"] not in INR_PAIRS:
            fail("symbol", f"{v['symbol'][:40]!r} is not a currency pair taken: {', '.join(sorted(INR_PAIRS))} or "
                           f"{', '.join(CROSS_PAIRS)}")
        if multiplier not in ("", str(CURRENCY_MULTIPLIER)):
            fail("multiplier", f"must be {CURRENCY_MULTIPLIER} (or empty) for a currency lot, not {multiplier[:40]!r}")
        if cross and Decimal(v["price"]) >= MAX_CROSS_PRICE:
            fail("price", f"{v['price']} is not a {v['symbol']} quote (under {MAX_CROSS_PRICE:,})")
        return CURRENCY_MULTIPLIER
    if multiplier not in ("", "1"):
        fail("multiplier", f"must be 1 (or empty) in segment {segment}: quantity is in units")
    return 1


SEP = "\x1f"  # a control character: never inside an accepted field
# The fast path for a valid trade row: one match over the fields joined by SEP, then the few
# checks a pattern cannot make. Anything it does not accept goes through parse_trade, which
# names the field at fault (or accepts a row that only needed its spaces stripped). Never
# laxer than parse_trade.
_FREE = r"[^\s\x00-\x1f\x7f-\x9f\u2028\u2029\udc80-\udcff]{0,%d}" % MAX_FIELD
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
_PRICE = r"(?:0|[1-9][0-9]{0,8})(?:\.[0-9]{1,4})?"  # no leading zero: the text is str(Decimal(text))
_TRADE_PATTERN = SEP.join([
    "%s", "(?:NSE|BSE|MCX|NCDEX)", "(?:CM|FO|CDS|COM)", _FREE, "[A-Za-z0-9]{1,10}", "[0-9]{16}", _TIME, "[0-9]{16}", _TIME,
    "[A-Z0-9][A-Z0-9&._-]{0,29}", "(?:IN[A-Z0-9]{9}[0-9])?", "(?:EQ|FUTSTK|FUTIDX|OPTSTK|OPTIDX|FUTCUR|OPTCUR|FUTCOM|OPTFUT)",
    _FREE, _FREE, _FREE, "[BS]", "[1-9][0-9]{0,9}", _PRICE, "(?:CNC|MIS|NRML)", "1[123]", "(?:[1-9][0-9]{0,6})?",
    "[YN]?"])


@lru_cache(maxsize=8)
def _trade_pattern(trade_date: str) -> re.Pattern:
    return re.compile(_TRADE_PATTERN % re.escape(trade_date))


def trade_row(file: str, row: int, values: list[str], trade_date: str,
              closes: Mapping[tuple, Decimal] | None, contracts: dict | None = None,
              closed: Mapping[str, str] | None = None) -> list[str]:
    """A trade row (the values in TRADE_FIELDS order) checked as parse_trade checks it, about
    five times faster; returns what Trade.as_row would (the closing price last). RowError if bad.
    `contracts` remembers each derivatives contract's checks and price across a file's rows;
    `closed`: the exchanges shut that day (parse_trade). `values` may end with the settlement
    type (TRADE_COLUMNS): a trade's row is the same with it or without it; any other row is
    parse_trade's to read."""
    if len(values) > _AT_CLOSE:
        if values[_AT_CLOSE] not in ("", TRADE):
            return parse_trade(file, row, dict(zip(TRADE_COLUMNS, values)), trade_date, closes, closed).as_row()
        values = values[:_AT_CLOSE]
    if _trade_pattern(trade_date).fullmatch(SEP.join(values)) is not None and not (closed and values[1] in closed):
        segment, isin, instrument, product = values[2], values[10], values[11], values[18]
        if (instrument in INSTRUMENTS[segment] and product in PRODUCTS[segment] and (isin or instrument != "EQ")
                and int(values[16]) <= MAX_QUANTITY and (multiplier := _fits_segment(values)) is not None
                and MIN_PRICES.get(segment, MIN_PRICE) <= Decimal(values[17]) <= MAX_PRICE):
            if multiplier != values[_AT_MULTIPLIER]:
                values = [*values[:_AT_MULTIPLIER], multiplier, values[_AT_MULTIPLIER + 1]]
            if segment == "CM":
                return [*values, ""]
            contracts = {} if contracts is None else contracts
            contract = (*values[1:3], instrument, values[9], *values[12:15])
            if contract not in contracts:
                contracts[contract] = _fo_close(values, trade_date, instrument, closes)
            close = contracts[contract]
            if close is not None:
                return [*values, str(close)]
    return parse_trade(file, row, dict(zip(TRADE_FIELDS, values)), trade_date, closes, closed).as_row()


def _fits_segment(v) -> str | None:
    """The fast path's check of exchange, multiplier and agricultural flag against the segment:
    the multiplier as Trade.as_row writes it (a currency row's 1000 whether the file gave it or
    not), or None for a row that parse_trade must look at and name the field of."""
    segment, multiplier, agri = v[2], v[_AT_MULTIPLIER], v[_AT_MULTIPLIER + 1]
    if not multiplier and not agri and segment in _EQUITY:  # most rows: one test, then the exchange's
        return "" if v[1] in _EQUITY_EXCHANGES else None
    if v[1] not in EXCHANGES[segment]:
        return None
    if segment == "COM":
        fits = multiplier and agri and int(v[16]) * int(multiplier) <= MAX_QUANTITY
        return multiplier if fits else None
    if agri:
        return None
    if segment == "CDS":
        fits = multiplier in ("", _CURRENCY) and v[9] in INR_PAIRS and int(v[16]) <= MAX_QUANTITY // 1000
        return _CURRENCY if fits else None
    return "" if multiplier in ("", "1") else None


_EQUITY, _EQUITY_EXCHANGES = ("CM", "FO"), EXCHANGES["CM"] | EXCHANGES["FO"]


def _fo_close(v: list[str], trade_date: str, instrument: str, closes) -> Decimal | None:
    """The contract's closing price if its derivatives fields are sound, else None (slow path)."""
    expiry = v[12]
    if len(expiry) != 10 or expiry < trade_date:
        return None
    try:
        dt.date.fromisoformat(expiry)
    except ValueError:
        return None
    strike = None
    if instrument.startswith("OPT"):
        if v[14] not in ("CE", "PE") or not PRICE.match(v[13]):
            return None
        strike = Decimal(v[13])
        if not MIN_PRICE <= strike <= MAX_PRICE:
            return None
    if closes is None:
        return None
    return closes.get((v[1], v[2], instrument, v[9], expiry, strike, v[14] if strike is not None else ""))


def contract_id(t: Trade) -> tuple[str, str, str, str, str, Decimal | None, str]:
    """How the bhavcopy names a contract: exchange, segment, instrument, symbol, expiry, strike, type."""
    strike = Decimal(t.strike) if t.instrument.startswith("OPT") else None
    return (t.exchange, t.segment, t.instrument, t.symbol, t.expiry, strike,
            t.option_type if t.instrument.startswith("OPT") else "")


def describe_contract(t: Trade) -> str:
    return " ".join(p for p in (t.exchange, t.instrument, t.symbol, t.expiry, t.strike, t.option_type) if p)


def effective(trades: list, key, status, order) -> list:
    """What goes on the note: the latest version of each trade (by `key`), cancelled ones
    removed, sorted by `order`. Takes the accessors so Trades and the split's rows share the rule."""
    latest = {}
    for t in trades:
        k = key(t)
        if status(t) in ("12", "13") or k not in latest:  # 12 modified, 13 cancelled
            latest[k] = t
    return sorted((t for t in latest.values() if status(t) != "13"), key=order)


def effective_trades(trades: list[Trade]) -> list[Trade]:
    return effective(trades, attrgetter("key"), attrgetter("status"),
                     attrgetter("exchange", "segment", "settlement_no", "trade_time", "trade_no"))


def _iso_date(text: str, fail) -> str:
    try:
        return dt.date.fromisoformat(text).isoformat() if len(text) == 10 else fail(f"{text!r} is not a date")
    except ValueError:
        fail(f"{text!r} is not a date (YYYY-MM-DD)")


def _price(text: str, fail, least: Decimal = MIN_PRICE) -> Decimal:
    if not PRICE.match(text):
        fail(f"{text[:40]!r} is not a number (digits, at most 4 decimal places)")
    value = Decimal(text)
    if not least <= value <= MAX_PRICE:
        fail(f"{text} is outside {least} to {MAX_PRICE:,}")
    return value


def _clean(raw: dict, fields: list[str], fail) -> dict[str, str]:
    """Every field stripped; none too long, none with a control character or a non-UTF-8 byte
    (a newline in a symbol would forge a row on the printed note)."""
    values = {}
    for f in fields:
        value = raw.get(f)
        value = value.strip() if isinstance(value, str) else ""
        if len(value) > MAX_FIELD:
            fail(f, f"is {len(value):,} characters long (at most {MAX_FIELD})")
        if UNDECODED.search(value):
            fail(f, "is not UTF-8 (save the file as UTF-8)")
        if CONTROL.search(value):
            fail(f, "contains a control character (a line break or tab); the dumps are read in byte ranges cut at "
                    "line ends, so a record must be one line (a multi-line address: join its lines with commas)")
        values[f] = value
    return values


def _failer(file: str, row: int, ucc: str):
    def fail(field: str, problem: str):
        raise RowError(file, row, field, problem, ucc)
    return fail
