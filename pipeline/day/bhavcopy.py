"""The exchanges' daily bhavcopy, in their common UDiFF layout: each derivatives contract's
closing and settlement prices, so a note can show the Closing Rate and mark futures to market.

Only the columns we need are required (extra ones are ignored); rows of other days and of
the cash segment are skipped. Currency (Sgmt CD) and commodity (CO) rows name their
instrument as the trade file does (FUTCUR, OPTCUR, FUTCOM, OPTFUT): the exchanges' UDiFF type
codes for those segments are to be confirmed, so both files share one vocabulary meanwhile. A bad row names no account, so it is an input error of the run;
an account whose contract is then missing is rejected with its own trade row named.
"""

from __future__ import annotations

import csv
from decimal import Decimal
from typing import Iterable

from pipeline.day.dumps import INSTRUMENTS as SEGMENT_INSTRUMENTS
from pipeline.day.dumps import PRICE, REFERENCE_FILE, RowError, check_header, reference_key

FILE = "bhavcopy.csv"
FIELDS = ["TradDt", "Src", "Sgmt", "FinInstrmTp", "TckrSymb", "XpryDt", "StrkPric", "OptnTp", "ClsPric", "SttlmPric"]
# UDiFF instrument types -> the trade file's instrument codes
INSTRUMENTS = {"IDF": "FUTIDX", "STF": "FUTSTK", "IDO": "OPTIDX", "STO": "OPTSTK",
               "FUTCUR": "FUTCUR", "OPTCUR": "OPTCUR", "FUTCOM": "FUTCOM", "OPTFUT": "OPTFUT"}
UDIFF_TYPES = {v: k for k, v in INSTRUMENTS.items()}
# UDiFF's Sgmt -> the trade file's segment (the trade file's own codes are taken too)
SEGMENTS = {"FO": "FO", "CD": "CDS", "CDS": "CDS", "CO": "COM", "COM": "COM"}
SGMT = {"FO": "FO", "CDS": "CD", "COM": "CO"}  # what a bhavcopy row says for a trade file's segment


def read(lines: Iterable[str], trade_date: str, errors: list[dict], max_errors: int = 1000) -> dict[tuple, Decimal]:
    """Contract id (as dumps.contract_id makes it) -> the price a note shows in its Closing Rate
    column: the daily settlement price for futures (what MTM uses), the closing price for options."""
    reader = csv.DictReader(lines)
    check_header(FILE, reader.fieldnames or [], FIELDS)
    prices: dict[tuple, Decimal] = {}
    rows: dict[tuple, int] = {}  # the row that gave each contract its price
    ambiguous: set[tuple] = set()
    for n, row in enumerate(reader, start=1):
        if row.get("TradDt") != trade_date or row.get("Sgmt") not in SEGMENTS:
            continue
        try:
            key, price = _contract_price(n, row)
            if key in prices and prices[key] != price:  # which one is the close? Neither is used
                ambiguous.add(key)
                raise RowError(FILE, n, "SttlmPric" if key[2].startswith("FUT") else "ClsPric",
                               f"{row['TckrSymb']} {row['XpryDt']} is listed again, at {price} where row "
                               f"{rows[key]} says {prices[key]}: its trades are rejected")
        except RowError as e:
            if len(errors) < max_errors:
                errors.append(e.as_dict())
            continue
        prices[key], rows[key] = price, n
    return {k: v for k, v in prices.items() if k not in ambiguous}


def _contract_price(n: int, row: dict[str, str]) -> tuple[tuple, Decimal]:
    segment = SEGMENTS[row["Sgmt"]]
    instrument = INSTRUMENTS.get(row["FinInstrmTp"] or "")
    if instrument not in SEGMENT_INSTRUMENTS[segment]:
        raise RowError(FILE, n, "FinInstrmTp", f"{row['FinInstrmTp']!r} is not an instrument of segment "
                                               f"{row['Sgmt']} ({', '.join(sorted(_types(segment)))})")
    option = instrument.startswith("OPT")
    strike = _price(n, "StrkPric", row["StrkPric"]) if option else None
    price = _price(n, "ClsPric" if option else "SttlmPric", row["ClsPric"] if option else row["SttlmPric"])
    key = (row["Src"], segment, instrument, row["TckrSymb"], row["XpryDt"], strike, row["OptnTp"] if option else "")
    return key, price


def _types(segment: str) -> list[str]:
    return [t for t, instrument in INSTRUMENTS.items() if instrument in SEGMENT_INSTRUMENTS[segment]]


def _price(n: int, field: str, text: str) -> Decimal:
    """The trade file's rule for a price (digits, at most 4 places, under a billion): no
    exponent, so 1e30 is a row error here, not an InvalidOperation at render."""
    if not PRICE.match(text or ""):
        raise RowError(FILE, n, field, f"{text[:40]!r} is not a price (digits, at most 4 decimal places)")
    value = Decimal(text)
    if value <= 0:
        raise RowError(FILE, n, field, f"{text!r} is not a positive price")
    return value



REFERENCE_FIELDS = ["date", "currency", "units", "rate"]
UNITS = {"1": 1, "100": 100}  # RBI quotes a rate for 1 USD, EUR or GBP and for 100 JPY
MAX_REFERENCE = Decimal("1000")  # rupees a unit: a guard against a broken file, as MAX_PRICE is


def read_reference_rates(lines: Iterable[str], trade_date: str, errors: list[dict],
                         max_errors: int = 1000) -> dict[tuple, Decimal]:
    """reference_rates.csv, RBI's reference rates for the day: reference_key(currency) -> rupees a
    unit (a rate for 100 JPY divided by 100, exactly). A cross-currency pair's rupee value is its
    value in the currency it is quoted in at this rate (NSE and BSE settle them so: EURUSD and
    GBPUSD at USD's, USDJPY at JPY's). Rows of other days are skipped; a bad row, or a currency
    given twice at two rates, is the run's input error, and that currency's trades are rejected."""
    reader = csv.DictReader(lines)
    check_header(REFERENCE_FILE, reader.fieldnames or [], REFERENCE_FIELDS)
    rates: dict[tuple, Decimal] = {}
    ambiguous: set[tuple] = set()
    for n, row in enumerate(reader, start=1):
        if (row.get("date") or "").strip() != trade_date:
            continue
        try:
            currency, units, text = ((row.get(f) or "").strip() for f in ("currency", "units", "rate"))
            if not currency.isascii() or not currency.isalpha() or not currency.isupper() or len(currency) != 3:
                raise RowError(REFERENCE_FILE, n, "currency", f"{currency[:40]!r} is not a currency code (e.g. USD)")
            if units not in UNITS:
                raise RowError(REFERENCE_FILE, n, "units", f"{units[:40]!r} must be 1 or 100 (RBI quotes JPY per 100)")
            if not PRICE.match(text) or not Decimal(0) < Decimal(text) < MAX_REFERENCE * UNITS[units]:
                raise RowError(REFERENCE_FILE, n, "rate", f"{text[:40]!r} is not a rate in rupees (at most 4 "
                                                          f"decimal places, under {MAX_REFERENCE:,} a unit)")
            key, rate = reference_key(currency), Decimal(text) / UNITS[units]
            if key in rates and rates[key] != rate:
                ambiguous.add(key)
                raise RowError(REFERENCE_FILE, n, "rate", f"{currency} is listed again, at {rate} a unit where an "
                                                          f"earlier row says {rates[key]}: its trades are rejected")
        except RowError as e:
            if len(errors) < max_errors:
                errors.append(e.as_dict())
            continue
        rates[key] = rate
    return {k: v for k, v in rates.items() if k not in ambiguous}
