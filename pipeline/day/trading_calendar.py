"""Exchange trading calendars: settlement is T+1 on a *trading* day of the segment's exchange.

A day is a trading day unless it is a Saturday, a Sunday or a published trading holiday;
special sessions (Muhurat trading) happen on a non-trading day and are allowed as trade
dates, but settle on the next regular trading day. MCX trades on some equity holidays in its
evening session alone (morning closed, evening open): a trade date, but no settlement day,
as its clearing banks are shut; a settlement holiday is a day it trades and does not settle.
A year with no published list is an error for NSE and BSE, never a guess: a wrong settlement
date is on every note of the day. MCX's and NCDEX's lists are used where given, and where not
their notes say so rather than guess.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pipeline.errors import CannotRun

HOLIDAYS_FILE = Path(__file__).parent / "data" / "holidays.json"
EXCHANGES = ("NSE", "BSE")
# Commodity exchanges keep their own holidays (MCX trades some equity holidays, in the evening
# session): their settlement dates come only from a list given for them, never from NSE's
COMMODITY_EXCHANGES = ("MCX", "NCDEX")
ALL_EXCHANGES = EXCHANGES + COMMODITY_EXCHANGES
KINDS = ("holidays", "special_sessions", "evening_sessions", "settlement_holidays")


class CalendarError(CannotRun, ValueError):
    pass


@dataclass(frozen=True)
class Calendar:
    years: dict[tuple[str, int], dict]  # (exchange, year) -> {kind: {ISO date: name}} for each of KINDS

    def _year(self, exchange: str, day: dt.date) -> dict:
        entry = self.years.get((exchange, day.year))
        if entry is None:
            raise CalendarError(f"no {exchange} trading-holiday list for {day.year}: add it to "
                                f"{HOLIDAYS_FILE.name} or name a file in CN_HOLIDAYS_FILE")
        return entry

    def knows(self, exchange: str, day: dt.date) -> bool:
        return (exchange, day.year) in self.years

    def is_trading_day(self, exchange: str, day: dt.date) -> bool:
        """A regular day of the exchange, on which it trades and settles."""
        entry = self._year(exchange, day)
        iso = day.isoformat()
        return day.weekday() < 5 and all(iso not in entry[k] for k in KINDS if k != "special_sessions")

    def trades_on(self, exchange: str, day: dt.date) -> bool:
        """The exchange holds a session: a regular day, its evening session alone, a special
        session, or a settlement holiday (trading, no settlement)."""
        entry = self._year(exchange, day)
        iso = day.isoformat()
        if iso in entry["special_sessions"] or iso in entry["evening_sessions"]:
            return True
        return day.weekday() < 5 and iso not in entry["holidays"]

    def next_trading_day(self, exchange: str, day: dt.date) -> dt.date:
        nxt = day + dt.timedelta(days=1)
        while not self.is_trading_day(exchange, nxt):
            nxt += dt.timedelta(days=1)
        return nxt

    def trade_date_warning(self, exchange: str, day: dt.date) -> str | None:
        """What the run report says about a trade date that is not a regular trading day."""
        if self.is_trading_day(exchange, day):
            return None
        entry, iso = self._year(exchange, day), day.isoformat()
        special = entry["special_sessions"].get(iso)
        if special:
            return f"{iso} is not a regular {exchange} trading day: special session ({special})"
        if iso in entry["evening_sessions"]:
            return f"{iso} is not a regular {exchange} trading day: evening session only ({entry['evening_sessions'][iso]})"
        if iso in entry["settlement_holidays"]:
            return f"{iso} is a {exchange} settlement holiday ({entry['settlement_holidays'][iso]}): it trades, " \
                   "and settles on the next trading day"
        why = entry["holidays"].get(iso, "weekend")
        return f"{iso} is not a {exchange} trading day ({why}) and no special session is listed"

    def closed_why(self, exchange: str, day: dt.date) -> str:
        """Why the exchange held no session on `day` (it must not have)."""
        return self._year(exchange, day)["holidays"].get(day.isoformat(), "weekend")


def load(path: str = "") -> Calendar:
    """The package's calendar, with a broker-supplied file's exchange-years laid over it."""
    return _load(str(HOLIDAYS_FILE), path)


@lru_cache(maxsize=4)
def _load(base: str, override: str) -> Calendar:
    years: dict[tuple[str, int], dict] = {}
    for source in filter(None, (base, override)):
        try:
            data = json.loads(Path(source).read_text())
        except (OSError, ValueError) as e:
            raise CalendarError(f"cannot read the holiday file {source}: {e}") from None
        for exchange, by_year in data.items():
            if exchange.startswith("_"):
                continue
            for year, entry in by_year.items():
                years[(exchange, int(year))] = {k: entry.get(k, {}) for k in KINDS}
    return Calendar(years)


def no_session(trade_date: str, path: str = "", exchanges=None) -> str | None:
    """Why none of `exchanges` (default: every exchange) traded on `trade_date`, or None if one
    did: a day refused before anything starts, not one whose every account is rejected. A
    commodity exchange whose list for the year is not given is not taken to have traded: its
    trades on a day NSE and BSE are shut need its list (CN_HOLIDAYS_FILE)."""
    cal, day = load(path), dt.date.fromisoformat(trade_date)
    said = []
    for ex in sorted(exchanges or ALL_EXCHANGES, key=ALL_EXCHANGES.index):
        if ex in COMMODITY_EXCHANGES and not cal.knows(ex, day):
            said.append(f"no {ex} holiday list for {day.year} says whether it traded (give one in CN_HOLIDAYS_FILE)")
        elif cal.trades_on(ex, day):
            return None
        else:
            said.append(f"{trade_date} is not a {ex} trading day ({cal.closed_why(ex, day)}) and no special session "
                        "is listed")
    return "; ".join(said)


def sessions(trade_date: str, path: str = "") -> dict[str, str]:
    """Each exchange whose list for the year is given: "regular", "evening" (its evening session
    alone), "special" (a special session, a settlement holiday's trading) or "shut"."""
    cal, day = load(path), dt.date.fromisoformat(trade_date)
    out = {}
    for ex in ALL_EXCHANGES:
        if not cal.knows(ex, day):
            continue
        entry = cal.years[(ex, day.year)]
        out[ex] = ("regular" if cal.is_trading_day(ex, day) else "evening" if day.isoformat() in
                   entry["evening_sessions"] else "special" if cal.trades_on(ex, day) else "shut")
    return out


def closed_exchanges(trade_date: str, path: str = "") -> dict[str, str]:
    """The exchanges known to have held no session on `trade_date`, each with why: their trades
    that day are rejected (a trade file for a shut exchange is another day's, or broken). An
    exchange whose list for the year is not given is not in it."""
    cal, day = load(path), dt.date.fromisoformat(trade_date)
    return {ex: cal.closed_why(ex, day) for ex in ALL_EXCHANGES if cal.knows(ex, day) and not cal.trades_on(ex, day)}


def settlement_dates(trade_date: str, path: str = "") -> dict[str, str]:
    """Each exchange's settlement date for the day's trades (ISO dates); a commodity exchange
    only when its holiday list for the year is given (the note says so otherwise)."""
    cal, day = load(path), dt.date.fromisoformat(trade_date)
    dates = {ex: cal.next_trading_day(ex, day).isoformat() for ex in EXCHANGES}
    for ex in COMMODITY_EXCHANGES:
        try:
            dates[ex] = cal.next_trading_day(ex, day).isoformat()
        except CalendarError:
            continue
    return dates


def trade_date_warnings(trade_date: str, path: str = "") -> list[str]:
    """NSE's and BSE's, and a commodity exchange's whose list is given."""
    cal, day = load(path), dt.date.fromisoformat(trade_date)
    return [w for ex in ALL_EXCHANGES if (ex in EXCHANGES or cal.knows(ex, day)) and
            (w := cal.trade_date_warning(ex, day))]
