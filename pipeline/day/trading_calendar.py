"""Exchange trading calendars: settlement is T+1 on a *trading* day of the segment's exchange.

A day is a trading day unless it is a Saturday, a Sunday or a published trading holiday;
special sessions (Muhurat trading) happen on a non-trading day and are allowed as trade
dates, but settle on the next regular trading day. A year with no published list is an
error, never a guess: a wrong settlement date is on every note of the day.
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


class CalendarError(CannotRun, ValueError):
    pass


@dataclass(frozen=True)
class Calendar:
    years: dict[tuple[str, int], dict]  # (exchange, year) -> {"holidays": {...}, "special_sessions": {...}}

    def _year(self, exchange: str, day: dt.date) -> dict:
        entry = self.years.get((exchange, day.year))
        if entry is None:
            raise CalendarError(f"no {exchange} trading-holiday list for {day.year}: add it to "
                                f"{HOLIDAYS_FILE.name} or name a file in CN_HOLIDAYS_FILE")
        return entry

    def is_trading_day(self, exchange: str, day: dt.date) -> bool:
        return day.weekday() < 5 and day.isoformat() not in self._year(exchange, day)["holidays"]

    def next_trading_day(self, exchange: str, day: dt.date) -> dt.date:
        nxt = day + dt.timedelta(days=1)
        while not self.is_trading_day(exchange, nxt):
            nxt += dt.timedelta(days=1)
        return nxt

    def trade_date_warning(self, exchange: str, day: dt.date) -> str | None:
        """What the run report says about a trade date that is not a regular trading day."""
        if self.is_trading_day(exchange, day):
            return None
        entry = self._year(exchange, day)
        special = entry.get("special_sessions", {}).get(day.isoformat())
        if special:
            return f"{day.isoformat()} is not a regular {exchange} trading day: special session ({special})"
        why = entry["holidays"].get(day.isoformat(), "weekend")
        return f"{day.isoformat()} is not a {exchange} trading day ({why}) and no special session is listed"


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
                years[(exchange, int(year))] = {"holidays": entry.get("holidays", {}),
                                                "special_sessions": entry.get("special_sessions", {})}
    return Calendar(years)


def no_session(trade_date: str, path: str = "") -> str | None:
    """Why no exchange traded on `trade_date` (no regular day, no special session on any), or
    None: a day refused before anything starts, not one whose every account is rejected."""
    cal, day = load(path), dt.date.fromisoformat(trade_date)
    said = [cal.trade_date_warning(ex, day) for ex in EXCHANGES]
    if all(w and w.endswith("no special session is listed") for w in said):
        return "; ".join(said)
    return None


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
    cal, day = load(path), dt.date.fromisoformat(trade_date)
    return [w for ex in EXCHANGES if (w := cal.trade_date_warning(ex, day))]
