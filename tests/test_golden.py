"""Golden checks: every field a contract note must show (docs/input.md), and the engine's totals, are printed."""

from __future__ import annotations

import re

from pipeline.note.charges import compute
from pipeline.note.content import money
from pipeline.note.render import render
from pipeline.stages import broker
from tests.test_render import TRADE_DATE, pdf_text, sample_client, sample_note, sample_trades


def test_every_mandated_field_and_the_totals_are_on_the_note(tmp_path):
    client = sample_client()
    trades = sample_trades(60)
    note = sample_note(60, client)
    text = pdf_text(render(note), tmp_path)
    flat = re.sub(r"\s+", " ", text)
    b = broker()

    for value in (b["name"], b["registered_office"], b["sebi_registration"], b["member_codes"]["NSE"],
                  b["member_codes"]["BSE"], b["gstin"], b["compliance_officer"]["name"],
                  b["compliance_officer"]["phone"], b["compliance_officer"]["email"], *b["segments"]):
        assert value in flat, value
    assert "CONTRACT NOTE CUM TAX INVOICE" in flat
    assert "CNT-26/27-0000042" in flat and "20-11-2026" in flat
    for settlement in note["note"]["settlements"]:
        assert settlement["number"] in flat
    for value in (client.name, client.address, client.pan, client.ucc, "Maharashtra (27)"):
        assert value in flat, value
    for t in trades:
        assert t.order_no in text and t.trade_no in text  # 16-digit strings, leading zeros kept
    for heading in ("Order No", "Trade No", "Security / Contract", "B/S", "Qty", "Gross Rate", "Brokerage",
                    "Net Rate", "Closing", "Net Total", "Remarks"):
        assert heading in flat, heading
    for label in ("Pay-in/Pay-out obligation", "Securities transaction tax", "Taxable value of supply",
                  "CGST @ 9%", "SGST @ 9%", "IGST @ 18%", "Exchange transaction charges", "SEBI turnover fees",
                  "Stamp duty", "IPFT charges", "Net amount receivable/(payable) by client"):
        assert label in flat, label

    charges = compute(trades, TRADE_DATE, False, b["tariff"])
    total = charges.total
    net_line = next(line for line in text.splitlines() if "Net amount receivable" in line)
    assert net_line.split()[-1] == money(total.net)
    stt_line = next(line for line in text.splitlines() if "Securities transaction tax" in line)
    assert stt_line.split()[-1] == money(-total.stt)
    for segment, levies in charges.segments.items():
        assert segment in flat
        assert money(levies.net) in net_line
    assert f"Page 1 of {note['total_pages']}" in flat
    assert "Authorised Signatory (digitally signed)" in flat


def test_in_state_clients_pay_cgst_and_sgst_others_igst(tmp_path):
    home = sample_client(state="Karnataka", code="29")
    text = pdf_text(render(sample_note(8, home)), tmp_path)
    igst = next(line for line in text.splitlines() if "IGST @ 18%" in line)
    cgst = next(line for line in text.splitlines() if "CGST @ 9%" in line)
    assert set(igst.split()[3:]) == {"0.00"} and set(cgst.split()[3:]) != {"0.00"}
