"""The threads a token key signs on (token._Threads): at most `size` at once, an idle one reused
rather than another started; and a signature whose thread could not start is never made later,
on a session already given back."""

from __future__ import annotations

import threading
import time

import pytest

from pipeline.seal.token import SOFTHSM, TokenConfig, TokenKey, _Threads


def _together(threads: _Threads, jobs: int, at_once: int) -> tuple[int, set[int], list[str]]:
    """`jobs` jobs, each of which waits until `at_once` of them run (a barrier): the most that
    ran at once, the threads that ran them, and what went wrong (a barrier never met)."""
    lock, now, most, seen, failed = threading.Lock(), [0], [0], set(), []
    barrier, done = threading.Barrier(at_once, timeout=10), threading.Semaphore(0)

    def job() -> None:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
            seen.add(threading.get_ident())
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            failed.append("fewer than %d at once" % at_once)
        with lock:
            now[0] -= 1
        done.release()

    for _ in range(jobs):
        threads.submit(job)
    for _ in range(jobs):
        assert done.acquire(timeout=30), "a job never ran"
    return most[0], seen, failed


def test_a_bounded_pool_runs_its_size_at_once_never_more_and_every_job():
    most, seen, failed = _together(_Threads("test", 3), 30, 3)
    assert most == 3 and len(seen) == 3 and not failed, (most, len(seen), failed)


def test_an_unbounded_pool_runs_every_call_at_once_and_reuses_idle_threads():
    threads = _Threads("test")
    most, first, failed = _together(threads, 8, 8)
    assert most == 8 and not failed
    until = time.monotonic() + 10
    while threads._idle < 8 and time.monotonic() < until:  # each back to waiting for a job
        time.sleep(0.01)
    _, again, failed = _together(threads, 8, 8)
    assert again <= first and not failed, "threads started while idle ones waited"


def test_a_signature_whose_thread_could_not_start_is_never_made_later(hsm, monkeypatch):
    """SoftHSM2 in process: `sign` hands its call to a thread of the key's. That thread cannot
    start (the process at its limit): the signature fails, and its session is given back.
    The next signature starts a thread, which must not make the first one's call too: on a
    session it no longer holds (another signature's, with a network HSM's several)."""
    key = TokenKey(TokenConfig(SOFTHSM, hsm.label, hsm.key_label, pin=hsm.pin_file.read_text()))
    made, raw = [], key._raw
    monkeypatch.setattr(key, "_raw", lambda k, data: made.append(data) or raw(k, data))  # counted, as it is
    start, fails = threading.Thread.start, [True]

    def start_once_failing(thread):
        if fails and fails.pop():
            raise RuntimeError("can't start new thread")
        return start(thread)

    try:
        monkeypatch.setattr(threading.Thread, "start", start_once_failing)
        with pytest.raises(RuntimeError):
            key.sign(b"first")
        key.sign(b"second")
        time.sleep(0.2)  # a call made later would be made by now
        assert made == [b"second"], made
    finally:
        key.close()
