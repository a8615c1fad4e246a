from decimal import Decimal

import pytest

from pipeline.day.dumps import Trade, RowError, effective_trades, parse_client, parse_trade
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
