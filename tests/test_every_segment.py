"""A day with every segment through the real pipeline, as `run` and `demo` run it: real Ray (the
session's), Redis, the SMTP sink, signing and storage. Every note mailed is read back from its
signed, encrypted PDF (pdftotext with the client's PAN) and each figure checked against an
independent recomputation from the input files (tests/recompute.py)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from decimal import Decimal as D
from pathlib import Path

import pytest

from pipeline.cluster.driver import RunRequest, run_day
from pipeline.record import keys
from pipeline.settings import ROOT
from tests.every_segment_day import DATE, SEGMENTS, SETTLE_SEGMENTS, UCC, write_every_segment_day
from tests.helpers import assert_signed_and_encrypted, attachment, client_rows, outbox_messages
from tests.recompute import check_text, recompute

pytestmark = pytest.mark.usefixtures("ray_session")


def note_text(pdf: Path, pan: str) -> str:
    return subprocess.run(["pdftotext", "-upw", pan, "-layout", str(pdf), "-"], capture_output=True, text=True,
                          check=True).stdout


def levies(text: str, label: str) -> list[D]:
    line = next(line for line in text.splitlines() if line.strip().startswith(label))
    return [D(t.strip("()").replace(",", "")) * (-1 if t.startswith("(") else 1)
            for t in line[line.index(label) + len(label):].split()]


def test_a_day_with_every_segment_runs_and_every_note_agrees_with_the_recomputation(settings, smtp_sink, tmp_path):
    day = write_every_segment_day(tmp_path / "input", 24, seed=9, settlements=True)
    summary = run_day(settings, RunRequest(DATE, str(day)))

    expected = recompute(day, DATE)
    assert summary["rejected"] == 0 and summary["failed"] == 0
    assert summary["accounts"] == summary["delivered"] == len(expected) == 26
    clients, store = client_rows(day), Path(settings.store_url)
    mailed = {m["Subject"].split("(")[-1].rstrip(")"): attachment(m)[1] for m in outbox_messages(smtp_sink.outbox)}
    assert sorted(mailed) == sorted(expected)
    for ucc, figures in expected.items():
        pdf = store / keys.signed_pdf_key(DATE, ucc)
        assert pdf.read_bytes() == mailed[ucc]
        assert check_text(note_text(pdf, clients[ucc]["pan"]), figures) == [], ucc

    pdf = store / keys.signed_pdf_key(DATE, UCC)
    assert_signed_and_encrypted(pdf, clients[UCC]["pan"])
    text = note_text(pdf, clients[UCC]["pan"])
    for title in ("NSE / CM", "NSE / FO", "NSE / CDS (currency derivatives)", "BSE / CM", "BSE / FO",
                  "BSE / CDS (currency derivatives)", "MCX / COM (commodity derivatives)",
                  "NCDEX / COM (commodity derivatives)"):
        assert re.search(rf"^\s*{re.escape(title)} · Settlement", text, re.M), title
    # MCX settles on Monday by its own calendar; NCDEX's list the run was not given
    assert re.search(r"Settlement MCX-COM\s+COM2026324 \(settles 23-11-2026\)", text)
    assert "Settlement NCDEX-COM       COM2026324 (settles per the exchange's calendar)" in text
    heads = next(line for line in text.splitlines() if line.strip().startswith("Particulars")).split()[1:]
    assert heads == SEGMENTS + ["Total", "(Net)"]
    # worked by hand, in the order of SEGMENTS:
    # BSE-CDS: USDJPY 2 lots sold at 150.25 yen, settled at 150.10, at 0.5560 rupees a yen: 2,000 x 0.15 x 0.556
    #   = 166.80; EURINR puts bought, 4 x 1,000 x 0.3025 = (1,210.00): (1,043.20)
    # BSE-CM: TCS 3 sold at 4,100 = 12,300.00
    # BSE-FO: SENSEX puts bought 20 x 310.50 = (6,210.00), BANKEX calls sold 30 x 250 = 7,500.00: 1,290.00
    # MCX-COM: GOLD sold at 76,543, settled at 76,500, x100 = 4,300.00; CRUDEOIL calls bought 2 x 100 x 95.50
    #   = (19,100.00): (14,800.00)
    # NCDEX-COM: GUARSEED10 bought 2 x 100 at 5,400, settled 5,390 = (2,000.00); its calls sold 100 x 120 =
    #   12,000.00: 10,000.00
    # NSE-CDS: USDINR sold 5,000 at 84.1250, settled 84.2000 = (375.00); EURUSD bought 2,000 at 1.0852, settled
    #   1.0860, at 84.1234 = 134.59744; GBPUSD calls bought 3,000 x 0.0045 x 84.1234 = (1,135.66590):
    #   (1,376.06846) -> (1,376.07)
    # NSE-CM: RELIANCE bought 10 x 2,900.50 = (29,005.00), INFY sold 5 x 1,800 = 9,000.00: (20,005.00)
    # NSE-FO: NIFTY bought 75 at 24,500, settled 24,510.50 = 787.50; RELIANCE calls sold 250 x 35.50 = 8,875.00:
    #   9,662.50
    obligations = [D("-1043.20"), D("12300.00"), D("1290.00"), D("-14800.00"), D("10000.00"), D("-1376.07"),
                   D("-20005.00"), D("9662.50")]
    assert levies(text, "Pay-in/Pay-out obligation") == obligations + [sum(obligations)]
    # CTT: GOLD's sell alone, 0.01% of 76,54,300 = 765.43 -> 765 (the guar seed option's sell is agricultural)
    assert levies(text, "Commodities transaction tax") == [0, 0, 0, -765, 0, 0, 0, 0, -765]
    # STT: BSE-CM delivery 0.1% of 12,300 = 12.30 -> 12; BSE-FO the BANKEX sell, 0.15% of 7,500 = 11.25 -> 11;
    # NSE-CM 0.1% of the delivery buy 29,005 = 29.005 and 0.025% of the intraday sell 9,000 = 2.25: 31.255 -> 31;
    # NSE-FO the option's sell, 0.15% of 8,875 = 13.3125 -> 13; none on currency or commodities
    assert levies(text, "Securities transaction tax") == [0, -12, -11, 0, 0, 0, -31, -13, -67]

    # SETTLE1: its options exercised and assigned, its contracts delivered, worked by hand (SETTLE_SEGMENTS' order)
    settle = note_text(store / keys.signed_pdf_key(DATE, "SETTLE1"), clients["SETTLE1"]["pan"])
    for kind in ("Exercise", "Assignment", "Delivery"):
        assert re.search(rf"^\s*\d{{16}}\s.*\s{kind}$", settle, re.M), kind
    heads = next(line for line in settle.splitlines() if line.strip().startswith("Particulars")).split()[1:]
    assert heads == SETTLE_SEGMENTS + ["Total", "(Net)"]
    # BSE-FO: SENSEX 80000 CE exercised at 80,450: 450 x 20 = 9,000.00
    # MCX-COM: CRUDEOIL 6000 CE exercised at 6,123: 123 x 2 x 100 = 24,600.00; CRUDEOIL 6100 PE assigned at 6,050:
    #   (5,000.00); GOLD future delivered at 76,500 x 100 = (76,50,000.00); GOLD 76000 CE delivered at its strike,
    #   76,000 x 100 = (76,00,000.00): (1,52,30,400.00)
    # NCDEX-COM: GUARSEED10 5500 CE exercised at 5,600: 100 x 100 = 10,000.00
    # NSE-CDS: USDINR 84 CE exercised at 84.2525: 0.2525 x 10,000 = 2,525.00; EURUSD 1.08 CE at 1.0852: 0.0052 x
    #   2,000 x 84.1234 = 874.88336: 3,399.88336 -> 3,399.88
    # NSE-FO: NIFTY future sold 75 at 24,520, settled 24,510.50 = 712.50; NIFTY 24000 CE exercised at 24,310.55:
    #   310.55 x 75 = 23,291.25; NIFTY 24500 PE assigned: 189.45 x 150 = (28,417.50); RELIANCE future delivered:
    #   500 x 2,950.40 = (14,75,200.00); RELIANCE 3000 PE's holder delivers 250 at 3,000 = 7,50,000.00: (7,29,613.75)
    obligations = [D("9000.00"), D("-15230400.00"), D("10000.00"), D("3399.88"), D("-729613.75")]
    assert levies(settle, "Pay-in/Pay-out obligation") == obligations + [sum(obligations)]
    # STT: BSE-FO 0.15% of the SENSEX exercise's 9,000 = 13.50 -> 14; NSE-FO the future's sell 0.05% of 18,39,000 =
    # 919.50, the exercise 0.15% of 23,291.25 = 34.936875, the deliveries 0.1% of 14,75,200 and 7,50,000 =
    # 2,225.20: 3,179.636875 -> 3,180 (none on the assignment, nor on currency)
    assert levies(settle, "Securities transaction tax") == [-14, 0, 0, 0, -3180, -3194]
    # CTT: the CRUDEOIL exercise 0.0001% of its settlement value 6,123 x 200 = 1.2246; the GOLD call delivered
    # 0.0001% of 76,500 x 100 = 7.65: 8.8746 -> 9; none on the assignment, the future delivered or the
    # agricultural guar seed
    assert levies(settle, "Commodities transaction tax") == [0, -9, 0, 0, 0, -9]
    # stamp duty: the RELIANCE future taken, 0.015% of 14,75,200 = 221.28
    assert levies(settle, "Stamp duty") == [0, 0, 0, 0, D("-221.28"), D("-221.28")]


def test_the_demo_command_runs_a_day_with_every_segment(ray_session, tmp_path):
    """`demo --segment-share 1`: every client also trades currency, commodities and BSE's index
    options; joined to the session's Ray, its notes are each checked as `run`'s are."""
    work = tmp_path / "demo"
    env = {**os.environ, "RAY_ADDRESS": ray_session.address_info["address"], "PYTHONPATH": ROOT}
    env.pop("CN_OWNER_PASSWORD", None)
    done = subprocess.run([sys.executable, "-m", "pipeline", "demo", "--accounts", "16", "--segment-share", "1",
                           "--seed", "4", "--file-key", "--workdir", str(work)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.splitlines()[-1])
    day = work / "input"
    with (day / "trades.csv").open(newline="") as f:
        kinds = {(r["exchange"], r["segment"], r["instrument"]) for r in csv.DictReader(f)}
    assert {f"{e}-{s}" for e, s, _ in kinds} == set(SEGMENTS)
    assert {i for _, _, i in kinds} == {"EQ", "FUTIDX", "FUTSTK", "OPTIDX", "OPTSTK", "FUTCUR", "OPTCUR", "FUTCOM",
                                        "OPTFUT"}
    expected = recompute(day, DATE)
    assert summary["delivered"] == summary["accounts"] == len(expected) == 16 and summary["rejected"] == 0
    clients = client_rows(day)
    for ucc, figures in expected.items():
        pdf = work / "store" / keys.signed_pdf_key(DATE, ucc)
        assert check_text(note_text(pdf, clients[ucc]["pan"]), figures) == [], ucc
    assert len(list((work / "outbox").glob("*.eml"))) == 16


def test_an_entity_of_its_own_runs_the_commodity_notes_with_its_details(settings, smtp_sink, tmp_path):
    """CN_BROKER_FILE names the commodity company's file: its run makes notes of MCX's and NCDEX's
    trades alone, in its name and note numbers, and counts the rest as the other entity's."""
    import dataclasses

    from tests.test_entities import COMMODITY, OTHERS, entity_file

    day = write_every_segment_day(tmp_path / "input", 12, seed=9)
    name = "Example Commodities Private Limited"
    own = dataclasses.replace(settings, broker_file=entity_file(
        tmp_path, name, COMMODITY, dict.fromkeys(OTHERS, "Example Securities Private Limited"), "CNC"))
    summary = run_day(own, RunRequest(DATE, str(day)))

    expected = {u: {s: f for s, f in a.items() if s in COMMODITY} for u, a in recompute(day, DATE).items()}
    expected = {u: a for u, a in expected.items() if a}
    assert summary["rejected"] == summary["failed"] == 0
    assert summary["delivered"] == summary["accounts"] == len(expected)
    assert set(summary["left_to_other_entities"]) == set(OTHERS)
    clients, store = client_rows(day), Path(settings.store_url)
    for ucc, figures in expected.items():
        text = note_text(store / keys.signed_pdf_key(DATE, ucc), clients[ucc]["pan"])
        assert check_text(text, figures) == [], ucc
        assert name in text and "CNC-26/27-" in text
    assert all(name in m["Subject"] or name in m.get_body().get_content() for m in outbox_messages(smtp_sink.outbox))
