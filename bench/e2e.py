"""End-to-end throughput: the Ray pipeline against a sequential loop of the same stages.

In one run, on the same synthetic accounts, with the same local redis-server and SMTP sink:
  (a) the pipeline (local Ray, render tasks + signer and mailer actors), and
  (b) one process calling split, render, sign+archive and mail in a plain loop (no Ray).
efficiency = pipeline rate / (cores x sequential rate): 1.0 would be perfect scaling.
Prints one JSON object as its last line.

    python bench/e2e.py --accounts 1500
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

from pipeline.cluster.driver import RunRequest, init_ray, run_day  # noqa: E402
from pipeline.day.split import split_day  # noqa: E402
from pipeline.day.synth import SynthOptions, write_dumps  # noqa: E402
from pipeline.embedded import start_redis, start_smtp_sink  # noqa: E402
from pipeline.record.state import RunState  # noqa: E402
from pipeline.record.storage import open_store  # noqa: E402
from pipeline.seal.sign import load_signer, make_test_certificate  # noqa: E402
from pipeline.settings import Settings  # noqa: E402
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
        batch = render_stage(Batch(run_id, TRADE_DATE, shard, lease=lease), load_shard(store, run_id, shard), state)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accounts", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        work = Path(tmp)
        write_dumps(work / "input", SynthOptions(dt.date.fromisoformat(TRADE_DATE), args.accounts, args.seed))
        key, cert, root = make_test_certificate(work / "keys")
        redis = start_redis(work / "redis")
        smtp = start_smtp_sink(work / "outbox", work / "smtp.log")
        try:
            base = Settings.from_env(redis_url=redis.url, smtp_url=smtp.url, signer_key=str(key),
                                     signer_cert=str(cert), signer_chain=str(root), signers=cores)
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
