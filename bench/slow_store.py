"""What bench/proof.py's and bench/fullday.py's `close` and `verify` steps run against and measure.

Kept apart from the benches: the processes close and verify spread their reads over
(pipeline/record/spread.py) unpickle the store, and with it import this module alone.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path


class SlowStore:
    """A store whose every request waits `latency_s` first, as an S3 round trip does. Each
    request appends a byte to `counter`, so the requests of every process are counted."""

    def __init__(self, store, latency_s: float, counter: Path):
        self.store, self.latency_s, self.url, self.counter = store, latency_s, store.url, Path(counter)
        self._fd = os.open(self.counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def __reduce__(self):
        return SlowStore, (self.store, self.latency_s, self.counter)

    @property
    def requests(self) -> int:
        return self.counter.stat().st_size

    def _wait(self) -> None:
        os.write(self._fd, b".")
        time.sleep(self.latency_s)

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def slow(*args, **kwargs):
            self._wait()
            return method(*args, **kwargs)
        return slow

    def keys(self, prefix: str, after: str = ""):
        self._wait()  # a listing page of 1,000 keys is one request
        for n, key in enumerate(self.store.keys(prefix, after), 1):
            if n % 1000 == 0:
                self._wait()
            yield key

    def md5s(self, prefix: str):
        self._wait()  # a listing page, as keys: each key's ETag comes with it
        for n, listed in enumerate(self.store.md5s(prefix), 1):
            if n % 1000 == 0:
                self._wait()
            yield listed


class TreeMemory:
    """The peak of this process's RSS plus its descendants' (the processes a step spreads its
    reads over), read from /proc every 0.2 s."""

    def __init__(self):
        self.peak_mb, self.most = 0.0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        self._sample()
        while not self.stop.wait(0.2):
            self._sample()

    def _sample(self) -> None:
        tree = _tree(os.getpid())
        self.peak_mb = max(self.peak_mb, sum(map(_rss_mb, tree)))
        self.most = max(self.most, len(tree))

    def result(self) -> dict:
        self.stop.set()
        self.thread.join()
        self._sample()
        return {"tree_peak_rss_mb": round(self.peak_mb, 1), "processes": self.most}


def _tree(root: int) -> list[int]:
    """The process and its descendants, from each thread's list of children: reading every
    process's stat in /proc five times a second took 14% of verify's own CPU samples at 150,000
    accounts with the test suite on the machine."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        with contextlib.suppress(OSError):
            for task in os.scandir(f"/proc/{pid}/task"):
                with open(f"{task.path}/children") as f:
                    todo += map(int, f.read().split())
    return found


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0) / 1024
    except OSError:
        return 0.0
