"""The driver's log of a run, kept in storage beside its record: `logs RUN_ID` reads it after the
cluster (and Ray's job logs with it) is gone, as `ray job logs` reads a job's while the head lives.

The lines go out while the day runs, a chunk every SHIP_EVERY_S, each chunk an object of its own
(storage has no append), written create-only at the next number: a rerun's lines follow the
run's. PANs and e-mail addresses are masked in every line before it leaves the process (the
project logs no password, PIN or key; tests grep the log for all of them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pipeline.record.redact import mask_text
from pipeline.record.storage import Store, write_once

SHIP_EVERY_S = 10.0
FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


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

    def emit(self, record: logging.LogRecord) -> None:  # under the handler's own lock (Handler.handle)
        self.held.append(mask_text(self.format(record)) + "\n")

    def ship(self) -> None:
        with self.ship_lock:
            with self.lock:
                lines, self.held = self.held, []
            if not lines:
                return
            data = "".join(lines).encode()
            try:  # a lost reply is settled by reading the key back, never by writing the lines again
                while write_once(self.store, chunk_key(self.run_id, self.next), data) != data:
                    self.next += 1  # taken by another driver of the run: the next number
                self.next += 1
            except Exception:  # storage errors come in many types: kept for the next ship, never the day's failure
                with self.lock:
                    self.held = lines + self.held


@contextmanager
def shipped(store: Store, run_id: str, logger: str = "pipeline") -> Iterator[Shipper]:
    """The `logger`'s lines (the driver's own) shipped to storage while the block runs, and the
    rest when it ends, however it ends."""
    target = logging.getLogger(logger)
    shipper, done = Shipper(store, run_id), threading.Event()
    level = target.level
    if target.getEffectiveLevel() > logging.INFO:  # the record keeps the INFO lines, whatever the terminal shows
        target.setLevel(logging.INFO)
    target.addHandler(shipper)

    def every():
        while not done.wait(SHIP_EVERY_S):
            shipper.ship()

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
        shipper.ship()


def read(store: Store, run_id: str, after: int = 0) -> Iterator[tuple[int, str]]:
    """(number, text) of each chunk from `after` on, in order."""
    for key in sorted(store.keys(prefix(run_id))):
        n = int(key.rsplit("/", 1)[1].split(".", 1)[0])
        if n >= after:
            yield n, store.get(key).decode()


def follow(store: Store, run_id: str, done: Callable[[], bool], every_s: float = 2.0) -> Iterator[str]:
    """Each chunk as it comes, until `done()` says the run has ended and one more look finds none."""
    after, ended = 0, False
    while True:
        found = list(read(store, run_id, after))
        for n, text in found:
            after = n + 1
            yield text
        if ended and not found:
            return
        ended = done()
        if not ended:
            time.sleep(every_s)
