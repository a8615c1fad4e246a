"""The day's counters through a stalled metrics agent, on a Ray of this script's own (run as a
subprocess by test_metrics_export.py: the test stops the node's dashboard agent, which the
session's shared Ray must keep).

The agent is stopped (SIGSTOP) for longer than the worker's OTLP export deadline (10 s), while
counts are made; then let go. Ray's core worker exports counters as deltas, and a delta whose
export failed is not sent again. Prints one JSON line: whether `wait_exported` saw every count,
what the node's metrics port showed (each metric and label summed over the processes that
export it, as Prometheus' sum by does), and what was counted; then the same port once more,
later, after a few more exports.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import ray  # noqa: E402

from actors import metrics  # noqa: E402

INTERVAL_MS = 2000  # exports every 2 s, not 10 s: the test's waits are short
STALL_S = 16  # longer than the OTLP export deadline (10 s) after the first export in the stall
NAMES = {"ray_cn_day_accounts_total": "status", "ray_cn_bounces_total": "kind", "ray_cn_nodes_total": "event",
         "ray_cn_waited_seconds_total": "on"}


def agent() -> psutil.Process:
    """This Ray's dashboard agent (the node's metrics agent): started under this script's raylet."""
    return next(p for p in psutil.Process().children(recursive=True) if p.cmdline()[:1] == ["ray::DashboardAgent"])


def shown() -> dict[str, float]:
    text = urllib.request.urlopen(metrics.node_metrics_url(), timeout=5).read().decode()
    sums: dict[str, float] = {}
    for name, label in NAMES.items():
        for worker in {w for w in WORKER.findall(text)}:
            for value, n in metrics._shown(text, f'WorkerId="{worker}"', name, label).items():
                key = f'{name}{{{label}="{value}"}}'
                sums[key] = sums.get(key, 0.0) + n
    return sums


WORKER = re.compile(r'WorkerId="(\w*)"')


def main() -> None:
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             _system_config={"metrics_report_interval_ms": INTERVAL_MS})
    try:
        metrics.day({"ok": 3})
        before = metrics.wait_exported(timeout_s=30)
        stalled = agent()
        stalled.send_signal(signal.SIGSTOP)
        try:
            metrics.day({"ok": 5, "physical": 1})
            metrics.bounces("bounced", 2)
            metrics.nodes("lost", 1)
            metrics.waited("hsm", 1.5)
            time.sleep(STALL_S)
        finally:
            stalled.send_signal(signal.SIGCONT)
        after = metrics.wait_exported(timeout_s=30)
        first = shown()
        time.sleep(3 * INTERVAL_MS / 1000)  # a late export would land by now: counted twice?
        print(json.dumps({"before": before, "after": after, "shown": first, "later": shown()}))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
