"""A synthetic day with every segment, for the tests that run one end to end: `synth`'s day with
every client also trading the other segments, and one client, EVERY1, whose trades cover every
exchange, segment and kind of contract the input takes (the synthetic day may miss a rare one).
Its contracts expire on days synth's never do, so the bhavcopy prices each of them once."""

from __future__ import annotations

import csv
import datetime as dt
from pathlib import Path

from pipeline.day.dumps import TRADE_COLUMNS, TRADE_FIELDS
from pipeline.day.synth import BHAV_FIELDS, SynthOptions, write_dumps

DATE = "2026-11-20"  # a Friday: every exchange trades, and settles on Monday the 23rd
UCC = "EVERY1"
CLIENT = {"ucc": UCC, "name": "Every Segment", "pan": "EVERY1234S", "email": "every1@example.com",
          "address": "7, Residency Road, Bengaluru", "state": "Karnataka", "gst_state_code": "29", "ecn_opt_in": "Y"}
_n = iter(range(9_000_000_000_000_001, 9_000_000_000_001_000, 2))


def _trade(exchange, segment, instrument, symbol, side, quantity, price, *, product="NRML", isin="", expiry="",
           strike="", option_type="", multiplier="", agri="", ucc=UCC) -> dict:
    n = next(_n)
    return {"trade_date": DATE, "exchange": exchange, "segment": segment, "settlement_no": f"{segment}2026324",
            "ucc": ucc, "order_no": f"{n:016d}", "order_time": "11:00:00", "trade_no": f"{n + 1:016d}",
            "trade_time": "11:00:02", "symbol": symbol, "isin": isin, "instrument": instrument, "expiry": expiry,
            "strike": strike, "option_type": option_type, "side": side, "quantity": quantity, "price": price,
            "product": product, "status": "11", "multiplier": multiplier, "agri": agri}


# (trade, its contract's bhavcopy row: UDiFF segment, type code, closing / settlement price)
EVERY = [
    (_trade("NSE", "CM", "EQ", "RELIANCE", "B", "10", "2900.50", product="CNC", isin="INE002A01018"), None),
    (_trade("NSE", "CM", "EQ", "INFY", "S", "5", "1800.00", product="MIS", isin="INE009A01021"), None),
    (_trade("BSE", "CM", "EQ", "TCS", "S", "3", "4100.00", product="CNC", isin="INE467B01029"), None),
    (_trade("NSE", "FO", "FUTIDX", "NIFTY", "B", "75", "24500.00", expiry="2026-12-31"), ("FO", "IDF", "24510.50")),
    (_trade("NSE", "FO", "OPTSTK", "RELIANCE", "S", "250", "35.50", expiry="2026-12-31", strike="3000",
            option_type="CE"), ("FO", "STO", "34.80")),
    (_trade("BSE", "FO", "OPTIDX", "SENSEX", "B", "20", "310.50", expiry="2026-12-29", strike="80000",
            option_type="PE"), ("FO", "IDO", "305.00")),
    (_trade("BSE", "FO", "OPTIDX", "BANKEX", "S", "30", "250.00", expiry="2026-12-29", strike="60000",
            option_type="CE"), ("FO", "IDO", "255.00")),
    (_trade("NSE", "CDS", "FUTCUR", "USDINR", "S", "5", "84.1250", expiry="2026-12-31", multiplier="1000"),
     ("CD", "FUTCUR", "84.2000")),
    (_trade("NSE", "CDS", "FUTCUR", "EURUSD", "B", "2", "1.0852", expiry="2026-12-31", multiplier="1000"),
     ("CD", "FUTCUR", "1.0860")),
    (_trade("NSE", "CDS", "OPTCUR", "GBPUSD", "B", "3", "0.0045", expiry="2026-12-31", strike="1.2700",
            option_type="CE", multiplier="1000"), ("CD", "OPTCUR", "0.0050")),
    (_trade("BSE", "CDS", "FUTCUR", "USDJPY", "S", "2", "150.25", expiry="2026-12-31", multiplier="1000"),
     ("CD", "FUTCUR", "150.10")),
    (_trade("BSE", "CDS", "OPTCUR", "EURINR", "B", "4", "0.3025", product="MIS", expiry="2026-12-31", strike="90.5000",
            option_type="PE", multiplier="1000"), ("CD", "OPTCUR", "0.3100")),
    (_trade("MCX", "COM", "FUTCOM", "GOLD", "S", "1", "76543", expiry="2027-02-05", multiplier="100", agri="N"),
     ("CO", "FUTCOM", "76500")),
    (_trade("MCX", "COM", "OPTFUT", "CRUDEOIL", "B", "2", "95.50", expiry="2026-12-16", strike="6000", option_type="CE",
            multiplier="100", agri="N"), ("CO", "OPTFUT", "97.00")),
    (_trade("NCDEX", "COM", "FUTCOM", "GUARSEED10", "B", "2", "5400", expiry="2026-12-18", multiplier="100", agri="Y"),
     ("CO", "FUTCOM", "5390")),
    (_trade("NCDEX", "COM", "OPTFUT", "GUARSEED10", "S", "1", "120.00", expiry="2026-12-18", strike="5500",
            option_type="CE", multiplier="100", agri="Y"), ("CO", "OPTFUT", "118.00")),
]
# SETTLE1: a client whose options are exercised and assigned and whose stock and commodity contracts go
# to delivery on the day (settlement_type EX, AS, DL: contracts expiring on DATE), beside a trade
SETTLE = {**CLIENT, "ucc": "SETTLE1", "name": "Settles Today", "pan": "SETLE1234S", "email": "settle1@example.com",
          "state": "Maharashtra", "gst_state_code": "27"}


def _settled(exchange, segment, instrument, symbol, side, quantity, price, kind, **kw) -> dict:
    return {**_trade(exchange, segment, instrument, symbol, side, quantity, price, expiry=DATE, ucc="SETTLE1", **kw),
            "settlement_type": kind}


SETTLED = [
    {**_trade("NSE", "FO", "FUTIDX", "NIFTY", "S", "75", "24520.00", expiry="2026-12-31", ucc="SETTLE1"),
     "settlement_type": "T"},
    _settled("NSE", "FO", "OPTIDX", "NIFTY", "B", "75", "24310.55", "EX", strike="24000", option_type="CE"),
    _settled("NSE", "FO", "OPTIDX", "NIFTY", "S", "150", "24310.55", "AS", strike="24500", option_type="PE"),
    _settled("NSE", "FO", "FUTSTK", "RELIANCE", "B", "500", "2950.40", "DL", isin="INE002A01018"),
    _settled("NSE", "FO", "OPTSTK", "RELIANCE", "S", "250", "2950.40", "DL", isin="INE002A01018", strike="3000",
             option_type="PE"),
    _settled("BSE", "FO", "OPTIDX", "SENSEX", "B", "20", "80450.00", "EX", strike="80000", option_type="CE"),
    _settled("NSE", "CDS", "OPTCUR", "USDINR", "B", "10", "84.2525", "EX", strike="84.0000", option_type="CE",
             multiplier="1000"),
    _settled("NSE", "CDS", "OPTCUR", "EURUSD", "B", "2", "1.0852", "EX", strike="1.0800", option_type="CE",
             multiplier="1000"),
    _settled("MCX", "COM", "OPTFUT", "CRUDEOIL", "B", "2", "6123", "EX", strike="6000", option_type="CE",
             multiplier="100", agri="N"),
    _settled("MCX", "COM", "OPTFUT", "CRUDEOIL", "S", "1", "6050", "AS", strike="6100", option_type="PE",
             multiplier="100", agri="N"),
    _settled("MCX", "COM", "FUTCOM", "GOLD", "B", "1", "76500", "DL", multiplier="100", agri="N"),
    _settled("MCX", "COM", "OPTFUT", "GOLD", "B", "1", "76500", "DL", strike="76000", option_type="CE",
             multiplier="100", agri="N"),
    _settled("NCDEX", "COM", "OPTFUT", "GUARSEED10", "B", "1", "5600", "EX", strike="5500", option_type="CE",
             multiplier="100", agri="Y"),
]
SETTLE_SEGMENTS = ["BSE-FO", "MCX-COM", "NCDEX-COM", "NSE-CDS", "NSE-FO"]
SEGMENTS = ["BSE-CDS", "BSE-CM", "BSE-FO", "MCX-COM", "NCDEX-COM", "NSE-CDS", "NSE-CM", "NSE-FO"]


def write_every_segment_day(folder: Path, accounts: int, seed: int, settlements: bool = False) -> Path:
    """`synth`'s day (every client trading the other segments too), then EVERY1 and its contracts;
    with `settlements`, SETTLE1 and its exercises, assignments and deliveries too (trades.csv then
    has the settlement_type column, empty on every other row)."""
    write_dumps(folder, SynthOptions(dt.date.fromisoformat(DATE), accounts, seed, segment_share=1.0))
    with (folder / "clients.csv").open("a", newline="") as f:
        csv.DictWriter(f, list(CLIENT)).writerows([CLIENT, SETTLE] if settlements else [CLIENT])
    if settlements:
        with (folder / "trades.csv").open(newline="") as f:
            rows = list(csv.DictReader(f))
        with (folder / "trades.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, TRADE_COLUMNS)
            writer.writeheader()
            writer.writerows([*rows, *(t for t, _ in EVERY), *SETTLED])
    else:
        with (folder / "trades.csv").open("a", newline="") as f:
            csv.DictWriter(f, TRADE_FIELDS).writerows(t for t, _ in EVERY)
    with (folder / "bhavcopy.csv").open("a", newline="") as f:
        writer = csv.DictWriter(f, BHAV_FIELDS)
        for t, bhav in EVERY:
            if bhav:
                sgmt, kind, price = bhav
                writer.writerow({"TradDt": DATE, "BizDt": DATE, "Sgmt": sgmt, "Src": t["exchange"], "FinInstrmTp": kind,
                                 "FinInstrmId": "", "ISIN": "", "TckrSymb": t["symbol"], "SctySrs": "",
                                 "XpryDt": t["expiry"], "StrkPric": t["strike"], "OptnTp": t["option_type"],
                                 "ClsPric": price, "SttlmPric": price, "TtlTradgVol": ""})
    return folder


def note_text(note: dict) -> str:
    """A note's data as its PDF's text reads: each section's heading and rows, the levies table."""
    lines = []
    for page in note["pages"]:
        for group in page["groups"]:
            lines += [group["label"], *group["lines"]]
    levies = note["levies"]
    return "\n".join(lines + [levies["head"], *levies["lines"], levies["net"]])
