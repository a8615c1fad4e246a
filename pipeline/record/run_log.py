"""The driver's log of a run, kept in storage beside its record: `logs RUN_ID` reads it after the
cluster (and Ray's job logs with it) is gone, as `ray job logs` reads a job's while the head lives.

The lines go out while the day runs, a chunk every SHIP_EVERY_S, each chunk an object of its own
(storage has no append), written create-only at the next number: a rerun's lines follow the
run's. PANs and e-mail addresses are masked in every line before it leaves the process (the
project logs no password, PIN or key; tests grep the log for all of them).

Each driver (the run's, each rerun's) marks its own part: `driver started` in a chunk written at
once, `driver running` when it has logged nothing for ALIVE_EVERY_S, and `driver ended` in its
final chunk, however it ended. `logs --follow` reads the run's state from these alone: the last
driver ended, or still runs, or wrote nothing for longer than it would while alive (killed, its
host lost). A report proves neither: a rerun's run has one from the start, a killed one never.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pipeline.record.redact import mask_text
from pipeline.record.storage import Store, write_once

SHIP_EVERY_S = 10.0
ALIVE_EVERY_S = 60.0  # a driver that has logged nothing for this long says it still runs
SILENCE_S = 180.0  # no line for this long, and no end: the driver is gone (three `running` marks missed)
FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
# a driver's marks: its logger's name and a session drawn at random, so no other line can pass for one
MARK = re.compile(r"^\S+ \S+ pipeline\.record\.run_log INFO run \S+: driver (started|running|ended) "
                  r"\(session ([0-9a-f]{12})(?:, ([^)]*))?\)$", re.M)


def prefix(run_id: str) -> str:
    return f"logs/{run_id}/"


def chunk_key(run_id: str, n: int) -> str:
    return f"{prefix(run_id)}{n:06d}.log"


class Shipper(logging.Handler):
    """Buffers the records of the loggers it is attached to; `ship` writes what it holds as the
    next chunk. A store that fails a write loses no line: the buffer is kept for the next try."""

    def __init__(self, store: Store, run_id: str):
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter(FORMAT))
        self.store, self.run_id, self.held, self.ship_lock = store, run_id, [], threading.Lock()
        self.next = sum(1 for _ in store.keys(prefix(run_id)))  # a rerun's chunks follow the run's
        self.session, self.shipped_at = secrets.token_hex(6), time.monotonic()
        self.about = f"pid {os.getpid()} on {socket.gethostname()}"  # where a follower looks for a lost driver

    def emit(self, record: logging.LogRecord) -> None:  # under the handler's own lock (Handler.handle)
        self.held.append(mask_text(self.format(record)) + "\n")

    def mark(self, what: str) -> None:
        """This driver's mark in the log (started, running, ended), kept with the lines, not printed."""
        about = "" if what == "ended" else f", {self.about}"
        said = f"run {self.run_id}: driver {what} (session {self.session}{about})"
        self.handle(logging.LogRecord(__name__, logging.INFO, __file__, 0, said, None, None))

    def ship(self, alive_after: float | None = None) -> None:
        """What is held, as the next chunk; with `alive_after`, a `running` mark first when the
        driver has shipped nothing for that long, so that a follower tells it from a dead one."""
        with self.ship_lock:
            if alive_after is not None and time.monotonic() - self.shipped_at >= alive_after and not self.held:
                self.mark("running")
            with self.lock:
                lines, self.held = self.held, []
            if not lines:
                return
            data = "".join(lines).encode()
            try:  # a lost reply is settled by reading the key back, never by writing the lines again
                while write_once(self.store, chunk_key(self.run_id, self.next), data) != data:
                    self.next += 1  # taken by another driver of the run: the next number
                self.next += 1
                self.shipped_at = time.monotonic()
            except Exception:  # storage errors come in many types: kept for the next ship, never the day's failure
                with self.lock:
                    self.held = lines + self.held


@contextmanager
def shipped(store: Store, run_id: str, logger: str = "pipeline") -> Iterator[Shipper]:
    """The `logger`'s lines (the driver's own) shipped to storage while the block runs, and the
    rest when it ends, however it ends; its start marked in a chunk written at once, its end in
    the last."""
    target = logging.getLogger(logger)
    shipper, done = Shipper(store, run_id), threading.Event()
    level = target.level
    if target.getEffectiveLevel() > logging.INFO:  # the record keeps the INFO lines, whatever the terminal shows
        target.setLevel(logging.INFO)
    target.addHandler(shipper)
    shipper.mark("started")
    shipper.ship()  # a follower started now knows a driver runs, before its first 10 s

    def every():
        while not done.wait(SHIP_EVERY_S):
            shipper.ship(alive_after=ALIVE_EVERY_S)

    thread = threading.Thread(target=every, name="run-log", daemon=True)
    thread.start()
    try:
        yield shipper
    except Exception as e:  # the line the operator saw last, kept with the rest
        target.error("run %s ended: %s", run_id, e)
        raise
    finally:
        done.set()
        thread.join()
        target.removeHandler(shipper)
        target.setLevel(level)
        shipper.mark("ended")
        shipper.ship()


def read(store: Store, run_id: str, after: int = 0) -> Iterator[tuple[int, str]]:
    """(number, text) of each chunk from `after` on, in order."""
    for key in sorted(store.keys(prefix(run_id))):
        n = int(key.rsplit("/", 1)[1].split(".", 1)[0])
        if n >= after:
            yield n, store.get(key).decode()


class DriverGone(Exception):
    """The run's last driver wrote no end, and nothing for longer than a live one would."""


def last_mark(text: str, before: tuple | None = None) -> tuple | None:
    """(what, session, about) of the last driver mark in `text`, else `before`: the driver that
    started last is the run's (a driver holds the run's lease; a second one waits for it)."""
    found = MARK.findall(text)
    return found[-1] if found else before


def follow(store: Store, run_id: str, every_s: float = 2.0, silence_s: float = SILENCE_S,
           clock: Callable[[], float] = time.monotonic) -> Iterator[str]:
    """Each chunk as it comes, until the log says its last driver ended (a log from before the
    marks: what it holds). A driver that started, has not ended and has written nothing for
    `silence_s` is gone: DriverGone, after every chunk it did write."""
    after, last, heard = 0, None, clock()
    while True:
        found = list(read(store, run_id, after))
        for n, text in found:
            after, last = n + 1, last_mark(text, last)
            yield text
        if last is None or last[0] == "ended":
            return
        if found:
            heard = clock()
        elif clock() - heard > silence_s:
            host = f" ({last[2]})" if last[2] else ""
            raise DriverGone(f"run {run_id}: its driver{host} is gone: no line for {silence_s:g} s and no end in its "
                             "log (killed, or its host lost); a run or rerun of the same id resumes it once its "
                             "lease lapses (CN_LEASE_S)")
        time.sleep(every_s)
