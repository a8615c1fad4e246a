"""Exercise, assignment and physical delivery (settlement_type EX, AS, DL): each kind's levies
worked by hand from the schedule in force on 2026-11-20 (rates.json's set from 2026-04-01), a
client outside the broker's state (IGST), the default tariff (no brokerage on a settlement row);
the rows that do not fit, rejected by file, row and field; and a note showing each kind's line."""

from __future__ import annotations

from decimal import Decimal as D

import pytest

from pipeline.day.dumps import TRADE_COLUMNS, RowError, Trade, parse_trade, trade_row
from pipeline.note.charges import Levies, compute
from pipeline.note.content import build_note
from pipeline.note.render import render
from pipeline.stages import broker
from tests.test_render import pdf_text, sample_client

DATE = "2026-11-20"
_n = iter(range(7_000_000_000_000_001, 7_000_000_000_001_000, 2))


def row(exchange, segment, instrument, symbol, side, quantity, price, kind, *, strike="", option_type="",
        multiplier="", agri="", isin="", expiry=DATE, product="NRML") -> dict:
    n = next(_n)
    return {"trade_date": DATE, "exchange": exchange, "segment": segment, "settlement_no": f"{segment}2026324",
            "ucc": "C0000042", "order_no": f"{n:016d}", "order_time": "15:30:00", "trade_no": f"{n + 1:016d}",
            "trade_time": "15:30:00", "symbol": symbol, "isin": isin, "instrument": instrument, "expiry": expiry,
            "strike": strike, "option_type": option_type, "side": side, "quantity": quantity, "price": price,
            "product": product, "status": "11", "multiplier": multiplier, "agri": agri, "settlement_type": kind}


NIFTY_EX = row("NSE", "FO", "OPTIDX", "NIFTY", "B", "75", "24310.55", "EX", strike="24000", option_type="CE")
NIFTY_AS = row("NSE", "FO", "OPTIDX", "NIFTY", "S", "150", "24310.55", "AS", strike="24500", option_type="PE")
RELIANCE_DL = row("NSE", "FO", "FUTSTK", "RELIANCE", "B", "500", "2950.40", "DL", isin="INE002A01018")
RELIANCE_PUT_DL = row("NSE", "FO", "OPTSTK", "RELIANCE", "S", "250", "2950.40", "DL", strike="3000",
                      option_type="PE", isin="INE002A01018")
CRUDE_EX = row("MCX", "COM", "OPTFUT", "CRUDEOIL", "B", "2", "6123", "EX", strike="6000", option_type="CE",
               multiplier="100", agri="N")
CRUDE_AS = row("MCX", "COM", "OPTFUT", "CRUDEOIL", "S", "2", "6123", "AS", strike="6000", option_type="CE",
               multiplier="100", agri="N")
GOLD_DL = row("MCX", "COM", "FUTCOM", "GOLD", "B", "1", "76500", "DL", multiplier="100", agri="N")
GOLD_CALL_DL = row("MCX", "COM", "OPTFUT", "GOLD", "B", "1", "76500", "DL", strike="76000", option_type="CE",
                   multiplier="100", agri="N")
USDINR_EX = row("NSE", "CDS", "OPTCUR", "USDINR", "B", "10", "84.2525", "EX", strike="84.0000", option_type="CE",
                multiplier="1000")


def parsed(*rows: dict) -> list[Trade]:
    return [parse_trade("trades.csv", i, r, DATE) for i, r in enumerate(rows, 1)]


def levies(*rows: dict, tariff: dict | None = None) -> Levies:
    (only,) = compute(parsed(*rows), DATE, False, tariff or broker()["tariff"]).segments.values()
    return only


def figures(levy: Levies) -> dict:
    return {f: getattr(levy, f) for f in ("obligation", "brokerage", "stt", "ctt", "txn", "sebi", "stamp", "ipft",
                                          "igst", "net")}


def test_an_exercised_index_option_pays_stt_on_its_intrinsic_value_to_its_holder():
    # NIFTY 24000 CE exercised, 75 units, settled at 24,310.55: intrinsic 310.55 a unit x 75 = 23,291.25, paid
    # to the holder. STT 0.15% (from 2026-04-01) of 23,291.25 = 34.936875 -> 35 (to the rupee); SEBI fee
    # 0.0001% = 0.02329125 -> 0.02; no stamp duty, transaction charge or IPFT on an exercise; IGST 18% of
    # 0.02 = 0.0036 -> 0.00. Net 23,291.25 - 35 - 0.02 = 23,256.23
    assert figures(levies(NIFTY_EX)) == {"obligation": D("23291.25"), "brokerage": 0, "stt": 35, "ctt": 0, "txn": 0,
                                         "sebi": D("0.02"), "stamp": 0, "ipft": 0, "igst": 0, "net": D("23256.23")}


def test_before_april_2026_an_exercise_pays_stt_at_0125_percent():
    # the same exercise on 2026-03-19, the schedule from 2024-10-01: 0.125% of 23,291.25 = 29.1140625 -> 29
    early = {**NIFTY_EX, "trade_date": "2026-03-19", "expiry": "2026-03-19"}
    t = parse_trade("trades.csv", 1, early, "2026-03-19")
    assert compute([t], "2026-03-19", False, broker()["tariff"]).segments["NSE-FO"].stt == 29


def test_an_assigned_index_option_pays_its_intrinsic_value_and_no_stt():
    # NIFTY 24500 PE assigned, 150 units, settled at 24,310.55: intrinsic 189.45 x 150 = 28,417.50 paid by the
    # writer; no STT on the writer; SEBI fee 0.0284175 -> 0.03; IGST on 0.03 = 0.0054 -> 0.01.
    # Net (28,417.50) - 0.03 - 0.01 = (28,417.54)
    assert figures(levies(NIFTY_AS)) == {"obligation": D("-28417.50"), "brokerage": 0, "stt": 0, "ctt": 0, "txn": 0,
                                         "sebi": D("0.03"), "stamp": 0, "ipft": 0, "igst": D("0.01"),
                                         "net": D("-28417.54")}


def test_a_stock_future_going_to_delivery_pays_delivery_stt_and_stamp_duty():
    # RELIANCE future to delivery, 500 shares taken at the settlement price 2,950.40: 14,75,200.00 paid.
    # STT 0.1% (as a delivery trade) = 1,475.20 -> 1,475; stamp duty 0.015% on the buyer = 221.28; SEBI fee
    # 1.4752 -> 1.48; no transaction charge on the delivery obligation; IGST 18% of 1.48 = 0.2664 -> 0.27.
    # Net (14,75,200.00) - 1,475 - 221.28 - 1.48 - 0.27 = (14,76,898.03)
    assert figures(levies(RELIANCE_DL)) == {"obligation": D("-1475200.00"), "brokerage": 0, "stt": 1475, "ctt": 0,
                                            "txn": 0, "sebi": D("1.48"), "stamp": D("221.28"), "ipft": 0,
                                            "igst": D("0.27"), "net": D("-1476898.03")}


def test_a_stock_put_exercised_into_delivery_is_valued_at_its_strike():
    # RELIANCE 3000 PE's holder delivers 250 shares at the strike: 7,50,000.00 received. STT 0.1% = 750; no
    # stamp duty (the seller's side); SEBI fee 0.75; IGST 0.135 -> 0.14. Net 7,50,000 - 750 - 0.75 - 0.14
    # = 7,49,249.11
    assert figures(levies(RELIANCE_PUT_DL)) == {"obligation": D("750000.00"), "brokerage": 0, "stt": 750, "ctt": 0,
                                                "txn": 0, "sebi": D("0.75"), "stamp": 0, "ipft": 0,
                                                "igst": D("0.14"), "net": D("749249.11")}


def test_an_exercised_commodity_option_pays_ctt_on_its_settlement_value():
    # CRUDEOIL 6000 CE (an option on the future) exercised, 2 lots x 100 barrels, settled at 6,123: intrinsic
    # 123 x 200 = 24,600.00 received. CTT 0.0001% of the settlement value (not the intrinsic; Finance Act 2013,
    # s. 117's serial 5, s. 118(b)(ii)): 6,123 x 200 = 12,24,600 x 0.000001 = 1.2246 -> 1; SEBI fee 0.0246 -> 0.02;
    # IGST 0.0036 -> 0.00. Net 24,600 - 1 - 0.02 = 24,598.98
    assert figures(levies(CRUDE_EX)) == {"obligation": D("24600.00"), "brokerage": 0, "stt": 0, "ctt": 1, "txn": 0,
                                         "sebi": D("0.02"), "stamp": 0, "ipft": 0, "igst": 0, "net": D("24598.98")}


def test_an_assigned_commodity_option_pays_no_ctt():
    # its writer pays the 24,600.00 and SEBI's 0.02 (IGST 0.00): (24,600.02)
    assert figures(levies(CRUDE_AS)) == {"obligation": D("-24600.00"), "brokerage": 0, "stt": 0, "ctt": 0, "txn": 0,
                                         "sebi": D("0.02"), "stamp": 0, "ipft": 0, "igst": 0, "net": D("-24600.02")}


def test_a_commodity_future_delivered_pays_no_ctt_and_an_option_delivered_its_delivery_rate():
    # GOLD future to delivery, 1 lot of 100 (10 g quotes) at 76,500: 76,50,000.00 paid; no CTT on the delivery;
    # SEBI fee 7.65; IGST 1.377 -> 1.38. Net (76,50,009.03)
    assert figures(levies(GOLD_DL)) == {"obligation": D("-7650000.00"), "brokerage": 0, "stt": 0, "ctt": 0, "txn": 0,
                                        "sebi": D("7.65"), "stamp": 0, "ipft": 0, "igst": D("1.38"),
                                        "net": D("-7650009.03")}
    # GOLD 76000 CE exercised into delivery: 100 units taken at the strike, 76,00,000.00 paid; CTT 0.0001% on the
    # holder, of the settlement value 76,500 x 100 = 7.65 -> 8; SEBI fee 7.60; IGST 1.368 -> 1.37.
    # Net (76,00,000) - 8 - 7.60 - 1.37 = (76,00,016.97)
    assert figures(levies(GOLD_CALL_DL)) == {"obligation": D("-7600000.00"), "brokerage": 0, "stt": 0, "ctt": 8,
                                             "txn": 0, "sebi": D("7.60"), "stamp": 0, "ipft": 0, "igst": D("1.37"),
                                             "net": D("-7600016.97")}


def test_an_exercised_currency_option_is_settled_in_cash_without_stt_or_ctt():
    # USDINR 84 CE exercised, 10 lots of 1,000, settled at 84.2525: 0.2525 x 10,000 = 2,525.00 received; no STT,
    # CTT, stamp duty, transaction charge or IPFT; SEBI fee 0.002525 -> 0.00. Net 2,525.00
    assert figures(levies(USDINR_EX)) == {"obligation": D("2525.00"), "brokerage": 0, "stt": 0, "ctt": 0, "txn": 0,
                                          "sebi": 0, "stamp": 0, "ipft": 0, "igst": 0, "net": D("2525.00")}


def test_a_tariff_may_charge_a_settlement_row_a_flat_fee():
    # a tariff's "settlement" entry: Rs 20 on the NIFTY exercise; IGST 18% of 20 + 0.02 = 3.6036 -> 3.60.
    # Net 23,291.25 - 20 - 35 - 0.02 - 3.60 = 23,232.63
    tariff = {**broker()["tariff"], "settlement": {"flat": "20"}}
    got = levies(NIFTY_EX, tariff=tariff)
    assert (got.brokerage, got.igst, got.net) == (20, D("3.60"), D("23232.63"))


def test_a_settlement_row_comes_back_from_its_shard_row():
    for t in parsed(NIFTY_EX, RELIANCE_PUT_DL, CRUDE_EX):
        assert Trade.from_row(t.as_row()) == t and Trade.from_row(t.as_row()).flow == t.flow
    values = [NIFTY_EX[f] for f in TRADE_COLUMNS]
    assert trade_row("trades.csv", 1, values, DATE, {}) == parsed(NIFTY_EX)[0].as_row()


@pytest.mark.parametrize("change,field,problem", [
    ({"settlement_type": "XX"}, "settlement_type", "is not T (trade), EX"),
    ({"instrument": "FUTIDX", "strike": "", "option_type": ""}, "instrument", "is of an option"),
    ({"instrument": "OPTSTK", "symbol": "RELIANCE"}, "settlement_type", "settles by delivery"),
    ({"side": "S"}, "side", "holder"),
    ({"price": ""}, "price", "not a number"),
    ({"price": "23900"}, "price", "out of the money"),
    ({"expiry": "2026-11-26"}, "expiry", "expiring on the day"),
    ({"product": "MIS"}, "product", "NRML"),
])
def test_an_exercise_that_does_not_fit_rejects_its_row_naming_the_field(change, field, problem):
    with pytest.raises(RowError) as e:
        parse_trade("trades.csv", 7, {**NIFTY_EX, **change}, DATE)
    assert (e.value.file, e.value.row, e.value.field, e.value.ucc) == ("trades.csv", 7, field, "C0000042")
    assert problem in e.value.problem


@pytest.mark.parametrize("bad,field,problem", [
    (row("NSE", "CDS", "FUTCUR", "USDINR", "B", "10", "84.25", "DL", multiplier="1000"), "instrument", "cash"),
    (row("NSE", "FO", "OPTIDX", "NIFTY", "B", "75", "24310", "DL", strike="24000", option_type="CE"), "instrument",
     "cash"),
    (row("NSE", "CM", "EQ", "INFY", "B", "10", "1800", "DL", isin="INE009A01021", expiry="", product="CNC"),
     "settlement_type", "segment CM"),
    ({**NIFTY_AS, "side": "B"}, "side", "writer"),
    (row("NSE", "CDS", "FUTCUR", "USDINR", "B", "10", "84.25", "EX", multiplier="1000"), "instrument", "option"),
])
def test_other_rows_that_cannot_settle_so_are_rejected(bad, field, problem):
    # through the fast path's entry too: trade_row hands any settlement row to parse_trade
    with pytest.raises(RowError) as e:
        trade_row("trades.csv", 3, [bad[f] for f in TRADE_COLUMNS], DATE, {})
    assert (e.value.row, e.value.field) == (3, field) and problem in e.value.problem


def test_the_note_shows_each_kind_on_its_own_line_in_its_section(tmp_path):
    """A line per kind, after the section's trades: Gross Rate the settlement price, Net Rate the value a unit
    it settles at, Net Total the value, Remarks the kind; the levies column adds them up."""
    client = sample_client()
    trades = sorted(parsed(NIFTY_EX, NIFTY_AS, RELIANCE_DL, CRUDE_EX, USDINR_EX), key=lambda t: t.exchange_segment)
    b = broker()
    charges = compute(trades, DATE, False, b["tariff"])
    note = build_note(client, trades, charges, b, DATE, "CNT-26/27-0000042")
    lines = [line for page in note["pages"] for g in page["groups"] for line in g["lines"]]
    exercise = next(line for line in lines if "NIFTY" in line and line.endswith("Exercise"))
    assert "OPTIDX NIFTY 20-11-2026 24000 CE" in exercise and "24,310.5500" in exercise and "310.5500" in exercise
    assert exercise.split()[-2] == "23,291.25"
    assigned = next(line for line in lines if line.endswith("Assignment"))
    assert assigned.split()[-2] == "(28,417.50)" and "189.4500" in assigned
    delivered = next(line for line in lines if line.endswith("Delivery"))
    assert delivered.split()[-2] == "(14,75,200.00)"
    # NSE-FO: 23,291.25 - 28,417.50 - 14,75,200.00 = (14,80,326.25)
    assert charges.segments["NSE-FO"].obligation == D("-1480326.25")
    text = pdf_text(render(note), tmp_path)
    for word in ("Exercise", "Assignment", "Delivery", "(14,80,326.25)", "Commodities transaction tax"):
        assert word in text, word


def test_the_split_reads_the_settlement_column_with_or_without_the_lot_columns(tmp_path, redis_url):
    """A file may give settlement_type and leave out multiplier and agri (an equity day): the rows of
    a trade are read as before, a settlement row keeps its type into the shard, a bad one rejects its
    account naming the field."""
    import csv
    import datetime as dt
    import json
    import os

    from pipeline.day.split import split_day
    from pipeline.day.synth import SynthOptions, write_dumps
    from pipeline.record.state import RunState
    from pipeline.record.storage import open_store

    day = tmp_path / "in"
    write_dumps(day, SynthOptions(dt.date.fromisoformat(DATE), 12, seed=3, segment_share=0))
    with (day / "trades.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    good, bad = rows[0]["ucc"], next(r["ucc"] for r in rows if r["ucc"] != rows[0]["ucc"])
    extra = [{**NIFTY_EX, "ucc": good}, {**RELIANCE_DL, "ucc": bad, "instrument": "FUTIDX", "symbol": "NIFTY",
                                         "isin": ""}]
    columns = [c for c in TRADE_COLUMNS if c not in ("multiplier", "agri")]
    with (day / "trades.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows([*rows, *extra])
    run = f"settle-{os.urandom(3).hex()}"
    store = tmp_path / "store"
    split = split_day(open_store(str(day)), open_store(str(store)), RunState(redis_url, run), run, DATE, 4, "CNT")
    assert split.rejected == 1
    assert RunState(redis_url, run).accounts([bad])[bad]["reason"].startswith(
        f"trades.csv row {len(rows) + 2} field 'instrument'")
    accounts = [json.loads(line) for p in store.rglob("shard-*.jsonl") for line in p.read_text().splitlines()]
    (mine,) = [a for a in accounts if a["ucc"] == good]
    settled = [Trade.from_row(r) for r in mine["trades"] if r[-1] == "EX"]
    assert len(settled) == 1 and settled[0].turnover == D("23291.25") and settled[0].flow == "S"
