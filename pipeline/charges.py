"""Brokerage and statutory levies for one client's day: pure functions over Decimal.

Rounding rules, all here and nowhere else:
  - STT is rounded to the nearest rupee, per segment (exchange + segment), half up;
  - every other levy and the brokerage is rounded to the paisa, half up;
  - levies are computed on a segment's turnover per product category, then rounded once,
    so a total never depends on the order trades arrive in;
  - brokerage is per executed order (an order's trades share it, pro rata by quantity).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field, fields
from decimal import ROUND_HALF_UP, Decimal
from functools import lru_cache
from pathlib import Path

from pipeline.dumps import Trade

RUPEE = Decimal("1")
PAISA = Decimal("0.01")
RATES_FILE = Path(__file__).parent / "data" / "rates.json"
LEVY_FIELDS = ("brokerage", "stt", "txn", "sebi", "stamp", "ipft", "cgst", "sgst", "igst")


def rupees(x: Decimal) -> Decimal:
    return x.quantize(RUPEE, rounding=ROUND_HALF_UP)


def paise(x: Decimal) -> Decimal:
    return x.quantize(PAISA, rounding=ROUND_HALF_UP)


@dataclass(frozen=True)
class Levies:
    buys: Decimal = Decimal(0)
    sells: Decimal = Decimal(0)
    brokerage: Decimal = Decimal(0)
    stt: Decimal = Decimal(0)
    txn: Decimal = Decimal(0)
    sebi: Decimal = Decimal(0)
    stamp: Decimal = Decimal(0)
    ipft: Decimal = Decimal(0)
    cgst: Decimal = Decimal(0)
    sgst: Decimal = Decimal(0)
    igst: Decimal = Decimal(0)

    @property
    def obligation(self) -> Decimal:
        """Pay-in (negative) or pay-out (positive) before any charge."""
        return self.sells - self.buys

    @property
    def taxable_value(self) -> Decimal:
        return self.brokerage + self.txn + self.sebi

    @property
    def net(self) -> Decimal:
        """Receivable by the client if positive, payable if negative."""
        return self.obligation - sum(getattr(self, f) for f in LEVY_FIELDS)

    def __add__(self, other: "Levies") -> "Levies":
        return Levies(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


@dataclass(frozen=True)
class Charges:
    segments: dict[str, Levies]
    brokerage_per_unit: dict[str, Decimal] = field(default_factory=dict)  # by trade_no

    @property
    def total(self) -> Levies:
        return sum(self.segments.values(), Levies())


def category(trade: Trade) -> str:
    if trade.segment == "CM":
        return "delivery" if trade.product == "CNC" else "intraday"
    return "futures" if trade.instrument.startswith("FUT") else "options"


def segment_of(trade: Trade) -> str:
    return f"{trade.exchange}-{trade.segment}"


@lru_cache(maxsize=1)
def _schedules(path: Path = RATES_FILE) -> list[dict]:
    data = json.loads(path.read_text())
    return sorted(data["schedules"], key=lambda s: s["effective_from"])


def rates_for(trade_date: str) -> dict:
    """The schedule in force on trade_date, so a rerun of an old day uses that day's rates."""
    applicable = [s for s in _schedules() if s["effective_from"] <= trade_date]
    if not applicable:
        raise ValueError(f"no levy rates in force on {trade_date} (earliest {_schedules()[0]['effective_from']})")
    return applicable[-1]


def compute(trades: list[Trade], trade_date: str, intra_state: bool, tariff: dict) -> Charges:
    rates = rates_for(trade_date)
    per_unit = _brokerage_per_unit(trades, tariff)
    by_segment: dict[str, list[Trade]] = defaultdict(list)
    for t in trades:
        by_segment[segment_of(t)].append(t)
    segments = {
        seg: _segment_levies(ts, rates, intra_state, tariff)
        for seg, ts in sorted(by_segment.items())
    }
    return Charges(segments=segments, brokerage_per_unit=per_unit)


def _segment_levies(trades: list[Trade], rates: dict, intra_state: bool, tariff: dict) -> Levies:
    buys = sum((t.turnover for t in trades if t.side == "B"), Decimal(0))
    sells = sum((t.turnover for t in trades if t.side == "S"), Decimal(0))
    stt = txn = sebi = stamp = ipft = Decimal(0)
    for t in trades:
        cat, value = category(t), t.turnover
        stt_rate, stt_side = rates["stt"][cat]
        if stt_side == "both" or (stt_side == "sell" and t.side == "S"):
            stt += value * Decimal(stt_rate)
        if t.side == "B":
            stamp += value * Decimal(rates["stamp"][cat])
        txn += value * Decimal(rates["txn"][t.exchange][cat])
        sebi += value * Decimal(rates["sebi"])
        ipft += value * Decimal(rates["ipft"][cat])
    brokerage = sum((_order_brokerage(o, tariff) for o in _orders(trades).values()), Decimal(0))
    txn, sebi = paise(txn), paise(sebi)
    gst_base = brokerage + txn + sebi
    gst_rate = Decimal(rates["gst"])
    if intra_state:
        cgst = sgst = paise(gst_base * gst_rate / 2)
        igst = Decimal(0)
    else:
        cgst = sgst = Decimal(0)
        igst = paise(gst_base * gst_rate)
    return Levies(buys=buys, sells=sells, brokerage=brokerage, stt=rupees(stt), txn=txn, sebi=sebi,
                  stamp=paise(stamp), ipft=paise(ipft), cgst=cgst, sgst=sgst, igst=igst)


def _orders(trades: list[Trade]) -> dict[str, list[Trade]]:
    orders: dict[str, list[Trade]] = defaultdict(list)
    for t in trades:
        orders[t.order_no].append(t)
    return orders


def _order_brokerage(order: list[Trade], tariff: dict) -> Decimal:
    rule = tariff[category(order[0])]
    if "flat" in rule:
        return paise(Decimal(rule["flat"]))
    turnover = sum((t.turnover for t in order), Decimal(0))
    fee = turnover * Decimal(rule["percent"])
    cap = Decimal(rule["cap"])
    return paise(min(fee, cap) if cap > 0 else fee)


def _brokerage_per_unit(trades: list[Trade], tariff: dict) -> dict[str, Decimal]:
    out = {}
    for order in _orders(trades).values():
        qty = sum(t.quantity for t in order)
        unit = (_order_brokerage(order, tariff) / qty).quantize(Decimal("0.0001"), rounding=ROUND_HALF_UP)
        for t in order:
            out[t.trade_no] = unit
    return out
