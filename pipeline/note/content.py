"""Client + trades + charges -> the note's data, every value a finished string.

The template only lays out what it is given. Tables are monospaced lines padded here: one
text run per block instead of one per cell makes Typst ~3x cheaper per row, and it is the
look of a printed contract note. Pagination happens here too, with a fixed number of rows
per page, so the page count is known before Typst runs: a huge note can be rendered as
page ranges in parallel and still say "Page X of Y" continuously.

No value is ever cut: each column is as wide as the note's widest value (never narrower
than the standard layout), and the table's font shrinks if a note's lines grow past the page.

One note covers every exchange and segment the client traded that day (the broker holding
each membership): a section of trades per exchange, segment and settlement, and in the levies
table a column per exchange and segment with its own obligation and net, then the grand total.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from functools import lru_cache
from itertools import chain, groupby, repeat
from operator import attrgetter, itemgetter
from pathlib import Path

from pipeline import native
from pipeline.day import trading_calendar
from pipeline.day.dumps import CROSS_PAIRS, DELIVERY, SEGMENTS, TRADE, Client, Trade, intrinsic
from pipeline.note.amounts import column, money
from pipeline.note.charges import CarryForward, Charges, net_totals, per_unit, segment_of

ROWS_FIRST_PAGE = 46
ROWS_PER_PAGE = 64
ROWS_FOR_LEVIES = 28
# The page sizes above leave room for three section headings a page and five settlement lines
# in the header (the client block's height). A note across more exchanges and segments pays
# for the rest in rows: measured, a heading is under 1.5 rows and a header line about one.
HEADINGS_FREE, HEADING_ROWS = 3, 2
SETTLEMENTS_FREE, SETTLEMENT_ROWS = 5, 2
# (heading line 1, heading line 2, least width in characters, right-aligned)
TRADE_COLUMNS = [
    ("Order No", "", 16, False), ("Order", "Time", 8, False), ("Trade No", "", 16, False),
    ("Trade", "Time", 8, False), ("Security / Contract", "Description", 38, False), ("B/S", "", 3, False),
    ("Qty", "", 7, True), ("Gross Rate", "/ Unit", 12, True), ("Brokerage", "/ Unit", 9, True),
    ("Net Rate", "/ Unit", 12, True), ("Closing", "Rate", 9, True), ("Net Total", "before levies", 15, True),
    ("Remarks", "", 14, False),
]
LEVY_LABEL_WIDTH = 42
LEVY_VALUE_WIDTH = 17
MONO_SIZE_PT = 6.8
MONO_ADVANCE = 0.6  # a monospaced glyph is 0.6 em wide
GAP = "  "  # between two columns of the trade table: one space ran "Gross Rate" into "Brokerage"
TEXT_WIDTH_PT = 770  # A4 landscape less the margins and the levies box's inset
# (label, the Levies field it prints, a charge: printed negated, in brackets as the client pays it)
LEVY_LINES = [
    ("Pay-in/Pay-out obligation", "obligation", False),
    ("Brokerage", "brokerage", True),
    ("Exchange transaction charges", "txn", True),
    ("SEBI turnover fees", "sebi", True),
    ("Taxable value of supply", "taxable_value", False),
    ("CGST @ 9%", "cgst", True),
    ("SGST @ 9%", "sgst", True),
    ("IGST @ 18%", "igst", True),
    ("Securities transaction tax", "stt", True),
    ("Commodities transaction tax", "ctt", True),
    ("Stamp duty", "stamp", True),
    ("IPFT charges", "ipft", True),
    ("Net amount receivable/(payable) by client", "net", False),
]
CTT_LINE = "Commodities transaction tax"  # printed only on a note with commodity trades
SEGMENT_NAMES = {"CDS": "currency derivatives", "COM": "commodity derivatives"}
NO_CALENDAR = "per the exchange's calendar"  # settlement date of an exchange whose holidays we lack
# A settlement row's remark, and the order its kind's lines follow a section's trades and C/F lines in
SETTLEMENT_REMARKS = {"EX": "Exercise", "AS": "Assignment", "DL": "Delivery"}


def build_note(client: Client, trades: list[Trade], charges: Charges, broker: dict,
               trade_date: str, number: str, settles: dict[str, str] | None = None) -> dict:
    """`settles`: each exchange's settlement date (ISO), from the run's trading calendar."""
    rows, sections = _trade_rows(trades, charges)
    widths, lines = _padded(rows)
    settlements = _settlements(sections, settles or trading_calendar.settlement_dates(trade_date))
    levies = levies_table(charges)
    with_ctt = _commodities(charges)  # levies_table's CTT line
    pages = paginate(lines, max(0, len(settlements) - SETTLEMENTS_FREE) * SETTLEMENT_ROWS, int(with_ctt))
    return {
        "broker": broker_block(broker),
        "note": {
            "number": number,
            "trade_date": _dmy(trade_date),
            "settlements": settlements,
        },
        "client": {
            "name": client.name, "address": client.address, "state": client.state,
            "gst_state_code": client.gst_state_code, "pan": client.pan, "ucc": client.ucc,
            "place_of_supply": f"{client.state} ({client.gst_state_code})",
        },
        "levies": levies,
        "heads": table_heads(widths),
        "mono_size": fitting_size(sum(widths) + len(GAP) * (len(widths) - 1)),
        "levies_size": fitting_size(len(levies["head"])),
        "pages": pages,
        "total_pages": len(pages),
        "page_offset": 0,
    }


def broker_block(broker: dict) -> dict:
    """The broker's details as printed; member codes as one line, however many exchanges."""
    block = dict(broker)  # a copy in C, in the broker's order
    block.pop("tariff", None)
    block["member_codes_text"] = _member_codes_text(tuple(broker["member_codes"].items()))
    return block


@lru_cache(maxsize=16)  # the same broker's, note after note
def _member_codes_text(codes: tuple[tuple[str, str], ...]) -> str:
    return ", ".join(f"{ex} {code}" for ex, code in codes)


def page_range(note: dict, start: int, stop: int) -> dict:
    """The same note cut to pages [start, stop): header on the first, levies on the last."""
    return {**note, "pages": note["pages"][start:stop], "page_offset": start}


@lru_cache(maxsize=256)  # twice a note, over a few hundred widths
def fitting_size(chars: int) -> float:
    """The monospaced font size at which a line of `chars` characters fits the page."""
    return round(min(MONO_SIZE_PT, TEXT_WIDTH_PT / (MONO_ADVANCE * max(1, chars))), 2)


def levies_table(charges: Charges) -> dict:
    """A column per exchange and segment, each with its obligation and net, then the grand total.
    The total's values are the segments' summed line by line from a Decimal zero, as Charges.total's
    fields are: its taxable value and net, sums of sums, are the same (each amount is a few paise
    under 28 digits, so no sum rounds). A note of one segment prints its segment's column as its
    total: the same amounts to the paisa, without printing them again."""
    segments = charges.segments
    labels, values_of, charged = _LEVY_TABLE[_commodities(charges)]
    values = [values_of(levies) for levies in segments.values()]
    if len(values) > 1:
        values.append(tuple(map(sum, zip(*values), repeat(_NOUGHT))))
    columns = [column(v, charged) for v in values]
    if len(columns) == 1:
        columns.append(columns[0])
    names = [*segments, "Total (Net)"]
    width = max(LEVY_VALUE_WIDTH, 2 + max(map(len, chain.from_iterable(columns))), 2 + max(map(len, names)))
    template = f"%-{LEVY_LABEL_WIDTH}s" + f"%{width}s" * len(names)  # ljust the label, rjust each cell
    head = template % ("Particulars", *names)
    rows = [template % cells for cells in zip(labels, *columns)]  # (label, a cell a column)
    return {"head": head, "lines": rows[:-1], "net": rows[-1]}


_NOUGHT = Decimal(0)


def _levy_lines(commodities: bool) -> tuple[list[str], attrgetter, tuple[bool, ...]]:
    """The levies table's labels, its values of a Levies in one call, and which are charges."""
    lines = [line for line in LEVY_LINES if commodities or line[0] != CTT_LINE]
    return [label for label, _, _ in lines], attrgetter(*(f for _, f, _ in lines)), tuple(c for _, _, c in lines)


_LEVY_TABLE = {False: _levy_lines(False), True: _levy_lines(True)}


def _commodities(charges: Charges) -> bool:
    """Whether the note has commodity trades, and so the levies table its CTT line."""
    return not _COMMODITY_SEGMENTS.isdisjoint(charges.segments)


_COMMODITY_SEGMENTS = frozenset(s for s in SEGMENTS if s.endswith("-COM"))  # MCX-COM, NCDEX-COM


def column_widths(rows: list[list[str]]) -> list[int]:
    widths = _LEAST_WIDTHS
    if not rows:
        return list(widths)
    return [max(w, max(map(len, column))) for w, column in zip(widths, zip(*rows))]


_LEAST_WIDTHS = tuple(max(w, len(h1), len(h2)) for h1, h2, w, _ in TRADE_COLUMNS)


def padded(rows: list[tuple[str, tuple[str, ...]]]) -> tuple[list[int], list[tuple[str, str]]]:
    """The trade table's columns' widths, and its lines as (label, text): each column as wide as
    its widest cell (never narrower than its least), each row padded to them, its trailing
    spaces stripped. padded.c's twin, which does a note's rows (ASCII) in one pass over its cells."""
    widths = column_widths([cells for _, cells in rows])
    layout = _layout(tuple(widths))
    return widths, [(label, (layout % cells).rstrip()) for label, cells in rows]


def _compiled_padded():
    module = native.extension(Path(__file__).with_name("padded.c"), "a note's lines are padded in Python")
    if module is None:
        return padded
    lines, right = module.lines, tuple(right for _, _, _, right in TRADE_COLUMNS)

    def compiled(rows: list[tuple[str, tuple[str, ...]]]) -> tuple[list[int], list[tuple[str, str]]]:
        return lines(rows, _LEAST_WIDTHS, right, GAP) or padded(rows)  # None: a row not the C's to pad
    return compiled


_padded = _compiled_padded()


def table_heads(widths: list[int] | None = None) -> list[str]:
    return list(_heads(tuple(widths or column_widths([]))))


@lru_cache(maxsize=64)  # most notes' columns are the least widths
def _heads(widths: tuple[int, ...]) -> tuple[str, str]:
    layout = _layout(widths)
    return tuple((layout % tuple(c[i] for c in TRADE_COLUMNS)).rstrip() for i in (0, 1))


@lru_cache(maxsize=256)  # a few hundred sets of widths among a day's notes
def _layout(widths: tuple[int, ...]) -> str:
    """One %-template per note (a tuple of cells % it): padding a row is then a single C-level call,
    ~40% fewer instructions than str.format's, which parses its fields' specs again every row."""
    return GAP.join(f"%{'' if right else '-'}{w}s" for w, (_, _, _, right) in zip(widths, TRADE_COLUMNS))


def paginate(lines: list[tuple[str, str]], header_rows: int = 0, levy_rows: int = 0) -> list[dict]:
    """`lines`: (section label, text). Fixed rows per page, less what headings past the page's allowance take; the levies block
    goes on the last page if it fits, else a new one. `header_rows`: the first page's header
    past its usual height; `levy_rows`: the levies block's lines past the usual (the CTT line)."""
    first = ROWS_FIRST_PAGE - header_rows
    pages, start, capacity = [], 0, first
    while start < len(lines) or not pages:
        take = _fitting(lines, start, capacity)
        pages.append({"groups": _groups(lines[start:start + take]), "rows": take})
        start += take
        capacity = ROWS_PER_PAGE
    groups = len(pages[-1]["groups"])
    used = pages[-1]["rows"] + groups + _heading_rows(groups)
    room = (first if len(pages) == 1 else ROWS_PER_PAGE) - used
    if room < ROWS_FOR_LEVIES + levy_rows:
        pages.append({"groups": [], "rows": 0})
    return pages


def _fitting(lines: list[tuple[str, str]], start: int, capacity: int) -> int:
    """How many lines from `start` fit in `capacity` rows with their section headings (at least one)."""
    headings, label, take, room = 0, None, 0, capacity
    for i in range(start, min(len(lines), start + capacity)):
        if lines[i][0] != label:
            headings, label = headings + 1, lines[i][0]
            room = capacity - _heading_rows(headings)  # the rows left for lines once the headings are in
        if take + 1 > room:
            break
        take += 1
    return max(1, take) if start < len(lines) else 0


def _heading_rows(headings: int) -> int:
    return max(0, headings - HEADINGS_FREE) * HEADING_ROWS


def _trade_rows(trades: list[Trade], charges: Charges) -> tuple[list[tuple[str, tuple[str, ...]]], set[tuple[str, str]]]:
    """(group label, cells) per row: trades by segment and settlement, each futures segment's
    C/F lines after its trades, then its exercises, assignments and deliveries, a kind at a time;
    and the sections met, (segment, settlement), which the note's settlements list."""
    totals, carried_totals = net_totals(trades, charges)
    shares = charges.brokerage_share
    rows, sections = [], set()
    key = attrgetter("exchange_segment", "settlement_no")  # segment_of(t), settlement
    for section, group in groupby(trades, key=key):
        sections.add(section)
        segment, settlement = section
        label = _section_label(segment, settlement)
        group = list(group)
        traded = [t for t in group if t.settlement == TRADE]
        rows += [(label, _cells(t, per_unit(shares[t.key], t), totals[t.key])) for t in traded]
        rows += [(label, _carried_cells(c, carried_totals[i])) for i, c in enumerate(charges.carried)
                 if segment_of(c.trade) == segment and c.trade.settlement_no == settlement]
        if len(traded) < len(group):  # exercises, then assignments, then deliveries, each in the trades' order
            settled = sorted((t for t in group if t.settlement != TRADE), key=lambda t: _KIND_ORDER[t.settlement])
            rows += [(label, _settled_cells(t, charges.brokerage_per_unit(t), totals[t.key])) for t in settled]
    return rows, sections


_KIND_ORDER = {kind: i for i, kind in enumerate(SETTLEMENT_REMARKS)}


@lru_cache(maxsize=256)  # a note's few sections, the same in most notes
def _section_label(segment: str, settlement: str) -> str:
    return f"{_segment_title(segment)}  ·  Settlement {settlement}"


def _segment_title(segment: str) -> str:
    """NSE / CM, MCX / COM (commodity derivatives): the exchange and segment a section holds."""
    name = SEGMENT_NAMES.get(segment.partition("-")[2])
    return segment.replace("-", " / ") + (f" ({name})" if name else "")


def _groups(lines: list[tuple[str, str]]) -> list[dict]:
    """Consecutive rows of one label become one block of text."""
    return [{"label": label, "lines": list(map(_TEXT, rows))} for label, rows in groupby(lines, key=_LABEL)]


_LABEL, _TEXT = itemgetter(0), itemgetter(1)


def _cells(t: Trade, brokerage_unit: Decimal, net_total: Decimal) -> tuple[str, ...]:
    order_no, order_time, trade_no, trade_time, side, quantity, price, product, status, close = _CELL_FIELDS(t)
    remarks = product + (" (modified)" if status == "12" else "")
    closing = money(close, 4) if close is not None else ""
    gross = money(price, 4)
    if brokerage_unit:
        net = money(price + brokerage_unit if side == "B" else price - brokerage_unit, 4)
    else:  # no brokerage (deliveries at 0% on the default tariff): the Net Rate is the Gross Rate
        net = gross
    return (
        order_no, order_time, trade_no, trade_time, _describe(t), side,
        str(quantity), gross, money(brokerage_unit, 4), net,
        closing, money(net_total), remarks,
    )


_CELL_FIELDS = attrgetter("order_no", "order_time", "trade_no", "trade_time", "side", "quantity", "price", "product",
                          "status", "close")  # one call for the ten


def _settled_cells(t: Trade, brokerage_unit: Decimal, net_total: Decimal) -> tuple[str, ...]:
    """An exercise, assignment or delivery: the Gross Rate column holds the settlement price, and
    the Net Rate the value a unit it settles at (an option's intrinsic value; a delivery's price:
    a future's settlement price, an option's strike) less or plus the brokerage a unit, so that
    Net Rate x quantity x multiplier is the Net Total, as on a trade's row."""
    if t.settlement == DELIVERY:
        rate = Decimal(t.strike) if t.instrument.startswith("OPT") else t.price
    else:
        rate = intrinsic(t)
    net_rate = rate + brokerage_unit if t.flow == "B" else rate - brokerage_unit
    return (t.order_no, t.order_time, t.trade_no, t.trade_time, _describe(t), t.side, str(t.quantity),
            money(t.price, 4), money(brokerage_unit, 4), money(net_rate, 4), "", money(net_total),
            SETTLEMENT_REMARKS[t.settlement])


def _carried_cells(c: CarryForward, net_total: Decimal) -> tuple[str, ...]:
    rate = money(c.price, 4)
    return ("", "", "", "", _describe(c.trade), c.side, str(c.quantity), rate, money(Decimal(0), 4), rate,
            rate, money(net_total), "C/F")


def _describe(t: Trade) -> str:
    """The contract, with its lot multiplier where a lot is not one unit (x1000 on currency,
    x100 on gold), and a cross-currency pair's reference rate (INR/USD 84.1234: rupees a dollar):
    the reader needs them to get from the rate to the Net Total."""
    if t.instrument == "EQ":
        return f"{t.symbol} EQ {t.isin}".strip()
    if t.fx is None:  # a contract's trades share its text (a Decimal's digits are not in its hash: fx is apart)
        return _contract_text(_CONTRACT(t))
    return f"{_contract_text(_CONTRACT(t))} INR/{CROSS_PAIRS[t.symbol]} {t.fx:f}"


_CONTRACT = attrgetter("instrument", "symbol", "expiry", "strike", "option_type", "multiplier")


@lru_cache(maxsize=4096)  # a day's derivatives contracts, by far fewer than their trades
def _contract_text(contract: tuple[str, str, str, str, str, int]) -> str:
    instrument, symbol, expiry, strike, option_type, multiplier = contract
    parts = [instrument, symbol, _dmy(expiry) if expiry else "", strike, option_type,
             f"x{multiplier}" if multiplier != 1 else ""]
    return " ".join(filter(None, parts))


def _settlements(sections: set[tuple[str, str]], settles: dict[str, str]) -> list[dict]:
    """CM settles T+1; derivatives settle daily (T+1 pay-in/pay-out): the next trading day of the
    exchange. An exchange whose holiday list the run lacks (MCX, NCDEX unless the broker gives
    one) says so rather than print a date that may be wrong. `sections`: (segment, settlement),
    in order of exchange, segment and settlement (an exchange's name, before the segment's "-")."""
    seen = sorted((segment.partition("-")[0], segment, n) for segment, n in sections)
    return [{"segment": s, "number": n, "date": _dmy(settles[ex]) if ex in settles else NO_CALENDAR}
            for ex, s, n in seen]


@lru_cache(maxsize=256)  # a note's expiries and dates are few, its contracts' lines many
def _dmy(iso: str) -> str:
    return dt.date.fromisoformat(iso).strftime("%d-%m-%Y")
