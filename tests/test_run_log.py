"""`logs RUN_ID`: the driver's log of a run, read from storage after Redis (and the cluster) is
gone, the rerun's lines after the run's; no PAN, e-mail address, owner password or PIN in it
(before: the log lived in the terminal, or in Ray's job logs while the head lived)."""

from __future__ import annotations

import os
import subprocess
import sys

from pipeline.cluster.driver import RunRequest, rerun, run_day
from pipeline.record import run_log
from pipeline.record.storage import open_store
from pipeline.settings import ROOT
from tests.conftest import TRADE_DATE
from tests.helpers import client_rows


def test_a_run_s_log_is_in_storage_and_logs_reads_it_after_redis_is_gone_with_no_pii(ray_session, settings, day):
    first = run_day(settings, RunRequest(TRADE_DATE, str(day)))
    uccs = sorted(client_rows(day))
    rerun(settings, first["run_id"], accounts=[uccs[0]], force=True)
    env = {**os.environ, "CN_STORE": settings.store_url, "REDIS_URL": "redis://127.0.0.1:1/0"}  # Redis gone
    done = subprocess.run([sys.executable, "-m", "pipeline", "logs", first["run_id"]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert f"run {first['run_id']}" in text and " INFO " in text
    assert text.count("signer pool:") == 2, "the run's driver's lines, then the rerun's"
    clients = client_rows(day).values()
    secrets_ = [settings.owner_password] + [c["pan"] for c in clients] + [c["email"] for c in clients]
    assert [s for s in secrets_ if s and s in text] == []
    chunks = list(run_log.read(open_store(settings.store_url), first["run_id"]))
    assert len(chunks) >= 2 and [n for n, _ in chunks] == list(range(len(chunks)))
    marks = [m for m in run_log.MARK.findall(text) if m[0] != "running"]
    assert [m[0] for m in marks] == ["started", "ended", "started", "ended"] and marks[0][1] != marks[2][1], marks
    followed = subprocess.run([sys.executable, "-m", "pipeline", "logs", first["run_id"], "--follow"], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=60)
    assert followed.returncode == 0 and followed.stdout == text, "both drivers ended: --follow prints it and ends"


def test_a_line_that_quotes_a_pan_or_an_address_is_masked_before_it_leaves(settings, tmp_path):
    import logging

    store = open_store(str(tmp_path / "store"))
    with run_log.shipped(store, "r1"):
        logging.getLogger("pipeline.x").warning("550 <alice@example.com> for ABCDE1234F")
    text = "".join(t for _, t in run_log.read(store, "r1"))  # its start's chunk, then the rest
    assert "alice@example.com" not in text and "ABCDE1234F" not in text and "a***@example.com" in text


def test_a_store_that_fails_a_write_loses_no_line(tmp_path):
    import logging

    store = open_store(str(tmp_path / "store"))
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "logs").write_text("not a folder")  # the store refuses the chunk's write
    with run_log.shipped(store, "r2") as shipper:
        logging.getLogger("pipeline.x").warning("first")
        shipper.ship()  # refused: kept
        (tmp_path / "store" / "logs").unlink()
        logging.getLogger("pipeline.x").warning("second")
    [(_, text)] = run_log.read(store, "r2")
    assert text.index("first") < text.index("second")


# `logs RUN_ID --follow` ends when the run's driver has ended, by what the log says: a rerun's
# driver after the run's report exists, and a killed one, said after a bounded silence

WRITER = """
import logging, os, sys, time
from pipeline.record import run_log
from pipeline.record.storage import open_store

run_log.SHIP_EVERY_S, run_log.ALIVE_EVERY_S = 0.2, 0.5  # a day's pace, shortened
with run_log.shipped(open_store(sys.argv[1]), sys.argv[2]):
    logging.getLogger("pipeline.cluster.driver").info("run %s: the rerun's first line", sys.argv[2])
    while not os.path.exists(sys.argv[3]):
        time.sleep(0.05)
    logging.getLogger("pipeline.cluster.driver").info("run %s: the rerun's last line", sys.argv[2])
"""


def _a_finished_run(store_url: str, run_id: str) -> None:
    """A run whose driver ended and whose report is written: what a rerun's log follows."""
    import json
    import logging

    from pipeline.record.keys import report_keys
    from pipeline.record.manifest import SplitResult, save_manifest

    store = open_store(store_url)
    with run_log.shipped(store, run_id):
        logging.getLogger("pipeline.cluster.driver").info("run %s: the run's own line", run_id)
    save_manifest(store, run_id, SplitResult([0], 10, 2))
    store.put(report_keys(run_id)[0], json.dumps({"run_id": run_id, "trade_date": TRADE_DATE, "accounts": 2}).encode())


def _started(args: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "REDIS_URL": "redis://127.0.0.1:1/0", "PYTHONPATH": ROOT}  # Redis gone: storage alone
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _until(condition, seconds: float = 30) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_follow_goes_on_until_a_rerun_s_driver_ends_though_the_run_s_report_exists(s3_bucket, tmp_path):
    """Before: --follow ended once the report existed, so a rerun's log (the report there since
    the first run) ended at its first look, before the rerun's lines."""
    url, run_id, stop = f"s3://{s3_bucket}", "follow-rerun", tmp_path / "stop"
    _a_finished_run(url, run_id)
    writer = _started(["-c", WRITER, url, run_id, str(stop)])
    follower = None
    try:
        store = open_store(url)
        _until(lambda: any("first line" in text for _, text in run_log.read(store, run_id)))
        follower = _started(["-m", "pipeline", "logs", run_id, "--follow", "--store", url])
        import time

        time.sleep(3)  # a look or two: the follower waits, the rerun's driver still runs
        assert follower.poll() is None, follower.communicate()
        stop.touch()
        assert writer.wait(timeout=30) == 0, writer.stderr.read()
        out, err = follower.communicate(timeout=30)
    finally:
        for p in (writer, follower):
            if p and p.poll() is None:
                p.kill()
    assert follower.returncode == 0, err
    assert out.index("the run's own line") < out.index("the rerun's first line") < out.index("the rerun's last line")


def test_follow_says_a_killed_driver_is_gone_after_a_bounded_silence_and_exits_non_zero(s3_bucket, tmp_path):
    """Before: a driver killed mid-run writes no report, so --follow waited for ever."""
    import signal
    import time

    url, run_id = f"s3://{s3_bucket}", "follow-killed"
    from pipeline.record.manifest import SplitResult, save_manifest

    save_manifest(open_store(url), run_id, SplitResult([0], 10, 2))
    writer = _started(["-c", WRITER, url, run_id, str(tmp_path / "never")])
    follower = None
    try:
        store = open_store(url)
        _until(lambda: any("first line" in text for _, text in run_log.read(store, run_id)))
        follower = _started(["-m", "pipeline", "logs", run_id, "--follow", "--silence-s", "3", "--store", url])
        time.sleep(5)  # longer than the silence: a live driver that logs nothing says it still runs
        assert follower.poll() is None, follower.communicate()
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=10)
        killed = time.monotonic()
        out, err = follower.communicate(timeout=60)
        waited = time.monotonic() - killed
    finally:
        for p in (writer, follower):
            if p and p.poll() is None:
                p.kill()
    assert follower.returncode == 3, (out, err)
    assert "the rerun's first line" in out and "the rerun's last line" not in out
    assert err.splitlines()[-1].startswith("error: ") and "gone" in err and "no line for 3 s" in err, err
    assert 2 < waited < 30, waited
