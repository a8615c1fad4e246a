"""Per-shard work on a run's record (close, verify), spread over a process per core.

Every request to S3 costs the client CPU (1-3 ms through botocore, ~0.1 ms through obstore,
record/s3.py), and reading an object's chain more, so a command that reads the whole record of a
1.5M-account day, 45,000 objects, was bound by one core however many requests it kept in
flight: `close` took 211 s and `verify` 217 s on two cores (bench/fullday.py). Here the jobs go
out in slices to a process per core (this one among them), each keeping its share of IN_FLIGHT
requests in flight with threads, and come back in the order given, a few slices ahead at most:
memory follows the slices, not the day.

A small run's few shards stay in this process: a process costs a start and a store of its own.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice
from multiprocessing.connection import Connection, Pipe
from typing import Callable, Iterable, Iterator

from pipeline.record.storage import IN_FLIGHT, StorageError, Store

FROM_JOBS = 512  # fewer shards than this are worked in this process
SLICE = 64  # the jobs a process is handed at once


def each(fn: Callable, store: Store, jobs: Iterable[tuple], count: int, here: bool = True) -> Iterator:
    """fn(store, *job) for every job, in order. `fn` is sent to the processes by name, so a
    module's own function; `count`, the number of jobs, decides whether processes are worth it.
    This process works a slice in every `cores` itself: a process of its own costs the command
    ~65 MB (Python, botocore), and this one is there anyway. Not with `here` False, when this
    process has work of its own meanwhile (close's report): slices it held up behind that work,
    under one lock, held up every other process's answers behind them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cores < 2 or count < FROM_JOBS:
        cores = 1
    share = max(1, IN_FLIGHT // cores)
    with ThreadPoolExecutor(share) as threads, ThreadPoolExecutor(2) as own, \
            contextlib.ExitStack() as stack:
        others = [stack.enter_context(_Process(store, share)) for _ in range(cores - 1)]
        jobs, ahead, n = iter(jobs), deque(), 0
        while True:
            while len(ahead) < 2 * cores and (chunk := list(islice(jobs, SLICE))):
                mine, n = n % cores == 0 and (here or not others), n + 1  # two of its own in flight: no idle tail
                ahead.append(own.submit(_slice, threads, fn, store, chunk) if mine
                             else others[n % len(others)].submit(fn, chunk))
            if not ahead:
                return
            yield from ahead.popleft().result()


class _Process:
    """A Python process of its own, handed slices over a socket and answering them in order.
    Not multiprocessing's pool: its queues' semaphores brought multiprocessing's resource
    tracker along, one more process of 12 MB for a command held to 200 MB at 1.5M accounts.
    It ends when told, or when its socket closes: a command killed leaves none behind."""

    def __init__(self, store: Store, threads: int):
        mine, theirs = Pipe()
        path = os.pathsep.join(p for p in sys.path if p)  # where this process found pipeline/ (and a bench's store)
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from pipeline.record.spread import serve; serve({theirs.fileno()})"],
            pass_fds=[theirs.fileno()], env={**os.environ, "PYTHONPATH": path})
        theirs.close()
        self.conn, self.waiting, self.lock = mine, deque(), threading.Lock()
        self.conn.send((store, threads))
        self.reader = threading.Thread(target=self._answers, daemon=True)
        self.reader.start()

    def submit(self, fn: Callable, chunk: list[tuple]) -> Future:
        done: Future = Future()
        with self.lock:
            self.waiting.append(done)
            self.conn.send((fn, chunk))
        return done

    def _answers(self) -> None:
        while True:
            try:
                ok, value = self.conn.recv()
            except (EOFError, OSError):
                break
            except Exception as e:  # read whole, but not made again here (an error whose class needs other arguments)
                ok, value = False, StorageError(f"a process this command spread its reads over answered with what "
                                                f"this one cannot read: {type(e).__name__}: {e}")
            with self.lock:
                done = self.waiting.popleft()
            done.set_result(value) if ok else done.set_exception(value)
        with self.lock:
            left, self.waiting = list(self.waiting), deque()
        for done in left:
            done.set_exception(StorageError(f"a process this command spread its reads over ended "
                                            f"(exit status {self.process.wait()}) before answering"))

    def __enter__(self) -> _Process:
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(OSError):  # told to end (its socket closed here would not wake its reader)
            self.conn.send(None)
        self.process.wait()  # once the slices it holds are answered
        self.reader.join()
        self.conn.close()


def serve(fd: int) -> None:
    """The other end of a _Process: slices in, their results (or what they raised) out."""
    conn = Connection(fd)
    store, threads = conn.recv()
    with ThreadPoolExecutor(threads) as pool:
        while True:
            try:
                work = conn.recv()
            except EOFError:
                return
            if work is None:
                return
            fn, chunk = work
            try:
                answer = (True, _slice(pool, fn, store, chunk))
            except Exception as e:  # whatever a job raised is the command's to say, as if raised there
                answer = (False, e)
            try:
                conn.send(answer)
            except (pickle.PicklingError, TypeError, AttributeError):
                conn.send((False, StorageError(f"{type(answer[1]).__name__}: {answer[1]}")))
            except (BrokenPipeError, ConnectionResetError):
                return


def _slice(threads: ThreadPoolExecutor, fn: Callable, store: Store, chunk: list[tuple]) -> list:
    return list(threads.map(lambda job: fn(store, *job), chunk))
