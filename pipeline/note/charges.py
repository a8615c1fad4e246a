"""Brokerage and statutory levies for one client's day: pure functions over Decimal.

Rounding rules, all here and nowhere else (one rule: half up):
  - STT and CTT are rounded to the nearest rupee, per segment (exchange + segment);
  - every other levy, the brokerage and every printed amount is rounded to the paisa;
  - levies are computed on a segment's turnover per product category, then rounded once,
    so a total never depends on the order trades arrive in;
  - brokerage is per executed order, an order being (exchange, segment, order_no); its trades
    share it pro rata by quantity, in whole paise (largest remainder), so the shares add up
    to the order's brokerage exactly;
  - a row's Net Total is its gross value less its share; the segment's residue from rounding
    to the paisa is spread over its rows, so the column sums to obligation - brokerage exactly.

Futures are marked to market: the day's open position in each contract is carried forward
(C/F) at the exchange's daily settlement price, as brokers' notes show it (a C/F line per
contract; see e.g. Upstox's "What is a contract note": "C/F - Carry forward ... used to
calculate the marked-to-market value of the future ... based on that day's closing price",
https://upstox.freshdesk.com/support/solutions/articles/248951-what-is-a-contract-note-).
So a futures segment's obligation is the day's MTM, not the notional value. Levies stay on
the traded turnover; the C/F line is not a trade. Options stay at premium.

Every segment's levies come from one table per levy in the schedule, keyed by the trade's
category (delivery, intraday, futures, options, currency_futures, currency_options,
commodity_futures, commodity_options): a segment is a row in each table, not a branch here.
Transaction charges may differ within an exchange's category: MCX's and NCDEX's commodity
groups, named contracts, BSE's SENSEX and BANKEX options. The schedule's txn_groups name them
(by symbol or instrument), each with its own rate; everything else pays the exchange's rate.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field, fields
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal
from functools import lru_cache
from operator import attrgetter
from heapq import nlargest
from itertools import repeat
from pathlib import Path

from pipeline.day.dumps import ASSIGNMENT, DELIVERY, DERIVATIVES, EXERCISE, TRADE, Trade, contract_id

RUPEE = Decimal("1")
PAISA = Decimal("0.01")
_UNIT_STEP = Decimal("0.0001")  # a rate's, per unit
RATES_FILE = Path(__file__).parent / "data" / "rates.json"
LEVY_FIELDS = ("brokerage", "stt", "txn", "sebi", "stamp", "ipft", "cgst", "sgst", "igst", "ctt")
# The derivatives segments' categories are named apart: each has its own rates in every table
KINDS = {"FO": "", "CDS": "currency_", "COM": "commodity_"}
# An exercise or assignment is taxed on its intrinsic value, a delivery on the delivery's value, at
# rates of their own (docs/input.md): each is a category of its own in every table, so a schedule
# that lacks one stops the note rather than charge it as a trade
SETTLED = {EXERCISE: "options_exercise", ASSIGNMENT: "options_assignment"}
EQUITY_DELIVERY = "physical_delivery"  # stock futures and options settled by delivery (FO)
# A settlement row's brokerage: the tariff's own entry, else none (an exercise, assignment or
# delivery is no order the client placed); docs/input.md says why
SETTLEMENT_TARIFF = "settlement"
NO_BROKERAGE = {"flat": "0"}


def rupees(x: Decimal) -> Decimal:
    return x.quantize(RUPEE, ROUND_HALF_UP)  # by position: half the cost of rounding=


def paise(x: Decimal) -> Decimal:
    return x.quantize(PAISA, ROUND_HALF_UP)


@dataclass(frozen=True)
class Levies:
    buys: Decimal = Decimal(0)  # traded turnover, exact
    sells: Decimal = Decimal(0)
    carry: Decimal = Decimal(0)  # C/F value of the futures positions at the settlement price
    obligation: Decimal = Decimal(0)  # pay-in (negative) or pay-out (positive) before charges, to the paisa
    brokerage: Decimal = Decimal(0)
    stt: Decimal = Decimal(0)
    txn: Decimal = Decimal(0)
    sebi: Decimal = Decimal(0)
    stamp: Decimal = Decimal(0)
    ipft: Decimal = Decimal(0)
    cgst: Decimal = Decimal(0)
    sgst: Decimal = Decimal(0)
    igst: Decimal = Decimal(0)
    ctt: Decimal = Decimal(0)  # commodities transaction tax (non-agricultural commodity derivatives)

    @property
    def taxable_value(self) -> Decimal:
        return self.brokerage + self.txn + self.sebi

    @property
    def net(self) -> Decimal:
        """Receivable by the client if positive, payable if negative."""
        return self.obligation - sum(_levy_values(self), _NOUGHT)  # from a Decimal: an int 0 is converted

    def __add__(self, other: "Levies") -> "Levies":
        return Levies(**{f: getattr(self, f) + getattr(other, f) for f in _LEVIES_FIELDS})


_LEVIES_FIELDS = tuple(f.name for f in fields(Levies))
_all_values, _levy_values = attrgetter(*_LEVIES_FIELDS), attrgetter(*LEVY_FIELDS)  # a tuple of them, in one call


def _levies(**values: Decimal) -> Levies:
    """Levies(**values), every field given, without the frozen dataclass's setattr a field (a
    fifth of a typical note's charges went to making its segments' Levies and their total)."""
    levies = object.__new__(Levies)
    levies.__dict__.update(values)
    return levies


@dataclass(frozen=True)
class CarryForward:
    """A futures position carried forward: a notional trade closing it at the settlement price."""
    trade: Trade  # one of the contract's trades: segment, description
    side: str  # S closes a long position, B a short one
    quantity: int
    price: Decimal

    @property
    def value(self) -> Decimal:
        """Rupees, signed: a cross-currency position at the trade's reference rate."""
        value = self.price * self.quantity * self.trade.multiplier * (1 if self.side == "S" else -1)
        return value if self.trade.fx is None else value * self.trade.fx


@dataclass(frozen=True)
class Charges:
    segments: dict[str, Levies]
    brokerage_share: dict[tuple, Decimal] = field(default_factory=dict)  # by Trade.key, whole paise
    carried: list[CarryForward] = field(default_factory=list)

    @property
    def total(self) -> Levies:
        """The segments' sum, field by field from Decimal(0) as Levies() + each would add them, made once."""
        rows = [_all_values(s) for s in self.segments.values()]
        if not rows:
            return Levies()
        return _levies(**dict(zip(_LEVIES_FIELDS, map(sum, zip(*rows), repeat(_NOUGHT)))))  # sum(column, Decimal(0))

    def brokerage_per_unit(self, t: Trade) -> Decimal:
        """For display: the trade's share of its order's brokerage per quoted unit (a lot holds
        `multiplier` of them), to 4 places, so the Net Rate sits beside the Gross Rate it adjusts:
        in the currency the rate is quoted in (a cross-currency pair's at its reference rate)."""
        return per_unit(self.brokerage_share[t.key], t)


def per_unit(share: Decimal, t: Trade) -> Decimal:
    """Charges.brokerage_per_unit of a trade whose share is `share` (a note's rows call it a trade)."""
    if not share:  # a delivery's at 0%: what nought over the units rounds to, without the division
        return _NO_FEE_A_UNIT
    units = t.quantity * t.multiplier if t.fx is None else t.quantity * t.multiplier * t.fx
    return (share / units).quantize(_UNIT_STEP, ROUND_HALF_UP)


_NO_FEE_A_UNIT = Decimal(0).quantize(_UNIT_STEP)  # 0.0000


def category(trade: Trade) -> str:
    return _traded_category(trade) if trade.settlement == TRADE else settled_category(trade)


def _traded_category(trade: Trade) -> str:
    """A trade's category (not a settlement row's: the callers that loop over trades have asked)."""
    if trade.segment == "CM":
        return "delivery" if trade.product == "CNC" else "intraday"
    return KINDS[trade.segment] + ("futures" if trade.instrument.startswith("FUT") else "options")


def settled_category(trade: Trade) -> str:
    """options_exercise, currency_options_assignment ...; physical_delivery (stock F&O),
    commodity_delivery (a commodity future), commodity_options_delivery (an option on one)."""
    if trade.settlement != DELIVERY:
        return KINDS[trade.segment] + SETTLED[trade.settlement]
    if trade.segment == "FO":
        return EQUITY_DELIVERY
    return "commodity_" + ("options_delivery" if trade.instrument.startswith("OPT") else "delivery")


def party(trade: Trade) -> str:
    """Which side a tax charged on "buy" falls on: a trade's buyer; for a settlement row, the
    option's holder (its purchaser, who exercised: EX rows are the holder's, B) and, on a
    delivery, a future's side taking delivery. A delivered call's holder takes delivery (B), a
    delivered put's holder gives it (S)."""
    if trade.settlement != DELIVERY or not trade.instrument.startswith("OPT"):
        return trade.side
    return "B" if (trade.option_type == "CE") == (trade.side == "B") else "S"


def segment_of(trade: Trade) -> str:
    return trade.exchange_segment  # f"{trade.exchange}-{trade.segment}", made with the trade


@lru_cache(maxsize=4)
def _schedules(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    schedules = sorted(data["schedules"], key=lambda s: s["effective_from"])
    for schedule in schedules:
        _check_groups(schedule)
    return schedules


def _check_groups(schedule: dict) -> None:
    """A contract in two groups of one exchange with a rate for the same category would be
    charged by whichever comes first: refused when the schedule is read, naming both."""
    for exchange, groups in (schedule.get("txn_groups") or {}).items():
        seen: dict[tuple[str, str], str] = {}
        for name, group in groups.items():
            members = [*group.get("symbols", ()), *group.get("instruments", ())]
            for cat in (k for k in group if k not in ("symbols", "instruments")):
                Decimal(group[cat])  # a rate, or InvalidOperation naming the text
                for member in members:
                    if (member, cat) in seen:
                        raise ValueError(f"the levy schedule from {schedule['effective_from']}: {exchange} {member} "
                                         f"is in the transaction groups {seen[(member, cat)]!r} and {name!r} for {cat}")
                    seen[(member, cat)] = name


@lru_cache(maxsize=64)  # each note of a day asks for the day's
def rates_for(trade_date: str, path: Path | None = None) -> dict:
    """The schedule in force on trade_date, so a rerun of an old day uses that day's rates.
    `path`: another schedule file (tests of a change of rate that is not yet law). Kept as the
    schedules are (_schedules): a file is read once."""
    schedules = _schedules(path or RATES_FILE)
    applicable = [s for s in schedules if s["effective_from"] <= trade_date]
    if not applicable:
        raise ValueError(f"no levy rates in force on {trade_date} (earliest {schedules[0]['effective_from']})")
    return applicable[-1]


def compute(trades: list[Trade], trade_date: str, intra_state: bool, tariff: dict,
            rates_file: Path | None = None) -> Charges:
    rates = rates_for(trade_date, rates_file)
    by_segment: dict[str, list[Trade]] = defaultdict(list)
    orders: dict[tuple, list[Trade]] = defaultdict(list)
    for t in trades:
        by_segment[t.exchange_segment].append(t)  # segment_of(t)
        orders[t.order_key].append(t)
    carried = carry_forward(trades)
    shares: dict[tuple, Decimal] = {}
    brokerage: dict[str, Decimal] = defaultdict(Decimal)  # a segment's orders' fees: an order is in one segment
    rules: dict[str, tuple] = {}  # the tariff's rule by category, read once a note (most of its orders share a few)
    for order in orders.values():  # one pass: each order's fee, its segment's sum, the trades' shares
        fee = _order_brokerage(order, tariff, rules)
        brokerage[order[0].exchange_segment] += fee
        if len(order) == 1:  # most orders: one trade, the whole fee
            shares[order[0].key] = fee
        else:
            shares.update(split_pro_rata(fee, order))
    memo = _worked_out(rates)
    segments = {
        seg: _segment_levies(ts, [c for c in carried if segment_of(c.trade) == seg] if carried else carried,
                             brokerage[seg], rates, intra_state, memo)
        for seg, ts in sorted(by_segment.items())
    }
    return Charges(segments=segments, brokerage_share=shares, carried=carried)


def carry_forward(trades: list[Trade]) -> list[CarryForward]:
    """Each futures contract's open position at the end of the day, closed at its settlement price."""
    net: dict[tuple, int] = defaultdict(int)
    first: dict[tuple, Trade] = {}
    for t in trades:  # a future going to delivery is its DL row's, not a position carried
        if t.segment in DERIVATIVES and t.instrument.startswith("FUT") and t.settlement == TRADE:
            contract = contract_id(t)
            net[contract] += t.quantity if t.side == "B" else -t.quantity
            first.setdefault(contract, t)
    out = []
    for contract, qty in net.items():
        if qty:
            t = first[contract]
            if t.close is None:
                raise ValueError(f"no settlement price for {t.instrument} {t.symbol} {t.expiry}")
            out.append(CarryForward(t, "S" if qty > 0 else "B", abs(qty), t.close))
    return out


def net_totals(trades: list[Trade], charges: Charges) -> tuple[dict[tuple, Decimal], dict[int, Decimal]]:
    """Each row's Net Total before levies, to the paisa: trades by Trade.key, C/F lines by their
    index in charges.carried. A row is its signed gross value less its share of the order's
    brokerage; a segment's rounding residue goes, a paisa at a time, to the rows that rounding
    moved furthest, so every segment's column sums to obligation - brokerage exactly."""
    by_segment: dict[str, list[tuple[tuple, Decimal]]] = defaultdict(list)  # segment -> (row key, exact)
    shares = charges.brokerage_share
    for t in trades:
        key = t.key
        by_segment[t.exchange_segment].append((key, (t.turnover if t.flow == "S" else -t.turnover) - shares[key]))
    for i, c in enumerate(charges.carried):
        by_segment[segment_of(c.trade)].append((("C/F", i), c.value))
    rounded: dict[tuple, Decimal] = {}
    for segment, rows in by_segment.items():
        values = {k: exact.quantize(PAISA, ROUND_HALF_UP) for k, exact in rows}  # paise(), a call a row the less
        levies = charges.segments[segment]
        residue = levies.obligation - levies.brokerage - sum(values.values(), _NOUGHT)
        if residue:
            step = PAISA if residue > 0 else -PAISA
            # the rows a sort by that, largest first and stable, would put first (a few hundred of 60,000)
            for k, _ in nlargest(int(abs(residue) / PAISA), rows, key=lambda r: (r[1] - values[r[0]]) * step):
                values[k] += step
        rounded.update(values)
    carried = {i: rounded.pop(("C/F", i)) for i in range(len(charges.carried))}  # the trades' are left
    return rounded, carried


def _segment_levies(trades: list[Trade], carried: list[CarryForward], brokerage: Decimal, rates: dict,
                    intra_state: bool, memo: dict | None = None) -> Levies:
    """`brokerage`: the fees of the segment's orders (compute sums them as it makes them); `memo`:
    what was worked out from `rates` before (_worked_out), so a kind's rates are read once a run."""
    memo = _worked_out(rates) if memo is None else memo
    buys, sells, kinds = _turnover_by_kind(trades, rates, memo)
    carry = sum((c.value for c in carried), _NOUGHT)
    stt = ctt = txn = sebi = stamp = ipft = _NOUGHT
    for kind, value, at_price, payer in kinds:  # a tax a kind does not pay adds nothing (its rate None)
        stt_rate, stt_at_price, ctt_rate, ctt_at_price, stamp_rate, txn_rate, sebi_rate, ipft_rate = (
            memo.get((kind, payer)) or _kind_rates(memo, rates, kind, payer))
        if stt_rate is not None:
            stt += (at_price if stt_at_price else value) * stt_rate
        if ctt_rate is not None:
            ctt += (at_price if ctt_at_price else value) * ctt_rate
        if stamp_rate is not None:
            stamp += value * stamp_rate
        txn += value * txn_rate
        sebi += value * sebi_rate
        if ipft_rate is not None:
            ipft += value * ipft_rate
    txn, sebi = paise(txn), paise(sebi)
    gst_base = brokerage + txn + sebi
    gst_rate = _decimal(rates["gst"])
    if intra_state:
        cgst = sgst = paise(gst_base * gst_rate / 2)
        igst = _NOUGHT
    else:
        cgst = sgst = _NOUGHT
        igst = paise(gst_base * gst_rate)
    return _levies(buys=buys, sells=sells, carry=carry, obligation=paise(sells - buys + carry), brokerage=brokerage,
                  stt=rupees(stt), txn=txn, sebi=sebi, stamp=paise(stamp), ipft=paise(ipft),
                  cgst=cgst, sgst=sgst, igst=igst, ctt=rupees(ctt))


def _kind_rates(memo: dict, rates: dict, kind: tuple, payer: str) -> tuple:
    """A kind of turnover's rates, each a Decimal, or None where the levy is not charged on it:
    (STT, on the settlement price, CTT, on the settlement price, stamp duty, transaction charge,
    SEBI's fee, IPFT). Read from the schedule the first time a kind is met, then from `memo`; a
    rate the schedule lacks stops the note when its kind is first met, as it always did."""
    cat, exchange, group, agri, side = kind
    stt = _tax_rule(rates, "stt", cat, payer)
    ctt = (None, False) if agri else _tax_rule(rates, "ctt", cat, payer)
    stamp = _rate(rates, "stamp", cat) if side == "B" else None
    txn = (_decimal(rates["txn_groups"][exchange][group][cat]) if group else
           _rate(rates["txn"], exchange, cat, rates["effective_from"]))
    sebi = _decimal(rates["sebi_agri"] if agri else rates["sebi"])
    ipft = _rate(rates["ipft"], exchange, cat, rates["effective_from"]) if exchange in rates["ipft"] else None
    memo[(kind, payer)] = found = (*stt, *ctt, stamp, txn, sebi, ipft)
    return found


def _worked_out(rates: dict) -> dict:
    """What compute works out from a schedule (a kind's rates, a trade's kind), kept for the run
    beside it: by the schedule's id, the schedule itself held so that no other object takes the id.
    A schedule is read once (_schedules) and never changed, so what was worked out stays true."""
    held = _WORKED_OUT.get(id(rates))
    if held is None or held[0] is not rates:
        if len(_WORKED_OUT) >= 16:
            _WORKED_OUT.clear()
        held = _WORKED_OUT[id(rates)] = (rates, {})
    return held[1]


_WORKED_OUT: dict[int, tuple[dict, dict]] = {}


def _turnover_by_kind(trades: list[Trade], rates: dict,
                      memo: dict) -> tuple[Decimal, Decimal, list[tuple[tuple, Decimal, Decimal, str]]]:
    """The segment's bought and sold turnover (what the client pays, and is paid), and its
    turnover summed by what decides its rates (category, exchange, transaction-charge group,
    agricultural, side): each rate is then applied once to an exact sum, and a levy is the same
    whatever the trades' order. Each sum with its base at the settlement price and the side its
    taxes fall on (party): a trade's are its turnover and side; a settlement row's the units at
    its settlement price (an exercise's whole underlying value, where a tax's rule says so) and
    party(), summed apart so that the trades' loop is what it was before settlement rows came."""
    buys = sells = _NOUGHT
    sums: dict[tuple, Decimal] = defaultdict(Decimal)
    settled: dict[tuple, list[Decimal]] = {}
    groups = rates.get("txn_groups") or {}
    for t in trades:
        if t.flow == "B":
            buys += t.turnover
        else:
            sells += t.turnover
        if t.settlement != TRADE:
            cat = settled_category(t)
            group = _txn_group(groups, t, cat) if t.exchange in groups else ""
            both = settled.setdefault((cat, t.exchange, group, t.agri == "Y", t.side, party(t)), [Decimal(0)] * 2)
            both[0] += t.turnover
            both[1] += _at_price(t)
            continue
        where = (t.segment, t.product, t.instrument, t.exchange, t.agri, t.side)
        kind = memo.get(where) or _traded_kind(memo, groups, t, where)
        if kind is _BY_SYMBOL:  # a category some of the exchange's transaction groups name
            kind = memo.get((*where, t.symbol)) or _traded_kind(memo, groups, t, (*where, t.symbol))
        sums[kind] += t.turnover
    kinds = [(key, value, value, key[4]) for key, value in sums.items()]
    return buys, sells, kinds + [(key[:5], value, at_price, key[5]) for key, (value, at_price) in settled.items()]


def _traded_kind(memo: dict, groups: dict, t: Trade, where: tuple) -> tuple:
    """A trade's kind (category, exchange, transaction group, agricultural, side) from the fields
    that decide it (`where`), worked out the first time they are met. Its symbol decides it too
    where a transaction group of its exchange names its category: `where` without the symbol is
    then kept as _BY_SYMBOL, and each symbol's kind under `where` and the symbol."""
    cat = _traded_category(t)
    grouped = any(cat in group for group in groups.get(t.exchange, {}).values())
    if grouped and len(where) == _WHERE:
        memo[where] = _BY_SYMBOL
        where = (*where, t.symbol)
    group = _txn_group(groups, t, cat) if grouped else ""
    memo[where] = kind = (cat, t.exchange, group, t.agri == "Y", t.side)
    return kind


_WHERE = 6  # (segment, product, instrument, exchange, agri, side)
_BY_SYMBOL = ("by symbol",)


def _at_price(t: Trade) -> Decimal:
    """A settlement row's units at its settlement price, in rupees."""
    value = t.price * t.quantity * t.multiplier
    return value if t.fx is None else value * t.fx


def _txn_group(groups: dict, t: Trade, cat: str) -> str:
    """The exchange's named group (a commodity group, named contracts) this trade is in and that
    has a transaction rate for its category, or "": the exchange's own rate then applies."""
    for name, group in groups[t.exchange].items():
        if cat in group and (t.symbol in group.get("symbols", ()) or t.instrument in group.get("instruments", ())):
            return name
    return ""


def _tax_rule(rates: dict, tax: str, cat: str, side: str) -> tuple[Decimal | None, bool]:
    """STT's or CTT's rate on this side of a trade of `cat`, and whether its base is the units at
    the settlement price; None: not charged (currency derivatives pay neither; equity no CTT,
    commodities no STT). `side`: party(); a rule is [rate, sides] or [rate, sides,
    "settlement_price"]: sides both, sell, or buy (an exercised option's tax, on its purchaser);
    the third, the base is the units at the settlement price (CTT on an exercised commodity
    option: the Finance Act 2013's "settlement price", s. 118), not the row's value (STT's: the
    intrinsic value, since the Finance (No. 2) Act 2019)."""
    rule = rates.get(tax, {}).get(cat)
    if rule is None:
        return None, False
    sides = rule[1]
    if not (sides == "both" or (sides == "sell" and side == "S") or (sides == "buy" and side == "B")):
        return None, False
    return _decimal(rule[0]), rule[2:] == ["settlement_price"]


def _rate(table: dict, levy: str, cat: str, effective_from: str = "") -> Decimal:
    """A levy's rate for a category: one the schedule lacks is an error naming the levy, never a
    zero, since a missing row would drop a charge from every note of the segment."""
    try:
        return _decimal(table[levy][cat])
    except KeyError:
        since = effective_from or table.get("effective_from", "?")
        raise ValueError(f"the levy schedule from {since} has no {levy} rate for {cat}") from None


def _order_brokerage(order: list[Trade], tariff: dict, rules: dict | None = None) -> Decimal:
    """The tariff's rule for the order's category; a currency or commodity category the tariff
    does not name takes its futures or options rule. `rules`: the rules read for this note so far."""
    if order[0].settlement != TRADE:  # never a trading category's rule (physical_delivery is no delivery trade)
        cat = SETTLEMENT_TARIFF
    else:
        cat = _traded_category(order[0])
    rule = rules.get(cat) if rules is not None else None
    if rule is None:
        rule = _tariff_rule(tariff, cat)
        if rules is not None:
            rules[cat] = rule
    flat, percent, cap = rule
    if flat is not None:
        return flat
    turnover = order[0].turnover if len(order) == 1 else sum((t.turnover for t in order), _NOUGHT)
    fee = turnover * percent
    return (cap if _NOUGHT < cap < fee else fee).quantize(PAISA, ROUND_HALF_UP)  # paise(min(fee, cap) if capped)


def _tariff_rule(tariff: dict, cat: str) -> tuple[Decimal | None, Decimal | None, Decimal | None]:
    """(a flat fee in paise, or None; the percent and the cap, or None): the category's rule."""
    if cat == SETTLEMENT_TARIFF:
        rule = tariff.get(SETTLEMENT_TARIFF) or NO_BROKERAGE
    else:
        rule = tariff.get(cat) or tariff[cat.rpartition("_")[2]]
    if "flat" in rule:
        return _flat_fee(rule["flat"]), None, None
    percent, cap = _decimal(rule["percent"]), _decimal(rule["cap"])
    if not percent:  # a turnover (never negative) at 0% is 0.00 whatever the cap: a flat fee of nothing
        return _flat_fee("0"), None, None
    return None, percent, cap


_decimal = lru_cache(maxsize=256)(Decimal)  # a tariff's few rates, read once an order
_NOUGHT = Decimal(0)  # the zero each sum and levy starts from, made once (Decimal(0) is a call each time)


@lru_cache(maxsize=64)
def _flat_fee(text: str) -> Decimal:
    return paise(Decimal(text))


def split_pro_rata(amount: Decimal, order: list[Trade]) -> dict[tuple, Decimal]:
    """Whole paise by quantity, the paise left over to the largest remainders (then first rows)."""
    if len(order) == 1:
        return {order[0].key: amount}
    qty = sum(t.quantity for t in order)
    exact = [amount * t.quantity / qty for t in order]
    shares = [x.quantize(PAISA, rounding=ROUND_DOWN) for x in exact]
    left = int((amount - sum(shares, Decimal(0))) / PAISA)
    for i in sorted(range(len(order)), key=lambda i: shares[i] - exact[i])[:left]:
        shares[i] += PAISA
    return {t.key: s for t, s in zip(order, shares)}
