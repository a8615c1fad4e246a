"""The threads a token key signs on (token._Threads): at most `size` at once, an idle one reused
rather than another started, and a call whose thread could not start never made later on a
session already given back. Pure logic: no HSM."""

from __future__ import annotations

import threading
import time

import pytest

from pipeline.seal import token
from pipeline.seal.token import _Threads


def _running(threads: _Threads, jobs: int) -> tuple[int, set[int]]:
    """The most jobs that ran at once, and the threads that ran them, for `jobs` jobs that each
    hold on for a moment."""
    lock, now, most, seen, done = threading.Lock(), [0], [0], set(), threading.Semaphore(0)

    def job() -> None:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
            seen.add(threading.get_ident())
        time.sleep(0.02)
        with lock:
            now[0] -= 1
        done.release()

    for _ in range(jobs):
        threads.submit(job)
    for _ in range(jobs):
        assert done.acquire(timeout=10), "a job never ran"
    return most[0], seen


def test_a_bounded_pool_runs_at_most_its_size_at_once_and_every_job():
    most, seen = _running(_Threads("test", 3), 30)
    assert most == 3 and len(seen) == 3


def test_an_unbounded_pool_reuses_an_idle_thread_rather_than_start_another():
    threads = _Threads("test")
    assert _running(threads, 8)[0] == 8  # as many as the calls at once
    time.sleep(0.05)  # each back to waiting
    most, seen = _running(threads, 1)
    assert most == 1
    again = set()
    for _ in range(5):  # one at a time: the same few threads, not five new ones
        again |= _running(threads, 1)[1]
    assert len(again) <= 8


def test_a_call_whose_thread_could_not_start_is_never_made_later(monkeypatch):
    """The call is queued with no thread; the next submit starts one, which must not make it:
    its caller already gave its session back (`sign` failed). Cancelled, it is passed over."""
    made, fails = [], [True]
    start = threading.Thread.start

    def start_once_failing(self):
        if fails and fails.pop():
            raise RuntimeError("can't start new thread")
        return start(self)

    threads = _Threads("test")
    monkeypatch.setattr(threading.Thread, "start", start_once_failing)
    first = token.Future()
    with pytest.raises(RuntimeError):
        try:
            threads.submit(lambda: token._settle(first, lambda: made.append("first") or b""))
        except RuntimeError:
            first.cancel()  # as TokenKey._sign_once does
            raise
    second = token.Future()
    threads.submit(lambda: token._settle(second, lambda: made.append("second") or b""))
    second.result(timeout=10)
    time.sleep(0.05)
    assert made == ["second"] and first.cancelled()
