"""A whole day through the real pipeline: real Ray, redis-server, SMTP server, storage."""

from __future__ import annotations

import csv
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
import ray
from ray._private.utils import publish_error_to_driver

from pipeline.cluster.driver import COMPILE_THREADS, FIRST_NOTES, TAIL_PARTS, RunRequest, _tail, _units, run_day, workers_environment
from pipeline.day.synth import SynthOptions, write_dumps
from pipeline.record import keys
from pipeline.record.storage import open_store
from pipeline.settings import ROOT
from tests.conftest import TRADE_DATE
from tests.helpers import assert_signed_and_encrypted, attachment, client_rows, outbox_messages, pipeline_counting

pytestmark = pytest.mark.usefixtures("ray_session")


JEMALLOC_MAPPED = "import sys; sys.exit('libjemalloc' not in open('/proc/self/maps').read())"


def test_ray_s_processes_run_with_jemalloc_and_one_compile_thread_and_what_the_driver_starts_after_do_not():
    """Typst's, qpdf's and OpenSSL's allocations under glibc's malloc cost ~0.5 ms a note; Typst's
    pool of a thread a core ~0.13 ms of a compile in a worker that holds one core."""
    @ray.remote(resources={"render": 1})
    def worker() -> tuple[bool, str | None]:
        return "libjemalloc" in Path("/proc/self/maps").read_text(), os.environ.get("RAYON_NUM_THREADS")

    # the session's Ray was started as init_ray starts one
    assert ray.get(worker.remote()) == (True, str(COMPILE_THREADS))
    before = {name: os.environ.get(name) for name in ("LD_PRELOAD", "RAYON_NUM_THREADS")}
    with workers_environment():
        assert subprocess.run([sys.executable, "-c", JEMALLOC_MAPPED]).returncode == 0
        assert os.environ["RAYON_NUM_THREADS"] == str(COMPILE_THREADS)
    assert {name: os.environ.get(name) for name in before} == before
    assert subprocess.run([sys.executable, "-c", JEMALLOC_MAPPED]).returncode == 1


def traded_accounts(day: Path) -> set[str]:
    with (day / "trades.csv").open(newline="") as f:
        return {r["ucc"] for r in csv.DictReader(f)}


class _Names:
    """A remote function whose task names are noted as the driver asks for tasks."""

    def __init__(self, task, seen: list):
        self.task, self.seen = task, seen

    def options(self, **options):
        self.seen.append(options.get("name"))
        return self.task.options(**options)

    def remote(self, *args, **kwargs):
        self.seen.append(None)
        return self.task.remote(*args, **kwargs)


def test_every_account_is_signed_archived_and_mailed_exactly_once(settings, day, smtp_sink, tmp_path, monkeypatch):
    from pipeline.cluster import driver, split_tasks

    names: list = []
    for module, task in ((driver, "render_task"), (split_tasks, "read_task"), (split_tasks, "assemble_task")):
        monkeypatch.setattr(module, task, _Names(getattr(module, task), names))
    summary = run_day(settings, RunRequest(TRADE_DATE, str(day)))
    # a task's name says its kind, not its shard: Ray keeps ~4 KB in the driver for each name it saw (a 1.5M day
    # named its 15,360 shards' tasks, and its driver's peak RSS grew with them)
    assert len(names) > 10 and len(set(names)) <= 5, sorted(set(map(str, names)))

    accounts = traded_accounts(day)
    clients = client_rows(day)
    assert summary["accounts"] == len(accounts)
    assert summary["delivered"] == len(accounts) and summary["failed"] == 0

    messages = outbox_messages(smtp_sink.outbox)
    assert len(messages) == len(accounts)
    assert len({m["Message-ID"] for m in messages}) == len(messages)
    store = Path(settings.store_url)
    for msg in messages:
        ucc = msg["Subject"].split("(")[-1].rstrip(")")
        assert msg["To"].addresses[0].addr_spec == clients[ucc]["email"]
        name, pdf = attachment(msg)
        assert name == f"ContractNote_{ucc}_{TRADE_DATE.replace('-', '')}.pdf"
        archived = store / keys.signed_pdf_key(TRADE_DATE, ucc)
        assert archived.read_bytes() == pdf, f"{ucc}: mailed PDF differs from the archive"
        assert_signed_and_encrypted(archived, clients[ucc]["pan"])

    report = json.loads((store / keys.report_keys(summary["run_id"])[0]).read_text())
    assert report["statuses"] == {"delivered": len(accounts)}
    with (store / keys.report_keys(summary["run_id"])[1]).open() as f:
        rows = list(csv.DictReader(f))
    assert {r["ucc"] for r in rows} == accounts
    assert all(r["message_id"] for r in rows)


def test_the_first_chain_carries_a_few_notes_of_the_lead_shard_and_every_account_is_in_one_chain():
    shards = {7: list("abcdefghij"), 3: list("xyz"), 9: ["q"]}  # heaviest first, as the split orders them
    units = _units(list(shards), first=3)
    assert units[0] == (3, (0, FIRST_NOTES))
    dealt = [u for shard, part in units for u in (shards[shard][slice(*part)] if part else shards[shard])]
    assert sorted(dealt) == sorted(u for accounts in shards.values() for u in accounts)
    assert _units([7, 3], first=None) == [(7, None), (3, None)]  # a resumed run or a rerun cuts nothing


def test_the_days_last_shards_go_in_parts_and_every_account_is_in_one_chain():
    """The chains still queued at the signer when the last render ends are the run's tail, the
    signer's work alone: the last `cut` shards go in TAIL_PARTS parts, each of at most a part of
    a shard's size but the last (a shard holds more or fewer accounts than the size)."""
    shards = {7: list("abcdefghijkl"), 3: list("mnopqrst"), 9: list("uvwxyz0123456"), 5: list("AB")}
    units = _units(list(shards), first=3, cut=2, shard_size=8)
    assert units[:3] == [(3, (0, FIRST_NOTES)), (3, (FIRST_NOTES, None)), (7, None)]
    assert [s for s, _ in units[3:]] == [9] * TAIL_PARTS + [5] * TAIL_PARTS
    assert all(len(shards[s][slice(*p)]) <= 8 // TAIL_PARTS for s, p in units[3:] if p[1] is not None)
    dealt = [u for shard, part in units for u in (shards[shard][slice(*part)] if part else shards[shard])]
    assert sorted(dealt) == sorted(u for accounts in shards.values() for u in accounts)
    for window in (6, 64):  # the last window of chains is parts, and not every shard of it is cut (a mailing each)
        units = _units(list(range(200)), None, _tail(window), 100)
        assert all(part is not None for _, part in units[-window:]) and _tail(window) < window


def test_rerunning_a_run_id_delivers_nothing_new(settings, day, smtp_sink):
    first = run_day(settings, RunRequest(TRADE_DATE, str(day)))
    mailed = len(outbox_messages(smtp_sink.outbox))

    again = run_day(settings, RunRequest(TRADE_DATE, str(day), run_id=first["run_id"]))

    assert len(outbox_messages(smtp_sink.outbox)) == mailed == first["delivered"]
    assert again["delivered_now"] == 0
    assert again["delivered"] == first["delivered"]


def test_bad_rows_reject_their_account_and_the_rest_is_delivered(settings, day, smtp_sink):
    trades = (day / "trades.csv").read_text().splitlines()
    header = trades[0].split(",")
    row = trades[5].split(",")
    victim = row[header.index("ucc")]
    row[header.index("price")] = "12.3x"
    trades[5] = ",".join(row)
    orphan = trades[1].split(",")
    orphan[header.index("ucc")] = "NOCLIENT1"
    trades.append(",".join(orphan))
    orphan_row = len(trades) - 1  # a row's number: its line's, the header line 0
    # a trade number given twice as an original (another trade's, or the dump repeated): one was
    # silently dropped and the note charged the other; now the account is rejected, naming it
    first = next(i for i, r in enumerate(trades) if i > 5 and r.split(",")[header.index("status")] == "11"
                 and r.split(",")[header.index("ucc")] not in (victim, "NOCLIENT1"))
    again = trades[first].split(",")
    twice = again[header.index("ucc")]
    again[header.index("quantity")] = str(int(again[header.index("quantity")]) * 2)
    trades.append(",".join(again))
    (day / "trades.csv").write_text("\n".join(trades) + "\n")
    # a client code given twice in clients.csv (the same row again, or another client's code)
    clients = (day / "clients.csv").read_text().splitlines()
    header_c = clients[0].split(",")
    dup_at = next(i for i, c in enumerate(clients) if i > 0 and c.split(",")[header_c.index("ucc")] not in
                  (victim, twice))
    dup = clients[dup_at].split(",")[header_c.index("ucc")]
    clients.append(clients[dup_at])
    (day / "clients.csv").write_text("\n".join(clients) + "\n")

    summary = run_day(settings, RunRequest(TRADE_DATE, str(day)))

    assert summary["rejected"] == 4
    assert summary["delivered"] == summary["accounts"] - 4
    rows = {r["ucc"]: r for r in csv.DictReader(
        (Path(settings.store_url) / keys.report_keys(summary["run_id"])[1]).open())}
    assert rows[victim]["status"] == "rejected"
    assert "trades.csv row 5 field 'price'" in rows[victim]["reason"]
    # a rejection no single row causes names its rows: the operator finds each in the file
    assert rows["NOCLIENT1"]["status"] == "rejected"
    assert f"trades.csv row {orphan_row} field 'ucc': trades for an account with no valid client record" in \
        rows["NOCLIENT1"]["reason"], rows["NOCLIENT1"]["reason"]
    assert rows[twice]["status"] == "rejected" and again[header.index("trade_no")] in rows[twice]["reason"]
    assert f"trades.csv row {len(trades) - 1} field 'trade_no'" in rows[twice]["reason"] and \
        f"also row {first}:" in rows[twice]["reason"], rows[twice]["reason"]
    assert rows[dup]["status"] == "rejected"
    assert f"clients.csv row {len(clients) - 1} field 'ucc': duplicate client (also row {dup_at})" in \
        rows[dup]["reason"], rows[dup]["reason"]
    mailed_to = {m["To"].addresses[0].addr_spec for m in outbox_messages(smtp_sink.outbox)}
    assert client_rows(day)[victim]["email"] not in mailed_to


def test_a_day_on_s3_uses_fixed_partition_prefixes(settings, day, smtp_sink, s3_bucket, tmp_path):
    s3 = boto3.client("s3")
    for name in ("clients.csv", "trades.csv", "bhavcopy.csv", "reference_rates.csv"):
        s3.upload_file(str(day / name), s3_bucket, f"input/{name}")
    on_s3 = settings.__class__(**{**settings.__dict__, "store_url": f"s3://{s3_bucket}"})

    summary = run_day(on_s3, RunRequest(TRADE_DATE, f"s3://{s3_bucket}/input"))

    assert summary["delivered"] == summary["accounts"] > 0
    listed = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket)
              for o in page.get("Contents", [])]
    pdfs = [k for k in listed if k.endswith(".pdf")]
    assert len(pdfs) == summary["accounts"]
    assert all(k.split("/")[0] in {f"{p}-signed-pdf" for p in range(10)} for k in pdfs)
    shard_files = [k for k in listed if "-contract-notes-data/" in k]
    assert shard_files and all(k.split("/")[0] in {f"{p}-contract-notes-data" for p in range(10)}
                               for k in shard_files)
    ucc = pdfs[0].rsplit("/", 1)[1][:-4]
    local = tmp_path / "one.pdf"
    local.write_bytes(open_store(f"s3://{s3_bucket}").get(pdfs[0]))
    assert_signed_and_encrypted(local, client_rows(day)[ucc]["pan"])


def test_the_run_command_joins_ray_and_ends_with_a_json_summary(ray_session, settings, day, smtp_sink, tmp_path):
    env = {**os.environ, "RAY_ADDRESS": ray_session.address_info["address"], "REDIS_URL": settings.redis_url,
           "CN_SIGNER_KEY": settings.signer_key, "CN_SIGNER_CERT": settings.signer_cert,
           "CN_SIGNER_CHAIN": settings.signer_chain, "CN_SHARD_SIZE": "10", "PYTHONPATH": ROOT,
           "CN_OWNER_PASSWORD": settings.owner_password}
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    run = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "run", "--date", TRADE_DATE, "--input", str(day),
         "--store", settings.store_url, "--smtp", settings.smtp_url],
        stdout=stdout.open("w"), stderr=stderr.open("w"), env=env, cwd=ROOT)
    while run.poll() is None:  # what Ray prints to every driver, from a thread of its own, as a retried task's error
        publish_error_to_driver("test", "Task SignerActor.sign failed. There are 3 retries remaining",
                                ray._private.worker.global_worker.gcs_client)
        time.sleep(0.2)
    out, err = stdout.read_text(), stderr.read_text()

    assert run.returncode == 0, out[-3000:] + err[-3000:]  # the summary says which accounts
    assert "retries remaining" in err
    assert len(out.splitlines()) == 1, out[-3000:]  # the summary alone: tools read the last line
    summary = json.loads(out)
    assert {"run_id", "accounts", "delivered", "failed", "elapsed_s", "notes_per_s"} <= summary.keys()
    assert summary["delivered"] == summary["accounts"] == len(traded_accounts(day))
    assert len(outbox_messages(smtp_sink.outbox)) == summary["delivered"]


PREFLIGHTS = """
from pipeline.cluster import driver
real = driver.preflight
def preflight(*args, **kwargs):
    counted.append(args[2] if len(args) > 2 else kwargs.get("run_id"))
    return real(*args, **kwargs)
driver.preflight = preflight
"""


def test_the_run_command_checks_its_run_once(ray_session, settings, smtp_sink, tmp_path):
    """`run` checks the run before it takes the lease; the day then starts with what that found.
    It checked twice: Redis, a storage write, the create-only check, the input's headers, and the
    signing key read again (for an HSM, a login and its probe signatures), before the first note."""
    day = tmp_path / "day"
    write_dumps(day, SynthOptions(dt.date.fromisoformat(TRADE_DATE), 20, seed=5))
    env = {**os.environ, "RAY_ADDRESS": ray_session.address_info["address"], "REDIS_URL": settings.redis_url,
           "CN_SIGNER_KEY": settings.signer_key, "CN_SIGNER_CERT": settings.signer_cert,
           "CN_SIGNER_CHAIN": settings.signer_chain, "PYTHONPATH": ROOT, "CN_OWNER_PASSWORD": settings.owner_password}
    done, calls = pipeline_counting(PREFLIGHTS, ["run", "--date", TRADE_DATE, "--input", str(day), "--store",
                                                 str(tmp_path / "store"), "--smtp", settings.smtp_url],
                                    env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["delivered"] == summary["accounts"] == 20
    assert calls == [summary["run_id"]], calls


def test_a_huge_note_is_rendered_in_page_ranges_signed_and_mailed_whole(settings, tmp_path, smtp_sink):
    from pipeline.cluster.page_ranges import PARALLEL_FROM_PAGES
    from pipeline.note.content import ROWS_PER_PAGE

    day = tmp_path / "volatile"
    # every client trades the other segments too: the huge note spans exchanges and segments, as a volatile day's does
    write_dumps(day, SynthOptions(dt.date.fromisoformat(TRADE_DATE), 3, seed=16, segment_share=1.0))
    trades = (day / "trades.csv").read_text().splitlines()
    whale = [t for t in trades[1:] if ",C0000002," in t]
    wanted = (PARALLEL_FROM_PAGES + 20) * ROWS_PER_PAGE
    extra = []
    for i in range(wanted // max(1, len(whale)) + 1):
        for t in whale:
            cols = t.split(",")
            cols[7] = f"{9 * 10**15 + i * 10**6 + len(extra):016d}"  # a distinct trade number
            extra.append(",".join(cols))
    (day / "trades.csv").write_text("\n".join(trades + extra) + "\n")

    summary = run_day(settings, RunRequest(TRADE_DATE, str(day)))

    assert summary["delivered"] == summary["accounts"] == 3
    pdf = Path(settings.store_url) / keys.signed_pdf_key(TRADE_DATE, "C0000002")
    pan = client_rows(day)["C0000002"]["pan"]
    assert_signed_and_encrypted(pdf, pan)
    info = subprocess.run(["pdfinfo", "-upw", pan, str(pdf)], capture_output=True, text=True).stdout
    pages = int(next(line.split()[-1] for line in info.splitlines() if line.startswith("Pages:")))
    assert pages > PARALLEL_FROM_PAGES
    text = subprocess.run(["pdftotext", "-upw", pan, "-f", str(pages), "-l", str(pages), str(pdf), "-"],
                          capture_output=True, text=True).stdout
    assert f"Page {pages} of {pages}" in text and "Levies and charges" in text
    laid = subprocess.run(["pdftotext", "-layout", "-upw", pan, "-f", str(pages), "-l", str(pages), str(pdf), "-"],
                          capture_output=True, text=True).stdout
    heads = next(line for line in laid.splitlines() if line.strip().startswith("Particulars")).split()[1:-2]
    assert len(heads) == 7 and any(h.endswith(("-CDS", "-COM")) for h in heads), heads
    [msg] = [m for m in outbox_messages(smtp_sink.outbox) if "C0000002" in m["Subject"]]
    assert attachment(msg)[1] == pdf.read_bytes()


def test_the_day_and_bounce_counters_reach_the_nodes_metrics_port_before_the_process_lets_go(ray_session):
    from actors import metrics

    before = metrics.shown_totals()
    metrics.day({"ok": 3, "physical": 1})
    metrics.bounces("bounced", 2)
    assert metrics.wait_exported(timeout_s=60)
    shown = metrics.shown_totals()
    assert shown[(metrics.DAY, "delivered")] >= before.get((metrics.DAY, "delivered"), 0) + 3
    assert shown[(metrics.DAY, "physical")] >= before.get((metrics.DAY, "physical"), 0) + 1
    assert shown[(metrics.BOUNCES, "bounced")] >= before.get((metrics.BOUNCES, "bounced"), 0) + 2
