"""A small day on Ray's real autoscaler with fake nodes of cluster.yaml's types (slow: ~50 s)."""

from __future__ import annotations

import json
import subprocess
import sys

from pipeline.settings import ROOT


def test_the_driver_demand_launches_render_and_signer_nodes_which_go_afterwards(keys_dir, tmp_path):
    out = subprocess.run([sys.executable, f"{ROOT}/tests/autoscaled_day.py", str(tmp_path), str(keys_dir)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600, env=_env())
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "render" in result["types_seen"] and "signer,smtp" in result["types_seen"]
    summary = result["summary"]
    assert summary["delivered"] == summary["accounts"] == result["outbox"] > 0
    assert result["workers_left"] == 0, "worker nodes outlived the run"
    assert result["head_metrics"].get("delivered") == summary["delivered"], result["head_metrics"]
    assert summary["actors"] == {"signers": 2, "mailers": 2}, "the pools follow the two signer/SMTP nodes"


def _env() -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "AWS_"))}
    return {**env, "PYTHONPATH": ROOT}
