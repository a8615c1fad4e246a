"""The full-size day, measured rather than drawn as a line: `run`, `close` and `verify` on a
synthetic day at two sizes (150,000 and 1,500,000 accounts by default), everything a run does
per account but the pixels, and every per-account figure of the large size against the small.

The run is `python -m pipeline run`'s own code (pipeline.__main__.main) in a child process, on
a local Ray it starts as a run does: the real split, shards, Redis records and counters, note
numbers, the mail guard, the delivery log, the archive's writes, the report, and a relay spoken
to over SMTP. Three things that cost CPU per note and teach nothing at scale are swapped for
stand-ins, in this bench only (the driver's modules are patched, and each Ray worker's by Ray's
worker_process_setup_hook; `run` has no flag for any of it):
  render   the Typst compile: a fixed one-page PDF (~0.4 KB) naming the account
           (pipeline.note.render.render_all); the note's data, charges in Decimal, is built as ever
  sign     the signature and AES-256: the PDF with a fixed byte string appended
           (pipeline.seal.sign.protect_each, and the user half of the keys made at render)
  relay    the message: a relay (this file, --relay) that answers 250 at once, keeping only a
           digest of each Message-ID, so each message is counted once
Then, the run's end set back past the bounce window, `close` and `verify` on the folder store,
and on a local S3 server (versitygw, keeping connections as S3 does) holding a copy of the run's
record, every request delayed by --latency-ms (20: S3 from the same region), as bench/proof.py
does.

Printed per size: wall time; CPU by process (the driver, Ray's own processes, Redis, the relay,
the stage workers by task); the split's rows a second; the driver's, Redis's and the workers'
peak memory; Redis's keys and bytes; storage objects; the report's write time and size; close's
and verify's time, CPU, peak memory and requests (--day-only: not those); each role's CPU an
account in each tenth of the day. `per_account`: each figure that should not grow with the day,
as large / small (goal: at most 1.15).

With --save, the large size's control-plane figures go to measured.json, where `plan` reads
the report's write time, Redis's bytes and the rows an account from.

With --keep DIR, each size's record (its store, Redis's append-only file, the keys) stays in
DIR/ACCOUNTS as the day left it (close and verify, unless --day-only, then run on a copy of it);
with --record DIR/ACCOUNTS, no day is run: `close` and `verify` on S3, --runs times, each on a
fresh copy of that record's bucket and Redis (a day takes 35 minutes at 1.5M).

    python bench/fullday.py [--sizes 150000 1500000] [--days /var/tmp/cn-fullday/days] [--save]
    python bench/fullday.py --sizes 150000 1500000 --keep /var/tmp/cn-kept --day-only
    python bench/fullday.py --record /var/tmp/cn-kept/1500000 --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import measured  # noqa: E402

DATE = "2026-11-20"
PY = sys.executable
GOAL_RATIO = 1.15
GOAL_S, GOAL_MB = 120.0, 200.0  # close and verify at 1.5M on S3
TICK = os.sysconf("SC_CLK_TCK")


# ---- the stand-ins (bench only) --------------------------------------------------------------

def _pdf(ucc: str) -> bytes:
    text = f"BT /F1 12 Tf 72 760 Td (stand-in note {ucc}) Tj ET".encode()
    return (b"%%PDF-1.7\n1 0 obj<</Type/Catalog/Pages 2 0 R>>endobj\n2 0 obj<</Type/Pages/Kids[3 0 R]/Count 1>>endobj\n"
            b"3 0 obj<</Type/Page/Parent 2 0 R/MediaBox[0 0 595 842]/Contents 4 0 R>>endobj\n"
            b"4 0 obj<</Length %d>>stream\n%s\nendstream endobj\ntrailer<</Root 1 0 R>>\n%%%%EOF\n" % (len(text), text))


def stand_in_render(notes: list[dict], tagged: bool = False) -> list[bytes]:
    return [_pdf(note["client"]["ucc"]) for note in notes]


def stand_in_protect(notes, owner_password, signer, info, algorithm="aes256") -> list[bytes]:
    return [pdf + b"%stand-in signature and encryption\n" for pdf, _pan, _made in notes]


def install_standins() -> None:
    """Ray's worker_process_setup_hook, and the driver's own: the names each stage calls."""
    from pipeline import stages
    from pipeline.cluster import driver, first_notes

    driver.render_all = first_notes.render_all = stand_in_render
    stages.protect_each = stand_in_protect
    stages.user_halves = lambda pans, algorithm: [None] * len(pans)


def day_run(argv: list[str]) -> int:
    """The child: `python -m pipeline run ARGV` with the stand-ins, its Ray given the hook; the
    split's end and the report's write timed where the driver reaches them."""
    import ray

    from pipeline.__main__ import main
    from pipeline.cluster import driver
    from pipeline.record import report

    install_standins()
    init = ray.init

    def hooked(*a, **kw):
        kw["runtime_env"] = {**(kw.get("runtime_env") or {}), "worker_process_setup_hook": "bench.fullday.install_standins"}
        return init(*a, **kw)
    ray.init = hooked
    times: dict = {}
    split_done, write = driver._split_done, report.write

    def timed_split(*a, **kw):
        times.setdefault("split_done_at", time.time())
        return split_done(*a, **kw)

    def timed_write(*a, **kw):
        t = time.perf_counter()
        out = write(*a, **kw)
        times["report_write_s"] = round(time.perf_counter() - t, 3)
        return out
    driver._split_done, driver.report.write = timed_split, timed_write
    status = main(["run", *argv])
    print(json.dumps({"bench_times": times}), flush=True)
    return status


# ---- a relay that accepts at once ------------------------------------------------------------

class _Relay(asyncio.Protocol):
    seen: set[bytes] = set()
    accepted = 0

    def connection_made(self, transport) -> None:
        self.t, self.buf, self.data = transport, b"", None
        transport.write(b"220 fullday relay\r\n")

    def data_received(self, chunk: bytes) -> None:
        self.buf += chunk
        out = []
        while True:
            if self.data is not None:
                end = self.buf.find(b"\r\n.\r\n")
                if end < 0:
                    break
                self._message(self.buf[:end])
                self.buf, self.data = self.buf[end + 5:], None
                out.append(b"250 2.0.0 queued\r\n")
                continue
            end = self.buf.find(b"\r\n")
            if end < 0:
                break
            line, self.buf = self.buf[:end], self.buf[end + 2:]
            verb = line[:4].upper()
            if verb in (b"EHLO", b"HELO"):
                out.append(b"250-fullday\r\n250-PIPELINING\r\n250-8BITMIME\r\n250 SIZE 52428800\r\n")
            elif verb == b"DATA":
                self.data = True
                out.append(b"354 go on\r\n")
            elif verb == b"QUIT":
                self.t.write(b"".join(out) + b"221 bye\r\n")
                self.t.close()
                return
            else:
                out.append(b"250 OK\r\n")
        if out:
            self.t.write(b"".join(out))

    def _message(self, data: bytes) -> None:
        at = data.find(b"\nMessage-ID:")
        mid = data[at:data.find(b"\r\n", at + 1)] if at >= 0 else data[:200]
        _Relay.seen.add(hashlib.blake2b(mid, digest_size=12).digest())
        _Relay.accepted += 1


def relay(port: int, counts: Path) -> None:
    async def serve():
        server = await asyncio.get_running_loop().create_server(_Relay, "127.0.0.1", port)
        print("listening", flush=True)
        while True:
            await asyncio.sleep(1)
            written = counts.with_suffix(".part")  # renamed into place: read while written, it was empty
            written.write_text(json.dumps({"accepted": _Relay.accepted, "distinct": len(_Relay.seen)}))
            os.replace(written, counts)
        await server.wait_closed()
    asyncio.run(serve())


# ---- CPU and memory by process ---------------------------------------------------------------

class Processes:
    """Every second, the CPU ticks and RSS of the child's process tree, Redis and the relay, by
    role; a worker's ticks go to the task its title names at that moment (ray::render_task...).
    With `progress` (the run's counters), each role's CPU an account in each tenth of the day, a
    role against its own stage's count (render against the accounts rendered: it runs ahead of
    the mail): a cost that grows with the day shows within one run, where two runs differ by this
    machine's spread as well."""

    def __init__(self, roots: dict[int, str], progress: Callable[[], dict] | None = None):
        self.roots, self.last, self.cpu, self.peak = roots, {}, {}, {}
        self.progress, self.marks = progress, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.wait(1.0):
            self.sample()

    def sample(self) -> None:
        procs = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    stat = Path(f"/proc/{entry.name}/stat").read_text()
                    cmd = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                except OSError:
                    continue
                fields = stat[stat.rfind(")") + 2:].split()
                procs[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[21]), cmd)
        rss: dict[str, float] = {}
        for pid, (_ppid, ticks, pages, cmd) in procs.items():
            role = self._role(pid, procs, cmd)
            if role is None:
                continue
            self.cpu[role] = self.cpu.get(role, 0) + ticks - self.last.get(pid, 0)
            self.last[pid] = ticks
            group = role.split(":")[0]
            rss[group] = rss.get(group, 0) + pages * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
        for group, mb in rss.items():
            self.peak[group] = max(self.peak.get(group, 0), mb)
        if self.progress is not None:
            self.marks.append((self.progress(), dict(self.cpu)))

    def _role(self, pid: int, procs: dict, cmd: str) -> str | None:
        seen, at = 0, pid
        while at in procs and seen < 64:
            if at in self.roots:
                role = self.roots[at]
                if at == pid or role != "driver":
                    return role if at == pid else None
                title = cmd.split(" ")[0] if cmd.startswith("ray::") else ""
                return f"stages:{title[5:].split('.')[0] or 'idle'}" if title else "ray"
            at, seen = procs[at][0], seen + 1
        return None

    def result(self) -> dict:
        self.stop.set()
        self.thread.join()
        self.sample()
        cpu = {role: round(t / TICK, 1) for role, t in sorted(self.cpu.items())}
        groups = {}
        for role, s in cpu.items():
            groups[role.split(":")[0]] = round(groups.get(role.split(":")[0], 0) + s, 1)
        return {"cpu_s": groups, "cpu_s_stages": {r.split(":")[1]: s for r, s in cpu.items() if ":" in r},
                "peak_rss_mb": {g: round(mb, 1) for g, mb in sorted(self.peak.items())}, **self.tenths()}

    def tenths(self) -> dict:
        """CPU ms an account by role in each tenth of its stage's accounts, and the ninth tenth's
        over the second's (the first holds the start, the last the drain)."""
        by_role: dict[str, list] = {}
        for role in sorted(self.cpu):
            counter = STAGE_COUNTER.get(role.split(":")[-1], "delivered")
            marks = [(m[0].get(counter, 0), m[1].get(role, 0)) for m in self.marks]
            if not marks or not marks[-1][0]:
                continue
            at = [next(m for m in marks if m[0] >= marks[-1][0] * k / 10) for k in range(11)]
            by_role[role] = [round((b[1] - a[1]) / TICK * 1000 / (b[0] - a[0]), 4) if b[0] > a[0] else None
                             for a, b in zip(at, at[1:])]
        return {"cpu_ms_per_account_by_tenth": by_role,
                "ninth_over_second_tenth": {role: round(t[8] / t[1], 3) for role, t in by_role.items()
                                            if t[1] and t[8] is not None and t[1] >= 0.005}}


STAGE_COUNTER = {"split": "validated", "render": "rendered", "SignerActor": "signed"}  # the rest: "delivered"


def run_progress(redis_url: str, run_id: str) -> Callable[[], dict]:
    """The run's stage counters as the sampler reads them each second."""
    import redis as redis_py

    from pipeline.record import keys

    r = redis_py.Redis.from_url(redis_url, decode_responses=True)
    return lambda: {k: int(v) for k, v in r.hgetall(keys.run_counts(run_id)).items()}


# ---- one size --------------------------------------------------------------------------------

def dumps(days: Path, accounts: int, seed: int) -> Path:
    """The day's input, kept in --days between runs (34M rows take ~15 min to write)."""
    from pipeline.day.synth import SynthOptions, write_dumps

    folder = days / f"{accounts}-seed{seed}"
    if not folder.exists():
        part = folder.with_suffix(".part")
        shutil.rmtree(part, ignore_errors=True)
        write_dumps(part, SynthOptions(dt.date.fromisoformat(DATE), accounts, seed))
        part.rename(folder)
    return folder


def rows_of(folder: Path) -> int:
    rows = 0
    for name in ("clients.csv", "trades.csv"):
        with (folder / name).open("rb") as f:
            rows += sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 24), b"")) - 1
    return rows


def one_size(args, accounts: int, tmp: Path) -> dict:
    from pipeline.embedded import free_port, start_redis, wait_for_port
    from pipeline.seal.sign import make_test_certificate

    work = args.keep / str(accounts) if args.keep else tmp
    day = dumps(args.days, accounts, args.seed)
    make_test_certificate(work / "keys")
    redis = start_redis(work / "redis")
    port, counts = free_port(), work / "relay.json"
    relay_proc = subprocess.Popen([PY, __file__, "--relay", str(port), str(counts)], stdout=subprocess.DEVNULL)
    wait_for_port(port, relay_proc, "the bench's relay")
    run_id = f"fullday-{accounts}"
    env = _env(work, redis.url, port)
    out: dict = {"accounts": accounts}
    try:
        started = time.time()
        with tempfile.TemporaryFile("w+") as log, tempfile.TemporaryFile("w+") as err:
            child = subprocess.Popen([PY, __file__, "--day-run", "--date", DATE, "--input", str(day), "--run-id", run_id],
                                     stdout=log, stderr=err, text=True, cwd=ROOT, env=env)
            watch = Processes({child.pid: "driver", redis.process.pid: "redis", relay_proc.pid: "relay"},
                              run_progress(redis.url, run_id))
            child.wait()
            by_process = watch.result()
            stdout, stderr = (f.seek(0) or f.read() for f in (log, err))
        if child.returncode not in (0, 1):
            raise SystemExit(f"run {run_id} failed:\n{stderr[-3000:]}")
        lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        summary, times = lines[-2], lines[-1]["bench_times"]
        relayed = json.loads(counts.read_text())
        if summary["failed"]:
            from pipeline.record.state import RunState
            failed = RunState(redis.url, run_id).accounts(RunState(redis.url, run_id).failed()[:3])
            raise SystemExit(f"run {run_id}: {summary['failed']} accounts failed, as {list(failed.values())}")
        out.update(_run_figures(args, accounts, day, work, redis.url, run_id, summary, times, started, by_process, relayed))
        if args.keep and not args.day_only:  # the record kept as the day left it: close writes to a copy
            redis.stop()
            work = shutil.copytree(work, tmp / "closed", symlinks=True)
            redis = start_redis(work / "redis")
            env = _env(work, redis.url, port)
        if not args.day_only:
            out.update(proof(args, work, env, run_id, accounts))
    finally:
        relay_proc.terminate()
        redis.stop()
    return out


def _run_figures(args, accounts, day, work, redis_url, run_id, summary, times, started, by_process, relayed) -> dict:
    import redis as redis_py

    r = redis_py.Redis.from_url(redis_url)
    memory = r.info("memory")
    run_keys = [k for k in r.scan_iter(match=f"*{run_id}*", count=10_000)]
    run_bytes = sum(r.memory_usage(k, samples=0) or 0 for k in run_keys)
    objects = sum(len(files) for _, _, files in os.walk(work / "store"))
    report_json = work / "store" / "reports" / f"{run_id}.json"
    rows = rows_of(day)
    split_s = times["split_done_at"] - started
    cpu = by_process["cpu_s"]
    return {
        "rows": rows, "delivered": summary["delivered"], "physical": summary["physical"],
        "nothing_due": summary.get("nothing_due", 0), "failed": summary["failed"],
        "rejected": summary["rejected"], "unconfirmed": summary["unconfirmed"],
        "relay_accepted": relayed["accepted"], "relay_distinct": relayed["distinct"],
        "wall_s": round(summary["elapsed_s"], 1), "notes_per_s": summary["notes_per_s"],
        "split_s": round(split_s, 1), "split_rows_per_s": round(rows / split_s),
        **by_process, "cpu_ms_per_account": {k: round(v * 1000 / accounts, 3) for k, v in cpu.items()},
        "driver_peak_rss_mb": summary["driver_peak_rss_mb"],
        "redis_peak_mb": round(memory["used_memory_peak"] / 2 ** 20, 1),
        "redis_keys": r.dbsize(), "redis_run_keys": len(run_keys),
        "redis_bytes_per_account": round(run_bytes / accounts, 1),
        "storage_objects": objects, "storage_objects_per_account": round(objects / accounts, 4),
        "report_write_s": times.get("report_write_s"), "report_bytes": report_json.stat().st_size,
        "report_bytes_per_account": round(report_json.stat().st_size / accounts, 1),
    }


def _env(work: Path, redis_url: str, relay_port: int = 0) -> dict:
    keys = work / "keys"
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("CN_", "RAY_ADDRESS"))},
            "PYTHONPATH": str(ROOT), "REDIS_URL": redis_url, "SMTP_URL": f"smtp://127.0.0.1:{relay_port}",
            "CN_STORE": str(work / "store"), "CN_SIGNER_KEY": str(keys / "signer.key.pem"),
            "CN_SIGNER_CERT": str(keys / "signer.cert.pem"), "CN_SIGNER_CHAIN": str(keys / "root.cert.pem"),
            "CN_OWNER_PASSWORD": "bench-owner-secret", "CN_TOKEN_KEY_FILE": str(work / "token.key")}


# ---- close and verify ------------------------------------------------------------------------

def proof(args, work: Path, env: dict, run_id: str, accounts: int) -> dict:
    """close and verify, past the window, on the folder store; then on S3:
    the record copied to a versitygw, each request delayed as S3's round trip (bench/proof.py)."""
    from tests.servers import start_versitygw

    from pipeline.record.state import RunState

    state = RunState(env["REDIS_URL"], run_id)  # the window closed: the run ended 73 hours ago (it is 72)
    state.update_meta(finished=float(state.meta()["finished"]) - 73 * 3600)
    out = {}
    s3 = start_versitygw(work / "s3", keep_alive=True)
    try:
        s3_env = _on_s3(env, s3.url)
        out["s3_copied_objects"] = copy_record(work / "store", s3_env, run_id)
        for name in ("close", "verify"):
            out[f"{name}_s3"] = step(name, run_id, s3_env, args.latency_ms, "s3://cn-archive")
            out[f"{name}_local"] = step(name, run_id, env, 0.0, env["CN_STORE"])
    finally:
        s3.stop()
    for name in ("close", "verify"):
        out[f"{name}_s3"]["requests_per_account"] = round(out[f"{name}_s3"]["requests"] / accounts, 4)
    return out


def on_the_kept_record(args) -> dict:
    """One run of `close` and `verify` on S3, on a record --keep left: its bucket made once
    (DIR/s3.pristine, the record's objects) and copied, and its Redis copied, so
    that each run closes and verifies it whole, as the first did."""
    from tests.servers import start_versitygw

    from pipeline.embedded import start_redis
    from pipeline.record.state import RunState

    kept = args.record
    accounts, pristine = int(kept.name), kept / "s3.pristine"
    run_id = f"fullday-{accounts}"
    with tempfile.TemporaryDirectory(prefix="cn-again-", dir=args.work) as tmp:
        shutil.copytree(kept / "redis", Path(tmp) / "redis")
        redis = start_redis(Path(tmp) / "redis")
        env = _env(kept, redis.url)
        s3 = None
        try:
            state = RunState(redis.url, run_id)
            state.update_meta(finished=float(state.meta()["finished"]) - 73 * 3600)
            if not pristine.exists():
                s3 = start_versitygw(Path(tmp) / "s3", keep_alive=True)
                copy_record(kept / "store", _on_s3(env, s3.url), run_id)
                s3.stop()
                shutil.copytree(Path(tmp) / "s3", pristine, symlinks=True)  # its objects' metadata in xattrs too
            else:
                shutil.copytree(pristine, Path(tmp) / "s3", symlinks=True)
            s3 = start_versitygw(Path(tmp) / "s3", keep_alive=True)
            s3_env = _on_s3(env, s3.url)
            out = {"bench": "fullday", "record": str(kept), "accounts": accounts, "latency_ms": args.latency_ms}
            for name in ("close", "verify"):
                out[f"{name}_s3"] = step(name, run_id, s3_env, args.latency_ms, "s3://cn-archive")
        finally:
            if s3:
                s3.stop()
            redis.stop()
    out["close_verify_s3_within_goal"] = all(out[f"{n}_s3"]["elapsed_s"] <= GOAL_S and
                                             out[f"{n}_s3"]["tree_peak_rss_mb"] <= GOAL_MB for n in ("close", "verify"))
    return out


def _on_s3(env: dict, url: str) -> dict:
    from tests.servers import S3_ACCESS_KEY, S3_SECRET_KEY

    return {**env, "AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1"}


def copy_record(store: Path, env: dict, run_id: str) -> int:
    """Every object of the run, the signed PDFs too: verify holds each mailed note to the SHA-256
    its mailing logged (followup/notes_check.py), one GET a note."""
    import boto3

    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
    client.create_bucket(Bucket="cn-archive")
    files = [p for p in store.rglob("*") if p.is_file()]
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda p: client.upload_file(str(p), "cn-archive", str(p.relative_to(store))), files))
    return len(files)


def step(name: str, run_id: str, env: dict, latency_ms: float, store_url: str) -> dict:
    """One of close or verify in a process of its own, with those it spreads its reads over (their
    peak memory is the step's)."""
    from bench.proof import step_command

    done = subprocess.run(step_command(name, run_id, latency_ms), cwd=ROOT, capture_output=True, text=True,
                          env={**env, "CN_STORE": store_url, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise SystemExit(f"{name} on {store_url} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


# ---- both sizes ------------------------------------------------------------------------------

PER_ACCOUNT = ("redis_bytes_per_account", "storage_objects_per_account", "report_bytes_per_account")


def once(args) -> dict:
    if args.record and args.save:
        raise SystemExit("--record saves nothing")
    if args.record:
        return on_the_kept_record(args)
    if args.days is None:  # --smoke's days go with it
        with tempfile.TemporaryDirectory(prefix="cn-days-", dir=args.work) as days:
            return once(argparse.Namespace(**{**vars(args), "days": Path(days)}))
    out = {"bench": "fullday", "cores": os.cpu_count(), "sizes": args.sizes, "latency_ms": args.latency_ms,
           "stand_ins": ["typst compile", "signature and AES-256", "the relay's handling of DATA"]}
    sizes = []
    for accounts in args.sizes:
        with tempfile.TemporaryDirectory(prefix="cn-fullday-", dir=args.work) as tmp:
            sizes.append(one_size(args, accounts, Path(tmp)))
        out[f"at_{accounts}"] = sizes[-1]
        print(json.dumps({"size": sizes[-1]}), file=sys.stderr, flush=True)
    small, large = sizes[0], sizes[-1]
    ratios = {name: _ratio(large[name], small[name]) for name in PER_ACCOUNT}
    ratios.update({f"cpu_ms_per_account.{k}": _ratio(v, small["cpu_ms_per_account"].get(k, 0))
                   for k, v in large["cpu_ms_per_account"].items()})
    ratios["wall_s_per_account"] = _ratio(large["wall_s"] / large["accounts"], small["wall_s"] / small["accounts"])
    ratios["split_s_per_row"] = _ratio(small["split_rows_per_s"], large["split_rows_per_s"])
    ratios["report_write_s_per_account"] = _ratio(large["report_write_s"] / large["accounts"],
                                                  small["report_write_s"] / small["accounts"])
    if not args.day_only:
        for name in ("close", "verify"):
            ratios[f"{name}_s3_requests_per_account"] = _ratio(large[f"{name}_s3"]["requests_per_account"],
                                                               small[f"{name}_s3"]["requests_per_account"])
    ratios["driver_peak_rss_mb"] = _ratio(large["driver_peak_rss_mb"], small["driver_peak_rss_mb"])
    out["per_account_large_over_small"] = ratios
    out["over_goal"] = sorted(k for k, v in ratios.items() if v is not None and v > GOAL_RATIO)
    out["over_goal_within_the_large_day"] = sorted(k for k, v in large.get("ninth_over_second_tenth", {}).items()
                                               if v > GOAL_RATIO)
    out["each_once_at_relay"] = all(s["relay_accepted"] == s["relay_distinct"] == s["delivered"] == s["accounts"]
                                    - s["physical"] - s["nothing_due"] for s in sizes)  # paper; every trade cancelled
    out["close_verify_s3_within_goal"] = None if args.day_only else all(large[f"{n}_s3"]["elapsed_s"] <= GOAL_S
                                             and large[f"{n}_s3"]["tree_peak_rss_mb"] <= GOAL_MB for n in ("close", "verify"))
    return out


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs=2, default=[150_000, 1_500_000], metavar=("SMALL", "LARGE"))
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--days", type=Path, default=Path("/var/tmp/cn-fullday/days"),
                        help="where the synthetic days are kept between runs")
    parser.add_argument("--work", default=None, help="where each size's store, Redis and S3 server go (default: TMPDIR)")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="added to each S3 request of close and verify")
    parser.add_argument("--day-only", action="store_true", help="the run alone, without close and verify")
    parser.add_argument("--keep", type=Path, help="keep each size's record in KEEP/ACCOUNTS, for --record")
    parser.add_argument("--record", type=Path, help="no day: close and verify on S3 on a record --keep left")
    # --save with one run: each figure is a mean over a day's 1.5M accounts, and a run takes an hour here
    measured.run("fullday", parser, once, {"sizes": [100, 400], "days": None},
                 min_runs=1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--day-run"]:
        sys.exit(day_run(sys.argv[2:]))
    elif sys.argv[1:2] == ["--relay"]:
        relay(int(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
