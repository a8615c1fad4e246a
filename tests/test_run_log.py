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


def test_a_line_that_quotes_a_pan_or_an_address_is_masked_before_it_leaves(settings, tmp_path):
    import logging

    store = open_store(str(tmp_path / "store"))
    with run_log.shipped(store, "r1"):
        logging.getLogger("pipeline.x").warning("550 <alice@example.com> for ABCDE1234F")
    [(_, text)] = run_log.read(store, "r1")
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
