"""Whose CPU a run's busy cores were: every process on the machine, sampled from /proc.

`/proc/stat` gives the cores' busy time and nothing about who spent it. A note's CPU is spent
in several processes at once (Ray's task workers, the signer and mailer actors, the driver,
Redis, the relay, Ray's own daemons), so the sampler reads each process's utime + stime every
`every` seconds (~2.5 ms of CPU each time with 70 processes) while the run goes on and attributes the growth to a group by its command
line. A process that ends between two samples loses what it spent after the last one: the
groups add up to a little less than the busy time, and `unattributed` says by how much.
"""

from __future__ import annotations

import os
import threading
from collections import Counter

HZ = os.sysconf("SC_CLK_TCK")
ACTORS = {"ray::SignerActor": "signer", "ray::MailerActor": "mailer", "ray::Totals": "day totals"}
TASKS, OTHER = "tasks (split, render)", "other"
RAY_OWN = ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "ray::DashboardAgent",
           "ray::RuntimeEnvAgent", "ray/_private", "--raylet_socket_name", "--session-dir", "--logs-dir")


def group(cmdline: str, comm: str) -> str:
    """A process's group, from what it runs. Ray retitles a worker with what it runs now, so a
    task worker seen idle last is still a task worker."""
    if cmdline.startswith("ray::"):
        name = cmdline.split()[0].split(".")[0]  # ray::SignerActor.sign while in a call
        if name in ACTORS:
            return ACTORS[name]
        if name not in ("ray::DashboardAgent", "ray::RuntimeEnvAgent"):
            return TASKS
    if "default_worker.py" in cmdline:  # a worker Ray has not titled yet
        return TASKS
    if any(part in cmdline for part in RAY_OWN):
        return "ray's own"
    if "-m pipeline run" in cmdline or "-m pipeline demo" in cmdline:
        return "driver"
    if "smtp_sink" in cmdline:
        return "relay"
    if "redis-server" in cmdline or comm == "redis-server":
        return "redis"
    return OTHER


def _read() -> dict[tuple[str, str], tuple[str, float]]:
    """(pid, start time) -> (group, CPU seconds so far) for every process now."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        name = "the bench (this sampler's)" if int(pid) == os.getpid() else group(cmdline, comm)
        out[(pid, fields[19])] = (name, (int(fields[11]) + int(fields[12])) / HZ)
    return out


class Sampler:
    """Started before the run, stopped after it: CPU seconds by group in between."""

    def __init__(self, every: float = 0.5) -> None:
        self.every, self._stop = every, threading.Event()
        self._base = {key: cpu for key, (_, cpu) in _read().items()}
        self._last: dict[tuple[str, str], tuple[str, float]] = {}
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._take()

    def _take(self) -> None:
        for key, (name, cpu) in _read().items():
            had = self._last.get(key, (OTHER,))[0]
            if had != OTHER and (name == OTHER or (name == TASKS and had != TASKS)):
                name = had  # an actor's worker seen idle, a process seen as it ends (no command line): as before
            self._last[key] = (name, cpu)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self._take()
        spent: Counter = Counter()
        for key, (name, cpu) in self._last.items():
            spent[name] += cpu - self._base.get(key, 0.0)
        return {name: round(s, 2) for name, s in spent.most_common()}
