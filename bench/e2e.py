"""End-to-end throughput: the Ray pipeline against a sequential loop of the same stages.

In one run, on the same synthetic accounts, with the same local redis-server and SMTP sink:
  (a) the pipeline (local Ray, render tasks + signer and mailer actors), and
  (b) one process calling split, render, sign+archive and mail in a plain loop (no Ray).
efficiency = pipeline rate / (cores x sequential rate): 1.0 would be perfect scaling.
Prints one JSON object as its last line.

    python bench/e2e.py --accounts 1500

With --tls, the pipeline alone with TLS off and on (Ray's gRPC with RAY_USE_TLS and a CA made
as `ray up` makes it, Redis TLS-only with client certificates), alternately, --runs times each,
each in a fresh process. Ray runs two nodes on this machine, a render node and a signer/SMTP
node, so every note crosses from one node's object store to the other's, as on a cluster. CPU
per note is every core's busy time during the run (/proc/stat): the driver, Ray's processes,
Redis, the sink, the kernel's share, and anything else running, so run it on a quiet machine.
(Summing the run's process tree missed Ray's workers in some runs: 13.8 or 24.5 ms a note for
the same run.) The ratio (on / off) is against the budget of 1.05.

    python bench/e2e.py --tls --accounts 1500 --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import measured  # noqa: E402

from pipeline import credentials  # noqa: E402
from pipeline.cluster.driver import RunRequest, init_ray, run_day  # noqa: E402
from pipeline.day.split import split_day  # noqa: E402
from pipeline.day.synth import SynthOptions, write_dumps  # noqa: E402
from pipeline.embedded import start_redis, start_smtp_sink  # noqa: E402
from pipeline.record.state import RunState  # noqa: E402
from pipeline.record.storage import open_store  # noqa: E402
from pipeline.seal.sign import make_test_certificate  # noqa: E402
from pipeline.seal.signer import load_signer  # noqa: E402
from pipeline.settings import Settings, tls_files  # noqa: E402
from pipeline.stages import Batch, broker, load_shard, mail_context, mail_stage, render_stage, sign_stage  # noqa: E402

TRADE_DATE = "2026-11-20"


async def _context(settings, state, store):
    return mail_context(settings, state, store)


def sequential(settings: Settings, input_dir: Path, run_id: str) -> dict:
    """The same stage functions, one after another, in this process."""
    started, cpu0 = time.perf_counter(), time.process_time()
    store, state = open_store(settings.store_url), RunState(settings.redis_url, run_id)
    split = split_day(open_store(str(input_dir)), store, state, run_id, TRADE_DATE, settings.shard_size,
                      broker()["note_prefix"])
    signer = load_signer(settings.signer_key, settings.signer_cert, None, settings.signer_chain)
    cpu: dict[str, float] = {}

    state.start({})
    lease = state.take_lease(3600).token
    loop = asyncio.new_event_loop()  # mailing only: signing must not run inside a loop
    ctx = loop.run_until_complete(_context(settings, state, store))
    delivered = 0
    for shard in split.shards:
        batch = render_stage(Batch(run_id, TRADE_DATE, shard, lease=lease), load_shard(store, run_id, shard), state,
                             encryption=settings.encryption)
        batch = sign_stage(batch, signer, settings.owner_password, settings.encryption, store, state)
        result = loop.run_until_complete(mail_stage(batch, ctx))
        delivered += result["tally"].get("ok", 0)
        for k, v in result["cpu_s"].items():
            cpu[k] = cpu.get(k, 0.0) + v
    loop.run_until_complete(ctx.pool.close())
    loop.close()
    elapsed = time.perf_counter() - started
    return {"delivered": delivered, "elapsed_s": elapsed, "cpu_s": time.process_time() - cpu0,
            "cpu_ms_per_note": {k: round(v * 1000 / max(1, delivered), 2) for k, v in cpu.items()}}


def tls_run(accounts: int, seed: int, tls_dir: Path | None) -> dict:
    """One run of the pipeline on two local Ray nodes; with TLS when RAY_USE_TLS came with the
    process's environment (Ray reads it when it is imported) and `tls_dir` holds the certificates."""
    import ray
    from ray.cluster_utils import Cluster

    with tempfile.TemporaryDirectory(prefix="bench-tls-") as tmp:
        work = Path(tmp)
        write_dumps(work / "input", SynthOptions(dt.date.fromisoformat(TRADE_DATE), accounts, seed))
        key, cert, root = make_test_certificate(work / "keys")
        redis = start_redis(work / "redis", tls_dir=tls_dir)
        smtp = start_smtp_sink(work / "outbox", work / "smtp.log")
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "resources": {"render": 1}, "include_dashboard": False,
            "object_store_memory": 256 * 1024 * 1024})
        cluster.add_node(num_cpus=1, resources={"signer": 1, "smtp": 1}, object_store_memory=256 * 1024 * 1024)
        try:
            settings = Settings.from_env(redis_url=redis.url, smtp_url=smtp.url, signer_key=str(key),
                                         signer_cert=str(cert), signer_chain=str(root), signers=1, mailers=1,
                                         store_url=str(work / "store"))
            init_ray(settings, address=cluster.address)
            busy0 = busy_s()
            pipe = run_day(settings, RunRequest(TRADE_DATE, str(work / "input"), run_id="tls" if tls_dir else "plain"))
            busy = busy_s() - busy0
        finally:
            ray.shutdown()
            cluster.shutdown()
            smtp.stop()
            redis.stop()
    notes = pipe["delivered_now"]
    return {"tls": tls_dir is not None, "delivered": notes, "notes_per_s": round(notes / pipe["elapsed_s"], 2),
            "cpu_ms_per_note": round(busy * 1000 / max(1, notes), 2)}


def busy_s() -> float:
    """CPU seconds every core of this machine has been busy since boot (/proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq = map(int, Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def tls_compare(accounts: int, seed: int, runs: int) -> dict:
    """Off and on alternately, each in a fresh process; the CA and the node's certificate made
    as `ray up` makes them, for the IP Ray uses."""
    import statistics
    import subprocess

    from ray.util import get_node_ip_address

    from pipeline.tls.ca import init_head

    runs_by = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="bench-tls-ca-") as ca:
        init_head(Path(ca), get_node_ip_address())
        tls_env = dict(zip(("RAY_TLS_CA_CERT", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY"), tls_files(ca)),
                       RAY_USE_TLS="1")
        for _ in range(runs):
            for tls in (False, True):
                done = subprocess.run([sys.executable, __file__, "--accounts", str(accounts), "--seed", str(seed),
                                       "--tls-run", ca if tls else "off"], capture_output=True, text=True,
                                      env={**os.environ, **(tls_env if tls else {})})
                if done.returncode:
                    raise SystemExit(f"the run with TLS {'on' if tls else 'off'} failed:\n{done.stderr[-3000:]}")
                runs_by[tls].append(json.loads(done.stdout.strip().splitlines()[-1]))

    def median(tls: bool, key: str) -> float:
        return round(statistics.median(r[key] for r in runs_by[tls]), 2)

    keys = ("notes_per_s", "cpu_ms_per_note")
    off, on = ({k: median(t, k) for k in keys} for t in (False, True))
    return {"accounts": accounts, "runs": runs, "nodes": 2, "tls_off": off, "tls_on": on,
            "cpu_per_note_ratio": round(on["cpu_ms_per_note"] / off["cpu_ms_per_note"], 3),
            "notes_per_s_ratio": round(on["notes_per_s"] / off["notes_per_s"], 3), "budget_cpu_ratio": 1.05,
            "each_run": {"off": runs_by[False], "on": runs_by[True]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accounts", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--tls", action="store_true", help="TLS off against on, --runs times each")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tls-run", help=argparse.SUPPRESS)  # off, or the CA's folder
    args = measured.with_smoke(parser, {"accounts": 40, "runs": 1})
    if args.tls_run:
        print(json.dumps(tls_run(args.accounts, args.seed, None if args.tls_run == "off" else Path(args.tls_run))))
        return
    if args.tls:
        print(json.dumps(tls_compare(args.accounts, args.seed, args.runs)))
        return
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        work = Path(tmp)
        write_dumps(work / "input", SynthOptions(dt.date.fromisoformat(TRADE_DATE), args.accounts, args.seed))
        key, cert, root = make_test_certificate(work / "keys")
        redis = start_redis(work / "redis")
        smtp = start_smtp_sink(work / "outbox", work / "smtp.log")
        try:
            # the signers a local run has (one, unless CN_SIGNERS says), as the loop has one
            base = credentials.resolve(Settings.from_env(  # the HMAC key file made once, as a run makes it
                redis_url=redis.url, smtp_url=smtp.url, signer_key=str(key), signer_cert=str(cert),
                signer_chain=str(root), token_key_file=str(work / "keys" / "token.key")))
            seq = sequential(Settings(**{**base.__dict__, "store_url": str(work / "seq")}), work / "input", "seq")
            init_ray(base)
            pipe = run_day(Settings(**{**base.__dict__, "store_url": str(work / "ray")}),
                           RunRequest(TRADE_DATE, str(work / "input"), run_id="ray"))
        finally:
            smtp.stop()
            redis.stop()
    pipeline_rate = pipe["delivered_now"] / pipe["elapsed_s"]
    sequential_rate = seq["delivered"] / seq["elapsed_s"]
    print(json.dumps({
        "accounts": args.accounts,
        "cores": cores,
        "pipeline_notes_per_s": round(pipeline_rate, 2),
        "sequential_notes_per_s": round(sequential_rate, 2),
        "efficiency": round(pipeline_rate / (cores * sequential_rate), 3),
        "pipeline_elapsed_s": round(pipe["elapsed_s"], 2),
        "sequential_elapsed_s": round(seq["elapsed_s"], 2),
        "pipeline_cpu_ms_per_note": pipe["cpu_ms_per_note"],
        "sequential_cpu_ms_per_note": seq["cpu_ms_per_note"],
        "delivered": {"pipeline": pipe["delivered_now"], "sequential": seq["delivered"]},
    }))


if __name__ == "__main__":
    main()
