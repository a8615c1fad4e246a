"""Ends a local run's Ray processes when the driver dies, however it dies.

`ray.init()` on one machine starts Ray's processes under the driver; GCS and the raylet go
with it, but the raylet's agents (dashboard agent, runtime-env agent) are left behind when
the driver is SIGKILLed. This watcher is started by the driver with a pipe on its stdin: it
notes the driver's descendants every second while the driver lives, and when the pipe
closes (the driver is gone) it ends those still running. Processes are known as psutil knows
them, by PID and start in ticks since boot, so a reused PID is never hit. Not by start time as
a date: that moves when the clock is stepped, and after one step CI's reaper ended nothing.
It imports no Ray: it must outlive Ray's processes.

    python -m pipeline.cluster.reaper DRIVER_PID
"""

from __future__ import annotations

import os
import select
import sys

import psutil


def _tree(root: psutil.Process) -> set[psutil.Process]:
    try:
        return set(root.children(recursive=True))
    except psutil.Error:
        return set()


def watch(driver_pid: int, pipe_fd: int = 0, grace_s: float = 3.0) -> None:
    me = os.getpid()
    root = psutil.Process(driver_pid)
    seen: set[psutil.Process] = set()
    while True:
        seen |= {p for p in _tree(root) if p.pid != me}
        ready, _, _ = select.select([pipe_fd], [], [], 1.0)
        if ready and not os.read(pipe_fd, 4096):
            break  # EOF: the driver has exited or been killed
    left = []
    for p in seen:
        try:
            if p.is_running():
                p.terminate()
                left.append(p)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for p in alive:
        p.kill()


if __name__ == "__main__":
    watch(int(sys.argv[1]))
