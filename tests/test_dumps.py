import re
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from pipeline.day import dumps
from pipeline.day.dumps import TRADE_FIELDS, Trade, RowError, effective_trades, parse_client, parse_trade
from pipeline.day.split import shard_count
from pipeline.record import keys

GOOD = {
    "trade_date": "2026-11-20", "exchange": "NSE", "segment": "CM", "settlement_no": "CM2026324",
    "ucc": "C1", "order_no": "0000000000000042", "order_time": "09:15:00", "trade_no": "0000000000000043",
    "trade_time": "09:15:01", "symbol": "INFY", "isin": "INE009A01021", "instrument": "EQ", "expiry": "",
    "strike": "", "option_type": "", "side": "B", "quantity": "10", "price": "1800.05", "product": "CNC",
    "status": "11",
}


def test_a_good_trade_keeps_identifiers_as_strings_and_money_as_decimal():
    t = parse_trade("trades.csv", 1, GOOD, "2026-11-20")
    assert t.order_no == "0000000000000042"
    assert t.price == Decimal("1800.05") and t.turnover == Decimal("18000.50")


def test_a_trade_comes_back_from_its_shard_row_field_for_field_with_and_without_a_closing_price():
    """from_row builds a Trade by position: a field added out of TRADE_FIELDS' order fails here."""
    for close in (None, Decimal("1799.4")):
        t = Trade(**{**parse_trade("trades.csv", 1, GOOD, "2026-11-20").__dict__, "close": close})
        assert Trade.from_row(t.as_row()) == t


@pytest.mark.parametrize("field,value,problem", [
    ("price", "abc", "not a number"),
    ("price", "-1", "not a number"),
    ("price", "NaN", "not a number"),
    ("price", "0", "outside 0.01"),
    ("quantity", "1.5", "not a whole number"),
    ("quantity", "0", "not a whole number"),
    ("trade_no", "123", "16-digit"),
    ("side", "X", "B or S"),
    ("trade_date", "2026-11-19", "run is for"),
    ("instrument", "FUTSTK", "not traded in segment CM"),
])
def test_a_bad_trade_row_names_file_row_and_field(field, value, problem):
    with pytest.raises(RowError) as e:
        parse_trade("trades.csv", 7, {**GOOD, field: value}, "2026-11-20")
    assert (e.value.file, e.value.row, e.value.field, e.value.ucc) == ("trades.csv", 7, field, "C1")
    assert problem in str(e.value) and "trades.csv row 7" in str(e.value)


def test_a_bad_client_row_names_the_field():
    row = {"ucc": "C1", "name": "A", "pan": "ABCDE1234", "email": "a@example.com", "address": "x",
           "state": "Karnataka", "gst_state_code": "29", "ecn_opt_in": "Y"}
    with pytest.raises(RowError, match="clients.csv row 3 field 'pan'"):
        parse_client("clients.csv", 3, row)
    assert parse_client("clients.csv", 3, {**row, "pan": "abcde1234f"}).pan == "ABCDE1234F"


def test_cancelled_trades_vanish_and_modified_trades_replace_the_original():
    t = lambda **kw: parse_trade("t", 1, {**GOOD, **kw}, "2026-11-20")  # noqa: E731
    trades = [t(), t(status="12", quantity="9"), t(trade_no="0000000000000044"),
              t(trade_no="0000000000000044", status="13")]
    kept = effective_trades(trades)
    assert [(x.trade_no, x.quantity, x.status) for x in kept] == [("0000000000000043", 9, "12")]


def test_trade_numbers_that_collide_across_exchanges_are_two_trades_and_a_modification_stays_in_its_own():
    t = lambda **kw: parse_trade("t", 1, {**GOOD, **kw}, "2026-11-20")  # noqa: E731
    nse, bse = t(), t(exchange="BSE", side="S")
    kept = effective_trades([nse, bse, t(exchange="BSE", side="S", status="12", price="1800.10")])
    assert [(x.exchange, x.price) for x in kept] == [("BSE", Decimal("1800.10")), ("NSE", Decimal("1800.05"))]
    assert nse.key != bse.key and nse.order_key != bse.order_key


def test_a_derivatives_row_needs_a_real_expiry_and_an_option_a_numeric_strike():
    fut = {**GOOD, "segment": "FO", "instrument": "FUTIDX", "product": "NRML", "symbol": "NIFTY", "isin": ""}
    for field, value, problem in [("expiry", "garbage", "not a date"), ("expiry", "2026-11-19", "before the trade date")]:
        with pytest.raises(RowError, match=problem) as e:
            parse_trade("trades.csv", 4, {**fut, field: value}, "2026-11-20")
        assert e.value.field == field
    opt = {**fut, "instrument": "OPTIDX", "expiry": "2026-11-26", "option_type": "CE"}
    with pytest.raises(RowError, match="strike"):
        parse_trade("trades.csv", 5, {**opt, "strike": "abc"}, "2026-11-20")


def test_shards_are_a_multiple_of_partitions_so_each_shard_has_one_prefix():
    assert shard_count(1, 100) == 20 and shard_count(3001, 100) == 40
    for ucc in ("C1", "C0000042", "ZZ9"):
        k = keys.shard_of(ucc, 30)
        assert keys.shard_key("r", k).startswith(f"{keys.partition(ucc)}-contract-notes-data/")
        assert keys.signed_pdf_key("2026-11-20", ucc).startswith(f"{keys.partition(ucc)}-signed-pdf/")


def test_the_shard_holding_the_heaviest_account_is_dispatched_first(redis_url, tmp_path):
    import datetime as dt

    from pipeline.day.split import split_day
    from pipeline.day.synth import SynthOptions, write_dumps
    from pipeline.record.state import RunState
    from pipeline.record.storage import open_store
    from pipeline.stages import load_shard

    write_dumps(tmp_path / "in", SynthOptions(dt.date(2026, 11, 20), 60, seed=3))
    store = open_store(str(tmp_path / "store"))
    split = split_day(open_store(str(tmp_path / "in")), store, RunState(redis_url, "heavy"), "heavy",
                      "2026-11-20", 5, "CNT")
    counted = {s: sum(len(a["trades"]) for a in load_shard(store, "heavy", s)) for s in split.shards}
    assert dict(zip(split.shards, split.trades)) == counted
    order = split.heaviest_first(split.shards)
    assert [counted[s] for s in order] == sorted(counted.values(), reverse=True)


USDINR = {**GOOD, "segment": "CDS", "settlement_no": "CD2026324", "symbol": "USDINR", "isin": "",
          "instrument": "FUTCUR", "expiry": "2026-11-26", "product": "NRML", "quantity": "3", "price": "84.1225"}
GOLD = {**GOOD, "exchange": "MCX", "segment": "COM", "settlement_no": "CO2026324", "symbol": "GOLD", "isin": "",
        "instrument": "FUTCOM", "expiry": "2027-02-05", "product": "NRML", "quantity": "1", "price": "76543",
        "multiplier": "100", "agri": "N"}


def test_a_currency_lot_is_a_thousand_units_priced_to_four_places():
    t = parse_trade("trades.csv", 1, USDINR, "2026-11-20")
    assert (t.multiplier, t.agri) == (1000, "")
    assert t.turnover == Decimal("252367.5000")  # 3 lots x 1,000 USD x 84.1225
    premium = parse_trade("trades.csv", 1, {**USDINR, "instrument": "OPTCUR", "strike": "84.25", "option_type": "CE",
                                            "price": "0.0025", "multiplier": "1000"}, "2026-11-20")
    assert premium.turnover == Decimal("7.5000")  # a premium under a paisa is a currency option's tick


def test_a_commodity_row_carries_its_multiplier_and_agricultural_flag():
    gold = parse_trade("trades.csv", 1, GOLD, "2026-11-20")
    assert (gold.multiplier, gold.agri, gold.turnover) == (100, "N", Decimal("7654300"))  # 1 kg at 76,543 per 10 g
    assert Trade.from_row(gold.as_row()) == gold
    guar = parse_trade("trades.csv", 1, {**GOLD, "exchange": "NCDEX", "symbol": "GUARSEED10", "multiplier": "10",
                                         "agri": "Y", "price": "5400"}, "2026-11-20")
    assert guar.agri == "Y" and guar.turnover == Decimal("54000")


def test_bse_index_options_are_an_fo_trade_of_bse():
    sensex = {**GOOD, "exchange": "BSE", "segment": "FO", "symbol": "SENSEX", "isin": "", "instrument": "OPTIDX",
              "expiry": "2026-11-26", "strike": "80000", "option_type": "PE", "product": "NRML", "quantity": "20",
              "price": "310.5"}
    assert parse_trade("trades.csv", 1, sensex, "2026-11-20").turnover == Decimal("6210.0")


@pytest.mark.parametrize("base,field,value,problem", [
    (GOLD, "multiplier", "", "not a whole number"),
    (GOLD, "multiplier", "0", "not a whole number"),
    (GOLD, "agri", "", "must be Y"),
    (GOLD, "exchange", "NSE", "MCX or NCDEX in segment COM"),
    (GOLD, "instrument", "FUTCUR", "not traded in segment COM"),
    (GOLD, "expiry", "", "not a date"),
    (USDINR, "multiplier", "100", "must be 1000"),
    (USDINR, "symbol", "EURGBP", "not a currency pair taken"),
    (USDINR, "symbol", "USDINRX", "not a currency pair taken"),
    (USDINR, "symbol", "AUDINR", "not a currency pair taken"),  # before: any XXXINR, a lot of 1,000 (an exercise charged)
    ({**USDINR, "symbol": "EURUSD"}, "price", "10000", "not a EURUSD quote"),
    (USDINR, "exchange", "MCX", "BSE or NSE in segment CDS"),
    (USDINR, "agri", "N", "only for commodities"),
    (USDINR, "price", "0.00001", "not a number"),
    (GOOD, "multiplier", "10", "must be 1"),
    (GOLD, "quantity", "10000001", "over 1,000,000,000 units"),
    (USDINR, "quantity", "1000001", "over 1,000,000,000 units"),
    (GOOD, "segment", "CUR", "CM, FO, CDS or COM"),
])
def test_a_row_that_does_not_fit_its_segment_names_the_field(base, field, value, problem):
    with pytest.raises(RowError) as e:
        parse_trade("trades.csv", 9, {**base, field: value}, "2026-11-20")
    assert (e.value.row, e.value.field, e.value.ucc) == (9, field, "C1")
    assert problem in str(e.value)


def test_the_fast_check_agrees_with_parse_trade_on_the_new_segments():
    from pipeline.day.dumps import TRADE_FIELDS, trade_row

    closes = {("NSE", "CDS", "FUTCUR", "USDINR", "2026-11-26", None, ""): Decimal("84.2"),
              ("MCX", "COM", "FUTCOM", "GOLD", "2027-02-05", None, ""): Decimal("76600")}
    cases = [USDINR, {**USDINR, "multiplier": "1000"}, GOLD, {**GOLD, "agri": ""}, {**USDINR, "symbol": "EURGBP"},
             {**USDINR, "symbol": "AUDINR"},
             {**USDINR, "symbol": "EURUSD"},
             {**GOLD, "exchange": "BSE"}, {**GOOD, "multiplier": "1"}, {**GOOD, "agri": "Y"},
             {**GOLD, "quantity": "10000001"}, {**USDINR, "quantity": "1000000"}, {**USDINR, "quantity": "1000001"}]
    for n, raw in enumerate(cases, 1):
        values = [raw.get(f, "") for f in TRADE_FIELDS]
        try:
            want = parse_trade("trades.csv", n, raw, "2026-11-20", closes).as_row()
        except RowError as e:
            with pytest.raises(RowError, match=re.escape(str(e))):
                trade_row("trades.csv", n, values, "2026-11-20", closes, {})
            continue
        assert trade_row("trades.csv", n, values, "2026-11-20", closes, {}) == want, raw


def test_the_bhavcopy_prices_currency_and_commodity_contracts_and_refuses_a_stranger_type():
    from pipeline.day import bhavcopy

    head = "TradDt,Src,Sgmt,FinInstrmTp,TckrSymb,XpryDt,StrkPric,OptnTp,ClsPric,SttlmPric"
    lines = [head, "2026-11-20,NSE,CD,FUTCUR,USDINR,2026-11-26,,,84.2000,84.1975",
             "2026-11-20,MCX,CO,OPTFUT,GOLD,2027-01-27,77000,CE,1210.5,1211",
             "2026-11-20,NCDEX,CO,IDF,GUARSEED10,2026-12-19,,,5400,5400"]
    errors: list[dict] = []
    closes = bhavcopy.read(lines, "2026-11-20", errors)
    assert closes == {("NSE", "CDS", "FUTCUR", "USDINR", "2026-11-26", None, ""): Decimal("84.1975"),
                      ("MCX", "COM", "OPTFUT", "GOLD", "2027-01-27", Decimal("77000"), "CE"): Decimal("1210.5")}
    assert [(e["row"], e["field"]) for e in errors] == [(3, "FinInstrmTp")]


def test_a_trade_file_without_the_multiplier_and_agri_columns_is_read_as_before(tmp_path, redis_url):
    import csv
    import datetime as dt

    from pipeline.day.split import split_day
    from pipeline.day.synth import SynthOptions, write_dumps
    from pipeline.record.state import RunState
    from pipeline.record.storage import open_store

    write_dumps(tmp_path / "in", SynthOptions(dt.date(2026, 11, 20), 30, seed=3))
    path = tmp_path / "in" / "trades.csv"
    rows = [r for r in csv.DictReader(path.open(newline="")) if r["segment"] in ("CM", "FO")]
    with path.open("w", newline="") as f:
        old = [c for c in rows[0] if c not in ("multiplier", "agri")]
        writer = csv.DictWriter(f, old, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    split = split_day(open_store(str(tmp_path / "in")), open_store(str(tmp_path / "s")), RunState(redis_url, "old"),
                      "old", "2026-11-20", 10, "CNT")
    assert split.rejected == 0 and split.accounts > 0


EURUSD = {**USDINR, "symbol": "EURUSD", "price": "1.0852"}
CROSS_CLOSES = {("NSE", "CDS", "FUTCUR", "EURUSD", "2026-11-26", None, ""): Decimal("1.0860"),
                ("NSE", "CDS", "FUTCUR", "USDJPY", "2026-11-26", None, ""): Decimal("150.25")}


def test_a_cross_currency_pair_is_valued_in_rupees_at_the_reference_rate_of_its_quote_currency():
    from pipeline.day import bhavcopy
    from pipeline.day.dumps import reference_key

    errors: list[dict] = []
    rates = bhavcopy.read_reference_rates(["date,currency,units,rate", "2026-11-19,USD,1,83.0000",
                                           "2026-11-20,USD,1,84.1234", "2026-11-20,JPY,100,55.12"], "2026-11-20", errors)
    assert errors == [] and rates == {reference_key("USD"): Decimal("84.1234"), reference_key("JPY"): Decimal("0.5512")}
    closes = {**CROSS_CLOSES, **rates}
    # 3 lots of 1,000 EUR at 1.0852 USD = 3,255.60 USD, at 84.1234 rupees a dollar = 2,73,872.14...
    eur = parse_trade("trades.csv", 1, EURUSD, "2026-11-20", closes)
    assert (eur.multiplier, eur.fx, eur.close) == (1000, Decimal("84.1234"), Decimal("1.0860"))
    assert eur.turnover == Decimal("3255.6000") * Decimal("84.1234") == Decimal("273872.14104")
    # USDJPY: 2 lots of 1,000 USD at 150.25 yen = 3,00,500 yen, at 0.5512 rupees a yen (55.12 a hundred)
    jpy = parse_trade("trades.csv", 1, {**EURUSD, "symbol": "USDJPY", "quantity": "2", "price": "150.25"},
                      "2026-11-20", closes)
    assert jpy.turnover == Decimal("165635.6")
    assert Trade.from_row(eur.as_row()) == eur and Trade.from_row(jpy.as_row()) == jpy
    assert Trade.from_row(parse_trade("trades.csv", 1, USDINR, "2026-11-20").as_row()).fx is None
    # no reference rate for the day: the row names its symbol and the file that lacks it
    with pytest.raises(RowError, match="EURUSD settles in rupees at RBI's reference rate for USD, and "
                                       "reference_rates.csv gives none for 2026-11-20") as e:
        parse_trade("trades.csv", 4, EURUSD, "2026-11-20", CROSS_CLOSES)
    assert (e.value.row, e.value.field) == (4, "symbol")


@pytest.mark.parametrize("line,field", [
    ("2026-11-20,usd,1,84.1", "currency"), ("2026-11-20,USDX,1,84.1", "currency"), ("2026-11-20,USD,10,84.1", "units"),
    ("2026-11-20,USD,1,0", "rate"), ("2026-11-20,USD,1,1000", "rate"), ("2026-11-20,USD,1,8e1", "rate"),
    ("2026-11-20,JPY,100,100000", "rate"),
])
def test_a_bad_reference_rate_row_is_an_input_error_naming_its_field(line, field):
    from pipeline.day import bhavcopy

    errors: list[dict] = []
    assert bhavcopy.read_reference_rates(["date,currency,units,rate", line], "2026-11-20", errors) == {}
    assert [(e["file"], e["row"], e["field"]) for e in errors] == [("reference_rates.csv", 1, field)]


def test_a_currency_given_twice_at_two_rates_has_no_rate_and_its_trades_are_rejected():
    from pipeline.day import bhavcopy

    errors: list[dict] = []
    rates = bhavcopy.read_reference_rates(["date,currency,units,rate", "2026-11-20,USD,1,84.1234",
                                           "2026-11-20,USD,1,84.2", "2026-11-20,JPY,100,55.12",
                                           "2026-11-20,JPY,100,55.1200"], "2026-11-20", errors)
    assert list(rates) == [("RBI", "JPY")]  # the same rate twice is one rate
    assert [(e["row"], e["field"]) for e in errors] == [(2, "rate")]


def test_a_trades_derived_values_are_the_same_however_it_was_made_and_survive_a_pickle():
    """turnover, key and order_key are slots filled when the trade is made (from_row fills them
    itself): the same as the fields give, kept through pickle and copy, and outside __dict__."""
    import copy
    import pickle

    for row in ({**GOOD, "quantity": "7"}, {**GOOD, "segment": "CDS", "symbol": "USDINR", "isin": "",
                                            "instrument": "FUTCUR", "expiry": "2026-11-26", "product": "NRML",
                                            "price": "83.1225", "multiplier": "1000"}):
        made = Trade(**{f: (int(v) if f in ("quantity", "multiplier") else Decimal(v) if f == "price" else v)
                        for f, v in row.items()})
        for t in (made, Trade.from_row(made.as_row()), pickle.loads(pickle.dumps(made)), copy.deepcopy(made)):
            assert t == made and "key" not in t.__dict__
            assert str(t.turnover) == str(made.price * made.quantity * made.multiplier)
            assert t.key == (t.exchange, t.segment, t.trade_no) and t.order_key == (t.exchange, t.segment, t.order_no)
        assert Trade(**Trade.from_row(made.as_row()).__dict__) == made


def test_from_row_takes_each_field_from_its_own_column():
    """A row of a distinct text a column: each field of the rebuilt trade is its column's (from_row
    names every column by its index)."""
    row = [f"v{i}" for i in range(len(TRADE_FIELDS))] + ["7.5"]
    row[TRADE_FIELDS.index("quantity")], row[TRADE_FIELDS.index("price")] = "3", "2.25"
    row[TRADE_FIELDS.index("multiplier")] = "5"
    t = Trade.from_row(row)
    for i, f in enumerate(TRADE_FIELDS):
        assert str(getattr(t, f)) == row[i], f
    assert t.close == Decimal("7.5") and t.turnover == Decimal("33.75")


def test_the_compiled_row_fill_is_its_twin_s_and_in_use():
    """rows.c fills a trade's text fields as dumps.filled does: the same dict, in the same order of
    keys, its interned fields interned and a trade's own not; a row it does not take (a tuple, a
    column missing, a number) is the twin's."""
    row = [f"v{i}" for i in range(len(TRADE_FIELDS))] + ["7.5"]
    row[TRADE_FIELDS.index("quantity")], row[TRADE_FIELDS.index("price")] = "3", "2.25"
    row[TRADE_FIELDS.index("multiplier")] = "5"
    row = ["".join(c) for c in row]  # texts of their own: not the interned constants
    canonical = [sys.intern("".join(c)) for c in row]  # the interned text of each, another object than the row's
    made = dumps._made(row)
    assert made is not None, "pipeline/native.py builds it: gcc and Python's headers"
    made = made.__dict__
    twin = dumps.filled(dumps._SHARED_DICT, dumps._TEXT_FIELDS, row)
    assert {k: made[k] for k, _, _ in dumps._TEXT_FIELDS} == {k: twin[k] for k, _, _ in dumps._TEXT_FIELDS}
    assert list(made) == list(dumps._SHARED_DICT) and made is not dumps._SHARED_DICT
    for key, column, interned in dumps._TEXT_FIELDS:
        assert made[key] is (canonical[column] if interned else row[column]), key
    for odd in (tuple(row), row[:10], [*row[:5], 5, *row[6:]]):
        assert dumps._made(odd) is None
    assert Trade.from_row(tuple(Trade.from_row(row).as_row())) == Trade.from_row(row)


def test_the_compiled_trade_is_its_twin_s_to_the_decimal_s_digits_and_declines_what_is_not_a_trade_s_row():
    """rows.c's made() builds a trade's row as from_row's Python lines do: the same fields in the
    same order, of the same types and digits (a Decimal's exponent is printed on the note), and
    the same derived slots; a settlement row, a legacy short row and a row that does not parse are
    declined (None) and go the Python way, which raises what it raises."""
    import json

    from bench.render import trades
    from pipeline.day.dumps import reference_key
    from tests.test_settlement import CRUDE_EX, GOLD_DL, NIFTY_AS, USDINR_EX, parsed

    closes = {**CROSS_CLOSES, reference_key("USD"): Decimal("84.1234")}
    cross = [parse_trade("trades.csv", 1, EURUSD, "2026-11-20", closes).as_row()]
    settled = [t.as_row() for t in parsed(NIFTY_AS, CRUDE_EX, USDINR_EX, GOLD_DL)]
    day = [t.as_row() for seed in (0, 10, 20, 3) for t in trades(40, seed)]  # seeds 0, 10, 20: every segment
    first, lot = day[0], next(r for r in day if r[dumps._AT_MULTIPLIER])
    odd = [[*first, "", "T"], [*first, ""], [*first, "", "T", "more"],  # the type given, fx empty, a column past
           [*lot[:dumps._AT_MULTIPLIER], f" 0{lot[dumps._AT_MULTIPLIER]}", *lot[dumps._AT_MULTIPLIER + 1:]]]
    day += odd
    rows = json.loads(json.dumps(day + cross + settled))  # as a shard file gives them
    slots = ("turnover", "key", "order_key", "exchange_segment", "flow")

    def whole(t: Trade) -> str:  # every field and slot, a Decimal by its digits, each with its type
        return repr([(k, type(v), v) for k, v in t.__dict__.items()] + [(s, getattr(t, s)) for s in slots])

    assert dumps._made(rows[0]) is not None, "pipeline/native.py builds it: gcc and Python's headers"
    taken = [dumps._made(row) for row in rows]
    assert all(t is not None for t in taken[:len(day) + len(cross)]) and taken[len(day) + len(cross):] == [None] * 4
    assert {t.segment for t in taken[:len(day)]} == {"CM", "FO", "CDS", "COM"} and taken[len(day)].fx is not None
    for t, row in zip(taken[:len(day)], rows):  # the fields of few values interned, a trade's own its row's
        for key, column, interned in dumps._TEXT_FIELDS:
            assert t.__dict__[key] is (sys.intern(row[column]) if interned else row[column]), key
    short = rows[0][:dumps._AT_MULTIPLIER] + rows[0][dumps._AT_MULTIPLIER + 2:-1]  # before multiplier and agri
    bad = [[*rows[0][:16], "ten", *rows[0][17:]], [*rows[0][:17], "1,800", *rows[0][18:]], [*rows[0][:16], 10, *rows[0][17:]]]
    assert dumps._made(short) is None and all(dumps._made(row) is None for row in bad)
    compiled = [Trade.from_row(row) for row in rows + [short]]
    assert [whole(dumps.from_row_in_python(Trade, row)) for row in rows + [short]] == list(map(whole, compiled))
    for row in bad[:2]:
        with pytest.raises((ValueError, ArithmeticError)):  # int() and Decimal()'s own refusals
            Trade.from_row(row)


def test_dumps_imported_again_makes_trades_of_its_own_class():
    """rows.c keeps what it builds with until dumps configures it again: a module imported afresh
    (a new Trade class) gets trades of its class from the C, not the first module's. In a process
    of its own: reloading dumps here would leave the session's other tests another Trade."""
    import subprocess

    code = """
import importlib, json
from pipeline.day import dumps
from bench.render import trades
rows = json.loads(json.dumps([t.as_row() for t in trades(20, 0)]))
first = [dumps.Trade.from_row(r) for r in rows]
again = importlib.reload(dumps)
second = [again.Trade.from_row(r) for r in rows]
assert again._made(rows[0]) is not None and {type(t) for t in second} == {again.Trade} != {type(t) for t in first}
assert [t.__dict__ for t in first] == [t.__dict__ for t in second]
print("ok")
"""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
