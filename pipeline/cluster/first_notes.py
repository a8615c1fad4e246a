"""A fresh run's first notes, rendered, signed and mailed by the driver itself while Ray starts.

A cold run's first mail waited for Ray's start (4-5 s on two cores), its actors and workers,
and the whole split. These few notes need none of that: the driver has the signing key from
its preflight, and the stage functions run in any process. It finds a handful of clients of
one shard, reads the day for their rows alone (exactly as the split will build them), gives
them their note numbers and records those in storage before anything is mailed; the split
then writes the same numbers into their shard, and that shard's chain leaves them out.

Only where reading the whole day in the driver costs a few seconds at most (MAX_INPUT_BYTES):
a day bigger than that goes straight to the split, as before.

A run that joins a running Ray (a cluster's head, which neither signs nor mails) makes the same
first notes as far as their render, in the driver, and hands them to the pools' first actors as
they start: a task for them would wait ~1.1 s for a worker of the run's own, then read the day.
On one machine the split waits for them to be mailed, at most SPLIT_HOLD_S after they were handed
over (driver.py): its workers' boots would take the cores those actors start on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Callable

from pipeline import credentials
from pipeline.day import trading_calendar
from pipeline.day.split import DUMPS, Plan, first_accounts, make_plan, shard_line
from pipeline.note.content import ROWS_PER_PAGE
from pipeline.note.render import render_all
from pipeline.record import keys, made_with, note_numbers
from pipeline.record.records import Outcome
from pipeline.record.state import RunState
from pipeline.record.storage import Store, write_once
from pipeline.seal.sign import SignatureInfo
from pipeline.seal.signer import Signer
from pipeline.settings import Settings
from pipeline.stages import Batch, broker, mail_context, mail_stage, render_stage, sign_stage

if TYPE_CHECKING:
    from pipeline.mail.dkim_signer import DkimSigner

log = logging.getLogger("pipeline.cluster.first_notes")
COUNT = 4
# A heavy account is left to its shard's chain, where a huge note is rendered in page ranges in
# parallel: among the first notes (a 60,000-trade client is often the first of clients.csv) its
# 921 pages were rendered whole in this thread, and the other first notes waited on them
MAX_TRADES = 4 * ROWS_PER_PAGE
MAX_INPUT_BYTES = 128 << 20  # read for a few accounts (a 20,000-account day, 63 MB: 0.49 s of CPU with wanted.c,
# 1.75 s in Python; 0.41 s of wall time in one traced run before the moves were read): up to ~1 s, well before a cold
# run's first chain could mail


class FirstNotes:
    """The first notes under way in a thread of the driver. `plan` and `numbers` resolve early
    (the split waits on them: it must use the same ranges, and must not number these accounts
    again); `result` once they are mailed, as a chain's result. Handed to the pools instead
    (`send`), `sent` is the ref their chain ends with, and the chain is counted as the others."""

    def __init__(self, send: Callable[[Batch], object] | None = None) -> None:
        self.plan: Future[Plan | None] = Future()
        self.numbers: Future[dict[str, str]] = Future()
        self.shard: int | None = None
        self.result: dict | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.send, self.sent, self.batch = send, None, None
        self.chain = None  # the driver's, for the batch handed to the pools

    def numbered(self) -> dict[str, str]:
        return self.numbers.result()

    def skipped(self, shard: int) -> frozenset[str]:
        """The accounts this shard's chain leaves out: they are mailed here."""
        return frozenset(self.numbers.result()) if shard == self.shard else frozenset()

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()


def start(settings: Settings, resolved: Settings, signer: Signer | None, run_id: str, trade_date: str, inputs: Store,
          store: Store, state: RunState, lease: str, cpus: int,
          send: Callable[[Batch], object] | None = None) -> FirstNotes:
    """Starts the first notes in a thread and returns at once; `cpus`, the render CPUs the
    split will have, sets its plan's ranges. `send`: hands their rendered batch to the pools
    (and returns the chain's last ref) instead of signing and mailing it here."""
    first = FirstNotes(send)
    if sum(inputs.size(name) for name in DUMPS) > MAX_INPUT_BYTES:
        first.plan.set_result(None)
        first.numbers.set_result({})
        return first
    first.thread = threading.Thread(target=_run, name="first notes", daemon=True, args=(
        first, settings, resolved, signer, run_id, trade_date, inputs, store, state, lease, cpus))
    first.thread.start()
    return first


def _run(first: FirstNotes, settings: Settings, resolved: Settings, signer: Signer, run_id: str, trade_date: str,
         inputs: Store, store: Store, state: RunState, lease: str, cpus: int) -> None:
    try:
        plan = make_plan(inputs, trade_date, settings.shard_size, parts=max(1, cpus),
                         holidays_file=settings.holidays_file, entity=broker(settings.broker_file))
        first.plan.set_result(plan)
        shard, accounts = first_accounts(inputs, plan, trade_date, COUNT)
        accounts = [a for a in accounts if len(a[2]) <= MAX_TRADES]
        if not accounts:
            return
        prefix = broker(settings.broker_file)["note_prefix"]
        start = note_numbers.reserve(store, state, note_numbers.financial_year(trade_date), len(accounts))
        numbers = {ucc: note_numbers.note_number(prefix, trade_date, start + i) for i, (ucc, _, _) in
                   enumerate(accounts)}
        made = json.dumps({"shard": shard, "shard_count": plan.shard_count, "made_with": made_with.recorded(settings),
                           "numbers": numbers}).encode()
        if write_once(store, keys.first_notes_key(run_id), made) != made:  # ours, even if its reply was lost
            raise RuntimeError(f"run {run_id} already made its first notes")  # a fresh run is never resumed
        state.record(Outcome(ucc, "validated") for ucc in numbers)
        first.shard = shard
        first.numbers.set_result(numbers)
        batch = Batch(run_id, trade_date, shard, settles=trading_calendar.settlement_dates(trade_date, settings.holidays_file),
                      broker_file=settings.broker_file, lease=lease)
        notes = [json.loads(shard_line(u, c, t, numbers[u])) for u, c, t in accounts]
        if first.send is None:
            first.result = mail_notes(settings, resolved, signer, batch, notes, store, state)
            log.info("run %s: %d first notes made in the driver", run_id, len(numbers))
        else:
            first.batch = render_stage(batch, notes, state, render_notes=partial(render_all, tagged=settings.pdf_tags),
                                       encryption=settings.encryption)
            first.sent = first.send(first.batch)
            log.info("run %s: %d first notes rendered in the driver, handed to the pools", run_id, len(numbers))
    except BaseException as e:  # the driver says what it means for these accounts (driver.py)
        first.error = e
    finally:
        for future, empty in ((first.plan, None), (first.numbers, {})):
            if not future.done():
                future.set_result(empty)


def mail_notes(settings: Settings, resolved: Settings, signer: Signer, batch: Batch, accounts: list[dict],
               store: Store, state: RunState) -> dict:
    """A few accounts through render, sign and mail in this process (the test send's too)."""
    batch = render_stage(batch, accounts, state, render_notes=partial(render_all, tagged=settings.pdf_tags))
    batch = sign_stage(batch, signer, resolved.owner_password, resolved.encryption, store, state,
                       SignatureInfo(settings.sign_reason, settings.sign_location, settings.sign_contact))
    return asyncio.run(_mailed(resolved, state, store, batch, credentials.dkim_signer(settings)))


async def _mailed(settings: Settings, state: RunState, store: Store, batch: Batch, dkim: DkimSigner | None) -> dict:
    ctx = mail_context(settings, state, store, dkim=dkim)  # on the loop that sends: the pool belongs to it
    try:
        return await mail_stage(batch, ctx)
    finally:
        await ctx.pool.close()
