"""The synthetic day looks like a real one: what the rest of the pipeline is tested against."""

from __future__ import annotations

import csv
import datetime as dt
import statistics
from collections import Counter
from decimal import Decimal

from pipeline.day.synth import SynthOptions, write_dumps


def test_a_synthetic_day_is_heavy_tailed_mixed_and_safe_to_mail(tmp_path):
    write_dumps(tmp_path, SynthOptions(dt.date(2026, 11, 20), 2000, seed=3))
    trades = list(csv.DictReader((tmp_path / "trades.csv").open(newline="")))
    clients = list(csv.DictReader((tmp_path / "clients.csv").open(newline="")))

    per_client = sorted(Counter(t["ucc"] for t in trades if t["status"] == "11").values())
    assert 3 <= statistics.median(per_client) <= 5
    assert per_client[int(len(per_client) * 0.99)] >= 150
    assert {t["status"] for t in trades} == {"11", "12", "13"}
    assert {(t["exchange"], t["segment"]) for t in trades} >= {("NSE", "CM"), ("NSE", "FO"), ("BSE", "CM")}
    assert {t["instrument"] for t in trades} >= {"EQ", "FUTIDX", "FUTSTK", "OPTIDX", "OPTSTK"}
    assert {t["product"] for t in trades} >= {"CNC", "MIS", "NRML"}
    assert all(len(t["order_no"]) == len(t["trade_no"]) == 16 for t in trades)
    assert any(t["trade_no"].startswith("0") for t in trades)
    assert len({c["gst_state_code"] for c in clients}) >= 5 and "29" in {c["gst_state_code"] for c in clients}
    assert all(c["email"].endswith(("@example.com", ".test")) for c in clients)


def test_the_synthetic_bhavcopy_prices_every_derivatives_contract_traded(tmp_path):
    from pipeline.day import bhavcopy
    from pipeline.day.dumps import contract_id, parse_trade

    write_dumps(tmp_path, SynthOptions(dt.date(2026, 11, 20), 300, seed=4))
    errors: list[dict] = []
    with (tmp_path / "bhavcopy.csv").open() as f:
        closes = bhavcopy.read(f, "2026-11-20", errors)
    with (tmp_path / "reference_rates.csv").open() as f:
        rates = bhavcopy.read_reference_rates(f, "2026-11-20", errors)
    assert errors == [] and set(rates) == {("RBI", "USD"), ("RBI", "JPY")}
    rows = list(csv.DictReader((tmp_path / "trades.csv").open(newline="")))
    derivatives = [parse_trade("trades.csv", n, r, "2026-11-20", {**closes, **rates}) for n, r in enumerate(rows, 1)
                   if r["segment"] != "CM"]
    assert derivatives and all(t.close is not None for t in derivatives)
    assert {contract_id(t) for t in derivatives} == set(closes)
    assert all(abs(t.close - t.price) / t.price < Decimal("0.1") for t in derivatives)  # trades vary ±3%


def test_a_volatile_day_has_a_client_with_sixty_thousand_trades(tmp_path):
    write_dumps(tmp_path, SynthOptions(dt.date(2026, 11, 20), 3, seed=3, volatile=True))
    trades = list(csv.DictReader((tmp_path / "trades.csv").open(newline="")))
    counts = Counter(t["ucc"] for t in trades if t["status"] == "11")
    assert max(counts.values()) >= 60_000
    # its trades span the exchanges and segments (a mixed client's: 30% of them in the other segments)
    spans = Counter(f"{t['exchange']}-{t['segment']}" for t in trades if t["ucc"] == "C0000001")
    assert len(spans) == 8 and 0.2 < sum(n for s, n in spans.items() if s[-2:] in ("DS", "OM")) / sum(spans.values())


def test_a_share_of_clients_trade_currency_commodities_and_bse_index_options_and_the_rest_is_as_before(tmp_path):
    from pipeline.day.dumps import parse_trade

    date = dt.date(2026, 11, 20)
    write_dumps(tmp_path / "mixed", SynthOptions(date, 600, seed=3))
    write_dumps(tmp_path / "equity", SynthOptions(date, 600, seed=3, segment_share=0))
    mixed = list(csv.DictReader((tmp_path / "mixed" / "trades.csv").open(newline="")))
    equity = list(csv.DictReader((tmp_path / "equity" / "trades.csv").open(newline="")))
    kinds = {(t["exchange"], t["segment"]) for t in mixed}
    assert kinds >= {("NSE", "CDS"), ("BSE", "CDS"), ("MCX", "COM"), ("NCDEX", "COM"), ("BSE", "FO")}
    assert {t["agri"] for t in mixed if t["exchange"] == "NCDEX"} == {"Y"}
    assert any(t["trade_time"] > "17:00:00" for t in mixed if t["exchange"] == "MCX")  # its evening session
    traders = {t["ucc"] for t in mixed if t["segment"] in ("CDS", "COM") or t["exchange"] == "BSE" and t["segment"] == "FO"}
    assert 0.03 < len(traders) / 600 < 0.2  # a small share of clients
    # the same trades a client, numbers and times as the equity-only day: only some rows moved segment
    assert [(t["ucc"], t["trade_no"]) for t in mixed] == [(t["ucc"], t["trade_no"]) for t in equity]
    assert not {(t["exchange"], t["segment"]) for t in equity} - {("NSE", "CM"), ("BSE", "CM"), ("NSE", "FO")}
    assert {t["symbol"] for t in mixed if t["segment"] == "CDS"} >= {"USDINR", "EURUSD", "USDJPY"}  # cross pairs too
    assert {t["instrument"] for t in mixed if t["exchange"] == "NCDEX"} == {"FUTCOM", "OPTFUT"}
    errors: list[dict] = []
    from pipeline.day import bhavcopy
    with (tmp_path / "mixed" / "bhavcopy.csv").open() as f:
        closes = bhavcopy.read(f, "2026-11-20", errors)
    with (tmp_path / "mixed" / "reference_rates.csv").open() as f:
        closes.update(bhavcopy.read_reference_rates(f, "2026-11-20", errors))
    assert errors == []
    for n, r in enumerate(mixed, 1):
        parse_trade("trades.csv", n, r, "2026-11-20", closes)  # every row fits its segment


def test_on_an_equity_holiday_mcx_trades_in_its_evening_session_and_the_day_splits_whole(tmp_path, redis_url):
    """Holi 2026: NSE and BSE shut, MCX's evening session open. Every trade is MCX's, after 17:00, a
    client keeping its count of trades (the tail too); the split takes every account."""
    from pipeline.day.split import split_day
    from pipeline.record.state import RunState
    from pipeline.record.storage import open_store

    holi, friday = dt.date(2026, 3, 3), dt.date(2026, 11, 20)
    write_dumps(tmp_path / "holi", SynthOptions(holi, 200, seed=3))
    write_dumps(tmp_path / "friday", SynthOptions(friday, 200, seed=3))
    trades = list(csv.DictReader((tmp_path / "holi" / "trades.csv").open(newline="")))
    usual = list(csv.DictReader((tmp_path / "friday" / "trades.csv").open(newline="")))
    assert {(t["exchange"], t["segment"]) for t in trades} == {("MCX", "COM")}
    assert min(t["trade_time"] for t in trades) >= "17:00:00"
    assert Counter(t["ucc"] for t in trades) == Counter(t["ucc"] for t in usual)
    split = split_day(open_store(str(tmp_path / "holi")), open_store(str(tmp_path / "store")),
                      RunState(redis_url, "holi-synth"), "holi-synth", "2026-03-03", 50, "CNT")
    assert split.rejected == 0 and split.input_errors == [] and split.accounts + split.nothing_due == 200


def test_a_day_every_exchange_is_shut_has_nothing_to_synthesize(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="no exchange trades on 2026-01-26"):
        write_dumps(tmp_path, SynthOptions(dt.date(2026, 1, 26), 5, seed=3))


def test_on_an_expiry_day_positions_are_exercised_assigned_and_delivered_and_every_note_agrees(
        tmp_path, redis_url, monkeypatch):
    """A Thursday (synth's equity expiry): a share of clients have index options exercised or
    assigned and stock futures and options delivered; the split takes every row, and each such
    client's note agrees with the independent recomputation. The day's other rows are what they
    would be without them, and a day that is no expiry has no settlement column at all."""
    import os

    from pipeline import stages
    from pipeline.day import synth
    from pipeline.day.dumps import Client
    from pipeline.day.split import find_account, split_day
    from pipeline.record.manifest import save_manifest
    from pipeline.record.state import RunState
    from pipeline.record.storage import open_store
    from tests.every_segment_day import note_text
    from tests.recompute import check_text, recompute

    thursday = dt.date(2026, 11, 26)
    write_dumps(tmp_path / "day", SynthOptions(thursday, 150, seed=3))
    with (tmp_path / "day" / "trades.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    settled = [r for r in rows if r["settlement_type"]]
    assert {r["settlement_type"] for r in settled} == {"EX", "AS", "DL"}
    assert {r["instrument"] for r in settled} == {"OPTIDX", "FUTSTK", "OPTSTK"}
    monkeypatch.setattr(synth, "SETTLE_SHARE", 0)
    write_dumps(tmp_path / "none", SynthOptions(thursday, 150, seed=3))
    with (tmp_path / "none" / "trades.csv").open(newline="") as f:
        assert list(csv.DictReader(f)) == [r for r in rows if not r["settlement_type"]]
    write_dumps(tmp_path / "friday", SynthOptions(dt.date(2026, 11, 20), 5, seed=3))
    assert "settlement_type" not in (tmp_path / "friday" / "trades.csv").read_text().splitlines()[0]

    run, store = f"expiry-{os.urandom(3).hex()}", open_store(str(tmp_path / "store"))
    split = split_day(open_store(str(tmp_path / "day")), store, RunState(redis_url, run), run, thursday.isoformat(),
                      10, "CNT")
    assert split.rejected == 0 and split.input_errors == []
    save_manifest(store, run, split)
    expected = recompute(tmp_path / "day", thursday.isoformat())
    for ucc in sorted({r["ucc"] for r in settled}):
        account = find_account(store, run, ucc)
        note = stages.note_data(account, Client(**account["client"]), thursday.isoformat(),
                                {"NSE": "2026-11-27", "BSE": "2026-11-27"})
        assert check_text(note_text(note), expected[ucc]) == [], ucc
