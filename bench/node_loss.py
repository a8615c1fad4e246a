"""A day on a multi-node Ray on this machine that loses whole nodes mid-run, counted at the relay.

The nodes are cluster.yaml's roles in miniature (`ray.cluster_utils.Cluster`): a head with no
CPU and no role, two render nodes, two signer/SMTP nodes, one CPU each. A node is removed
without grace when the day reaches a point (`--at`, a fraction of the accounts delivered):
its raylet, object store and every worker and actor on it die at once, as a reclaimed or
failed instance's do. Prints one JSON line per day: the run's counts, the relay's (messages,
distinct Message-IDs), the delivery log's, the lost node's role and when it went, and the
wall and CPU seconds. With `--baseline`, the same day without a loss runs first, and the
cost of the loss is printed as the difference: extra seconds and extra CPU seconds.

    python bench/node_loss.py --accounts 2000 --lose signer --baseline
    python bench/node_loss.py --smoke          (the test command's size: 60 accounts, a signer node)

Each day runs in a process of its own: a driver joins one Ray.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRADE_DATE = "2026-11-20"
ROLES = {"render": {"render": 1}, "signer": {"signer": 1, "smtp": 1}}


def day(accounts: int, lose: list[str], at: float, seed: int = 55) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from pipeline.cluster.driver import RunRequest, run_day
    from pipeline.day.synth import SynthOptions, write_dumps
    from pipeline.embedded import start_redis, start_smtp_sink
    from pipeline.mail.message import message_id
    from pipeline.record import delivery_log
    from pipeline.record.state import RunState
    from pipeline.record.storage import open_store
    from pipeline.seal.sign import make_test_certificate
    from pipeline.settings import Settings

    work = Path(tempfile.mkdtemp(prefix="node-loss-"))
    write_dumps(work / "input", SynthOptions(dt.date.fromisoformat(TRADE_DATE), accounts, seed))
    key, cert, root = make_test_certificate(work / "keys")
    redis, smtp = start_redis(work / "redis"), start_smtp_sink(work / "outbox", work / "smtp.log")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "object_store_memory": 150 * 2**20})
    nodes = {role: [cluster.add_node(num_cpus=1, resources=res, object_store_memory=150 * 2**20) for _ in range(2)]
             for role, res in ROLES.items()}
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}}, log_to_driver=False)
    settings = Settings.from_env(
        store_url=str(work / "store"), redis_url=redis.url, smtp_url=smtp.url, shard_size=20, signers=0, mailers=0,
        signer_key=str(key), signer_cert=str(cert), signer_chain=str(root), owner_password="node-loss-owner",
        token_key_file=str(work / "keys" / "token.key"))
    run_id = f"node-loss-{'-'.join(lose) or 'none'}"
    lost: list[dict] = []

    def lose_nodes() -> None:
        state, started = RunState(settings.redis_url, run_id), time.monotonic()
        while int(state.counts().get("delivered", 0) or 0) < at * accounts:
            if time.monotonic() - started > 600:
                return
            time.sleep(0.05)
        for role in lose:
            node = nodes[role][-1]
            cluster.remove_node(node, allow_graceful=False)
            lost.append({"role": role, "after_s": round(time.monotonic() - started, 1),
                         "delivered_then": int(state.counts().get("delivered", 0) or 0)})

    killer = threading.Thread(target=lose_nodes, daemon=True)
    if lose:
        killer.start()
    cpu0, began = busy_s(), time.monotonic()
    try:
        summary = run_day(settings, RunRequest(TRADE_DATE, str(work / "input"), run_id), address=cluster.address)
        elapsed, cpu = time.monotonic() - began, busy_s() - cpu0
        at_relay = Counter(m for m in _message_ids(work / "outbox"))
        key_ = settings.hmac_key()
        log = delivery_log.latest(delivery_log.entries(open_store(settings.store_url), run_id))
        statuses = RunState(settings.redis_url, run_id).statuses()
        mailable = {message_id(run_id, u, key_) for u, e in log.items()}
        return {
            "accounts": summary["accounts"], "lose": lose, "lost": lost, "elapsed_s": round(elapsed, 1),
            "cpu_s": round(cpu, 1),
            "run": {k: summary.get(k) for k in ("delivered", "failed", "unconfirmed", "physical", "rejected", "nodes",
                                            "resent_chains", "waited_s")},
            "statuses": {k: v for k, v in statuses.items() if v},
            "relay": {"messages": sum(at_relay.values()), "distinct": len(at_relay),
                      "twice": sum(n - 1 for n in at_relay.values())},
            "log_delivered": sum(1 for e in log.values() if e["status"] == "delivered"),
            "log_unconfirmed": sorted(e["message_id"] for e in log.values() if e["status"] in ("sending",
                                                                                              "unconfirmed")),
            "at_relay_not_logged": len(set(at_relay) - mailable),
            "run_id": run_id, "store": settings.store_url, "redis": settings.redis_url, "work": str(work),
        }
    finally:
        ray.shutdown()
        cluster.shutdown()
        smtp.stop()
        redis.stop()


def _message_ids(outbox: Path):
    for path in outbox.glob("*.eml"):
        with path.open("rb") as f:
            for line in f:
                if line.lower().startswith(b"message-id:"):
                    yield line.split(b":", 1)[1].strip().decode()
                    break
                if line in (b"\r\n", b"\n"):
                    break


def busy_s() -> float:
    """CPU seconds every core of this machine has been busy since boot (/proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq = map(int, Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def in_process(accounts: int, lose: list[str], at: float) -> dict:
    """One day in a fresh process (its own Ray, its own temp dir for Ray's sockets)."""
    with tempfile.TemporaryDirectory(prefix="cnnl", dir="/tmp") as tmp:  # short: Ray's socket paths
        done = subprocess.run([sys.executable, __file__, "--one", "--accounts", str(accounts), "--at", str(at),
                               "--lose", ",".join(lose) or "none"], capture_output=True, text=True,
                              env={**os.environ, "RAY_TMPDIR": tmp}, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"the day failed (exit {done.returncode}): {done.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--accounts", type=int, default=2000)
    ap.add_argument("--lose", default="signer", help="render, signer, render,signer or none")
    ap.add_argument("--at", type=float, default=0.26, help="the fraction of accounts delivered when the node goes")
    ap.add_argument("--baseline", action="store_true", help="the same day without a loss first; print the cost")
    ap.add_argument("--smoke", action="store_true", help="60 accounts, a signer node lost: seconds, for the tests")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a day, in this process
    args = ap.parse_args()
    lose = [r for r in args.lose.split(",") if r and r != "none"]
    if args.smoke:
        args.accounts, lose = 60, ["signer"]
    if args.one:
        print(json.dumps(day(args.accounts, lose, args.at)), flush=True)
        return
    with_loss = in_process(args.accounts, lose, args.at)
    out = {"bench": "node_loss", "with_loss": with_loss}
    if args.baseline:
        base = in_process(args.accounts, [], args.at)
        out.update(baseline=base, cost={"extra_s": round(with_loss["elapsed_s"] - base["elapsed_s"], 1),
                                        "extra_cpu_s": round(with_loss["cpu_s"] - base["cpu_s"], 1)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
