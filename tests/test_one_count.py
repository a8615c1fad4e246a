"""One count per run (issue 69): one real day with a rejected account, an address-less one, a
relay's 550, bounces and deferrals, a rerun and a close; every view of it (the run's and the
rerun's summary, `status` from Redis and from storage, `runs`, the live page's /runs and
/runs/{id} from Redis and from storage, the report) says the same numbers at the same moment."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from pipeline.__main__ import _exit_status, main
from pipeline.api import create_app
from pipeline.cluster.driver import RunRequest, rerun, run_day
from pipeline.followup import bounces, close
from pipeline.record import keys, report
from tests.conftest import TRADE_DATE
from tests.test_proof import after_the_window

HEADLINE = ("accounts", "delivered", "bounced", "deferred", "failed", "unconfirmed", "rejected", "physical", "pending",
            "paper_owed")
NOWHERE = "redis://127.0.0.1:1/0"  # a Redis that is gone: the views read the record in storage


def spoil(day: Path) -> tuple[str, str, str]:
    """The day's first client gives no e-mail consent (paper), the second a name with a control
    character (rejected at validation), the third an address the relay refuses for good."""
    with (day / "clients.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    physical, rejected, refused = (r["ucc"] for r in rows[:3])
    rows[0]["ecn_opt_in"], rows[1]["name"] = "N", rows[1]["name"] + "\x07"
    out = io.StringIO()
    writer = csv.DictWriter(out, list(rows[0]), lineterminator="\r\n")
    writer.writeheader()
    writer.writerows(rows)
    (day / "clients.csv").write_text(out.getvalue())
    return physical, rejected, rows[2]["email"]


def cli(argv: list[str], monkeypatch, capsys, redis_url: str, store_url: str):
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("CN_STORE", store_url)
    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def views(settings, run_id: str, monkeypatch, capsys) -> dict[str, dict]:
    """Every view of the run now, by name."""
    status = ["status", run_id, "--json", "--store", settings.store_url]
    gone = dataclasses.replace(settings, redis_url=NOWHERE)
    live, stored = TestClient(create_app(settings, read_only=True)), TestClient(create_app(gone, read_only=True))
    found = {
        "status from Redis": cli(status, monkeypatch, capsys, settings.redis_url, settings.store_url),
        "status from storage": cli(status, monkeypatch, capsys, NOWHERE, settings.store_url),
        "runs": next(r for r in cli(["runs", "--json", "--store", settings.store_url], monkeypatch, capsys,
                                    NOWHERE, settings.store_url) if r["run_id"] == run_id),
        "api /runs/{id} from Redis": live.get(f"/runs/{run_id}").json(),
        "api /runs/{id} from storage": stored.get(f"/runs/{run_id}").json(),
        "api /runs from Redis": next(r for r in live.get("/runs").json()["runs"] if r["run_id"] == run_id),
        "api /runs from storage": next(r for r in stored.get("/runs").json()["runs"] if r["run_id"] == run_id),
        "report": json.loads((Path(settings.store_url) / keys.report_keys(run_id)[0]).read_text()),
    }
    assert found["status from Redis"]["source"] == "redis" and found["status from storage"]["source"] == "storage"
    assert found["api /runs/{id} from storage"]["source"] == "storage"
    return found


def assert_one_count(seen: dict[str, dict]) -> dict:
    counted = {name: {k: view.get(k) for k in HEADLINE} for name, view in seen.items()}
    first = next(iter(counted.values()))
    assert all(c == first for c in counted.values()), json.dumps(counted, indent=1)
    for name in ("api /runs/{id} from Redis", "api /runs/{id} from storage"):  # the live page's bars
        bars = seen[name]["counts"]
        assert {k: bars.get(k) for k in ("delivered", "failed", "bounced", "deferred")} == \
            {k: first[k] for k in ("delivered", "failed", "bounced", "deferred")}, (name, bars)
    return first


@pytest.fixture
def run_with_everything(ray_session, settings, day, smtp_server, tmp_path):
    physical, rejected, refused = spoil(day)
    dsns = tmp_path / "dsns"
    relay = smtp_server(reject={refused}, bounce_rate=0.4, bounces=str(dsns))
    settings = dataclasses.replace(settings, smtp_url=relay.url)
    first = run_day(settings, RunRequest(TRADE_DATE, str(day)))
    assert (first["rejected"], first["failed"]) == (1, 1), first
    bounced = bounces.collect(settings, first["run_id"], [str(dsns)])
    assert bounced["bounced"] and bounced["deferred"], bounced
    return settings, first, smtp_server("clean")


def test_every_view_of_a_run_counts_the_same_through_its_rerun_and_close(run_with_everything, monkeypatch,
                                                                          capsys):
    settings, first, clean = run_with_everything
    run_id = first["run_id"]

    before = views(settings, run_id, monkeypatch, capsys)
    counted = assert_one_count(before)
    assert counted["failed"] == 1 and counted["rejected"] == 1 and counted["physical"] == 1
    assert before["status from Redis"]["next"].startswith(f"rerun {run_id} --failed (1 failed)")

    # the refused account through another relay: delivered; the rejected one is not rerunnable
    again = rerun(settings, run_id, failed=True, relays=clean.url)
    assert again["rerun_outcomes"] == {"delivered": 1}, again
    after_rerun = views(settings, run_id, monkeypatch, capsys)
    counted = assert_one_count({"rerun's summary": again, **after_rerun})
    assert (counted["failed"], counted["rejected"], counted["paper_owed"]) == (0, 1, 1 + counted["bounced"])
    for name in ("status from Redis", "status from storage"):
        view = after_rerun[name]
        assert "rerun" not in view["next"], (name, view["next"])  # a rejected account is not rerun by `rerun`
        assert view["started_at"] == report.iso(first["started_at"]), "the run's start is its first, not the rerun's"
        assert view["state"] == "finished"
    assert after_rerun["runs"]["started_at"] == first["started_at"] and after_rerun["runs"]["state"] == "finished"
    assert after_rerun["runs"]["duration_s"] >= again["elapsed_s"] + first["elapsed_s"] - 1

    # closed and sealed: the deferred mail is delivered, final, in every view
    close.close(settings, run_id, now=after_the_window(settings, run_id))
    sealed = views(settings, run_id, monkeypatch, capsys)
    final = assert_one_count(sealed)
    assert final["deferred"] == 0 and final["delivered"] == counted["delivered"] + counted["deferred"]
    assert {sealed[n]["state"] for n in ("status from Redis", "status from storage", "runs")} == {"sealed"}
    assert sealed["status from storage"]["next"] == f"post {final['paper_owed']} paper notes " \
                                                    f"(reports/{run_id}.paper.csv); verify {run_id} (sealed)"


@pytest.mark.parametrize("left, status", [({}, 0), ({"physical": 2}, 0), ({"pending": 3}, 1), ({"failed": 1}, 1),
                                          ({"unconfirmed": 1}, 1), ({"rejected": 1}, 1)])
def test_run_exits_0_only_when_no_account_is_left_without_its_outcome(left, status):
    """An account left pending (never mailed, never failed) is no success either."""
    assert _exit_status({"delivered": 5, "failed": 0, "rejected": 0, "unconfirmed": 0, "pending": 0, **left}) == status
