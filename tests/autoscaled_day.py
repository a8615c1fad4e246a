"""A small day on Ray's real autoscaler with fake nodes, on this machine (run as a subprocess
by test_autoscaler.py: it needs a Ray of its own, with its own ports and temp dir).

The fake node types are cluster.yaml's, with the same names and custom resources but one
CPU each. The head has no CPU, as in cluster.yaml, so every render task and every actor
needs a worker node the autoscaler launches because of the driver's demand; two signer/SMTP
nodes are asked for, and the signer and mailer pools grow to their slots. Prints one JSON
line: the node types seen, the run's summary, and the nodes left after the idle timeout.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def fake_config(gcs_address: str) -> dict:
    real = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    types = {"ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0}}
    for name, t in real["available_node_types"].items():
        if name == real["head_node_type"]:
            continue
        small = {k: 1 for k in t["resources"] if k != "CPU"}
        types[name] = {"resources": {"CPU": 1, **small, "object_store_memory": 150 * 2**20}, "node_config": {},
                       "min_workers": 0, "max_workers": 2 if "signer" in small else 1,
                       **({"priority": t["priority"]} if "priority" in t else {})}
    return {
        "cluster_name": "fake-contract-notes", "max_workers": 4, "upscaling_speed": 10, "idle_timeout_minutes": 0.25,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": gcs_address},
        "auth": {"ssh_user": "ubuntu"}, "available_node_types": types, "head_node_type": "ray.head.default",
        "head_node": {}, "worker_nodes": {}, "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


def main(work: Path, keys: Path) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from pipeline.cluster import plan as cluster
    from pipeline.cluster.driver import RunRequest, job_config, run_day
    from pipeline.day.synth import SynthOptions, write_dumps
    from pipeline.embedded import free_port, start_redis, start_smtp_sink
    from pipeline.settings import Settings

    gcs = f"{ray._private.services.get_node_ip_address()}:{free_port()}"
    config_path = work / "autoscaler.yaml"
    config_path.write_text(yaml.safe_dump(fake_config(gcs)))
    metrics_port = free_port()
    head = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "gcs_server_port": int(gcs.rsplit(":", 1)[1]), "autoscaling_config": str(config_path),
        "include_dashboard": False, "dashboard_agent_listen_port": free_port(), "metrics_export_port": metrics_port,
        "object_store_memory": 150 * 2**20})
    assert head.address == gcs, (head.address, gcs)
    ray.init(address=head.address, job_config=job_config(), log_to_driver=False)
    # a relay 150 ms away keeps the mailing going while the second signer/SMTP node joins
    (work / "relay.json").write_text(json.dumps({"delay_ms": 150}))
    redis = start_redis(work / "redis")
    smtp = start_smtp_sink(work / "outbox", work / "smtp.log", ["--faults", str(work / "relay.json")])
    seen, stop = set(), threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for node in ray.nodes():
                if node["Alive"] and node["Resources"].get("CPU", 0) > 0:
                    seen.add(",".join(sorted(k for k in node["Resources"] if k in ("render", "signer", "smtp"))))
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        write_dumps(work / "input", SynthOptions(dt.date(2026, 11, 20), 16, seed=51))
        settings = Settings(store_url=str(work / "store"), redis_url=redis.url, smtp_url=smtp.url, shard_size=4,
                            window=4, signers=0, mailers=0, smtp_connections=2,  # pools sized by the nodes
                            signer_key=str(keys / "signer.key.pem"), signer_cert=str(keys / "signer.cert.pem"),
                            signer_chain=str(keys / "root.cert.pem"), owner_password="autoscaler-owner-secret")
        started = time.time()
        with cluster.session(True, deadline_min=None, config=str(config_path), teardown=lambda c: None,
                             shutdown=lambda config: None) as current:
            current.request([{"CPU": 1, "render": 1}] + [{"CPU": 1, "signer": 1, "smtp": 1}] * 2)  # capacity up front
            summary = run_day(settings, RunRequest("2026-11-20", str(work / "input")))
        ran_s = time.time() - started
        deadline = time.time() + 120  # request released: idle nodes go after idle_timeout_minutes
        while time.time() < deadline and [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0)]:
            time.sleep(1)
        stop.set()
        workers_left = len([n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0)])
        outbox = len(list((work / "outbox").glob("*.eml")))
        return {"types_seen": sorted(seen), "summary": summary, "outbox": outbox, "run_s": round(ran_s, 1),
                "workers_left": workers_left, "gone_after_s": round(time.time() - started - ran_s, 1),
                "head_metrics": head_metrics(f"http://{gcs.rsplit(':', 1)[0]}:{metrics_port}/metrics")}
    finally:
        stop.set()
        smtp.stop()
        redis.stop()
        ray.shutdown()
        head.shutdown()


def head_metrics(url: str) -> dict[str, float]:
    """The day's counters as Prometheus scrapes them from the head, once the workers are gone."""
    import urllib.request

    totals: dict[str, float] = {}
    for _ in range(30):  # the head's agent exports every few seconds
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith("ray_cn_day_accounts_total{"):
                status = line.split('status="', 1)[1].split('"', 1)[0]
                totals[status] = float(line.rsplit(" ", 1)[1])
        if totals:
            return totals
        time.sleep(1)
    return totals


def kill_ours(tmpdir: str) -> None:
    """Fake worker nodes are started by the autoscaler; any left are ours, found by our temp dir."""
    me = os.getpid()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != me and tmpdir in " ".join(proc.info["cmdline"] or []):
                proc.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    work, keys = Path(sys.argv[1]), Path(sys.argv[2])
    tmpdir = tempfile.mkdtemp(prefix="cnray", dir="/tmp")  # short: Ray's socket paths have a length limit
    os.environ.update(RAY_TMPDIR=tmpdir, RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1")
    try:
        print(json.dumps(main(work, keys)), flush=True)
    finally:
        kill_ours(tmpdir)
