"""`close` and `verify` against a store as slow as S3, projected to 1.5M accounts, in one run.

A run's record is laid out as a real one is (a folder store; its Redis a real redis-server):
--accounts accounts in shards of 100, each shard's delivery log a chain of its mailing's
intent and outcomes, 2% of the accounts bounced (a chain object per shard they fall in), the
report, its CSV and the paper list. Then `close` and `verify` run, each in a process of its
own with the processes it spreads its reads over (pipeline/record/spread.py; their peak RSS,
summed, is the step's), against that store with --latency-ms (20: S3 from the same region)
added to every request, as S3's round trip would be. Requests run 64 at a time
(pipeline/record/storage.py's IN_FLIGHT), so the time is the requests' waits, divided by 64, plus
the CPU. The 1.5M projection is a line through the two sizes measured (a fixed part, the
requests made one after another, and a part per account). The goal: both under
2 minutes at 1.5M accounts, memory flat (at most 200 MB), shown at two sizes.

    python bench/proof.py [--accounts 240000] [--latency-ms 20] [--runs 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import measured  # noqa: E402
from bench.slow_store import SlowStore, TreeMemory  # noqa: E402
from pipeline.cluster.memory import peak_rss_mb  # noqa: E402
from pipeline.settings import Settings  # noqa: E402

DAY = 1_500_000
GOAL_S = 120.0
GOAL_MB = 200.0
SHARD_SIZE = 100
BOUNCED = 0.02
NOTE = b"%PDF-1.7\n" + bytes(range(256)) * 4  # an archived note's stand-in (1 KB), the account's own at its end


def lay_out(work: Path, accounts: int, redis_url: str) -> tuple[Settings, str]:
    """The record of a mailed, partly bounced run, as a run leaves it."""
    from pipeline.followup import located
    from pipeline.record import delivery_log, keys, report
    from pipeline import credentials
    from pipeline.record.manifest import SplitResult, save_manifest
    from pipeline.record.records import Outcome
    from pipeline.record.state import RunState
    from pipeline.record.storage import open_store
    from pipeline.seal.sign import make_test_certificate
    from pipeline.seal.signer import load_signer

    make_test_certificate(work / "keys")
    settings = Settings(store_url=str(work / "store"), redis_url=redis_url, signer_key=str(work / "keys/signer.key.pem"),
                        signer_cert=str(work / "keys/signer.cert.pem"), signer_chain=str(work / "keys/root.cert.pem"),
                        token_key_file=str(work / "keys/token.key"))
    settings = credentials.resolve(settings)  # the HMAC key file, made once, as a run makes it
    run_id, store, key = "bench-proof", open_store(settings.store_url), settings.hmac_key()
    record = located.recorded(settings, settings, load_signer(settings.signer_key, settings.signer_cert, None).cert)
    state = RunState(redis_url, run_id)
    shards = max(keys.PARTITIONS, accounts // SHARD_SIZE // keys.PARTITIONS * keys.PARTITIONS)
    uccs = [f"C{n:07d}" for n in range(1, accounts + 1)]
    state.start({"date": "2026-11-20", "input": "bench", "finished": time.time() - 73 * 3600, "bounce_window_h": 72,
                 "message_ids": "keyed", **record})
    by_shard: dict[int, list[str]] = {}
    for u in uccs:
        by_shard.setdefault(keys.shard_of(u, shards), []).append(u)
    now = time.time()
    for shard, mine in by_shard.items():
        store.put(keys.shard_key(run_id, shard), "".join(json.dumps({"ucc": u}) + "\n" for u in mine).encode())
        mids = {u: keys.message_id(run_id, u, key) for u in mine}
        notes = {u: NOTE + u.encode() for u in mine}  # each archived, as the run archives it, and its hashes logged
        for u in mine:
            store.put(keys.signed_pdf_key("2026-11-20", u), notes[u])
        sha, md5 = ({u: f(notes[u]).hexdigest() for u in mine} for f in (hashlib.sha256, hashlib.md5))
        end = delivery_log.append(store, run_id, shard, [delivery_log.sending(u, mids[u], "", sha[u], md5[u])
                                                         for u in mine])
        outcomes = [Outcome(u, "delivered", message_id=mids[u], reply="250 2.0.0 queued", extra={"attempts": 1})
                    for u in mine]
        end = delivery_log.append(store, run_id, shard, [delivery_log.entry(o, "", sha[o.ucc]) for o in outcomes],
                                  end)
        state.record(outcomes)
        bounced = mine[:max(0, round(len(mine) * BOUNCED))]
        if bounced:
            delivery_log.append(store, run_id, shard, [
                {"ucc": u, "status": "bounced", "kind": "bounced", "dsn_status": "5.1.1", "reason": "User unknown",
                 "message_id": mids[u], "token": "", "at": now} for u in bounced], end)
            state.bounce([(u, "bounced", "5.1.1", "User unknown", now) for u in bounced])
    save_manifest(store, run_id, SplitResult(sorted(by_shard), shards, accounts))
    report.write(store, state, run_id, {"run_id": run_id, "trade_date": "2026-11-20", "accounts": accounts,
                                        **record}, [])
    return settings, run_id


def step(settings: Settings, name: str, run_id: str, latency_ms: float) -> dict:
    """One of close or verify, in this process and those it spreads its reads over, against the
    slow store (bench/fullday.py's too). Its own peak, and the peak of all its processes' RSS summed:
    each step loads what its command loads, no more (a verify step with close's modules was 17 MB more)."""
    import importlib

    from pipeline.followup import located
    from pipeline.record.storage import open_store

    command = importlib.import_module(f"pipeline.followup.{name}")

    with tempfile.NamedTemporaryFile(prefix="cn-requests-") as counter:
        slow = SlowStore(open_store(settings.store_url), latency_ms / 1000, Path(counter.name))
        located.open_store = lambda url, probe=False: slow  # every open of the run's store is the slow one
        tree = TreeMemory()
        started, cpu = time.perf_counter(), time.process_time()
        if name == "close":
            result = command.close(settings, run_id)
            assert not result["already_sealed"], result
        else:
            result = command.verify(slow, run_id)
            assert result["ok"] and result["sealed"], result["first_problem"]
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return {"elapsed_s": round(elapsed, 3), "cpu_s": round(cpu + children.ru_utime + children.ru_stime, 3),
                "requests": slow.requests, "peak_rss_mb": peak_rss_mb(), **tree.result(),
                "log_objects": result["log_objects"]}


def step_command(name: str, run_id: str, latency_ms: float, settings: Settings | None = None) -> list[str]:
    """The command line of a step in a process of its own. Through -c, not this file: the
    processes a step spreads its reads over import the main module of a file run as a script."""
    return [sys.executable, "-c", "from bench.proof import step_main; step_main()", "--step", name, "--run-id", run_id,
            "--latency-ms", str(latency_ms), *(["--settings", json.dumps(settings.__dict__)] if settings else [])]


def step_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--step", choices=["close", "verify"])
    parser.add_argument("--run-id")
    parser.add_argument("--latency-ms", type=float)
    parser.add_argument("--settings", help="the settings as JSON; without: from the environment")
    args = parser.parse_args(sys.argv[1:])
    settings = Settings(**json.loads(args.settings)) if args.settings else Settings.from_env()
    print(json.dumps(step(settings, args.step, args.run_id, args.latency_ms)))


def once(args) -> dict:
    from pipeline.embedded import start_redis

    out = {"bench": "proof", "latency_ms": args.latency_ms, "parallel": 64, "goal_s_at_1_5m": GOAL_S,
           "goal_peak_mb": GOAL_MB}
    for accounts in (args.accounts // 4, args.accounts):  # two sizes: memory must not follow the day
        with tempfile.TemporaryDirectory(prefix="cn-bench-proof-", ignore_cleanup_errors=True) as scratch:
            work = Path(scratch)
            redis = start_redis(work / "redis")
            try:
                built = time.perf_counter()
                settings, run_id = lay_out(work, accounts, redis.url)
                built = time.perf_counter() - built
                size = {"accounts": accounts, "laid_out_s": round(built, 1)}
                for name in ("close", "verify"):
                    done = subprocess.run(step_command(name, run_id, args.latency_ms, settings), capture_output=True,
                                          text=True, check=True,
                                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
                    size[name] = json.loads(done.stdout.splitlines()[-1])
                out[f"at_{accounts}"] = size
            finally:
                redis.stop()
    small, large = out[f"at_{args.accounts // 4}"], out[f"at_{args.accounts}"]
    for name in ("close", "verify"):  # a fixed part and a part per account, from the two sizes
        per_account = (large[name]["elapsed_s"] - small[name]["elapsed_s"]) / (args.accounts - args.accounts // 4)
        projected = large[name]["elapsed_s"] + per_account * (DAY - args.accounts)
        out[f"{name}_projected_s_at_1_5m"] = round(projected, 1)
        out[f"{name}_ratio_to_goal"] = round(projected / GOAL_S, 2)
        out[f"{name}_peak_mb"] = max(small[name]["tree_peak_rss_mb"], large[name]["tree_peak_rss_mb"])
    out["meets_goal"] = all(out[f"{n}_projected_s_at_1_5m"] <= GOAL_S and out[f"{n}_peak_mb"] <= GOAL_MB
                            for n in ("close", "verify"))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # both sizes over spread.FROM_JOBS shards (60,000 and 240,000 accounts): the processes a 1.5M day's close uses
    parser.add_argument("--accounts", type=int, default=240000)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    measured.run("proof", parser, once, {"accounts": 400, "latency_ms": 0.0})
