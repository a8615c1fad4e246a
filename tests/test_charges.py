"""The charges engine against hand-worked examples, and invariants over random days."""

from __future__ import annotations

from decimal import Decimal as D

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.day.dumps import Trade
from pipeline.note.charges import LEVY_FIELDS, compute, rates_for
from pipeline.stages import broker

TARIFF = broker()["tariff"]
NEW, OLD = "2026-11-20", "2025-06-02"  # under the 2026-04-01 and the 2024-10-01 schedules
_numbers = iter(range(10**15, 10**16))


def trade(side, qty, price, segment="CM", product="CNC", instrument="EQ", exchange="NSE", order=None, date=NEW,
          close=None, number=None, symbol="NIFTY"):
    n = number or f"{next(_numbers):016d}"
    return Trade(date, exchange, segment, f"{segment}2026324", "C1", order or n, "10:00:00", n, "10:00:01",
                 symbol, "", instrument, "2026-11-26" if segment == "FO" else "", "", "CE" if instrument.startswith(
                     "OPT") else "", side, qty, D(price), product, "11",
                 D(close or price) if segment == "FO" else None)


def levies(trades, date=NEW, intra=True):
    return compute(trades, date, intra, TARIFF).total


def test_delivery_buy_intra_state():
    # 100 x 1000.00 = 1,00,000. STT 0.1% = 100 (rupee); stamp 0.015% = 15.00; NSE txn 0.00297% = 2.97;
    # SEBI 0.10; IPFT 0.10; brokerage 0 (delivery is free); GST base 3.07 -> CGST = SGST = 0.28.
    t = levies([trade("B", 100, "1000.00")])
    assert (t.stt, t.stamp, t.txn, t.sebi, t.ipft, t.brokerage) == (D(100), D("15.00"), D("2.97"), D("0.10"),
                                                                     D("0.10"), D("0.00"))
    assert (t.cgst, t.sgst, t.igst) == (D("0.28"), D("0.28"), D(0))
    assert t.net == D("-100118.73")


def test_delivery_buy_inter_state_pays_igst_rounded_once():
    t = levies([trade("B", 100, "1000.00")], intra=False)
    assert (t.cgst, t.sgst, t.igst) == (D(0), D(0), D("0.55"))
    assert t.net == D("-100118.72")


def test_bse_delivery_uses_the_bse_transaction_rate_and_pays_no_ipft():
    # 1,00,000 bought on BSE: 0.00375% = 3.75; IPFT is NSE's Investor Protection Fund Trust's levy alone
    t = levies([trade("B", 100, "1000.00", exchange="BSE")])
    assert (t.txn, t.ipft) == (D("3.75"), D("0.00"))


def test_intraday_round_trip():
    # buy 100 x 500 = 50,000; sell 100 x 510 = 51,000. STT 0.025% of sells = 12.75 -> 13;
    # stamp 0.003% of buys = 1.50; txn 0.00297% of 1,01,000 = 3.00; SEBI 0.10; IPFT 0.10;
    # brokerage per order min(0.03%, 20): 15.00 + 15.30 = 30.30; IGST 18% of 33.40 = 6.01.
    t = levies([trade("B", 100, "500", product="MIS"), trade("S", 100, "510", product="MIS")], intra=False)
    assert (t.stt, t.stamp, t.txn, t.brokerage, t.igst) == (D(13), D("1.50"), D("3.00"), D("30.30"), D("6.01"))
    assert t.net == D("945.99")


def test_orders_with_one_number_on_two_exchanges_are_charged_each_on_its_own():
    # NSE buy 100 @ 820: 0.03% of 82,000 = 24.60, capped at 20 -> 0.2000 a unit;
    # BSE sell 10 @ 821: 0.03% of 8,210 = 2.463 -> 2.46 -> 0.2460 a unit.
    nse = trade("B", 100, "820", product="MIS", order="7" * 16, number="5" * 16)
    bse = trade("S", 10, "821", product="MIS", exchange="BSE", order="7" * 16, number="5" * 16)
    charges = compute([nse, bse], NEW, True, TARIFF)
    assert (charges.brokerage_per_unit(nse), charges.brokerage_per_unit(bse)) == (D("0.2000"), D("0.2460"))
    assert charges.total.brokerage == D("22.46")


def test_brokerage_is_per_order_and_capped():
    # one order filled in two trades: 0.03% of 2,00,000 = 60, capped at 20 for the order.
    t = levies([trade("S", 100, "1000", product="MIS", order="1" * 16),
                trade("S", 100, "1000", product="MIS", order="1" * 16)])
    assert t.brokerage == D("20.00")
    per_unit_trades = [trade("S", 100, "1000", product="MIS", order="2" * 16)]
    per_unit = compute(per_unit_trades, NEW, True, TARIFF)
    assert [per_unit.brokerage_per_unit(t) for t in per_unit_trades] == [D("0.2000")]  # 20 / 100 units


def test_futures_sell_under_new_and_old_rates():
    # 75 x 24,000 = 18,00,000. STT 0.05% = 900 (0.02% = 360 before 2026-04-01); txn 0.00173% = 31.14;
    # SEBI 1.80; IPFT 1.80; brokerage capped at 20; GST base 52.94 -> CGST = SGST = 4.76.
    # The short position is carried forward at the settlement price 23,900: the obligation is the
    # day's MTM, 75 x (24,000 - 23,900) = 7,500, not the notional 18,00,000.
    fut = dict(segment="FO", product="NRML", instrument="FUTIDX", close="23900")
    new = levies([trade("S", 75, "24000", **fut)])
    assert (new.stt, new.txn, new.sebi, new.ipft, new.stamp, new.cgst) == (D(900), D("31.14"), D("1.80"),
                                                                          D("1.80"), D("0.00"), D("4.76"))
    assert (new.sells, new.carry, new.obligation) == (D(1800000), D(-1792500), D("7500.00"))
    assert new.net == D("6535.74")
    old = levies([trade("S", 75, "24000", date=OLD, **fut)], date=OLD)
    assert old.stt == D(360) and old.net == D("7075.74")


def test_a_squared_off_future_carries_nothing_forward_and_its_obligation_is_the_realised_profit():
    fut = dict(segment="FO", product="NRML", instrument="FUTIDX", close="23900")
    charges = compute([trade("B", 75, "24000", **fut), trade("S", 75, "24010", **fut)], NEW, True, TARIFF)
    assert charges.carried == [] and charges.total.obligation == D("750.00")


def test_one_futures_buy_is_marked_to_market_not_shown_at_notional():
    # The case: one BANKNIFTY futures buy used to show a net payable of its notional value.
    t = trade("B", 30, "52000", segment="FO", product="NRML", instrument="FUTIDX", close="52105.5")
    charges = compute([t], NEW, True, TARIFF)
    (cf,) = charges.carried
    assert (cf.side, cf.quantity, cf.price) == ("S", 30, D("52105.5"))
    assert charges.total.obligation == D("3165.00")  # 30 x 105.50


def test_options_buy_and_sell_on_premium():
    # buy 75 x 100 premium = 7,500: stamp 0.003% = 0.225 -> 0.23; txn 0.03503% = 2.63; SEBI 0.01;
    # IPFT 0.0005% = 0.04; brokerage flat 20; IGST 18% of 22.64 = 4.08; no STT on a buy.
    opt = dict(segment="FO", product="NRML", instrument="OPTIDX")
    buy = levies([trade("B", 75, "100", **opt)], intra=False)
    assert (buy.stt, buy.stamp, buy.txn, buy.ipft, buy.brokerage, buy.igst) == (
        D(0), D("0.23"), D("2.63"), D("0.04"), D("20.00"), D("4.08"))
    assert buy.net == D("-7526.99")
    sell = levies([trade("S", 75, "100", **opt)], intra=False)
    assert (sell.stt, sell.stamp) == (D(11), D("0.00"))  # 0.15% of 7,500 = 11.25 -> 11
    assert levies([trade("S", 75, "100", date=OLD, **opt)], date=OLD).stt == D(8)  # 0.1% = 7.50 -> 8


def test_rates_follow_the_trade_date():
    assert rates_for("2026-03-31")["effective_from"] == "2024-10-01"
    assert rates_for("2026-04-01")["effective_from"] == "2026-04-01"


def lot(side, qty, price, segment, instrument, exchange, multiplier, symbol, agri="", close=None):
    """A currency or commodity trade: `qty` lots of `multiplier` quoted units each."""
    option = instrument.startswith("OPT")
    t = trade(side, qty, price, "FO", "NRML", instrument, exchange, close=close)
    return Trade(**{**t.__dict__, "segment": segment, "symbol": symbol, "strike": "100" if option else "",
                    "multiplier": multiplier, "agri": agri})


def test_currency_futures_on_nse_pay_no_stt_and_are_marked_to_market_by_the_thousand():
    # sell 5 lots USDINR @ 84.1250: 5 x 1,000 x 84.1250 = 4,20,625.00. No STT or CTT on currency.
    # NSE currency futures txn 0.00035% = 1.4721875 -> 1.47; SEBI 0.0001% = 0.420625 -> 0.42;
    # IPFT 0.00005% = 0.2103125 -> 0.21; stamp none (a sell); brokerage min(0.03% = 126.19, 20) = 20.00;
    # IGST 18% of (20 + 1.47 + 0.42 = 21.89) = 3.9402 -> 3.94. The short is carried forward at the
    # settlement price 84.2000: 5 x 1,000 x 84.2 = 4,21,000, so the obligation is (375.00).
    # Net = -375 - 20 - 1.47 - 0.42 - 0.21 - 3.94 = (401.04).
    t = lot("S", 5, "84.1250", "CDS", "FUTCUR", "NSE", 1000, "USDINR", close="84.2000")
    charges = compute([t], NEW, False, TARIFF)
    c = charges.segments["NSE-CDS"]
    assert (c.stt, c.ctt, c.txn, c.sebi, c.ipft, c.stamp, c.brokerage, c.igst) == (
        D(0), D(0), D("1.47"), D("0.42"), D("0.21"), D("0.00"), D("20.00"), D("3.94"))
    assert (c.sells, c.carry, c.obligation, c.net) == (D("420625.0000"), D("-421000.0000"), D("-375.00"), D("-401.04"))
    assert charges.brokerage_per_unit(t) == D("0.0040")  # 20 over 5,000 dollars


def test_currency_options_on_bse_on_premium():
    # buy 10 lots USDINR options @ 0.2500 premium: 10 x 1,000 x 0.25 = 2,500.00. BSE currency options
    # txn 0.001% = 0.025 -> 0.03; SEBI 0.0025 -> 0.00; stamp 0.0001% = 0.0025 -> 0.00; no IPFT (NSE's
    # levy: on NSE this would be 0.002% = 0.05); brokerage flat 20; CGST = SGST = 9% of 20.03 = 1.8027 -> 1.80.
    # Net = -2,500 - 20 - 0.03 - 1.80 - 1.80 = (2,523.63).
    c = levies([lot("B", 10, "0.2500", "CDS", "OPTCUR", "BSE", 1000, "USDINR")])
    assert (c.txn, c.sebi, c.stamp, c.ipft, c.brokerage, c.cgst, c.sgst) == (
        D("0.03"), D("0.00"), D("0.00"), D("0.00"), D("20.00"), D("1.80"), D("1.80"))
    assert c.net == D("-2523.63")
    assert levies([lot("B", 10, "0.2500", "CDS", "OPTCUR", "NSE", 1000, "USDINR")]).ipft == D("0.05")


def test_a_cross_currency_future_is_charged_and_marked_to_market_in_rupees_at_the_reference_rate():
    # sell 3 lots EURUSD @ 1.0852 USD, RBI's USD reference rate 84.1234: 3 x 1,000 x 1.0852 = 3,255.60 USD
    # = 2,73,872.14104 rupees. No STT or CTT. NSE currency futures txn 0.00035% = 0.9585525 -> 0.96;
    # SEBI 0.0001% = 0.27387 -> 0.27; IPFT 0.00005% = 0.13694 -> 0.14; no stamp on a sell; brokerage
    # min(0.03% = 82.16, 20) = 20.00; IGST 18% of 21.23 = 3.8214 -> 3.82. The short is carried forward at
    # the settlement price 1.0860 USD: 3,258 USD x 84.1234 = 2,74,074.0372, so the obligation is the MTM
    # 3,000 x (1.0852 - 1.0860) x 84.1234 = (201.89616) -> (201.90).
    # Net = -201.90 - 20 - 0.96 - 0.27 - 0.14 - 3.82 = (227.09).
    t = Trade(**{**lot("S", 3, "1.0852", "CDS", "FUTCUR", "NSE", 1000, "EURUSD", close="1.0860").__dict__,
                 "fx": D("84.1234")})
    charges = compute([t], NEW, False, TARIFF)
    c = charges.segments["NSE-CDS"]
    assert (c.stt, c.ctt, c.txn, c.sebi, c.ipft, c.stamp, c.brokerage, c.igst) == (
        D(0), D(0), D("0.96"), D("0.27"), D("0.14"), D("0.00"), D("20.00"), D("3.82"))
    assert (c.sells, c.carry, c.obligation, c.net) == (D("273872.14104"), D("-274074.0372"), D("-201.90"),
                                                       D("-227.09"))
    # the brokerage a unit is in dollars, as the rate it sits beside: 20 / (3,000 x 84.1234) = 0.0000792 -> 0.0001
    assert charges.brokerage_per_unit(t) == D("0.0001")


def test_gold_futures_on_mcx_pay_ctt_on_the_sell_to_the_rupee():
    # sell 1 lot GOLD @ 76,543 per 10 g, a 1 kg lot = multiplier 100: 76,54,300.00.
    # CTT 0.01% of a non-agricultural future's sell = 765.43 -> 765; MCX futures txn 0.0021% =
    # 160.7403 -> 160.74; SEBI 7.6543 -> 7.65; no stamp on a sell; no IPFT; brokerage capped 20;
    # CGST = SGST = 9% of (20 + 160.74 + 7.65 = 188.39) = 16.9551 -> 16.96. Carried forward at
    # 76,500: obligation 76,54,300 - 76,50,000 = 4,300.00.
    # Net = 4,300 - 20 - 160.74 - 7.65 - 765 - 16.96 - 16.96 = 3,312.69.
    c = levies([lot("S", 1, "76543", "COM", "FUTCOM", "MCX", 100, "GOLD", agri="N", close="76500")])
    assert (c.stt, c.ctt, c.txn, c.sebi, c.stamp, c.ipft, c.cgst) == (
        D(0), D(765), D("160.74"), D("7.65"), D("0.00"), D("0.00"), D("16.96"))
    assert (c.obligation, c.net) == (D("4300.00"), D("3312.69"))


def test_gold_options_on_mcx_pay_ctt_on_the_premium():
    # sell 1 lot GOLD options @ 1,210.50 premium, multiplier 100: 1,21,050.00. CTT 0.05% of premium =
    # 60.525 -> 61; MCX options txn 0.0418% = 50.5989 -> 50.60; SEBI 0.12105 -> 0.12; brokerage flat 20;
    # CGST = SGST = 9% of 70.72 = 6.3648 -> 6.36. Net = 1,21,050 - 20 - 50.60 - 0.12 - 61 - 12.72 = 1,20,905.56.
    c = levies([lot("S", 1, "1210.50", "COM", "OPTFUT", "MCX", 100, "GOLD", agri="N")])
    assert (c.ctt, c.txn, c.sebi, c.cgst, c.sgst) == (D(61), D("50.60"), D("0.12"), D("6.36"), D("6.36"))
    assert c.net == D("120905.56")


def test_an_agricultural_future_on_ncdex_pays_no_ctt_and_sebi_s_agricultural_fee():
    # buy 2 lots GUARSEED10 @ 5,400 a quintal, a 10 t lot = multiplier 100: 10,80,000.00. Agricultural:
    # no CTT (and none on a buy anyway); NCDEX futures txn 0.0058% = 62.64; SEBI Rs 1 a crore =
    # 0.108 -> 0.11; stamp 0.002% of the buy = 21.60; brokerage capped 20; IGST 18% of
    # (20 + 62.64 + 0.11 = 82.75) = 14.895 -> 14.90. Carried forward at 5,390: obligation
    # -10,80,000 + 10,78,000 = (2,000.00). Net = -2,000 - 20 - 62.64 - 0.11 - 21.60 - 14.90 = (2,119.25).
    guar = dict(segment="COM", instrument="FUTCOM", exchange="NCDEX", multiplier=100, symbol="GUARSEED10", agri="Y")
    c = levies([lot("B", 2, "5400", close="5390", **guar)], intra=False)
    assert (c.ctt, c.txn, c.sebi, c.stamp, c.igst) == (D(0), D("62.64"), D("0.11"), D("21.60"), D("14.90"))
    assert (c.obligation, c.net) == (D("-2000.00"), D("-2119.25"))
    # sold instead, still no CTT: the exemption is the contract's, not the side's
    assert levies([lot("S", 2, "5400", close="5390", **guar)]).ctt == D(0)


def test_bse_sensex_options_pay_bse_s_sensex_and_bankex_rate():
    # buy 20 SENSEX options @ 310.50 = 6,210.00. No STT on a buy; stamp 0.003% = 0.1863 -> 0.19;
    # BSE's SENSEX and BANKEX options txn Rs 3,250 a crore = 0.0325% = 2.01825 -> 2.02; SEBI 0.00621
    # -> 0.01; no IPFT (NSE's levy); brokerage flat 20; IGST 18% of 22.03 = 3.9654 -> 3.97.
    # Net = -6,210 - 0.19 - 2.02 - 0.01 - 20 - 3.97 = (6,236.19).
    c = levies([trade("B", 20, "310.50", "FO", "NRML", "OPTIDX", "BSE", symbol="SENSEX")], intra=False)
    assert (c.stt, c.stamp, c.txn, c.sebi, c.ipft, c.igst) == (D(0), D("0.19"), D("2.02"), D("0.01"), D("0.00"),
                                                               D("3.97"))
    assert c.net == D("-6236.19")
    # BANKEX is in the same group: buy 30 @ 400 = 12,000: 0.0325% = 3.90
    assert levies([trade("B", 30, "400", "FO", "NRML", "OPTIDX", "BSE", symbol="BANKEX")]).txn == D("3.90")


def test_bse_s_other_options_pay_its_lower_rate():
    # BSE charges Rs 500 a crore of premium (0.005%) on SENSEX 50 and stock options (its circular of
    # 27 September 2024, from 1 October 2024), Rs 3,250 on SENSEX and BANKEX alone.
    # buy 25 SENSEX50 @ 100 = 2,500: 0.005% = 0.125 -> 0.13 (SENSEX at the same premium: 0.8125 -> 0.81);
    # sell 500 RELIANCE stock options @ 30 = 15,000: 0.005% = 0.75.
    assert levies([trade("B", 25, "100", "FO", "NRML", "OPTIDX", "BSE", symbol="SENSEX50")]).txn == D("0.13")
    assert levies([trade("B", 25, "100", "FO", "NRML", "OPTIDX", "BSE", symbol="SENSEX")]).txn == D("0.81")
    assert levies([trade("S", 500, "30", "FO", "NRML", "OPTSTK", "BSE", symbol="RELIANCE")]).txn == D("0.75")
    # both kinds in one segment: each rate on its own turnover, then one rounding: 0.125 + 0.8125 = 0.9375 -> 0.94
    both = [trade("B", 25, "100", "FO", "NRML", "OPTIDX", "BSE", symbol=s) for s in ("SENSEX50", "SENSEX")]
    assert levies(both).txn == D("0.94")


def test_a_named_ncdex_contract_pays_its_own_rate_and_the_rest_of_the_exchange_its_rate():
    # NCDEX's options pay 0.03% of premium; guar seed options 0.015% (the named contract's rate).
    # sell 2 lots GUARSEED10 options @ 120.00 a quintal, multiplier 100: 24,000.00. Agricultural: no CTT;
    # txn 0.015% = 3.60; SEBI's agricultural Rs 1 a crore = 0.0024 -> 0.00; no stamp on a sell; brokerage
    # flat 20; IGST 18% of 23.60 = 4.248 -> 4.25. Net = 24,000 - 20 - 3.60 - 4.25 = 23,972.15.
    guar = lot("S", 2, "120.00", "COM", "OPTFUT", "NCDEX", 100, "GUARSEED10", agri="Y")
    c = levies([guar], intra=False)
    assert (c.ctt, c.txn, c.sebi, c.stamp, c.igst, c.net) == (D(0), D("3.60"), D("0.00"), D("0.00"), D("4.25"),
                                                              D("23972.15"))
    # a DHANIYA option, in no group: NCDEX's 0.03%: sell 1 lot @ 150, multiplier 50 = 7,500: 2.25
    assert levies([lot("S", 1, "150", "COM", "OPTFUT", "NCDEX", 50, "DHANIYA", agri="Y")]).txn == D("2.25")
    # guar seed futures: the group names options only, so NCDEX's futures rate 0.0058%: 2 x 100 x 5,400
    # = 10,80,000: 62.64
    assert levies([lot("B", 2, "5400", "COM", "FUTCOM", "NCDEX", 100, "GUARSEED10", agri="Y",
                       close="5400")]).txn == D("62.64")


def test_a_commodity_group_from_a_later_schedule_applies_by_trade_date(tmp_path):
    """A group A/B split of MCX's futures (a made-up one, from 2027-04-01): group B's metals at
    0.0013%, the rest of MCX at its 0.0021%; before the date, every contract at 0.0021%."""
    import json

    from pipeline.note.charges import RATES_FILE

    data = json.loads(RATES_FILE.read_text())
    later = json.loads(json.dumps(data["schedules"][-1]))
    later["effective_from"] = "2027-04-01"
    later["txn_groups"]["MCX"] = {"B": {"symbols": ["COPPER", "ZINC"], "commodity_futures": "0.000013"}}
    data["schedules"].append(later)
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps(data))

    def txn(date, symbol):
        t = Trade(**{**lot("S", 1, "800", "COM", "FUTCOM", "MCX", 2500, symbol, agri="N", close="800").__dict__,
                     "trade_date": date})
        return compute([t], date, True, TARIFF, rates).total.txn

    # 1 lot of 2,500 kg at 800 = 20,00,000: group B 0.0013% = 26.00; MCX's 0.0021% = 42.00
    assert (txn("2027-04-01", "COPPER"), txn("2027-04-01", "GOLDM")) == (D("26.00"), D("42.00"))
    assert txn("2027-03-31", "COPPER") == D("42.00")


def test_a_contract_in_two_groups_for_one_category_is_refused_when_the_schedule_is_read(tmp_path):
    import json

    from pipeline.note.charges import RATES_FILE

    data = json.loads(RATES_FILE.read_text())
    data["schedules"][-1]["txn_groups"]["NCDEX"]["pulses"] = {"symbols": ["GUARSEED10"], "commodity_options": "0.0001"}
    (tmp_path / "rates.json").write_text(json.dumps(data))
    guar = lot("S", 2, "120.00", "COM", "OPTFUT", "NCDEX", 100, "GUARSEED10", agri="Y")
    with pytest.raises(ValueError, match="GUARSEED10 is in the transaction groups 'guar seed options' and 'pulses'"):
        compute([guar], NEW, True, TARIFF, tmp_path / "rates.json")


def test_each_exchange_and_segment_is_charged_apart_and_the_total_is_their_sum():
    trades = [trade("B", 100, "1000.00"), lot("S", 5, "84.1250", "CDS", "FUTCUR", "NSE", 1000, "USDINR", close="84.2"),
              lot("S", 1, "76543", "COM", "FUTCOM", "MCX", 100, "GOLD", agri="N", close="76500")]
    charges = compute(trades, NEW, True, TARIFF)
    assert sorted(charges.segments) == ["MCX-COM", "NSE-CDS", "NSE-CM"]
    assert charges.total.net == sum(s.net for s in charges.segments.values())
    assert charges.segments["MCX-COM"].stt == 0 and charges.segments["NSE-CM"].ctt == 0


def test_a_schedule_without_a_segment_s_rate_is_an_error_naming_the_levy(tmp_path):
    import json

    from pipeline.note.charges import RATES_FILE

    data = json.loads(RATES_FILE.read_text())
    for schedule in data["schedules"]:
        del schedule["txn"]["NCDEX"]["commodity_futures"]
    (tmp_path / "rates.json").write_text(json.dumps(data))
    guar = lot("B", 2, "5400", "COM", "FUTCOM", "NCDEX", 100, "GUARSEED10", agri="Y", close="5390")
    with pytest.raises(ValueError, match="no NCDEX rate for commodity_futures"):
        compute([guar], NEW, True, TARIFF, tmp_path / "rates.json")


CATEGORIES = [("CM", "CNC", "EQ"), ("CM", "MIS", "EQ"), ("FO", "NRML", "FUTSTK"), ("FO", "NRML", "OPTIDX"),
              ("CDS", "NRML", "FUTCUR"), ("CDS", "MIS", "OPTCUR"), ("COM", "NRML", "FUTCOM"), ("COM", "NRML", "OPTFUT")]
LOTS = {"CDS": ("NSE", 1000, "USDINR", ""), "COM": ("MCX", 100, "GOLD", "N")}
trades_strategy = st.lists(
    st.tuples(st.sampled_from(CATEGORIES), st.sampled_from(["NSE", "BSE"]), st.sampled_from("BS"),
              st.integers(1, 5000), st.decimals(D("0.05"), D("90000"), places=2), st.integers(0, 5)),
    min_size=1, max_size=40)


def as_trades(specs):
    out = []
    for (segment, product, instrument), exchange, side, qty, price, order in specs:
        exchange = "NSE" if segment == "FO" else exchange
        if segment in LOTS:
            exchange, multiplier, symbol, agri = LOTS[segment]
            agri = "Y" if agri and qty % 3 == 0 else agri
            t = lot(side, qty, price, segment, instrument, exchange, multiplier, symbol, agri)
            out.append(Trade(**{**t.__dict__, "product": product, "order_no": f"{order:016d}" if order else t.order_no}))
            continue
        out.append(trade(side, qty, price, segment, product, instrument, exchange, order=f"{order:016d}"
                         if order else None))
    return out


@settings(max_examples=200, deadline=None)
@given(trades_strategy, st.booleans())
def test_invariants_hold_for_any_day(specs, intra):
    trades = as_trades(specs)
    charges = compute(trades, NEW, intra, TARIFF)
    total = charges.total
    assert total.net == total.obligation - sum(getattr(total, f) for f in LEVY_FIELDS)
    assert total.obligation == total.sells - total.buys + total.carry
    for f in ("buys", "sells", "carry", "obligation", *LEVY_FIELDS):
        assert getattr(total, f) == sum(getattr(s, f) for s in charges.segments.values())
    for seg in charges.segments.values():
        assert all(getattr(seg, f) >= 0 for f in LEVY_FIELDS)
        assert seg.stt == seg.stt.to_integral_value() and seg.ctt == seg.ctt.to_integral_value()
        assert all(-getattr(seg, f).as_tuple().exponent <= 2 for f in LEVY_FIELDS)
        assert (seg.igst == 0) if intra else (seg.cgst == seg.sgst == 0)
        assert seg.cgst == seg.sgst
    assert total.buys == sum(t.turnover for t in trades if t.side == "B")
    assert total.ctt <= sum(t.turnover for t in trades if t.segment == "COM" and t.side == "S") / 1000  # at most 0.1%
    if not any(t.side == "B" for t in trades):
        assert total.stamp == 0
