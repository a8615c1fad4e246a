"""Per-shard work on a run's record (close, verify), spread over a process per core.

Every request to S3 costs the client 2-3 ms of CPU (botocore signs it, runs its hooks, parses
the reply), so a command that reads the whole record of a 1.5M-account day, 45,000 objects,
was bound by one core however many requests it kept in flight: `close` took 211 s and
`verify` 217 s on two cores (bench/fullday.py). Here the jobs go out in slices to a process per
core (this one among them), each keeping its share of IN_FLIGHT requests in flight with threads,
and come back in the order given, a few slices ahead at most: memory follows the slices, not
the day.

A small run's few shards stay in this process: a process costs a start and a store of its own.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from itertools import islice
from typing import Callable, Iterable, Iterator

from pipeline.record.storage import IN_FLIGHT, Store

FROM_JOBS = 512  # fewer shards than this are worked in this process
SLICE = 64  # the jobs a process is handed at once

_store: Store | None = None
_threads: ThreadPoolExecutor | None = None


def each(fn: Callable, store: Store, jobs: Iterable[tuple], count: int) -> Iterator:
    """fn(store, *job) for every job, in order. `fn` is sent to the processes by name, so a
    module's own function; `count`, the number of jobs, decides whether processes are worth it.
    This process works a slice in every `cores` itself: a process of its own costs the command
    ~65 MB (Python, botocore), and this one is there anyway."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cores < 2 or count < FROM_JOBS:
        cores = 1
    share = max(1, IN_FLIGHT // cores)
    with ThreadPoolExecutor(share) as threads, ThreadPoolExecutor(2) as here, \
            _processes(cores - 1, store, share) as pool:
        jobs, ahead, n = iter(jobs), deque(), 0
        while True:
            while len(ahead) < 2 * cores and (chunk := list(islice(jobs, SLICE))):
                mine, n = n % cores == 0, n + 1  # two slices of this process's own in flight: no idle tail
                ahead.append(here.submit(_slice, threads, fn, store, chunk) if mine else pool.submit(_work, fn, chunk))
            if not ahead:
                return
            yield from ahead.popleft().result()


def _processes(n: int, store: Store, threads: int) -> ProcessPoolExecutor | contextlib.nullcontext:
    # spawned, not forked: this process may hold threads (a client's pool, Redis's) a fork would copy mid-step
    return ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
                               initargs=(store, threads)) if n else contextlib.nullcontext()


def _slice(threads: ThreadPoolExecutor, fn: Callable, store: Store, chunk: list[tuple]) -> list:
    return list(threads.map(lambda job: fn(store, *job), chunk))


def _start(store: Store, threads: int) -> None:
    global _store, _threads
    _store, _threads = store, ThreadPoolExecutor(threads)


def _work(fn: Callable, chunk: list[tuple]) -> list:
    return _slice(_threads, fn, _store, chunk)
