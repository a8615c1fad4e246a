"""The signer's stage alone (`stages.sign_stage`: sign, encrypt, archive, record) on batches of
100 notes back to back, the key file's, to a folder and to S3, there also a round trip away:
  folder_ms        wall ms a note, to a folder
  s3_ms            to an S3 server on this machine (versitygw, ~1 ms a request)
  s3_held_ms       the same, each request held `--latency-ms` on its way (a region's round trip to
                   S3: tests/servers.DelayingProxy, in this process, apart from the signer's)
  *_cpu_ms         this process's CPU a note (the S3 server's and the link's are their own)
  held_over_s3     notes a second held over not held (1.0: the round trip costs the signer nothing)
Each store's signer in a process of its own. With --baseline TREE, the same for that tree's pipeline (a `git
archive` of an earlier commit) after ours: figures ending in _baseline.

    python bench/archive.py [--batches 10] [--latency-ms 20] [--runs 3] [--baseline TREE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # after PYTHONPATH: a child measures the tree it names
from bench import measured  # noqa: E402

BATCH = 100  # a shard's accounts: one signer call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=10, help="batches of 100 timed, after one that warms")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--baseline", metavar="TREE", help="the same for this tree's pipeline, after ours")
    parser.add_argument("--one", metavar="STORE", help=argparse.SUPPRESS)
    if "--one" in sys.argv:  # a child: one store (a folder, or s3 at AWS_ENDPOINT_URL), its tree's code
        args = parser.parse_args()
        print(json.dumps(one(args.one, args.batches)))
        return
    measured.run("archive", parser, once, {"batches": 1})


def once(args) -> dict:
    out: dict = {"batches": args.batches, "notes": args.batches * BATCH, "latency_ms": args.latency_ms}
    with tempfile.TemporaryDirectory(prefix="bench-archive-") as tmp:
        for suffix, tree in [("", ROOT)] + ([("_baseline", Path(args.baseline).resolve())] if args.baseline else []):
            for name, latency in (("folder", None), ("s3", 0.0), ("s3_held", args.latency_ms)):
                out[f"{name}_ms{suffix}"], out[f"{name}_cpu_ms{suffix}"] = _child(tree, Path(tmp) / f"{name}{suffix}",
                                                                                  latency, args.batches)
            out[f"held_over_s3{suffix}"] = round(out[f"s3_ms{suffix}"] / out[f"s3_held_ms{suffix}"], 3)
    return out


def _child(tree: Path, work: Path, latency_ms: float | None, batches: int) -> tuple[float, float]:
    """One store's figures, in a process of its own running `tree`'s code: a folder (latency
    None), or an S3 server started here, behind a delaying link if `latency_ms`. The servers are
    this tree's (imported here, not where a child imports `tree`'s code)."""
    from tests.servers import S3_ACCESS_KEY, S3_SECRET_KEY, delaying_link, start_versitygw

    env, stop = {**os.environ, "PYTHONPATH": str(tree)}, []
    try:
        if latency_ms is None:
            store = str(work / "store")
        else:
            s3 = start_versitygw(work / "s3")
            stop.append(s3.stop)
            endpoint = s3.url
            if latency_ms:
                link = delaying_link(s3.url, latency_ms / 1000)
                stop.append(link.stop)
                endpoint = link.url
            store = "s3://bench-archive"
            env.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY,
                        "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1"})
        done = subprocess.run([sys.executable, str(ROOT / "bench" / "archive.py"), "--one", store, "--batches",
                               str(batches)], cwd=tree, env=env, capture_output=True, text=True)
    finally:
        for halt in reversed(stop):
            halt()
    if done.returncode:
        raise SystemExit(f"{store} ({tree}) failed:\n{done.stderr[-3000:]}")
    figures = json.loads(done.stdout.splitlines()[-1])
    return figures["wall_ms"], figures["cpu_ms"]


def one(store_url: str, batches: int) -> dict:
    """sign_stage over 1 + `batches` batches of typical notes, in the code on sys.path (the tree's)."""
    import boto3

    from pipeline.embedded import start_redis
    from pipeline.note.render import render
    from pipeline.record.state import RunState
    from pipeline.record.storage import open_store
    from pipeline.seal.sign import make_test_certificate, user_halves
    from pipeline.seal.signer import load_signer
    from pipeline.stages import Batch, sign_stage
    from tests.test_render import sample_note

    with tempfile.TemporaryDirectory(prefix="bench-archive-") as tmp:
        redis = start_redis(Path(tmp) / "redis")
        try:
            key, cert, root = make_test_certificate(Path(tmp) / "keys")
            signer = load_signer(str(key), str(cert), None, str(root))
            if store_url.startswith("s3://"):
                boto3.client("s3").create_bucket(Bucket=store_url[5:])
            store = open_store(store_url)
            notes = [render(sample_note(trades=5 + i % 15)) for i in range(BATCH)]
            pans = [f"ABCPD{i:04d}E" for i in range(BATCH)]
            state = RunState(redis.url, f"archive-{uuid.uuid4().hex[:6]}", 600)
            lease = state.take_lease(600).token
            cpu = wall = 0.0
            for n in range(1 + batches):
                items = [{"ucc": f"A{n:03d}{i:04d}", "pan": pan, "pdf": pdf, "made": made}
                         for i, (pan, pdf, made) in enumerate(zip(pans, notes, user_halves(pans, "aes256")))]
                c, w = time.process_time(), time.perf_counter()
                done = sign_stage(Batch(state.run_id, "2026-11-20", n, items, lease=lease), signer,
                                  "bench-owner-secret", "aes256", store, state)
                if n:  # the first warms: the S3 client's connections, the first imports
                    cpu, wall = cpu + time.process_time() - c, wall + time.perf_counter() - w
                assert len(done.items) == BATCH, f"{BATCH - len(done.items)} notes failed"
            count = batches * BATCH
            return {"wall_ms": round(wall * 1000 / count, 3), "cpu_ms": round(cpu * 1000 / count, 3)}
        finally:
            redis.stop()


if __name__ == "__main__":
    main()
