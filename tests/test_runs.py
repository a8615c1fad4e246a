"""`runs`: a store's runs, newest first, in one line each (issue 57), from storage alone."""

from __future__ import annotations

import json

from pipeline.__main__ import main
from pipeline.cluster.driver import RunRequest, run_day
from pipeline.followup import close
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
