"""Whose CPU a run's busy cores were, read from /proc.

`/proc/stat` gives the cores' busy time and nothing about who spent it. A note's CPU is spent
in several processes at once (Ray's task workers, the signer and mailer actors, the driver,
Redis, the relay, Ray's own daemons), so `sampled` reads the CPU of every process descended
from the bench every `every` seconds while a run goes on, and adds each one's growth to a group
named for what it runs. A process that ends between two samples loses what it spent after the
last one, and nothing outside the bench's tree is counted (the kernel's threads, anything else
on the machine): the busy time less the groups is both.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

HZ = os.sysconf("SC_CLK_TCK")
ACTORS = {"ray::SignerActor": "signer", "ray::MailerActor": "mailer", "ray::Totals": "day totals"}
TASKS, OTHER = "task workers (split, render)", "other"
RAY_OWN = ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "ray::DashboardAgent",
           "ray::RuntimeEnvAgent", "ray/_private", "--raylet_socket_name", "--session-dir", "--logs-dir")


def group(cmdline: str) -> str:
    """A process's group, from its command line: ours by the program it runs first, since a
    path among its arguments may hold any word; then Ray's, which retitles a worker with what it
    runs now (`ray::IDLE` between tasks, the actor's class in an actor)."""
    argv = cmdline.split()
    if not argv:
        return OTHER  # a zombie, or a process between fork and exec
    if "-m pipeline run" in cmdline or "-m pipeline demo" in cmdline:
        return "driver"
    if "pipeline.mail.smtp_sink" in argv:
        return "relay"
    if argv[0].endswith("redis-server"):
        return "redis"
    if argv[0].startswith("ray::"):
        name = argv[0].split(".")[0]  # ray::SignerActor.sign while in a call
        if name in ACTORS:
            return ACTORS[name]
        if name not in ("ray::DashboardAgent", "ray::RuntimeEnvAgent"):
            return TASKS
    if "default_worker.py" in cmdline:  # a worker Ray has not titled yet
        return TASKS
    if any(part in cmdline for part in RAY_OWN):
        return "ray's own"
    return OTHER


def _read() -> dict[tuple[str, str], tuple[str, float, str]]:
    """(pid, start time) -> (group, CPU seconds so far, parent pid) for every process now."""
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
        name = "the bench process" if int(pid) == os.getpid() else group(cmdline)
        out[(pid, fields[19])] = (name, (int(fields[11]) + int(fields[12])) / HZ, fields[1])
    return out


@contextmanager
def sampled(every: float = 0.5) -> Iterator[dict[str, float]]:
    """CPU seconds by group spent inside the block by this process and its descendants (~2.5 ms
    of CPU a sample with 70 processes); the dict is filled when the block ends."""
    now = _read()
    base = {key: cpu for key, (_, cpu, _) in now.items()}
    me = str(os.getpid())
    ours = {key for key in now if key[0] == me}  # (pid, start): kept once seen, as a child outlives its parent
    last: dict[tuple[str, str], tuple[str, float]] = {}
    stop = threading.Event()

    def take() -> None:
        now = _read()
        key_of = {key[0]: key for key in now}
        parent = {pid: ppid for (pid, _), (_, _, ppid) in now.items()}
        for key, (name, cpu, _) in now.items():
            up, seen = key[0], set()
            while key_of.get(up) not in ours and up in parent and up not in seen:
                seen.add(up)
                up = parent[up]
            if key_of.get(up) not in ours:
                continue
            ours.add(key)
            had = last.get(key, (OTHER,))[0]
            last[key] = (had if name == OTHER else name, cpu)  # a process seen as it ends keeps its group

    def run() -> None:
        while not stop.wait(every):
            take()

    thread = threading.Thread(target=run, name="cpu-sampler", daemon=True)
    thread.start()
    spent: dict[str, float] = {}
    try:
        yield spent
    finally:
        stop.set()
        thread.join()
        take()
        by = Counter()
        for key, (name, cpu) in last.items():
            by[name] += cpu - base.get(key, 0.0)
        spent.update((name, round(s, 2)) for name, s in by.most_common())
