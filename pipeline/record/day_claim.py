"""A trade date's notes belong to one run.

The archive keeps a day's signed notes by trade date and account (keys.signed_pdf_key), and
a note archived once is what every later attempt mails. A second, fresh run of the same date
would find every note archived, render none and mail the first run's notes again, under a mail
guard of its own that knows nothing of the first run's mail. So the first run to start a date
holds it (one create-only object), and a fresh run of a date held by a run that started is
refused before anything starts, naming that run: `rerun` goes on with it. A run that held the
date and never started (it stopped in preflight, or before its split) leaves it to the next.
"""

from __future__ import annotations

import json
from typing import Callable

from pipeline.errors import DayTaken
from pipeline.record import keys
from pipeline.record.storage import Store, StorageError, write_once


def claim(store: Store, trade_date: str, run_id: str, started: Callable[[str], bool]) -> None:
    """Holds `trade_date` for `run_id`, or raises DayTaken. `started(run)`: whether that run
    got as far as archiving or splitting (its manifest or first notes are in storage)."""
    key, mine = keys.day_claim_key(trade_date), json.dumps({"run_id": run_id}).encode()
    held = write_once(store, key, mine)
    try:
        holder = json.loads(held).get("run_id")
    except (ValueError, AttributeError):
        raise StorageError(f"{store.url}: object {key!r} is not a day's claim (edited?)") from None
    if holder == run_id:
        return
    if isinstance(holder, str) and started(holder):
        raise DayTaken(f"trade date {trade_date} is run {holder}'s: its notes are archived and may have been "
                       f"mailed, and a second run would mail them again; `rerun {holder}` goes on with it")
    store.put(key, mine)  # its holder never started: the date is this run's
