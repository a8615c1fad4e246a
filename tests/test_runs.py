"""`runs`: a store's runs, newest first, in one line each (issue 57), from storage alone."""

from __future__ import annotations

import json
import time

import pytest

from pipeline.__main__ import main
from pipeline.api import Seals, summary
from pipeline.cluster.driver import RunRequest, run_day
from pipeline.followup import close
from pipeline.followup.runs import list_runs, live
from pipeline.record import keys
from pipeline.record.records import Outcome
from pipeline.record.state import RunState
from pipeline.record.storage import open_store
from tests.conftest import NEXT_DATE, TRADE_DATE
from tests.test_proof import after_the_window


def test_runs_lists_the_store_s_runs_newest_first_with_their_counts_and_seal(ray_session, settings, day, next_day,
                                                                             capsys):
    first = run_day(settings, RunRequest(TRADE_DATE, str(day)))
    second = run_day(settings, RunRequest(NEXT_DATE, str(next_day), run_id="the-second-run"))
    close.close(settings, first["run_id"], now=after_the_window(settings, first["run_id"]))
    capsys.readouterr()
    assert main(["runs", "--store", settings.store_url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["run_id"] for r in rows] == ["the-second-run", first["run_id"]]
    newest, oldest = rows
    assert (newest["sealed"], oldest["sealed"]) == (False, True)
    assert newest["date"] == NEXT_DATE and newest["accounts"] == second["accounts"]
    assert newest["delivered"] == second["delivered"] and newest["paper"] == second["physical"]
    assert main(["runs", "--store", settings.store_url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["run", "date", "accounts"] and lines[1].startswith("the-second-run")
    assert lines[2].startswith(first["run_id"]) and lines[2].split()[-1] == "yes"


def test_a_rerun_under_way_has_in_runs_the_rate_the_live_page_gives_not_its_report_s(redis_url, tmp_path):
    """A finished run rerun now: `runs --json` (runs.live) and the live page (api.summary) both give the
    rerun's own rate, the notes it delivered since it started over its time so far, not the report's
    figure from the first driver's day."""
    run_id, store = "2026-11-20-rate-views", open_store(str(tmp_path / "store"))
    store.put(keys.manifest_key(run_id), b"{}")
    store.put(keys.report_keys(run_id)[0], json.dumps({"run_id": run_id, "trade_date": TRADE_DATE, "accounts": 40,
                                                       "finished_at": time.time() - 60, "notes_per_s": 12.5}).encode())
    state = RunState(redis_url, run_id)
    state.start({"date": TRADE_DATE, "accounts": 40})
    state.record([Outcome(f"C{n:07d}", "delivered") for n in range(30)])
    state.update_meta(finished=time.time() - 60, notes_per_s=12.5)
    state.start({"finished": "", "notes_per_s": ""})  # the rerun, as a driver starts it
    state.record([Outcome(f"C{n:07d}", "delivered") for n in range(30, 40)])
    state.update_meta(last_started=time.time() - 5)
    [row] = live(list_runs(store), redis_url)
    shown = summary(state, Seals(lambda _: store))
    assert row["state"] == shown["state"] == "running", (row, shown)
    assert row["notes_per_s"] == pytest.approx(shown["notes_per_s"], abs=0.02) and 1.9 < row["notes_per_s"] < 2.1, row
