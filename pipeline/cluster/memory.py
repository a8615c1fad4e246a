"""A process's own peak memory, for the run's summary and the benchmarks. No Ray here: a bench step
that reads it imports this module alone."""

from __future__ import annotations

import resource


def peak_rss_mb() -> float:
    """This process's own peak (VmHWM). Not ru_maxrss: Linux carries that over from the parent
    through fork and exec, so a child started by a big process reports the parent's peak."""
    try:
        with open("/proc/self/status") as f:
            kb = next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), 0)
    except OSError:  # no /proc (a driver on macOS): the best there is
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # bytes there
    return round(kb / 1024, 1)
