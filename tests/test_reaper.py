"""The reaper ends what a killed driver started, even when the wall clock is stepped meanwhile.

CI once left a killed driver's dashboard and runtime-env agents running: psutil gives a
process's start as boot time plus its start ticks, and the boot time it reads from /proc/stat
moves when the clock is stepped (NTP on a VM). The reaper compared those start times for
equality, so after a step it took every process it had seen for a new one and ended none."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil
import psutil._pslinux
import pytest

from pipeline.cluster import reaper

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the boot time stepped is Linux's")

PARENT = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
          "time.sleep(120)")


def test_a_killed_parents_descendants_are_ended_though_the_clock_was_stepped_while_it_ran(monkeypatch):
    parent = subprocess.Popen([sys.executable, "-c", PARENT])
    grandchild = None
    try:
        for _ in range(100):
            kids = psutil.Process(parent.pid).children()
            if kids:
                grandchild = kids[0]
                break
            time.sleep(0.05)
        assert grandchild is not None, "the parent never started its child"
        read_end, write_end = os.pipe()
        watcher = threading.Thread(target=reaper.watch, args=(parent.pid, read_end, 2.0), daemon=True)
        watcher.start()
        time.sleep(1.5)  # the watcher has noted the grandchild

        booted = psutil._pslinux.boot_time()
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: booted + 1.0)  # the clock stepped a second
        parent.kill()
        parent.wait()
        os.close(write_end)
        watcher.join(timeout=10)
        assert not watcher.is_alive()
        os.close(read_end)
        _, alive = psutil.wait_procs([grandchild], timeout=5)
        assert not alive, "the killed parent's child was left running"
    finally:
        if parent.poll() is None:
            parent.kill()
        if grandchild is not None and grandchild.is_running():
            grandchild.kill()
