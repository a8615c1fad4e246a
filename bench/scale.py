"""Scale: the split on one core and on all, runs at two sizes, memory, Redis, S3 and the tail.

Everything a user would run, with a local redis-server, SMTP sink and S3 server (versitygw,
counted at its access log), measured in one go and printed as one JSON line:
  split_rows_per_s_1core   split_day in one process (the 1-core baseline) on the large day
  split_rows_per_s_all     the Ray split (ranged reads, then group assembly) on every core
  first_note_s, notes_per_s_*, efficiency_*
                           `python -m pipeline run` as a user runs it, at both sizes, joining
                           a Ray already running (as on a cluster `ray up` started: a warm
                           machine); the first note is timed from the command's start to the
                           first relay acceptance; efficiency is against bench/e2e.py's
                           sequential loop on the small day (notes/s per core), run just
                           before each (sequential_notes_per_s, sequential_notes_per_s_large)
  first_note_s_cold        the same, for a run that starts Ray itself (the S3 run below)
  first_note_s_cold_large  the large day run cold (starting Ray itself), from outside the
                           process: the relay's first kept message against the command's start
  driver_peak_rss_mb_*     the driver's own peak RSS in each run
  redis_bytes_per_account  MEMORY USAGE of the large run's keys / its accounts
  report_peak_mb_*         peak RSS of a fresh process writing each run's report; per_100k:
                           its growth from the small to the large run, per 100,000 accounts
  report_s_per_100k        that process's time on the large run, per 100,000 accounts
  s3_requests_per_note     requests at the S3 server during the small day run on S3 / notes
  tail_*                   the small day with and without one 60,000-trade client;
                           tail_work_s: the CPU seconds the client adds (all cores busy time,
                           /proc/stat), tail_floor_ratio: the least tail_ratio these cores
                           allow, were that work spread over them with no idle moment
  cores_busy_*             the share of the cores busy during each run (all processes)
  all_cpu_ms_per_note_*    the cores' busy time during each run (every process on the machine:
                           the driver, Ray, its workers, Redis, the relay; run the bench alone)
                           over the notes it mailed (issue 73: at most 8 ms at 20,000 accounts)
  all_cpu_ms_per_note_by_process_*
                           the same by whose it was (bench/processes.py: the CPU of each process
                           the bench started, read from /proc every 0.5 s, grouped by what it
                           runs; "elsewhere, or missed": the kernel's threads, anything else on
                           the machine, and what a process spent after its last sample)
  s3_requests_by_kind      those requests by method and what they touched (s3_kinds), e.g.
                           "PUT delivery-log", "GET shard", "GET input"
  s3_requests_per_note_less_fixed
                           the same without the run's fixed requests (s3_fixed_requests: _fixed)
With --first-note-only, only that cold run of the large day, stopped once the relay has kept
its first message: first_note_s_cold_large alone, in seconds rather than minutes a run.
With --s3-only, only the S3 run of the small day (issue 73's requests a note), a minute a run;
with --baseline TREE too, the same run of that tree's pipeline after ours (figures *_baseline);
with --s3-latency-ms N too, each request held N ms on its way to S3, as a region's round trip
(s3_notes_per_s: what the signer's archive writes cost the day when each is a round trip).
With --save (and --runs 3 or more), the runs' medians and spread go to
pipeline/cluster/measured.json, where `plan` reads its rates from (bench/measured.py).

    python bench/scale.py --small 2000 --large 20000 [--runs 3 --save]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from bench import measured  # noqa: E402
from bench.e2e import busy_s, sequential  # noqa: E402
from bench.processes import sampled  # noqa: E402
from pipeline import credentials  # noqa: E402
from pipeline.cluster.driver import init_ray  # noqa: E402
from pipeline.day.synth import SynthOptions, write_dumps  # noqa: E402
from pipeline.embedded import start_redis, start_smtp_sink  # noqa: E402
from pipeline.record import keys  # noqa: E402
from pipeline.record.state import RunState  # noqa: E402
from pipeline.seal.sign import make_test_certificate  # noqa: E402
from pipeline.settings import Settings  # noqa: E402
from tests.servers import S3_ACCESS_KEY, S3_SECRET_KEY, delaying_link, start_versitygw  # noqa: E402

DATE = "2026-11-20"
PY = sys.executable


def rows_of(folder: Path) -> int:
    return sum(sum(1 for _ in (folder / f).open("rb")) - 1 for f in ("clients.csv", "trades.csv"))


def split_rates(settings: Settings, day: Path, warm: Path) -> dict:
    """In a child process each, so neither run's memory or Ray start is in the other."""
    code = """
import json, sys, time
from pipeline.settings import Settings
from pipeline.record.state import RunState
from pipeline.record.storage import open_store
s = Settings(**json.loads(sys.argv[1])); day, warm, mode = sys.argv[2:5]
if mode == "1core":
    from pipeline.day.split import split_day
    t = time.perf_counter()
    split_day(open_store(day), open_store(s.store_url), RunState(s.redis_url, "split1"), "split1", "%(d)s",
              s.shard_size, "CNT")
else:
    import ray
    from pipeline.cluster.driver import init_ray
    from pipeline.cluster.split_tasks import Split
    init_ray(s)  # joins the benchmark's Ray (RAY_ADDRESS)
    cpus = int(ray.cluster_resources()["render"])
    Split.start(s, "warm", "%(d)s", warm, cpus, False, lambda: None).done(block=True)  # workers started
    t = time.perf_counter()
    Split.start(s, "splitall", "%(d)s", day, cpus, False, lambda: None).done(block=True)
print(time.perf_counter() - t)
""" % {"d": DATE}
    rows, out = rows_of(day), {}
    for mode in ("1core", "all"):
        done = subprocess.run([PY, "-c", code, json.dumps(settings.__dict__), str(day), str(warm), mode],
                              capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, **attach(), "PYTHONPATH": str(ROOT)})
        if done.returncode:
            raise SystemExit(f"split {mode} failed:\n{done.stderr[-3000:]}")
        out[mode] = rows / float(done.stdout.strip().splitlines()[-1])
    return {"split_rows": rows, "split_rows_per_s_1core": round(out["1core"]),
            "split_rows_per_s_all": round(out["all"]), "split_speedup": round(out["all"] / out["1core"], 2)}


def attach() -> dict:
    """What a command needs to join the running Ray: its address, and the token Ray 2.60 makes
    a new local instance require (~/.ray/auth_token)."""
    return {"RAY_ADDRESS": ray.get_runtime_context().gcs_address,
            "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}


def run(env: dict, day: str, run_id: str, outbox: Path | None = None, tree: Path = ROOT) -> dict:
    """`python -m pipeline run`, timed from the command's start; the first note from Redis,
    and with `outbox` (the relay's), from outside: the first message the relay kept. `tree`:
    whose pipeline runs (a baseline's `git archive`), this one's by default."""
    kept = set(os.listdir(outbox)) if outbox else set()
    started, busy = time.time(), busy_s()
    env = env if tree == ROOT else {**env, "PYTHONPATH": str(tree)}
    with (tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err,  # no pipe to fill meanwhile
          sampled() as by_process):
        proc = subprocess.Popen([PY, "-m", "pipeline", "run", "--date", DATE, "--input", day, "--run-id", run_id],
                                stdout=out, stderr=err, text=True, cwd=tree, env=env)
        at_relay = _first_kept(proc, outbox, kept) if outbox else None
        proc.wait()
        busy, command_s = busy_s() - busy, time.time() - started  # the run's alone, not the reads below
        stdout, stderr = (f.seek(0) or f.read() for f in (out, err))
    if proc.returncode not in (0, 1):
        raise SystemExit(f"run {run_id} failed:\n{stderr[-3000:]}")
    summary = json.loads(stdout.strip().splitlines()[-1])
    state = RunState(env["REDIS_URL"], run_id)
    first = min(rec["updated"] for rec in state.all_accounts() if rec["stage"] == "delivered")
    out = {**summary, "first_note_s": round(first - started, 2), "command_s": round(command_s, 2), "busy_s": busy,
           "busy_s_by_process": by_process | {"elsewhere, or missed": round(busy - sum(by_process.values()), 2)}}
    if at_relay is not None:
        out["first_note_at_relay_s"] = round(at_relay - started, 2)
    return out


def _first_kept(proc: subprocess.Popen, outbox: Path, kept: set[str]) -> float | None:
    """When the relay wrote its first new message (the sink keeps one only to answer 250);
    the folder is looked at every 20 ms until then, never after."""
    while proc.poll() is None:
        times = [t for e in os.scandir(outbox)  # a dot-file is a message still being written, renamed when kept
                 if e.name not in kept and not e.name.startswith(".") and (t := _mtime(e))]
        if times:
            return min(times)
        time.sleep(0.02)
    return None


def _mtime(entry: os.DirEntry) -> float | None:
    try:
        return entry.stat().st_mtime
    except FileNotFoundError:  # taken away between the listing and the look
        return None


def report_peak_mb(env: dict, run_id: str) -> tuple[float, float]:
    """Peak RSS (MB) and seconds of writing the run's report, in a fresh process."""
    code = """
import sys
import time
from pipeline.record import report
from pipeline.settings import Settings
from pipeline.record.state import RunState
from pipeline.record.storage import open_store
s = Settings.from_env()
state = RunState(s.redis_url, sys.argv[1])
t = time.perf_counter()
report.write(open_store(s.store_url), state, sys.argv[1], {"run_id": sys.argv[1]}, [])
print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 1024,
      time.perf_counter() - t)
"""
    done = subprocess.run([PY, "-c", code, run_id], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    peak, seconds = map(float, done.stdout.strip().splitlines()[-1].split())
    return round(peak, 1), seconds


def redis_bytes_per_account(redis_url: str, run_id: str, accounts: int) -> float:
    r = RunState(redis_url, run_id).r
    names = [keys.run_meta(run_id), keys.run_counts(run_id), keys.run_accounts(run_id), keys.run_failed(run_id),
             keys.run_unconfirmed(run_id), keys.run_mailguard(run_id), keys.run_timeline(run_id)]
    return round(sum(r.memory_usage(k, samples=0) or 0 for k in names) / accounts, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=2000)
    parser.add_argument("--large", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--volatile-trades", type=int, default=60_000, help="the heavy day's volatile client's trades")
    parser.add_argument("--first-note-only", action="store_true",
                        help="only the cold run of the large day, up to its first note at the relay")
    parser.add_argument("--running", action="store_true",
                        help="with --first-note-only: the run joins a Ray the bench started (as on a cluster)")
    parser.add_argument("--s3-only", action="store_true",
                        help="only the small day's run on S3: its requests a note, by kind")
    parser.add_argument("--s3-latency-ms", type=float, default=0.0,
                        help="with --s3-only: each request held this long on its way to S3 (a delaying link in front)")
    parser.add_argument("--baseline", metavar="TREE",
                        help="with --first-note-only or --s3-only: the same run of this tree's pipeline after ours")
    measured.run("scale", parser, once, {"small": 60, "large": 120, "volatile_trades": 2_000})


def once(args) -> dict:
    if args.s3_latency_ms and not args.s3_only:
        raise SystemExit("--s3-latency-ms holds the S3 run's requests: it goes with --s3-only")
    if args.first_note_only:
        return first_note_only(args)
    if args.s3_only:
        return s3_only(args)
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        work = Path(tmp)
        date = dt.date.fromisoformat(DATE)
        for name, n, volatile in (("small", args.small, False), ("large", args.large, False),
                                  ("heavy", args.small, True)):
            write_dumps(work / name, SynthOptions(date, n, args.seed, volatile=volatile,
                                                  volatile_trades=args.volatile_trades))
        with _services(work) as (base, env):
            s3 = start_versitygw(work / "s3")
            try:
                init_ray(base)  # Ray as a run starts it (same role resources); the runs join it
                out: dict = {"accounts_small": args.small, "accounts_large": args.large, "cores": cores}
                out.update(split_rates(Settings(**{**base.__dict__, "store_url": str(work / "split")}),
                                       work / "large", work / "small"))
                local = {**env, **attach()}
                stores = {name: {**local, "CN_STORE": str(work / f"store-{name}")} for name in ("small", "large", "heavy")}
                seq_rate, runs = {}, {}
                for name in ("small", "large", "heavy"):
                    if name != "heavy":  # the baseline just before each run it is set against: this VM's speed drifts
                        seq = sequential(Settings(**{**base.__dict__, "store_url": str(work / f"seq-{name}")}),
                                         work / "small", f"seq-{name}")
                        seq_rate[name] = seq["delivered"] / seq["elapsed_s"]
                    runs[name] = run(stores[name], str(work / name), f"scale-{name}")  # a date's notes: one run's a store
                out["sequential_notes_per_s"] = round(seq_rate["small"], 2)
                out["sequential_notes_per_s_large"] = round(seq_rate["large"], 2)
                for name in ("small", "large"):
                    r = runs[name]
                    out[f"notes_per_s_{name}"] = r["notes_per_s"]
                    out[f"efficiency_{name}"] = round(r["notes_per_s"] / (cores * seq_rate[name]), 3)
                    out[f"first_note_s_{name}"] = r["first_note_s"]
                    out[f"driver_peak_rss_mb_{name}"] = r["driver_peak_rss_mb"]
                    out[f"cores_busy_{name}"] = round(r["busy_s"] / (cores * r["command_s"]), 3)
                    out[f"all_cpu_ms_per_note_{name}"] = round(r["busy_s"] * 1000 / max(1, r["delivered_now"]), 2)
                    out[f"all_cpu_ms_per_note_by_process_{name}"] = {
                        group: round(s * 1000 / max(1, r["delivered_now"]), 2)
                        for group, s in r["busy_s_by_process"].items()}
                    out[f"report_peak_mb_{name}"], report_s = report_peak_mb(stores[name], f"scale-{name}")
                out["report_s_per_100k"] = round(report_s * 100_000 / args.large, 1)
                out["cpu_ms_per_note_large"] = runs["large"]["cpu_ms_per_note"]
                out["rows_large"] = rows_of(work / "large")
                out["first_note_s"] = runs["small"]["first_note_s"]
                out["driver_rss_ratio"] = round(out["driver_peak_rss_mb_large"] / out["driver_peak_rss_mb_small"], 3)
                growth = out["report_peak_mb_large"] - out["report_peak_mb_small"]
                out["report_peak_mb_per_100k"] = round(max(growth, 0) * 100_000 / (args.large - args.small), 1)
                out["redis_bytes_per_account"] = redis_bytes_per_account(base.redis_url, "scale-large", args.large)
                out["tail_elapsed_s_without"] = runs["small"]["elapsed_s"]
                out["tail_elapsed_s_with"] = runs["heavy"]["elapsed_s"]
                out["tail_ratio"] = round(runs["heavy"]["elapsed_s"] / runs["small"]["elapsed_s"], 3)
                out["tail_work_s"] = round(runs["heavy"]["busy_s"] - runs["small"]["busy_s"], 1)
                out["tail_floor_ratio"] = round(1 + out["tail_work_s"] / cores / runs["small"]["elapsed_s"], 3)
                ray.shutdown()  # the runs below start Ray themselves: a cold start
                cold = run(env | {"CN_STORE": str(work / "cold")}, str(work / "large"), "scale-cold", work / "outbox")
                out["first_note_s_cold_large"] = cold["first_note_at_relay_s"]  # issue 43: within 5 s
                out.update(s3_run(env, s3.url, work / "small", args.small, work / "versitygw.log"))
            finally:
                s3.stop()
    return out


@contextmanager
def _services(work: Path) -> Iterator[tuple[Settings, dict]]:
    """A test key, a local redis-server and SMTP sink under `work`, stopped on the way out:
    the settings a run in this process takes, and the environment of a `run` command. The HMAC
    key file is made there too, as a run makes it on one machine: the sequential loop before
    the first run needs it, and no run leaves one in the repository."""
    key, cert, root = make_test_certificate(work / "keys")
    redis = start_redis(work / "redis")
    smtp = start_smtp_sink(work / "outbox", work / "smtp.log")
    try:
        token_key = work / "keys" / "token.key"
        yield (credentials.resolve(Settings.from_env(redis_url=redis.url, smtp_url=smtp.url, signer_key=str(key),
                                                     signer_cert=str(cert), signer_chain=str(root),
                                                     token_key_file=str(token_key))),
               run_env(redis.url, smtp.url, key, cert, root) | {"CN_TOKEN_KEY_FILE": str(token_key)})
    finally:
        smtp.stop()
        redis.stop()


def run_env(redis_url: str, smtp_url: str, key: Path, cert: Path, root: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "REDIS_URL": redis_url, "SMTP_URL": smtp_url,
            "CN_SIGNER_KEY": str(key), "CN_SIGNER_CERT": str(cert), "CN_SIGNER_CHAIN": str(root),
            "CN_OWNER_PASSWORD": "bench-owner-secret", "RAY_ADDRESS": ""}


def first_note_only(args) -> dict:
    """The cold run of the large day as once() runs it, ended (SIGTERM; its reaper ends its Ray)
    once the relay has kept its first message. With --running, the run joins a Ray this bench
    started (as on a `ray up` cluster): first_note_s_running_large. With --baseline TREE, the
    same run of that tree's pipeline (a `git archive` of an earlier commit) goes after ours, on
    the same Ray, Redis and relay, each in a store of its own: first_note_s_baseline."""
    if args.save:
        raise SystemExit("--first-note-only measures one figure of the bench: nothing to --save")
    name = "first_note_s_running_large" if args.running else "first_note_s_cold_large"
    out: dict = {"accounts_large": args.large}
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        work = Path(tmp)
        write_dumps(work / "large", SynthOptions(dt.date.fromisoformat(DATE), args.large, args.seed))
        with _services(work) as (base, env):
            if args.running:
                init_ray(base)
                env |= attach()
            try:
                sides = [(name, ROOT)] + ([("first_note_s_baseline", Path(args.baseline))] if args.baseline else [])
                for i, (figure, tree) in enumerate(sides):
                    out[figure] = _first_at_relay({**env, "CN_STORE": str(work / f"store-{i}"),
                                                   "PYTHONPATH": str(tree)},
                                                  tree, work / "large", work / "outbox", f"scale-first-{i}")
            finally:
                if args.running:
                    ray.shutdown()
    return out


def s3_only(args) -> dict:
    """The S3 run as once() makes it (the small day, a cold run starting Ray itself), alone. With
    --baseline TREE, the same run of that tree's pipeline after ours, on the same Redis and relay,
    on an S3 server of its own: its figures end in _baseline."""
    if args.save:
        raise SystemExit("--s3-only measures one figure of the bench: nothing to --save")
    out: dict = {"accounts_small": args.small, "s3_latency_ms": args.s3_latency_ms}
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        work = Path(tmp)
        write_dumps(work / "small", SynthOptions(dt.date.fromisoformat(DATE), args.small, args.seed))
        with _services(work) as (_, env):
            sides = [("", ROOT)] + ([("_baseline", Path(args.baseline))] if args.baseline else [])
            for i, (suffix, tree) in enumerate(sides):
                s3 = start_versitygw(work / f"side-{i}" / "s3")  # its log: side-i/versitygw.log
                held = delaying_link(s3.url, args.s3_latency_ms / 1000) if args.s3_latency_ms else None
                try:
                    figures = s3_run(env, held.url if held else s3.url, work / "small", args.small,
                                     work / f"side-{i}" / "versitygw.log", tree, f"scale-s3-{i}")
                finally:
                    if held:
                        held.stop()
                    s3.stop()
                out.update({k + suffix: v for k, v in figures.items()})
    return out


def _first_at_relay(env: dict, tree: Path, day: Path, outbox: Path, run_id: str) -> float:
    """Seconds from `run`'s start to the relay's first new message; the run is then ended."""
    with tempfile.TemporaryFile("w+") as err:
        kept, started = set(os.listdir(outbox)), time.time()
        proc = subprocess.Popen([PY, "-m", "pipeline", "run", "--date", DATE, "--input", str(day), "--run-id", run_id],
                                stdout=subprocess.DEVNULL, stderr=err, cwd=tree, env=env)
        try:
            at_relay = _first_kept(proc, outbox, kept)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
        if at_relay is None:
            err.seek(0)
            raise SystemExit(f"the run ended before the relay kept a message:\n{err.read()[-3000:]}")
    return round(at_relay - started, 2)


def s3_run(env: dict, endpoint: str, day: Path, accounts: int, log: Path, tree: Path = ROOT,
           run_id: str = "scale-s3") -> dict:
    """The small day again, input and store on the S3 server; its access log counts the requests.
    `tree`: whose pipeline runs (run's)."""
    import boto3

    s3env = {**env, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY,
             "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
             "CN_STORE": "s3://cn-archive"}
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=S3_ACCESS_KEY,
                          aws_secret_access_key=S3_SECRET_KEY, region_name="us-east-1")
    for bucket in ("cn-archive", "cn-input"):
        client.create_bucket(Bucket=bucket)
    for f in ("clients.csv", "trades.csv", "bhavcopy.csv", "reference_rates.csv"):
        client.upload_file(str(day / f), "cn-input", f"day/{f}")
    before = len(_requests(log))
    summary = run(s3env, "s3://cn-input/day", run_id, tree=tree)
    notes, served = summary["delivered_now"], _requests(log)[before:]
    fixed = sum(1 for fields in served if _fixed(fields))
    return {"first_note_s_cold": summary["first_note_s"], "s3_notes_per_s": summary["notes_per_s"],
            "s3_requests": len(served), "s3_notes": notes,
            "s3_requests_per_note": round(len(served) / max(1, notes), 3), "s3_requests_by_kind": s3_kinds(served),
            "s3_fixed_requests": fixed, "s3_requests_per_note_less_fixed": round((len(served) - fixed) / max(1, notes), 3)}


def _requests(log: Path) -> list[list[str]]:
    """versitygw writes one line per request it served: `time | vgw | status | took | ip | method | path | ...`."""
    if not log.exists():
        return []
    return [fields for line in log.open(errors="replace") if len(fields := line.split(" | ")) >= 7]


def _fixed(fields: list[str]) -> bool:
    """A request the run makes whatever its size (issue 73's "fixed ones"): the reports, the run's
    log, the note-number marks (one a split group), a HEAD, a listing, a whole input file read
    (the preflight's and the plan's looks at the dumps, the closing prices). The rest grow with
    the day: notes, delivery log, shard files and the dumps' ranged reads (206)."""
    method, path, status = fields[5].strip(), fields[6].strip(), fields[2].strip()
    return (method == "HEAD" or "/" not in path.strip("/") or "/reports/" in path or "/logs/" in path
            or "/noteseq/" in path or ("/cn-input/" in path and status != "206"))


KINDS = (("-signed-pdf/", "note"), ("-delivery-log/", "delivery-log"), ("-contract-notes-data/", "shard"),
         ("/cn-input/", "input"), ("/reports/", "reports"), ("/logs/", "run-log"), ("/noteseq/", "note-numbers"))


def s3_kinds(served: list[list[str]]) -> dict[str, int]:
    """Requests by method and what they touched, most first: "PUT note", "GET shard", "GET
    input", "LIST delivery-log" (a GET of the bucket, its prefix in the query), "HEAD ...". The
    server's log names no Range: the input's GETs are its ranged reads and whole files together."""
    kinds: dict[str, int] = {}
    for fields in served:
        method, path = fields[5].strip(), fields[6].strip()
        query = fields[8].strip() if len(fields) > 8 else ""
        what = next((name for part, name in KINDS if part in path), "other")
        if method == "GET" and "/" not in path.strip("/"):  # the bucket's: a listing, its prefix in the query
            method, what = "LIST", next((name for part, name in KINDS if part.strip("/") in query), "other")
        kinds[f"{method} {what}"] = kinds.get(f"{method} {what}", 0) + 1
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


if __name__ == "__main__":
    main()
