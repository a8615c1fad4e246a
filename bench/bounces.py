"""Bounces read and recorded per second on one core, against the issue's target, in one run.

A run of --accounts delivered accounts is put in a real redis-server (its own process) and
a folder store; --dsns of them get an RFC 3464 DSN (as the test relay and Postfix write them,
half permanent, half delayed) in a maildir, to their VERP addresses. Timed: what `bounces
RUN --maildir DIR` does with them in this one process: read each file, parse it (flufl.bounce
and the delivery-status part), check its token's HMAC, then record the lot (the delivery log,
then Redis); then, apart, the report written again, which costs the day's accounts rather
than the bounces' (`--watch` writes it at most every 5 minutes). The target is 2,000 a
second: a volatile day's 30,000 bounces in under 15 s.

    python bench/bounces.py [--dsns 2000 --accounts 100000] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import measured  # noqa: E402
from pipeline.followup.bounces import Tally, apply  # noqa: E402
from pipeline.cluster.memory import peak_rss_mb  # noqa: E402
from pipeline.embedded import start_redis  # noqa: E402
from pipeline.mail.mailbox import MaildirSource  # noqa: E402
from pipeline.mail.smtp_sink import dsn  # noqa: E402
from pipeline.mail.verp import Verp  # noqa: E402
from pipeline.record import delivery_log, keys, report  # noqa: E402
from pipeline.record.manifest import SplitResult, save_manifest  # noqa: E402
from pipeline.record.records import Outcome  # noqa: E402
from pipeline.record.state import RunState  # noqa: E402
from pipeline.record.storage import open_store  # noqa: E402

TARGET_PER_S = 2000
SHARD_SIZE = 100  # accounts a shard, as a run splits them: a 2% bounce rate puts ~2 bounces in each


def once(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="cn-bench-bounces-", ignore_cleanup_errors=True) as scratch:
        work = Path(scratch)
        redis = start_redis(work / "redis")
        try:
            run_id, v = "bench-bounces", Verp("bounces", "bounces.broker.example.com", os.urandom(32))
            state, store = RunState(redis.url, run_id), open_store(str(work / "store"))
            state.start({"date": "2026-11-20", "finished": time.time(), "bounce_window_h": 72})
            uccs = [f"C{n:07d}" for n in range(1, args.accounts + 1)]
            shards = max(keys.PARTITIONS, len(uccs) // SHARD_SIZE // keys.PARTITIONS * keys.PARTITIONS)
            by_shard: dict[int, list[str]] = {}
            for u in uccs:
                by_shard.setdefault(keys.shard_of(u, shards), []).append(u)
            for shard, mine in by_shard.items():  # each shard's mailing in its log, as a run leaves it
                outcomes = [Outcome(u, "delivered", message_id=keys.message_id(run_id, u, v.key), reply="250 2.0.0 queued")
                            for u in mine]
                end = delivery_log.append(store, run_id, shard, [delivery_log.sending(o.ucc, o.message_id) for o in outcomes])
                delivery_log.append(store, run_id, shard, [delivery_log.entry(o) for o in outcomes], end)
                state.record(outcomes)
            save_manifest(store, run_id, SplitResult(list(range(shards)), shards, len(uccs)))
            report.write(store, state, run_id, {"run_id": run_id, "trade_date": "2026-11-20"}, [])
            box = work / "bounces"
            for sub in ("new", "cur", "tmp"):
                (box / sub).mkdir(parents=True)
            step = max(1, len(uccs) // args.dsns)
            for n, u in enumerate(uccs[::step][:args.dsns]):
                original = (f"From: notes@broker.example.com\r\nTo: {u.lower()}@clients.test\r\nMessage-ID: "
                            f"{keys.message_id(run_id, u, v.key)}\r\nSubject: Contract note\r\n\r\n").encode()
                kind = "bounced" if n % 2 == 0 else "deferred"
                (box / "new" / f"{n:08d}.bench").write_bytes(dsn(kind, v.address(run_id, u), f"{u.lower()}@clients.test",
                                                                 original))
            started, cpu = time.perf_counter(), time.process_time()
            source, tally = MaildirSource(box, 5_000_000), Tally()
            messages = list(source.unseen())
            source.seen(apply(store, state, shards, v, messages, tally))
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
            assert tally.applied["bounced"] + tally.applied["deferred"] == args.dsns and tally.refused == 0, tally
            written = time.perf_counter()
            report.rewrite(store, state, run_id)
            written = time.perf_counter() - written
            per_s = args.dsns / elapsed
            return {"bench": "bounces", "dsns": args.dsns, "accounts": args.accounts, "shards": shards,
                    "elapsed_s": round(elapsed, 3), "peak_rss_mb": round(peak_rss_mb(), 1),
                    "cpu_s": round(cpu, 3), "dsns_per_s": round(per_s, 1), "target_per_s": TARGET_PER_S,
                    "ratio_to_target": round(per_s / TARGET_PER_S, 2), "meets_target": per_s >= TARGET_PER_S,
                    "report_rewrite_s": round(written, 3),
                    "per_s_with_one_report": round(args.dsns / (elapsed + written), 1)}
        finally:
            redis.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsns", type=int, default=2000)
    parser.add_argument("--accounts", type=int, default=100000)
    measured.run("bounces", parser, once, {"dsns": 50, "accounts": 500})
