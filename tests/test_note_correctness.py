"""Every figure on a note, read back from the PDF with pdftotext, against the trade file.

The hand-made day holds what real days break on: trade and order numbers that collide across
exchanges, 100-crore amounts, 1-lakh prices, a price modification, a cancellation that arrives
before its original, a futures position carried forward, STT of exactly 0.50, and a trade date
whose next day is an exchange holiday.
"""

from __future__ import annotations

import csv
import re
import subprocess
from decimal import Decimal as D
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import stages
from pipeline.day.dumps import CLIENT_FIELDS, TRADE_FIELDS, Client
from pipeline.day.split import find_account, split_day
from pipeline.note.render import render
from pipeline.record.manifest import save_manifest
from pipeline.record.state import RunState
from pipeline.record.storage import open_store

DATE = "2026-11-23"  # a Monday; 24-11-2026 is an NSE/BSE holiday (Guru Nanak Jayanti)
N = lambda i: f"{i:016d}"  # noqa: E731
MONEY = re.compile(r"^\(?[0-9][0-9,]*\.[0-9]{2}\)?$")


def row(**kw) -> dict:
    base = dict(trade_date=DATE, exchange="NSE", segment="CM", settlement_no="CM2026327", ucc="H1",
                order_time="10:00:00", trade_time="10:00:05", symbol="SBIN", isin="INE062A01020",
                instrument="EQ", expiry="", strike="", option_type="", side="B", product="CNC", status="11")
    return {**base, **kw}


HAND_MADE = [
    # the same trade and order number on NSE-CM and BSE-CM: two trades, two orders
    row(order_no=N(1), trade_no=N(2), quantity="10", price="820.00", product="MIS"),
    row(exchange="BSE", settlement_no="CM2026999", order_no=N(1), trade_no=N(2), side="S", quantity="10",
        price="821.00", product="MIS"),
    # 100 crore at a price of 1 lakh
    row(order_no=N(3), trade_no=N(4), quantity="10000", price="100000.00", symbol="MRF", isin="INE883A01011"),
    # a price modification: the 12 replaces the 11
    row(order_no=N(5), trade_no=N(6), quantity="7", price="1000.00", side="S", product="MIS"),
    row(order_no=N(5), trade_no=N(6), quantity="7", price="1001.50", side="S", product="MIS", status="12"),
    # a cancellation that arrives before its original: the trade is not on the note
    row(order_no=N(7), trade_no=N(8), quantity="3", price="500.00", status="13"),
    row(order_no=N(7), trade_no=N(8), quantity="3", price="500.00"),
    # futures: 2 x 500 = 1,000 sold -> STT 0.05% = 0.50 -> 1 (half up); the short is carried forward
    row(segment="FO", settlement_no="FO2026327", order_no=N(9), trade_no=N(10), symbol="ITC", isin="",
        instrument="FUTSTK", expiry="2026-11-26", side="S", quantity="2", price="500.00", product="NRML"),
    # an option whose price was modified: NRML (modified), at premium, with its closing rate
    row(segment="FO", settlement_no="FO2026327", order_no=N(20), trade_no=N(21), symbol="NIFTY", isin="",
        instrument="OPTIDX", expiry="2026-11-26", strike="24000", option_type="CE", quantity="75",
        price="120.00", product="NRML"),
    row(segment="FO", settlement_no="FO2026327", order_no=N(20), trade_no=N(21), symbol="NIFTY", isin="",
        instrument="OPTIDX", expiry="2026-11-26", strike="24000", option_type="CE", quantity="75",
        price="121.00", product="NRML", status="12"),
    # one order in three fills: 20 of brokerage shared pro rata in whole paise (6.67, 6.67, 6.66)
    *[row(order_no=N(11), trade_no=N(12 + i), quantity="1", price="70000.00", product="MIS", symbol="INFY",
          isin="INE009A01021") for i in range(3)],
]
BHAVCOPY = [{"TradDt": DATE, "Src": "NSE", "Sgmt": "FO", "FinInstrmTp": "STF", "TckrSymb": "ITC",
             "XpryDt": "2026-11-26", "StrkPric": "", "OptnTp": "", "ClsPric": "498.00", "SttlmPric": "497.35",
             "Extra": "ignored"},
            {"TradDt": DATE, "Src": "NSE", "Sgmt": "FO", "FinInstrmTp": "IDO", "TckrSymb": "NIFTY",
             "XpryDt": "2026-11-26", "StrkPric": "24000.00", "OptnTp": "CE", "ClsPric": "118.40", "SttlmPric": "118.45",
             "Extra": ""}]
CLIENT = {"ucc": "H1", "name": "Hand Made", "pan": "ABCDE1234F", "email": "h1@example.com",
          "address": "1 MG Road, Bengaluru", "state": "Karnataka", "gst_state_code": "29", "ecn_opt_in": "Y"}


def write_csv(path: Path, fields: list[str], rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fields)
        w.writeheader()
        w.writerows(rows)


def write_day(folder: Path, trades=HAND_MADE, bhav=BHAVCOPY, clients=(CLIENT,), refs=()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_csv(folder / "clients.csv", CLIENT_FIELDS, list(clients))
    write_csv(folder / "trades.csv", TRADE_FIELDS, list(trades))
    write_csv(folder / "bhavcopy.csv", list(bhav[0]), list(bhav))
    if refs:
        write_csv(folder / "reference_rates.csv", ["date", "currency", "units", "rate"], list(refs))
    return folder


def pdftotext(pdf: bytes, tmp_path: Path) -> str:
    path = tmp_path / "note.pdf"
    path.write_bytes(pdf)
    return subprocess.run(["pdftotext", "-layout", str(path), "-"], capture_output=True, text=True,
                          check=True).stdout


def split_and_render(tmp_path: Path, redis_url: str, run_id: str, trades=HAND_MADE, bhav=BHAVCOPY, refs=()
                     ) -> tuple[str, dict]:
    inputs = open_store(str(write_day(tmp_path / "in", trades=trades, bhav=bhav, refs=refs)))
    store = open_store(str(tmp_path / "store"))
    split = split_day(inputs, store, RunState(redis_url, run_id), run_id, DATE, 100, "CNT")
    assert split.accounts == 1 and split.rejected == 0, split
    save_manifest(store, run_id, split)
    account = find_account(store, run_id, "H1")
    note = stages.note_data(account, Client(**account["client"]), DATE, {})
    return pdftotext(render(note), tmp_path), note


def parse_rows(text: str) -> dict[str, list[tuple[str, D]]]:
    """Segment -> (line, Net Total) for every trade and C/F line, as the PDF prints them."""
    rows: dict[str, list] = {}
    segment = None
    for line in text.splitlines():
        label = re.match(r"\s*(NSE|BSE|MCX|NCDEX) / (CM|FO|CDS|COM)\b[^·]*·\s+Settlement", line)
        if label:
            segment = f"{label[1]}-{label[2]}"
            continue
        tokens = line.split()
        totals = [t for t in tokens if MONEY.match(t)]
        if segment and (re.match(r"\s*\d{16}\s", line) or line.rstrip().endswith("C/F")):
            assert len(totals) == 1, line  # rates have 4 places: the Net Total is the one 2-place amount
            rows.setdefault(segment, []).append((line, amount(totals[0])))
    return rows


def amount(text: str) -> D:
    value = D(text.strip("()").replace(",", ""))
    return -value if text.startswith("(") else value


def levies_line(text: str, label: str) -> list[D]:
    line = next(line for line in text.splitlines() if line.strip().startswith(label))
    return [amount(t) for t in line[len(label) + line.index(label):].split()]


def test_the_hand_made_day_shows_every_trade_once_every_value_whole_and_reconciles(tmp_path, redis_url):
    text, note = split_and_render(tmp_path, redis_url, "hand-made")
    rows = parse_rows(text)
    # every effective trade once: both colliding trades, the modified price, not the cancelled one
    assert sorted(rows) == ["BSE-CM", "NSE-CM", "NSE-FO"]
    assert len(rows["NSE-CM"]) == 6 and len(rows["BSE-CM"]) == 1 and len(rows["NSE-FO"]) == 3
    assert sum(N(2) in line for seg in rows.values() for line, _ in seg) == 2
    assert N(8) not in text and "1,001.5000" in text and "1,000.0000" not in text
    # every value whole: the 100-crore buy, the 1-lakh price, the remarks, the carried position
    assert "(1,00,00,00,000.00)" in text and "1,00,000.0000" in text
    for remark in ("CNC", "MIS (modified)", "NRML (modified)", "C/F"):
        assert remark in text
    # the option: at premium (75 x 121 bought), its closing rate from the bhavcopy, nothing carried
    assert re.search(r"OPTIDX NIFTY 26-11-2026 24000 CE\s+B\s+75\s+121\.0000\s+0\.2667\s+121\.2667\s+118\.4000"
                     r"\s+\(9,095\.00\)\s+NRML \(modified\)", text)
    assert re.search(r"FUTSTK ITC 26-11-2026\s+B\s+2\s+497\.3500\s+0\.0000\s+497\.3500\s+497\.3500\s+\(994\.70\)\s+C/F",
                     text)
    # the colliding orders were charged each on its own: 0.03% of 8,200 = 2.46 for the NSE buy,
    # 0.03% of 8,210 = 2.463 -> 2.46 for the BSE sell: 0.2460 a unit each
    assert re.search(rf"{N(1)}.*{N(2)}.*\s820\.0000\s+0\.2460\s+820\.2460", text)
    assert re.search(rf"{N(1)}.*{N(2)}.*\s821\.0000\s+0\.2460\s+820\.7540", text)
    # columns reconcile with the levies table to the paisa, segment by segment, and the Total
    heads = next(line for line in text.splitlines() if line.strip().startswith("Particulars")).split()[1:]
    assert heads == ["BSE-CM", "NSE-CM", "NSE-FO", "Total", "(Net)"]
    obligation, brokerage = levies_line(text, "Pay-in/Pay-out obligation"), levies_line(text, "Brokerage")
    for i, segment in enumerate(heads[:3]):
        assert sum(v for _, v in rows[segment]) == obligation[i] + brokerage[i], segment  # brokerage printed negative
    nse_cm = 7 * D("1001.50") - D("8200.00") - D("1000000000.00") - 3 * D("70000.00")
    nse_fo = D("5.30") - 75 * D("121.00")  # the future's MTM (2 x 2.65) and the option's premium
    assert obligation == [D("8210.00"), nse_cm, nse_fo, D("8210.00") + nse_cm + nse_fo]
    stt = levies_line(text, "Securities transaction tax")
    assert stt[2] == D(-1) and stt[3] == sum(stt[:3])  # the futures sell's 0.50 rounds half up to 1
    # settlement on the next trading day: 24-11-2026 is a holiday
    assert "25-11-2026" in text and "24-11-2026" not in text
    # the pro-rata brokerage of one order in three fills adds up to the order's brokerage
    fills = [v for line, v in rows["NSE-CM"] if "INFY" in line]
    assert sum(fills) == -3 * D("70000.00") - D("20.00")


def bhav(src, sgmt, kind, symbol, expiry, close, strike="", option=""):
    return {"TradDt": DATE, "Src": src, "Sgmt": sgmt, "FinInstrmTp": kind, "TckrSymb": symbol, "XpryDt": expiry,
            "StrkPric": strike, "OptnTp": option, "ClsPric": close, "SttlmPric": close, "Extra": ""}


def lots(exchange, segment, instrument, symbol, expiry, side, quantity, price, n, multiplier="", agri="", strike="",
         option_type=""):
    return row(exchange=exchange, segment=segment, settlement_no=f"{segment}2026327", order_no=N(n),
               trade_no=N(n + 1), symbol=symbol, isin="", instrument=instrument, expiry=expiry, side=side,
               quantity=quantity, price=price, product="NRML", multiplier=multiplier, agri=agri, strike=strike,
               option_type=option_type)


EVERY_SEGMENT = [
    lots("NSE", "CDS", "FUTCUR", "USDINR", "2026-11-26", "S", "5", "84.1250", 200),
    lots("BSE", "CDS", "OPTCUR", "USDINR", "2026-11-26", "B", "10", "0.2500", 202, "1000", strike="84.2500",
         option_type="CE"),
    lots("MCX", "COM", "FUTCOM", "GOLD", "2027-02-05", "S", "1", "76543", 204, "100", "N"),
    lots("MCX", "COM", "OPTFUT", "GOLD", "2027-01-27", "S", "1", "1210.50", 206, "100", "N", "77000", "CE"),
    lots("NCDEX", "COM", "FUTCOM", "GUARSEED10", "2026-12-19", "B", "2", "5400", 208, "100", "Y"),
    lots("BSE", "FO", "OPTIDX", "SENSEX", "2026-11-26", "B", "20", "310.50", 210, strike="80000", option_type="PE"),
]
EVERY_BHAVCOPY = [
    bhav("NSE", "CD", "FUTCUR", "USDINR", "2026-11-26", "84.2000"),
    bhav("BSE", "CD", "OPTCUR", "USDINR", "2026-11-26", "0.2600", "84.25", "CE"),
    bhav("MCX", "CO", "FUTCOM", "GOLD", "2027-02-05", "76500"),
    bhav("MCX", "CO", "OPTFUT", "GOLD", "2027-01-27", "1200", "77000", "CE"),
    bhav("NCDEX", "CO", "FUTCOM", "GUARSEED10", "2026-12-19", "5390"),
    bhav("BSE", "FO", "IDO", "SENSEX", "2026-11-26", "305.00", "80000", "PE"),
]


def test_a_day_in_every_segment_shows_each_exchange_and_segment_apart_and_reconciles(tmp_path, redis_url):
    text, note = split_and_render(tmp_path, redis_url, "every-segment", EVERY_SEGMENT, EVERY_BHAVCOPY)
    rows = parse_rows(text)
    heads = next(line for line in text.splitlines() if line.strip().startswith("Particulars")).split()[1:]
    assert heads == ["BSE-CDS", "BSE-FO", "MCX-COM", "NCDEX-COM", "NSE-CDS", "Total", "(Net)"]
    assert sorted(rows) == sorted(heads[:5])
    for title in ("MCX / COM (commodity derivatives)", "NSE / CDS (currency derivatives)", "BSE / FO"):
        assert title in text, title
    # the lot multiplier is on the row: 5 x 1,000 x 84.1250 sold, carried forward at 84.2000
    assert re.search(r"FUTCUR USDINR 26-11-2026 x1000\s+S\s+5\s+84\.1250\s+0\.0040\s+84\.1210\s+84\.2000"
                     r"\s+4,20,605\.00\s+NRML", text)
    assert re.search(r"FUTCUR USDINR 26-11-2026 x1000\s+B\s+5\s+84\.2000\s.*\(4,21,000\.00\)\s+C/F", text)
    # the obligations, worked out here from quantity x multiplier x price and the settlement prices
    obligation, brokerage = levies_line(text, "Pay-in/Pay-out obligation"), levies_line(text, "Brokerage")
    expected = {"BSE-CDS": -10 * 1000 * D("0.25"), "BSE-FO": -20 * D("310.50"),
                "MCX-COM": 100 * (D(76543) - D(76500)) + 100 * D("1210.50"),
                "NCDEX-COM": 2 * 100 * (D(5390) - D(5400)), "NSE-CDS": 5 * 1000 * (D("84.1250") - D("84.2000"))}
    assert obligation == [expected[h] for h in heads[:5]] + [sum(expected.values())]
    for i, segment in enumerate(heads[:5]):
        assert sum(v for _, v in rows[segment]) == obligation[i] + brokerage[i], segment
    # CTT only on MCX's non-agricultural sells: 0.01% of 76,54,300 + 0.05% of 1,21,050 = 825.955 -> 826
    assert levies_line(text, "Commodities transaction tax") == [D(0), D(0), D(-826), D(0), D(0), D(-826)]
    assert levies_line(text, "Securities transaction tax") == [D(0)] * 6  # every sell here is currency or commodity
    # stamp on the buys: BSE-CDS 0.0001% of 2,500 = 0.0025 -> 0.00; SENSEX 0.003% of 6,210 = 0.19;
    # guar 0.002% of 10,80,000 = 21.60
    assert levies_line(text, "Stamp duty") == [D(0), D("-0.19"), D(0), D("-21.60"), D(0), D("-21.79")]
    net = levies_line(text, "Net amount receivable/(payable) by client")
    assert net[-1] == sum(net[:-1])
    # MCX and NCDEX settle on their own calendars: MCX's 24th is its evening session alone (Guru Nanak
    # Jayanti), so it settles on the 25th as NSE does; NCDEX's list the run was not given
    dates = {s["segment"]: s["date"] for s in note["note"]["settlements"]}
    assert (dates["MCX-COM"], dates["NSE-CDS"], dates["NCDEX-COM"]) == ("25-11-2026", "25-11-2026",
                                                                        "per the exchange's calendar")


CROSS = [
    lots("NSE", "CDS", "FUTCUR", "EURUSD", "2026-11-26", "S", "3", "1.0852", 220),
    lots("BSE", "CDS", "OPTCUR", "USDJPY", "2026-11-26", "B", "2", "0.85", 222, strike="150", option_type="CE"),
    lots("NSE", "CDS", "FUTCUR", "USDINR", "2026-11-26", "B", "1", "84.1000", 224),
]
CROSS_BHAVCOPY = [bhav("NSE", "CD", "FUTCUR", "EURUSD", "2026-11-26", "1.0860"),
                  bhav("BSE", "CD", "OPTCUR", "USDJPY", "2026-11-26", "0.90", "150.00", "CE"),
                  bhav("NSE", "CD", "FUTCUR", "USDINR", "2026-11-26", "84.2000")]
REFERENCE = [{"date": DATE, "currency": "USD", "units": "1", "rate": "84.1234"},
             {"date": DATE, "currency": "JPY", "units": "100", "rate": "55.12"}]


def test_a_cross_currency_pair_shows_its_quote_and_reference_rate_and_settles_in_rupees(tmp_path, redis_url):
    text, _ = split_and_render(tmp_path, redis_url, "cross", CROSS, CROSS_BHAVCOPY, REFERENCE)
    rows = parse_rows(text)
    # the rate in dollars, the rupee value at RBI's rate: 3 x 1,000 x 1.0852 x 84.1234 = 2,73,872.14104,
    # less 20 of brokerage = 2,73,852.14; the short carried forward at 1.0860: (2,74,074.04)
    assert re.search(r"FUTCUR EURUSD 26-11-2026 x1000 INR/USD 84\.1234\s+S\s+3\s+1\.0852\s+0\.0001\s+1\.0851\s+"
                     r"1\.0860\s+2,73,852\.14\s+NRML", text), text
    assert re.search(r"FUTCUR EURUSD .*\(2,74,074\.04\)\s+C/F", text)
    # USDJPY options at premium in yen: 2 x 1,000 x 0.85 = 1,700 yen at 0.5512 rupees = 937.04, plus 20
    assert re.search(r"OPTCUR USDJPY 26-11-2026 150 CE x1000 INR/JPY 0\.5512\s+B\s+2\s+0\.8500.*\(957\.04\)", text)
    heads = next(line for line in text.splitlines() if line.strip().startswith("Particulars")).split()[1:]
    assert heads == ["BSE-CDS", "NSE-CDS", "Total", "(Net)"]
    obligation, brokerage = levies_line(text, "Pay-in/Pay-out obligation"), levies_line(text, "Brokerage")
    # NSE: EURUSD's MTM 3,000 x (1.0852 - 1.0860) x 84.1234 = (201.89616) and USDINR's 1,000 x (84.2 - 84.1) = 100
    assert obligation == [D("-937.04"), D("-101.90"), D("-1038.94")]
    for i, segment in enumerate(heads[:2]):
        assert sum(v for _, v in rows[segment]) == obligation[i] + brokerage[i], segment


def test_a_cross_currency_trade_without_its_reference_rate_rejects_its_account_by_row(tmp_path, redis_url):
    inputs = open_store(str(write_day(tmp_path / "in", trades=CROSS, bhav=CROSS_BHAVCOPY, refs=REFERENCE[1:])))
    state = RunState(redis_url, "no-rate")
    split = split_day(inputs, open_store(str(tmp_path / "store")), state, "no-rate", DATE, 100, "CNT")
    assert (split.accounts, split.rejected) == (0, 1)
    assert state.accounts(["H1"])["H1"]["reason"].startswith(
        "trades.csv row 1 field 'symbol': EURUSD settles in rupees at RBI's reference rate for USD")


def test_a_derivatives_trade_whose_contract_is_not_in_the_bhavcopy_rejects_its_account_by_row(tmp_path, redis_url):
    other = dict(CLIENT, ucc="H2", pan="ABCDE1235F")
    trades = HAND_MADE + [row(ucc="H2", segment="FO", settlement_no="FO2026327", order_no=N(90), trade_no=N(91),
                              symbol="NIFTY", isin="", instrument="FUTIDX", expiry="2026-11-26", quantity="75",
                              price="24000.00", product="NRML")]
    inputs = open_store(str(write_day(tmp_path / "in", trades=trades, clients=(CLIENT, other))))
    state = RunState(redis_url, "no-close")
    split = split_day(inputs, open_store(str(tmp_path / "store")), state, "no-close", DATE, 100, "CNT")
    assert (split.accounts, split.rejected) == (1, 1)
    reason = state.accounts(["H2"])["H2"]["reason"]
    assert reason.startswith(f"trades.csv row {len(trades)} field 'symbol'") and "not in bhavcopy.csv" in reason


def test_note_numbers_are_never_issued_twice_when_redis_loses_them(tmp_path):
    from pipeline.embedded import start_redis

    redis = start_redis(tmp_path / "redis")
    try:
        inputs = open_store(str(write_day(tmp_path / "in")))
        store = open_store(str(tmp_path / "store"))
        numbers = []
        for run in ("first", "second", "third"):
            state = RunState(redis.url, run)
            save_manifest(store, run, split_day(inputs, store, state, run, DATE, 100, "CNT"))
            numbers.append(find_account(store, run, "H1")["note_no"])
            state.r.flushall()  # Redis restarted without persistence
        assert numbers == ["CNT-26/27-0000001", "CNT-26/27-0000002", "CNT-26/27-0000003"]
    finally:
        redis.stop()


@pytest.mark.parametrize("trade_date,settles", [
    ("2026-11-23", "2026-11-25"),  # Guru Nanak Jayanti on the 24th
    ("2026-03-30", "2026-04-01"),  # Mahavir Jayanti on the 31st
    ("2026-11-20", "2026-11-23"),  # Friday -> Monday
    ("2026-11-21", "2026-11-23"),  # a Saturday trade date still settles on a trading day
    ("2026-11-08", "2026-11-09"),  # Muhurat trading on a Sunday holiday
    ("2026-11-09", "2026-11-11"),  # Diwali Balipratipada on the 10th
])
def test_settlement_is_the_next_trading_day_of_the_exchange(trade_date, settles):
    from pipeline.day import trading_calendar

    # MCX's evening sessions on the equity holidays here settle nothing, so it settles with NSE
    assert trading_calendar.settlement_dates(trade_date) == {"NSE": settles, "BSE": settles, "MCX": settles}


def test_a_trade_date_that_is_not_a_trading_day_is_flagged_and_a_special_session_is_named():
    from pipeline.day import trading_calendar

    assert trading_calendar.trade_date_warnings("2026-11-20") == []
    saturday = trading_calendar.trade_date_warnings("2026-11-21")
    assert len(saturday) == 3 and "not a NSE trading day (weekend)" in saturday[0]  # NSE, BSE and MCX
    assert "special session (Muhurat trading" in trading_calendar.trade_date_warnings("2026-11-08")[0]
    assert "(Christmas)" in trading_calendar.trade_date_warnings("2026-12-25")[0]


def test_a_broker_supplied_holiday_file_overrides_and_a_year_without_a_list_is_an_error(tmp_path):
    from pipeline.day import trading_calendar

    extra = tmp_path / "holidays.json"
    extra.write_text('{"NSE": {"2026": {"holidays": {"2026-11-25": "declared"}}},'
                     ' "BSE": {"2027": {"holidays": {}}}}')
    # the broker's NSE 2026 replaces ours whole (a holiday moved is a holiday removed)
    assert trading_calendar.settlement_dates("2026-11-23", str(extra))["NSE"] == "2026-11-24"
    assert trading_calendar.settlement_dates("2026-11-24", str(extra))["NSE"] == "2026-11-26"
    assert trading_calendar.settlement_dates("2026-11-23", str(extra))["BSE"] == "2026-11-25"
    with pytest.raises(trading_calendar.CalendarError, match="no NSE trading-holiday list for 2027"):
        trading_calendar.settlement_dates("2027-01-04", str(extra))


def test_the_tax_invoice_names_the_sac_code_and_the_reverse_charge(tmp_path, redis_url):
    text, _ = split_and_render(tmp_path, redis_url, "sac")
    flat = re.sub(r"\s+", " ", text)
    assert "SAC 997152 (stockbroking services)" in flat and "Tax payable on reverse charge: No" in flat


def test_cells_are_never_cut_in_the_stored_lines(tmp_path, redis_url):
    _, note = split_and_render(tmp_path, redis_url, "widths")
    lines = [line for page in note["pages"] for g in page["groups"] for line in g["lines"]]
    assert any("(1,00,00,00,000.00)" in line for line in lines)
    head = note["levies"]["head"]
    assert max(len(line) for line in note["levies"]["lines"]) <= len(head)
    assert note["mono_size"] <= 6.8 and note["levies_size"] <= 6.8



KINDS = [("CM", "CNC", "EQ"), ("CM", "MIS", "EQ"), ("FO", "NRML", "FUTSTK"), ("FO", "NRML", "FUTIDX"),
         ("FO", "NRML", "OPTIDX"), ("CDS", "NRML", "FUTCUR"), ("CDS", "MIS", "OPTCUR"), ("COM", "NRML", "FUTCOM"),
         ("COM", "NRML", "OPTFUT")]
# where a currency or commodity kind trades, its lot multiplier and whether it is agricultural
LOT_TERMS = {"CDS": (("NSE", "BSE"), 1000, ""), "COM": (("MCX", "NCDEX"), 100, "N")}
day_strategy = st.lists(
    st.tuples(st.sampled_from(KINDS), st.sampled_from(["NSE", "BSE"]), st.sampled_from("BS"),
              st.integers(1, 200_000), st.decimals(D("0.05"), D("150000"), places=2),
              st.decimals(D("0.05"), D("150000"), places=2), st.integers(0, 6), st.integers(0, 3)),
    min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(day_strategy, st.booleans())
def test_every_note_reconciles_row_by_row_column_by_column_segment_by_segment(specs, intra):
    from pipeline.day.dumps import Trade
    from pipeline.note.charges import compute, net_totals
    from pipeline.note.content import build_note, money
    from pipeline.stages import broker

    trades = []
    for i, ((segment, product, instrument), exchange, side, qty, price, close, order, contract) in enumerate(specs):
        exchange = "NSE" if segment == "FO" else exchange
        exchanges, multiplier, agri = LOT_TERMS.get(segment, ((exchange,), 1, ""))
        exchange = exchanges[contract % len(exchanges)]
        agri = "Y" if agri and exchange == "NCDEX" and contract % 2 else agri
        derivative = segment != "CM"
        # a currency contract in three is a cross-currency pair, valued at a reference rate of six places
        cross = segment == "CDS" and contract % 3 == 0
        trades.append(Trade(DATE, exchange, segment, f"{segment}1", "H1", N(order or 100 + i), "10:00:00", N(i % 5),
                            "10:00:01", ("USDJPY" if cross else f"SYM{contract}"), "", instrument,
                            "2026-11-26" if derivative else "", "100" if instrument.startswith("OPT") else "",
                            "CE" if instrument.startswith("OPT") else "", side, qty, price, product, "11",
                            close if derivative else None, multiplier, agri, D("0.556789") if cross else None))
    trades = sorted({t.key: t for t in trades}.values(), key=lambda t: (t.exchange, t.segment, t.trade_no))
    b = broker()
    charges = compute(trades, DATE, intra, b["tariff"])
    rows, carried = net_totals(trades, charges)
    # row by row: the gross value less the exact pro-rata brokerage, within the paisa the residue moves
    for t in trades:
        order = [o for o in trades if o.order_key == t.order_key]
        order_brokerage = sum(charges.brokerage_share[o.key] for o in order)
        gross = t.quantity * t.multiplier * t.price * (t.fx or 1)  # worked out here, not by Trade.turnover
        exact = (gross if t.side == "S" else -gross) - order_brokerage * t.quantity / sum(o.quantity for o in order)
        assert abs(rows[t.key] - exact) <= D("0.015")
    # segment by segment: the column sums to obligation - brokerage, exactly
    for segment, levies in charges.segments.items():
        column = [v for t, v in ((t, rows[t.key]) for t in trades) if f"{t.exchange}-{t.segment}" == segment]
        column += [carried[i] for i, c in enumerate(charges.carried)
                   if f"{c.trade.exchange}-{c.trade.segment}" == segment]
        assert sum(column) == levies.obligation - levies.brokerage
    # Total = sum of segments, for every line of the levies table
    total = charges.total
    for f in ("obligation", "brokerage", "stt", "ctt", "txn", "sebi", "stamp", "ipft", "cgst", "sgst", "igst"):
        assert getattr(total, f) == sum(getattr(s, f) for s in charges.segments.values())
    assert total.net == sum(s.net for s in charges.segments.values())
    # and the printed lines carry exactly those amounts, never cut
    note = build_note(Client(**CLIENT), trades, charges, b, DATE, "CNT-26/27-0000001", {"NSE": DATE, "BSE": DATE})
    printed = [line for page in note["pages"] for g in page["groups"] for line in g["lines"]]
    assert len(printed) == len(trades) + len(charges.carried)
    expected = sorted([money(v) for v in rows.values()] + [money(v) for v in carried.values()])
    assert sorted(next(tok for tok in line.split() if MONEY.match(tok)) for line in printed) == expected


def test_the_trade_table_s_columns_stand_apart_in_headings_and_values():
    """Before, one space between columns ran "Gross Rate" into "Brokerage", and two values one
    space apart read as one."""
    from pipeline.note.content import table_heads

    first, _ = table_heads()
    assert "Gross Rate  Brokerage" in first and "Rate Brokerage" not in first, first


def test_a_synthetic_day_s_mixed_clients_get_notes_whose_obligations_are_their_trades(tmp_path, redis_url):
    """Each mixed client's obligation per exchange and segment, worked out here from the trade file's
    rows (quantity x multiplier x price, open futures at the bhavcopy's settlement price), against the note."""
    import datetime as dt
    from collections import defaultdict

    from pipeline.day.dumps import effective_trades, parse_trade
    from pipeline.day.synth import SynthOptions, write_dumps

    write_dumps(tmp_path / "in", SynthOptions(dt.date(2026, 11, 20), 120, seed=11, segment_share=0.3))
    raw = list(csv.DictReader((tmp_path / "in" / "trades.csv").open(newline="")))
    bhav = {(r["Src"], r["TckrSymb"], r["XpryDt"], r["StrkPric"], r["OptnTp"]): D(r["SttlmPric"])
            for r in csv.DictReader((tmp_path / "in" / "bhavcopy.csv").open(newline=""))}
    # a cross pair's rupees at RBI's rate for the currency it is quoted in (JPY's given for 100 yen)
    rbi = {r["currency"]: D(r["rate"]) / int(r["units"])
           for r in csv.DictReader((tmp_path / "in" / "reference_rates.csv").open(newline=""))}
    inr = lambda t: rbi[{"EURUSD": "USD", "GBPUSD": "USD", "USDJPY": "JPY"}[t.symbol]] if t.symbol[3:] != "INR" \
        and t.segment == "CDS" else 1  # noqa: E731
    mixed = sorted({r["ucc"] for r in raw if r["segment"] in ("CDS", "COM")})
    assert len(mixed) >= 5
    store = open_store(str(tmp_path / "store"))
    split = split_day(open_store(str(tmp_path / "in")), store, RunState(redis_url, "mixed"), "mixed", "2026-11-20",
                      50, "CNT")
    assert split.rejected == 0
    save_manifest(store, "mixed", split)
    for ucc in mixed[:8]:
        mine = effective_trades([parse_trade("t", n, r, "2026-11-20") for n, r in enumerate(raw, 1) if r["ucc"] == ucc])
        expected: dict[str, D] = defaultdict(D)
        open_lots: dict[tuple, int] = defaultdict(int)
        for t in mine:
            units = t.quantity * (1000 if t.segment == "CDS" else int(t.multiplier))
            expected[f"{t.exchange}-{t.segment}"] += units * t.price * inr(t) * (1 if t.side == "S" else -1)
            if t.instrument.startswith("FUT"):
                open_lots[(t.exchange, t.segment, t.symbol, t.expiry, inr(t))] += units * (1 if t.side == "B" else -1)
        for (exchange, segment, symbol, expiry, rate), units in open_lots.items():
            expected[f"{exchange}-{segment}"] += units * bhav[(exchange, symbol, expiry, "", "")] * rate
        account = find_account(store, "mixed", ucc)
        note = stages.note_data(account, Client(**account["client"]), "2026-11-20", {"NSE": "2026-11-23",
                                                                                     "BSE": "2026-11-23"})
        obligation = note["levies"]["lines"][0].split()[2:]  # after "Pay-in/Pay-out obligation"
        heads = note["levies"]["head"].split()[1:-2]
        assert heads == sorted(expected), ucc
        assert [amount(v) for v in obligation[:-1]] == [expected[h].quantize(D("0.01")) for h in heads], ucc
    text = pdftotext(render(note), tmp_path)
    assert "(commodity derivatives)" in text or "(currency derivatives)" in text


def test_a_day_after_1_april_2027_takes_the_new_financial_year_s_note_numbers(tmp_path):
    """One sequence per financial year (April to March): 31 March 2027 is the last day of 2026-27,
    1 April 2027 starts 2027-28 at 1, and a late rerun of 31 March carries on 2026-27's sequence."""
    from pipeline.embedded import start_redis

    redis = start_redis(tmp_path / "redis")
    store = open_store(str(tmp_path / "store"))
    try:
        numbers = []
        for run, date in [("mar31", "2027-03-31"), ("apr01", "2027-04-01"), ("apr02", "2027-04-02"),
                          ("mar31-again", "2027-03-31")]:
            day = [{**r, "trade_date": date} for r in HAND_MADE if r["segment"] == "CM"]
            inputs = open_store(str(write_day(tmp_path / run, trades=day)))
            save_manifest(store, run, split_day(inputs, store, RunState(redis.url, run), run, date, 100, "CNT"))
            numbers.append(find_account(store, run, "H1")["note_no"])
        assert numbers == ["CNT-26/27-0000001", "CNT-27/28-0000001", "CNT-27/28-0000002", "CNT-26/27-0000002"]
    finally:
        redis.stop()


def test_a_rate_that_changes_on_a_date_applies_by_trade_date(tmp_path):
    """A new schedule from 2027-04-01 (a made-up change: CTT on commodity futures to 0.02% and NSE's
    currency futures charge to 0.0004%) leaves 31 March's trades at the old rates."""
    import json

    from pipeline.day.dumps import Trade
    from pipeline.note.charges import RATES_FILE, compute
    from pipeline.stages import broker

    data = json.loads(RATES_FILE.read_text())
    changed = json.loads(json.dumps(data["schedules"][-1]))
    changed["effective_from"] = "2027-04-01"
    changed["ctt"]["commodity_futures"] = ["0.0002", "sell"]
    changed["txn"]["NSE"]["currency_futures"] = "0.000004"
    data["schedules"].append(changed)
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps(data))

    def levies(date: str, segment: str, exchange: str, symbol: str, price: str, multiplier: int):
        t = Trade(date, exchange, segment, "S1", "H1", N(1), "10:00:00", N(2), "10:00:01", symbol, "", "FUT" + (
            "COM" if segment == "COM" else "CUR"), "2027-04-28", "", "", "S", 1, D(price), "NRML", "11", D(price),
            multiplier, "N" if segment == "COM" else "")
        return compute([t], date, True, broker()["tariff"], rates).total

    # gold: 1 x 100 x 76,543 = 76,54,300 sold: CTT 0.01% = 765.43 -> 765, then 0.02% = 1,530.86 -> 1,531
    assert levies("2027-03-31", "COM", "MCX", "GOLD", "76543", 100).ctt == D(765)
    assert levies("2027-04-01", "COM", "MCX", "GOLD", "76543", 100).ctt == D(1531)
    # USDINR: 1 x 1,000 x 84.1250 = 84,125: 0.00035% = 0.2944 -> 0.29, then 0.0004% = 0.3365 -> 0.34
    assert levies("2027-03-31", "CDS", "NSE", "USDINR", "84.1250", 1000).txn == D("0.29")
    assert levies("2027-04-01", "CDS", "NSE", "USDINR", "84.1250", 1000).txn == D("0.34")


def test_a_note_across_every_segment_signs_and_verifies_with_pdfsig_and_qpdf(tmp_path, redis_url, keys_dir):
    from pipeline.seal.sign import SignatureInfo, protect
    from pipeline.seal.signer import load_signer
    from tests.helpers import assert_signed_and_encrypted

    _, note = split_and_render(tmp_path, redis_url, "every-segment-signed", EVERY_SEGMENT, EVERY_BHAVCOPY)
    signer = load_signer(str(keys_dir / "signer.key.pem"), str(keys_dir / "signer.cert.pem"), None,
                         str(keys_dir / "root.cert.pem"))
    path = tmp_path / "signed.pdf"
    path.write_bytes(protect(render(note), CLIENT["pan"].lower(), "owner-secret", signer, SignatureInfo(), "aes256"))
    assert_signed_and_encrypted(path, CLIENT["pan"])


def test_every_account_of_an_every_segment_day_agrees_with_an_independent_recomputation(tmp_path, redis_url):
    """tests/recompute.py works every figure out again from the input files alone; every account's
    levies table, rows and Net Total columns agree with it, EVERY1's across all eight segments, and
    SETTLE1's exercises, assignments and deliveries."""
    from tests.every_segment_day import DATE as DAY
    from tests.every_segment_day import SEGMENTS, SETTLE_SEGMENTS, UCC, note_text, write_every_segment_day
    from tests.recompute import recompute, check_text

    folder = write_every_segment_day(tmp_path / "in", 30, seed=5, settlements=True)
    store = open_store(str(tmp_path / "store"))
    split = split_day(open_store(str(folder)), store, RunState(redis_url, "every"), "every", DAY, 10, "CNT")
    assert split.rejected == 0 and split.input_errors == []
    save_manifest(store, "every", split)
    expected = recompute(folder, DAY)
    assert sorted(expected[UCC]) == SEGMENTS and sorted(expected["SETTLE1"]) == SETTLE_SEGMENTS
    assert len(expected) == split.accounts == 32
    for ucc, figures in expected.items():
        account = find_account(store, "every", ucc)
        note = stages.note_data(account, Client(**account["client"]), DAY, {"NSE": "2026-11-23", "BSE": "2026-11-23"})
        assert check_text(note_text(note), figures) == [], ucc
    # and the checker is not blind: a paisa more of brokerage on one segment is found
    wrong = {**expected[UCC], "MCX-COM": {**expected[UCC]["MCX-COM"],
                                          "brokerage": expected[UCC]["MCX-COM"]["brokerage"] + D("0.01")}}
    assert any(w.startswith("Brokerage:") for w in check_text(note_text(note_of(store, UCC, DAY)), wrong))


def note_of(store, ucc: str, day: str) -> dict:
    account = find_account(store, "every", ucc)
    return stages.note_data(account, Client(**account["client"]), day, {"NSE": "2026-11-23", "BSE": "2026-11-23"})
