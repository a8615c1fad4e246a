"""A small day on Ray's real autoscaler with fake nodes of cluster.yaml's types (slow: ~50 s), and
a day on a Ray started by hand, which has none."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys

from pipeline.settings import ROOT
from tests.conftest import TRADE_DATE


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


def test_a_day_on_a_ray_started_by_hand_with_no_render_node_stops_naming_the_role(
        redis_url, smtp_sink, keys_dir, day, tmp_path):
    """Joined by its address, a Ray with no autoscaler and no node offering `render` kept the day
    in its split for ever. It is said at once, waited for CN_CAPACITY_WAIT_S, then the run stops
    (exit 2) naming the role and how a node offers it."""
    held = subprocess.Popen([sys.executable, "-c", HELD_RAY], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=_env())
    try:
        assert select.select([held.stdout], [], [], 120)[0], "the hand-started Ray did not start in 120 s"
        address = held.stdout.readline().strip()
        assert address, "the hand-started Ray did not start"
        env = {k: v for k, v in _env().items() if not k.startswith(("CN_", "SMTP_URL"))}
        env.update(RAY_ADDRESS=address, RAY_AUTH_MODE="token", REDIS_URL=redis_url, SMTP_URL=smtp_sink.url, CN_CAPACITY_WAIT_S="5",
                   CN_STORE=str(tmp_path / "store"), CN_TOKEN_KEY_FILE=str(keys_dir / "token.key"),
                   CN_SIGNER_KEY=str(keys_dir / "signer.key.pem"), CN_SIGNER_CERT=str(keys_dir / "signer.cert.pem"),
                   CN_SIGNER_CHAIN=str(keys_dir / "root.cert.pem"), CN_OWNER_PASSWORD="test-owner-secret")
        done = subprocess.run([sys.executable, "-m", "pipeline", "run", "--date", TRADE_DATE, "--input", str(day)],
                              capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    finally:
        try:
            held.communicate("", timeout=60)  # its Ray shut down by the process that started it
        except subprocess.TimeoutExpired:
            held.kill()
            held.wait()
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    said, stopped = (done.stderr.find(f"no node of this Ray offers render{s}") for s in (" yet", " after"))
    assert 0 <= said < stopped and "--resources=" in done.stderr[stopped:], done.stderr[-3000:]


HELD_RAY = """
import sys, ray
ray.init(address="local", num_cpus=1, resources={"signer": 1, "smtp": 1}, include_dashboard=False,
         object_store_memory=150 * 1024 * 1024)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
"""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "AWS_"))}
    return {**env, "PYTHONPATH": ROOT}
