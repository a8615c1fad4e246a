"""Each exchange's own calendar: MCX trades on equity holidays in its evening session, a day
is refused only when no exchange of its trades held a session, and a trade on a shut exchange
rejects its account."""

from __future__ import annotations

import pytest

from pipeline.day import trading_calendar as cal
from pipeline.day.split import split_day
from pipeline.record.state import RunState
from pipeline.record.storage import open_store
from tests.test_note_correctness import CLIENT, N, bhav, lots, row, write_day

HOLI = "2026-03-03"  # NSE and BSE shut; MCX's morning session shut, its evening session open


def test_mcx_keeps_its_own_2026_calendar():
    # shut all day on Republic Day, as NSE and BSE; NCDEX's list is not shipped, so it is not said
    assert cal.closed_exchanges("2026-01-26") == {"NSE": "Republic Day", "BSE": "Republic Day", "MCX": "Republic Day"}
    # Holi: MCX trades in its evening session, so it is not shut, but its trades settle the next full day
    assert cal.closed_exchanges(HOLI) == {"NSE": "Holi", "BSE": "Holi"}
    assert cal.settlement_dates("2026-03-02") == {"NSE": "2026-03-04", "BSE": "2026-03-04", "MCX": "2026-03-04"}
    assert cal.settlement_dates(HOLI)["MCX"] == "2026-03-04"
    # 15 January: NSE's municipal-election holiday is not on MCX's list, which trades and settles
    assert cal.closed_exchanges("2026-01-15") == {"NSE": "Municipal Corporation Election - Maharashtra",
                                                  "BSE": "Municipal Corporation Election - Maharashtra"}
    assert cal.settlement_dates("2026-01-14")["MCX"] == "2026-01-15"
    # a settlement holiday: MCX trades on 19 February and settles nothing, so the 18th settles on the 20th
    assert cal.settlement_dates("2026-02-18") == {"NSE": "2026-02-19", "BSE": "2026-02-19", "MCX": "2026-02-20"}
    assert "2026-02-19" not in cal.closed_exchanges("2026-02-19")
    # the year's last trading day settles in a year MCX has no list for: its note says so, NSE's is an error
    with pytest.raises(cal.CalendarError, match="no NSE trading-holiday list for 2027"):
        cal.settlement_dates("2026-12-31")


def test_the_run_report_names_an_evening_only_day_and_a_settlement_holiday():
    warned = cal.trade_date_warnings(HOLI)
    assert warned[:2] == ["2026-03-03 is not a NSE trading day (Holi) and no special session is listed",
                          "2026-03-03 is not a BSE trading day (Holi) and no special session is listed"]
    assert warned[2] == "2026-03-03 is not a regular MCX trading day: evening session only (Holi)"
    assert cal.trade_date_warnings("2026-02-19") == [
        "2026-02-19 is a MCX settlement holiday (Chhatrapati Shivaji Maharaj Jayanti): it trades, and settles on "
        "the next trading day"]


def test_a_day_is_refused_only_when_none_of_its_exchanges_held_a_session():
    assert cal.no_session(HOLI) is None  # MCX's evening session
    assert cal.no_session(HOLI, exchanges={"MCX"}) is None
    assert cal.no_session(HOLI, exchanges={"NSE", "BSE"}) == (
        "2026-03-03 is not a NSE trading day (Holi) and no special session is listed; "
        "2026-03-03 is not a BSE trading day (Holi) and no special session is listed")
    # NCDEX's list is not given: on a day NSE and BSE are shut, its trades need it
    assert "no NCDEX holiday list for 2026 says whether it traded" in cal.no_session(HOLI, exchanges={"NCDEX"})
    said = cal.no_session("2026-01-26")
    assert said.startswith("2026-01-26 is not a NSE trading day (Republic Day)") and "MCX trading day" in said
    assert cal.no_session("2026-11-08") is None  # Muhurat trading on a Sunday


def test_a_broker_s_file_gives_ncdex_its_year_and_mcx_its_settlement_holidays(tmp_path):
    extra = tmp_path / "holidays.json"
    extra.write_text('{"NCDEX": {"2026": {"holidays": {"2026-03-03": "Holi"}}},'
                     ' "MCX": {"2026": {"holidays": {}, "settlement_holidays": {"2026-03-05": "a bank holiday"}}}}')
    assert cal.closed_exchanges(HOLI, str(extra)) == {"NSE": "Holi", "BSE": "Holi", "NCDEX": "Holi"}
    # the broker's MCX year replaces ours whole: Holi is an ordinary MCX day in it, the 5th settles nothing
    assert cal.settlement_dates("2026-03-02", str(extra))["MCX"] == "2026-03-03"
    assert cal.settlement_dates("2026-03-04", str(extra))["MCX"] == "2026-03-06"
    assert cal.settlement_dates("2026-03-04", str(extra))["NCDEX"] == "2026-03-05"
    assert cal.no_session(HOLI, str(extra), {"NCDEX"}).startswith("2026-03-03 is not a NCDEX trading day (Holi)")


GOLD = lots("MCX", "COM", "FUTCOM", "GOLD", "2026-04-03", "S", "1", "76543", 300, "100", "N")
GOLD_BHAV = bhav("MCX", "CO", "FUTCOM", "GOLD", "2026-04-03", "76500")


def on(date: str, r: dict) -> dict:
    return {**r, "trade_date": date, "trade_time": "18:30:00", "order_time": "18:29:50"}


def test_on_an_mcx_only_day_its_trades_make_notes_and_a_trade_on_a_shut_exchange_rejects_its_account(
        tmp_path, redis_url):
    other = dict(CLIENT, ucc="H2", pan="ABCDE1235F")
    trades = [on(HOLI, GOLD), on(HOLI, row(ucc="H2", order_no=N(400), trade_no=N(401), quantity="1", price="820"))]
    inputs = open_store(str(write_day(tmp_path / "in", trades=trades, bhav=[{**GOLD_BHAV, "TradDt": HOLI}],
                                      clients=(CLIENT, other))))
    state = RunState(redis_url, "holi")
    split = split_day(inputs, open_store(str(tmp_path / "store")), state, "holi", HOLI, 100, "CNT")
    assert (split.accounts, split.rejected) == (1, 1)
    assert state.accounts(["H2"])["H2"]["reason"] == (
        "trades.csv row 2 field 'exchange': NSE held no session on 2026-03-03 (Holi)")


@pytest.mark.parametrize("exchange_rows, refused", [
    ("MCX", None),
    ("NSE", "--date 2026-03-03: no exchange of the day's trades traded that day (the first and last rows of "
            "trades.csv are on NSE: 2026-03-03 is not a NSE trading day (Holi)"),
])
def test_the_run_s_preflight_takes_an_mcx_only_day_and_refuses_one_whose_trades_are_all_on_shut_exchanges(
        exchange_rows, refused, settings, tmp_path):
    from pipeline.cluster.driver import RunRequest, preflight
    from pipeline.settings import ConfigError

    trade = GOLD if exchange_rows == "MCX" else row(order_no=N(400), trade_no=N(401), quantity="1", price="820")
    folder = write_day(tmp_path / "in", trades=[on(HOLI, trade)], bhav=[{**GOLD_BHAV, "TradDt": HOLI}])
    if refused is None:
        preflight(settings, RunRequest(HOLI, str(folder)))
        return
    with pytest.raises(ConfigError) as e:
        preflight(settings, RunRequest(HOLI, str(folder)))
    assert str(e.value).startswith(refused), str(e.value)


def test_a_day_every_exchange_was_shut_is_refused_whatever_the_trades(settings, tmp_path):
    from pipeline.cluster.driver import RunRequest, preflight
    from pipeline.settings import ConfigError

    folder = write_day(tmp_path / "in", trades=[on("2026-01-26", GOLD)], bhav=[{**GOLD_BHAV, "TradDt": "2026-01-26"}])
    with pytest.raises(ConfigError, match=r"--date 2026-01-26: no exchange traded that day \(2026-01-26 is not a NSE "
                                          r"trading day \(Republic Day\)"):
        preflight(settings, RunRequest("2026-01-26", str(folder)))
