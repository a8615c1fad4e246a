"""The day's totals reach the head's metrics port exactly, even when the node's metrics agent
misses an export (stalled past the export deadline): none lost, none counted twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

COUNTED = {'ray_cn_day_accounts_total{status="delivered"}': 8.0, 'ray_cn_day_accounts_total{status="physical"}': 1.0,
           'ray_cn_bounces_total{kind="bounced"}': 2.0, 'ray_cn_nodes_total{event="lost"}': 1.0,
           'ray_cn_waited_seconds_total{on="hsm"}': 1.5}


def test_the_days_counters_reach_the_port_exactly_when_the_metrics_agent_missed_an_export():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    with tempfile.TemporaryDirectory(prefix="cnm", dir="/tmp") as tmp:  # a Ray of its own; short: its socket paths
        out = subprocess.run([sys.executable, f"{ROOT}/tests/stalled_agent.py"], cwd=ROOT, capture_output=True,
                             text=True, timeout=240, env={**env, "RAY_TMPDIR": tmp})
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["before"], seen
    assert seen["after"], seen  # wait_exported: every count was on the port
    assert seen["shown"] == COUNTED, seen  # none lost
    assert seen["later"] == COUNTED, seen  # and none counted twice by a late export
