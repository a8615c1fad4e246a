"""An independent recomputation of a note's figures from the day's input files, for the tests.

It shares no code with pipeline/note/charges.py or pipeline/day: it reads the CSV files
(clients, trades, bhavcopy, RBI's reference rates) and the levy schedule and the broker's
tariff as data, and works out, per account, exchange and segment, what the note must show:
the obligation (trades at their value, open futures at the settlement price), brokerage, each
levy rounded as its rule says, GST and the net. `check_text` then reads a note's text (pdftotext
of the PDF, or the note's own lines) and names every figure that differs.

The rules, written out again here on purpose (docs/input.md says them in words):
- a trade is (exchange, segment, trade_no): a modification (12) or cancellation (13) replaces
  what came before it, a cancelled trade is gone;
- a trade's value in rupees is quantity x multiplier x price, a cross-currency pair's (EURUSD,
  GBPUSD: dollars; USDJPY: yen) at RBI's reference rate for that currency;
- the levies of a segment are its turnover by (category, transaction group, agricultural, side)
  times each rate, summed, then rounded once: STT and CTT to the rupee, the rest to the paisa,
  half up; brokerage per order (exchange, segment, order_no) by the tariff, to the paisa; GST
  18% of brokerage + transaction charges + SEBI fee, halves each rounded for a client in the
  broker's state, whole otherwise;
- a settlement row (settlement_type EX, AS, DL; none or T is a trade) is valued at the
  settlement price its price field gives: an exercise or assignment at the option's intrinsic
  value (a call's settlement price less strike, a put's strike less settlement price) x units,
  paid to the holder (EX) or by the writer (AS); a delivery at a future's settlement price or
  an option's strike x units, paid by the side taking delivery (B). Its levies are its own
  category's (options_exercise, physical_delivery ...); a tax rule on "buy" falls on the
  option's holder (a delivered call's holder takes delivery, a put's gives it), and one marked
  "settlement_price" is on the units at the settlement price. Its brokerage is the tariff's
  "settlement" rule, or none. A future's delivery is no position carried forward.
"""

from __future__ import annotations

import csv
import json
import re
from collections import defaultdict
from decimal import ROUND_HALF_UP, Decimal as D
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RATES = ROOT / "pipeline" / "note" / "data" / "rates.json"
BROKER = ROOT / "templates" / "broker.json"
CROSS = {"EURUSD": "USD", "GBPUSD": "USD", "USDJPY": "JPY"}
KIND = {"FO": "", "CDS": "currency_", "COM": "commodity_"}
UDIFF = {"IDF": "FUTIDX", "STF": "FUTSTK", "IDO": "OPTIDX", "STO": "OPTSTK"}
LINES = [  # the levies table's label -> how the recomputation gives it (signed as printed)
    ("Pay-in/Pay-out obligation", lambda s: s["obligation"]),
    ("Brokerage", lambda s: -s["brokerage"]),
    ("Exchange transaction charges", lambda s: -s["txn"]),
    ("SEBI turnover fees", lambda s: -s["sebi"]),
    ("Taxable value of supply", lambda s: s["brokerage"] + s["txn"] + s["sebi"]),
    ("CGST @ 9%", lambda s: -s["cgst"]),
    ("SGST @ 9%", lambda s: -s["sgst"]),
    ("IGST @ 18%", lambda s: -s["igst"]),
    ("Securities transaction tax", lambda s: -s["stt"]),
    ("Commodities transaction tax", lambda s: -s["ctt"]),
    ("Stamp duty", lambda s: -s["stamp"]),
    ("IPFT charges", lambda s: -s["ipft"]),
    ("Net amount receivable/(payable) by client", lambda s: s["net"]),
]


def half_up(x: D, step: str) -> D:
    return x.quantize(D(step), rounding=ROUND_HALF_UP)


def rows(path: Path) -> list[dict]:
    with path.open(newline="", encoding="utf-8-sig") as f:
        return [{k: (v or "").strip() for k, v in r.items()} for r in csv.DictReader(f)]


def schedule(date: str) -> dict:
    in_force = [s for s in json.loads(RATES.read_text())["schedules"] if s["effective_from"] <= date]
    return max(in_force, key=lambda s: s["effective_from"])


def recompute(day: Path, date: str) -> dict[str, dict[str, dict[str, D]]]:
    """ucc -> "EXCHANGE-SEGMENT" -> figure -> amount, for every client with a trade standing."""
    rates, broker = schedule(date), json.loads(BROKER.read_text())
    settle = {}
    for r in rows(day / "bhavcopy.csv"):
        if r["TradDt"] == date and r["FinInstrmTp"] in ("IDF", "STF", "FUTCUR", "FUTCOM"):
            settle[(r["Src"], UDIFF.get(r["FinInstrmTp"], r["FinInstrmTp"]), r["TckrSymb"], r["XpryDt"])] = D(
                r["SttlmPric"])
    rbi = {}
    if (day / "reference_rates.csv").exists():
        rbi = {r["currency"]: D(r["rate"]) / D(r["units"]) for r in rows(day / "reference_rates.csv")
               if r["date"] == date}
    states = {r["ucc"]: r["gst_state_code"] for r in rows(day / "clients.csv")}
    standing: dict[tuple, dict] = {}  # a trade number is the exchange's and segment's: its last version names its client
    for t in rows(day / "trades.csv"):
        key = (t["exchange"], t["segment"], t["trade_no"])
        if t["status"] in ("12", "13") or key not in standing:
            standing[key] = t
    by_account: dict[str, list[dict]] = defaultdict(list)
    for t in standing.values():
        if t["status"] != "13":
            by_account[t["ucc"]].append(t)
    return {ucc: _account(trades, rates, broker, settle, rbi, states[ucc] == broker["gst_state_code"])
            for ucc, trades in by_account.items() if ucc in states}


def _account(trades, rates, broker, settle, rbi, intra) -> dict[str, dict[str, D]]:
    out = {}
    for segment in sorted({f"{t['exchange']}-{t['segment']}" for t in trades}):
        mine = [t for t in trades if f"{t['exchange']}-{t['segment']}" == segment]
        out[segment] = _segment(mine, rates, broker["tariff"], settle, rbi, intra)
    return out


def _kind(t: dict) -> str:
    return t.get("settlement_type") or "T"


def _units(t: dict, rbi: dict) -> D:
    """Units a row holds, in rupees a quoted unit's worth: lots x multiplier (x the reference rate)."""
    lot = 1000 if t["segment"] == "CDS" else int(t.get("multiplier") or 1)
    fx = rbi[CROSS[t["symbol"]]] if t["segment"] == "CDS" and t["symbol"] in CROSS else D(1)
    return int(t["quantity"]) * lot * fx


def _value(t: dict, rbi: dict, price: D | None = None) -> D:
    if price is not None or _kind(t) == "T":
        return _units(t, rbi) * (D(t["price"]) if price is None else price)
    settle, strike = D(t["price"]), D(t["strike"] or 0)
    if _kind(t) in ("EX", "AS"):
        per_unit = settle - strike if t["option_type"] == "CE" else strike - settle
        return _units(t, rbi) * max(per_unit, D(0))
    return _units(t, rbi) * (strike if t["instrument"].startswith("OPT") else settle)


def _pays(t: dict) -> bool:
    """True where the client pays the row's value: a buy, an assignment, a delivery taken."""
    return {"EX": False, "AS": True}.get(_kind(t), t["side"] == "B")


def _taxed_side(t: dict) -> str:
    """Whom a tax on "buy" falls on: the buyer; a delivered option's holder."""
    if _kind(t) == "DL" and t["instrument"].startswith("OPT"):
        return "B" if (t["option_type"] == "CE") == (t["side"] == "B") else "S"
    return t["side"]


def _category(t: dict) -> str:
    if t["segment"] == "CM":
        return "delivery" if t["product"] == "CNC" else "intraday"
    kind = _kind(t)
    if kind in ("EX", "AS"):
        return KIND[t["segment"]] + ("options_exercise" if kind == "EX" else "options_assignment")
    if kind == "DL":
        if t["segment"] == "FO":
            return "physical_delivery"
        return "commodity_options_delivery" if t["instrument"].startswith("OPT") else "commodity_delivery"
    return KIND[t["segment"]] + ("futures" if t["instrument"].startswith("FUT") else "options")


def _txn_rate(rates: dict, t: dict, cat: str) -> D:
    for group in (rates.get("txn_groups") or {}).get(t["exchange"], {}).values():
        if cat in group and (t["symbol"] in group.get("symbols", []) or t["instrument"] in group.get("instruments", [])):
            return D(group[cat])
    return D(rates["txn"][t["exchange"]][cat])


def _segment(trades, rates, tariff, settle, rbi, intra) -> dict[str, D]:
    buys = sum((_value(t, rbi) for t in trades if _pays(t)), D(0))
    sells = sum((_value(t, rbi) for t in trades if not _pays(t)), D(0))
    held: dict[tuple, list] = {}
    for t in trades:
        if t["instrument"].startswith("FUT") and _kind(t) == "T":
            contract = (t["exchange"], t["instrument"], t["symbol"], t["expiry"])
            units = int(t["quantity"]) * (1 if t["side"] == "B" else -1)
            held.setdefault(contract, [0, t])[0] += units
    carry = sum((_value({**t, "quantity": str(n)}, rbi, settle[c]) for c, (n, t) in held.items()), D(0))
    sums: dict[str, D] = defaultdict(D)  # exact, each rate times one trade: the sum is the same either way
    for t in trades:
        cat, value, agri = _category(t), _value(t, rbi), t.get("agri") == "Y"
        for tax in ("stt", "ctt"):
            rule = rates[tax].get(cat)
            if not rule or (tax == "ctt" and agri):
                continue
            if rule[1] == "both" or (rule[1] == "sell" and t["side"] == "S") or (
                    rule[1] == "buy" and _taxed_side(t) == "B"):
                base = _units(t, rbi) * D(t["price"]) if "settlement_price" in rule[2:] else value
                sums[tax] += base * D(rule[0])
        if t["side"] == "B":
            sums["stamp"] += value * D(rates["stamp"][cat])
        sums["txn"] += value * _txn_rate(rates, t, cat)
        sums["sebi"] += value * D(rates["sebi_agri" if agri else "sebi"])
        if t["exchange"] in rates["ipft"]:  # NSE's levy alone
            sums["ipft"] += value * D(rates["ipft"][t["exchange"]][cat])
    orders: dict[str, list] = defaultdict(list)
    for t in trades:
        orders[t["order_no"]].append(t)
    brokerage = D(0)
    for order in orders.values():
        cats = {_category(t) for t in order}
        assert len(cats) == 1, f"order {order[0]['order_no']} spans categories {cats}"
        cat = cats.pop()
        if _kind(order[0]) != "T":
            rule = tariff.get("settlement") or {"flat": "0"}
        else:
            rule = tariff.get(cat) or tariff[cat.rpartition("_")[2]]
        if "flat" in rule:
            brokerage += half_up(D(rule["flat"]), "0.01")
        else:
            fee = sum((_value(t, rbi) for t in order), D(0)) * D(rule["percent"])
            brokerage += half_up(min(fee, D(rule["cap"])) if D(rule["cap"]) > 0 else fee, "0.01")
    f = {"obligation": half_up(sells - buys + carry, "0.01"), "brokerage": brokerage,
         "stt": half_up(sums["stt"], "1"), "ctt": half_up(sums["ctt"], "1")}
    f.update({k: half_up(sums[k], "0.01") for k in ("txn", "sebi", "stamp", "ipft")})
    base = brokerage + f["txn"] + f["sebi"]
    half = half_up(base * D(rates["gst"]) / 2, "0.01")
    f.update(cgst=half if intra else D(0), sgst=half if intra else D(0),
             igst=D(0) if intra else half_up(base * D(rates["gst"]), "0.01"))
    f["net"] = f["obligation"] - sum(f[k] for k in ("brokerage", "stt", "ctt", "txn", "sebi", "stamp", "ipft", "cgst",
                                                    "sgst", "igst"))
    f["trades"] = D(len(trades))
    f["carried"] = D(sum(1 for n, _ in held.values() if n))
    return f


def amount(text: str) -> D:
    value = D(text.strip("()").replace(",", ""))
    return -value if text.startswith("(") else value


SECTION = re.compile(r"\s*(NSE|BSE|MCX|NCDEX) / (CM|FO|CDS|COM)\b[^·]*·\s+Settlement")
MONEY = re.compile(r"^\(?[0-9][0-9,]*\.[0-9]{2}\)?$")


def check_text(text: str, expected: dict[str, dict[str, D]]) -> list[str]:
    """What in a note's text (pdftotext -layout, or the note's lines) differs from `expected`
    (one account of recompute): [] when every figure of the levies table, every section's
    count of trade and C/F rows and every section's Net Total column agree."""
    wrong = []
    lines = text.splitlines()
    head = next((line for line in lines if line.strip().startswith("Particulars")), None)
    if head is None:
        return ["no levies table"]
    heads = head.split()[1:]
    segments = sorted(expected)
    if heads != segments + ["Total", "(Net)"]:
        return [f"the levies table's columns are {heads}, not {segments} and the total"]
    for label, figure in LINES:
        found = [line for line in lines if line.strip().startswith(label)]
        want = [figure(expected[s]) for s in segments]
        if not found:
            if label == "Commodities transaction tax" and not any(s.endswith("-COM") for s in segments):
                continue
            wrong.append(f"no line {label!r}")
            continue
        line = found[0]
        got = [amount(t) for t in line[line.index(label) + len(label):].split()]
        if got != want + [sum(want, D(0))]:
            wrong.append(f"{label}: the note says {got}, worked out {want + [sum(want, D(0))]}")
    section, columns = None, defaultdict(list)
    for line in lines:
        if m := SECTION.match(line):
            section = f"{m[1]}-{m[2]}"
        elif section and (re.match(r"\s*\d{16}\s", line) or line.rstrip().endswith("C/F")):
            totals = [t for t in line.split() if MONEY.match(t)]
            if len(totals) == 1:
                columns[section].append(amount(totals[0]))
            else:
                wrong.append(f"{section}: a row with {len(totals)} amounts: {line.strip()}")
    for s in segments:
        rows_expected = int(expected[s]["trades"] + expected[s]["carried"])
        if len(columns[s]) != rows_expected:
            wrong.append(f"{s}: {len(columns[s])} rows, worked out {rows_expected} (trades and C/F lines)")
        elif sum(columns[s], D(0)) != expected[s]["obligation"] - expected[s]["brokerage"]:
            wrong.append(f"{s}: the Net Total column sums to {sum(columns[s], D(0))}, worked out "
                         f"{expected[s]['obligation'] - expected[s]['brokerage']}")
    return wrong
