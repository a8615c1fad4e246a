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
    python bench/node_loss.py --accounts 200 --lose render --every   (nothing left to replace them)
    python bench/node_loss.py --smoke          (the tests' size: 60 accounts, a signer node)

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
from bench import measured  # noqa: E402

TRADE_DATE = "2026-11-20"
# Ray's worker_lease_timeout_milliseconds: a worker the driver leased before a drain may take the
# driver's next queued task for this long after its lease was granted (the driver's core worker
# reuses a lease without asking the raylet, draining or not); no lease is granted there after it
WORKER_LEASE_MS = 500
ROLES = {"render": {"render": 1}, "signer": {"signer": 1, "smtp": 1}}


def day(accounts: int, lose: list[str], at: float, seed: int = 55, notice_s: float = 0.0, every: bool = False) -> dict:
    """`notice_s`: the render node lost gets a spot notice that long before it goes, and its
    watcher (pipeline/cluster/spot_notice.py, against a metadata stand-in) drains it. `every`:
    every node of the roles lost, none left to take their work (no autoscaler on a Ray by hand):
    the run is to stop after CN_CAPACITY_WAIT_S, saying so; then, as its message says, a node
    of each role is started and the same run id runs again (`stopped`: what it said, when)."""
    import ray
    from ray.cluster_utils import Cluster

    from pipeline.cluster.driver import RunRequest, job_config, run_day
    from pipeline.day.synth import SynthOptions, write_dumps
    from pipeline.embedded import start_redis, start_smtp_sink
    from pipeline.errors import CannotRun
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
    from pipeline.embedded import free_port

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": bool(notice_s), "dashboard_port": free_port(),
        "object_store_memory": 150 * 2**20})
    nodes = {role: [cluster.add_node(num_cpus=1, resources=res, object_store_memory=150 * 2**20) for _ in range(2)]
             for role, res in ROLES.items()}
    ray.init(address=cluster.address, job_config=job_config(), log_to_driver=False)
    settings = Settings.from_env(
        store_url=str(work / "store"), redis_url=redis.url, smtp_url=smtp.url, shard_size=20, signers=0, mailers=0,
        signer_key=str(key), signer_cert=str(cert), signer_chain=str(root), owner_password="node-loss-owner",
        token_key_file=str(work / "keys" / "token.key"))
    run_id = f"node-loss-{'-'.join(lose) or 'none'}" + ("-noticed" if notice_s else "")
    lost: list[dict] = []
    metadata = watcher = None
    if notice_s:  # the render node's own watcher, as cluster.yaml starts it on every worker
        metadata = Metadata()
        watcher = subprocess.Popen([sys.executable, "-m", "pipeline.cluster.spot_notice", "--address", cluster.address,
                                    "--metadata", metadata.url, "--poll-s", "0.5",
                                    "--node-id", nodes["render"][-1].node_id], cwd=ROOT,
                                   stdout=subprocess.DEVNULL, stderr=open(work / "spot_notice.log", "wb"))

    def lose_nodes() -> None:
        state, started = RunState(settings.redis_url, run_id), time.monotonic()
        while int(state.counts().get("delivered", 0) or 0) < at * accounts:
            if time.monotonic() - started > 600:
                return
            time.sleep(0.05)
        for role in lose:
            for node in nodes[role] if every else nodes[role][-1:]:
                if notice_s and role == "render":
                    _noticed(cluster, node, metadata, notice_s, lost, started)
                    continue
                cluster.remove_node(node, allow_graceful=False)
                lost.append({"role": role, "after_s": round(time.monotonic() - started, 1),
                             "delivered_then": int(state.counts().get("delivered", 0) or 0)})

    killer = threading.Thread(target=lose_nodes, daemon=True)
    if lose:
        killer.start()
    cpu0, began = busy_s(), time.monotonic()
    stopped = None
    try:
        try:
            summary = run_day(settings, RunRequest(TRADE_DATE, str(work / "input"), run_id), address=cluster.address)
        except CannotRun as e:
            if not every:
                raise
            stopped = {"said": str(e), "after_s": round(time.monotonic() - began, 1)}
            killer.join()
            for role in lose:  # what the message asks for: a node of the role, then the same run id again
                cluster.add_node(num_cpus=1, resources=ROLES[role], object_store_memory=150 * 2**20)
            summary = run_day(settings, RunRequest(TRADE_DATE, str(work / "input"), run_id), address=cluster.address)
        elapsed, cpu = time.monotonic() - began, busy_s() - cpu0
        at_relay = Counter(m for m in _message_ids(work / "outbox"))
        key_ = settings.hmac_key()
        log = delivery_log.latest(delivery_log.entries(open_store(settings.store_url), run_id))
        statuses = RunState(settings.redis_url, run_id).statuses()
        mailable = {message_id(run_id, u, key_) for u, e in log.items()}
        noticed = [n for n in lost if n.get("notice")]
        return {
            "tasks_there_before_the_notice": sum(len(_started_after(n["node_id"], 0)) for n in noticed),
            "tasks_started_there_after_the_notice": [t for n in noticed for t in _started_after(n["node_id"],
                                                                                             n["drained_at"])],
            "worker_lease_ms": WORKER_LEASE_MS,
            "accounts": summary["accounts"], "lose": lose, "lost": lost, "stopped": stopped,
            "elapsed_s": round(elapsed, 1),
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
        if killer.is_alive():  # a notice's deadline may outlast the day: the node still goes before the cluster ends
            killer.join(timeout=120)
        if watcher:
            watcher.kill()
            metadata.stop()
        ray.shutdown()
        cluster.shutdown()
        smtp.stop()
        redis.stop()


class Metadata:
    """EC2's instance metadata as a stand-in on loopback, IMDSv2 only: a token from PUT
    latest/api/token, then reads that carry it (401 without). `notice(at)` posts a spot
    interruption notice for time `at`. `port`: a known one, for a stand-in that comes up late (an
    instance's metadata at boot)."""

    def __init__(self, port: int = 0):
        import http.server
        import secrets

        token, said = secrets.token_hex(16), {}
        self.said = said

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_PUT(self):  # noqa: N802
                ok = self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
                self._answer(200 if ok else 400, token if ok else "")

            def do_GET(self):  # noqa: N802
                if self.headers.get("X-aws-ec2-metadata-token") != token:
                    return self._answer(401, "")
                path = self.path.removeprefix("/latest/meta-data/")
                value = {"instance-id": "i-0standin"}.get(path) or said.get(path)
                self._answer(200 if value else 404, value or "")

            def _answer(self, code: int, body: str):
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def notice(self, at: float) -> None:
        when = dt.datetime.fromtimestamp(at, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.said["spot/instance-action"] = json.dumps({"action": "terminate", "time": when})

    def stop(self) -> None:
        self.server.shutdown()


def _noticed(cluster, node, metadata: Metadata, deadline_s: float, lost: list[dict], started: float) -> None:
    """The spot notice on `node`: its watcher drains it through the GCS; EC2 ends it at the deadline."""
    from pipeline.cluster.fleet import PREEMPTED
    from pipeline.cluster.ray_private import draining_nodes

    metadata.notice(time.time() + deadline_s)
    posted = time.monotonic()
    # a drained node with nothing left to run ends itself at once (reason PREEMPTED): between two
    # looks it can go from alive to ended without being seen draining (once in CI, a day's tail)
    while node.node_id not in draining_nodes() and not _ended_drained(node.node_id, PREEMPTED):
        if time.monotonic() - posted > 30:
            raise RuntimeError("the node was not drained within 30 s of the notice")
        time.sleep(0.1)
    lost.append({"role": "render", "notice": True, "node_id": node.node_id, "drained_at": time.time(),
                 "drained_after_s": round(time.monotonic() - posted, 1), "after_s": round(time.monotonic() - started, 1)})
    time.sleep(max(0.0, deadline_s - (time.monotonic() - posted)))
    cluster.remove_node(node, allow_graceful=False)
    lost[-1]["removed"] = True


def _ended_drained(node_id: str, preempted: int) -> bool:
    import ray

    return any(n["NodeID"] == node_id and not n["Alive"] and n.get("DeathReason") == preempted for n in ray.nodes())


def _started_after(node_id: str, at: float) -> list[dict]:
    """The tasks Ray's task events show starting on the node after `at` (epoch seconds), each
    with how long after it (ms)."""
    from ray.util.state import list_tasks

    tasks = list_tasks(filters=[("node_id", "=", node_id)], limit=10_000, detail=True, raise_on_missing_output=False)
    return [{"name": t.name, "after_ms": t.start_time_ms - at * 1000} for t in tasks
            if (t.start_time_ms or 0) > at * 1000]


def head_phase(work: Path, smtp_url: str, run_id: str, accounts: int) -> None:
    """A head (with the driver and the run's Redis on it) and its workers; prints the Redis URL,
    then, if it lives that long, the run's summary."""
    import ray
    from ray.cluster_utils import Cluster

    from pipeline.cluster.driver import RunRequest, job_config, run_day
    from pipeline.embedded import start_redis
    from pipeline.settings import Settings

    redis = start_redis(work / f"redis-{os.getpid()}")  # the head's: a new head's is empty
    print(redis.url, flush=True)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "object_store_memory": 150 * 2**20})
    for res in ROLES.values():
        cluster.add_node(num_cpus=1, resources=res, object_store_memory=150 * 2**20)
    ray.init(address=cluster.address, job_config=job_config(), log_to_driver=False)
    keys = work / "keys"
    settings = Settings.from_env(
        store_url=str(work / "store"), redis_url=redis.url, smtp_url=smtp_url, shard_size=20, signers=0, mailers=0,
        signer_key=str(keys / "signer.key.pem"), signer_cert=str(keys / "signer.cert.pem"),
        signer_chain=str(keys / "root.cert.pem"), owner_password="node-loss-owner", token_key_file=str(keys / "token.key"))
    try:
        summary = run_day(settings, RunRequest(TRADE_DATE, str(work / "input"), run_id), address=cluster.address)
        print(json.dumps(summary, default=str), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
        redis.stop()


def head_lost(accounts: int, at: float, seed: int = 55) -> dict:
    """The head instance ended mid-day (its driver, Redis, GCS and every process of its
    cluster killed at once), then a new cluster runs the same run id against the same store
    and relay, as docs/operations.md says."""
    import psutil

    from pipeline.day.synth import SynthOptions, write_dumps
    from pipeline.embedded import start_smtp_sink
    from pipeline.record import delivery_log
    from pipeline.record.state import RunState
    from pipeline.record.storage import open_store
    from pipeline.seal.sign import make_test_certificate

    work = Path(tempfile.mkdtemp(prefix="node-loss-"))
    write_dumps(work / "input", SynthOptions(dt.date.fromisoformat(TRADE_DATE), accounts, seed))
    make_test_certificate(work / "keys")
    smtp = start_smtp_sink(work / "outbox", work / "smtp.log")  # the relay is not on the head
    run_id, lost, began = "node-loss-head", [], time.monotonic()
    cpu0 = busy_s()

    def phase(tmp: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, __file__, "--head-phase", str(work), smtp.url, run_id, str(accounts)],
                                stdout=subprocess.PIPE, stderr=open(work / f"phase-{len(lost)}.log", "ab"), text=True,
                                env={**os.environ, "RAY_TMPDIR": tmp}, start_new_session=True)

    try:
        with tempfile.TemporaryDirectory(prefix="cnh1", dir="/tmp") as tmp1:
            first = phase(tmp1)
            state = RunState(first.stdout.readline().strip(), run_id)
            while int(state.counts().get("delivered", 0) or 0) < at * accounts:
                if first.poll() is not None or time.monotonic() - began > 600:
                    raise RuntimeError(f"the first head ended before the loss: {first.returncode}")
                time.sleep(0.05)
            delivered_then = int(state.counts().get("delivered", 0) or 0)
            _kill_all(first.pid, tmp1, psutil)
            lost.append({"role": "head", "after_s": round(time.monotonic() - began, 1), "delivered_then": delivered_then})
        for retried in range(2):  # Ray's own start gives a raylet 30 s to register: on a loaded machine, again once
            said = (work / "phase-1.log").stat().st_size if (work / "phase-1.log").exists() else 0
            with tempfile.TemporaryDirectory(prefix="cnh2", dir="/tmp") as tmp2:
                second = phase(tmp2)
                out, _ = second.communicate(timeout=900)
                if retried or not (second.returncode and
                                   RAY_START_TIMED_OUT in (work / "phase-1.log").read_text()[said:]):
                    break
                _kill_all(second.pid, tmp2, psutil)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if second.returncode or not lines:
            raise RuntimeError(f"the new head's run failed ({second.returncode}): "
                               f"{(work / 'phase-1.log').read_text()[-3000:]}")
        summary, elapsed, cpu = json.loads(lines[-1]), time.monotonic() - began, busy_s() - cpu0
    finally:
        smtp.stop()
    at_relay = Counter(_message_ids(work / "outbox"))
    log = delivery_log.latest(delivery_log.entries(open_store(str(work / "store")), run_id))
    return {
        "accounts": summary["accounts"], "lose": ["head"], "lost": lost, "elapsed_s": round(elapsed, 1),
        "new_head_started_again": retried,
        "cpu_s": round(cpu, 1),
        "run": {k: summary.get(k) for k in ("delivered", "failed", "unconfirmed", "physical", "rejected", "nodes",
                                            "resent_chains", "waited_s")},
        "relay": {"messages": sum(at_relay.values()), "distinct": len(at_relay),
                  "twice": sum(n - 1 for n in at_relay.values())},
        "log_delivered": sum(1 for e in log.values() if e["status"] == "delivered"),
        "log_unconfirmed": sorted(e["message_id"] for e in log.values() if e["status"] in ("sending", "unconfirmed")),
        "at_relay_not_logged": len(set(at_relay) - {e["message_id"] for e in log.values()}),
        "run_id": run_id, "store": str(work / "store"), "work": str(work),
    }


RAY_START_TIMED_OUT = "The current node timed out during startup"  # ray/_private/node.py, its raylet's 30 s


def _kill_all(pid: int, tmpdir: str, psutil) -> None:
    """Every process of the first head's cluster at once, as its instance's end would: the
    phase, its children (Redis, the GCS, the raylets, the workers), and anything under its
    Ray temp dir that was re-parented."""
    procs = []
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        pass
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if tmpdir in " ".join(proc.info["cmdline"] or []):
                procs.append(proc)
        except psutil.Error:
            pass
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


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


def in_process(accounts: int, lose: list[str], at: float, notice_s: float = 0.0, every: bool = False) -> dict:
    """One day in a fresh process (its own Ray, its own temp dir for Ray's sockets)."""
    with tempfile.TemporaryDirectory(prefix="cnnl", dir="/tmp") as tmp:  # short: Ray's socket paths
        done = subprocess.run([sys.executable, __file__, "--one", "--accounts", str(accounts), "--at", str(at),
                               "--lose", ",".join(lose) or "none", "--notice-s", str(notice_s),
                               *(["--every"] if every else [])],
                              capture_output=True, text=True,
                              env={**os.environ, "RAY_TMPDIR": tmp}, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"the day failed (exit {done.returncode}): {done.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--accounts", type=int, default=2000)
    ap.add_argument("--lose", default="signer", help="render, signer, render,signer, head or none")
    ap.add_argument("--at", type=float, default=0.26, help="the fraction of accounts delivered when the node goes")
    ap.add_argument("--notice-s", type=float, default=0.0,
                    help="a lost render node gets a spot notice this long before it goes (its watcher drains it)")
    ap.add_argument("--every", action="store_true",
                    help="every node of the roles lost: the run stops, then runs again once a node of each is added")
    ap.add_argument("--baseline", action="store_true", help="the same day without a loss first; print the cost")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a day, in this process
    if sys.argv[1:2] == ["--head-phase"]:
        head_phase(Path(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return
    args = measured.with_smoke(ap, {"accounts": 60, "lose": "signer", "baseline": False})
    lose = [r for r in args.lose.split(",") if r and r != "none"]
    if args.one:
        one = head_lost(args.accounts, args.at) if lose == ["head"] else day(args.accounts, lose, args.at,
                                                                               notice_s=args.notice_s, every=args.every)
        print(json.dumps(one), flush=True)
        return
    with_loss = in_process(args.accounts, lose, args.at, args.notice_s, args.every)
    out = {"bench": "node_loss", "with_loss": with_loss}
    if args.baseline:
        base = in_process(args.accounts, [], args.at)
        out.update(baseline=base, cost={"extra_s": round(with_loss["elapsed_s"] - base["elapsed_s"], 1),
                                        "extra_cpu_s": round(with_loss["cpu_s"] - base["cpu_s"], 1)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
