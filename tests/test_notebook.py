"""CI executes notebooks/rerun.ipynb against a small local run with injected failures, from a
Redis that never saw the run (it comes back from storage)."""

from __future__ import annotations

import ast
import datetime as dt

import nbformat
import pytest
import redis
from nbclient import NotebookClient

from pipeline.cluster.driver import RunRequest, run_day
from pipeline.day.synth import SynthOptions, write_dumps
from pipeline.record.storage import open_store
from pipeline.settings import ROOT, Settings
from tests.conftest import TRADE_DATE
from tests.helpers import client_rows, outbox_messages


def inject(nb, **params) -> None:
    """What papermill does: a cell after the `parameters` cell overrides them."""
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in params.items())))


def test_the_notebook_shows_the_failures_and_its_rerun_delivers_them(
        ray_session, redis_url, keys_dir, smtp_server, tmp_path, monkeypatch):
    write_dumps(tmp_path / "input", SynthOptions(dt.date.fromisoformat(TRADE_DATE), 12, seed=41))
    clients = client_rows(tmp_path / "input")
    traded = sorted({line.split(",")[4] for line in (tmp_path / "input" / "trades.csv").read_text().splitlines()[1:]})
    victims = traded[:2]
    failing_relay, healthy_relay = smtp_server("first", reject={clients[victims[1]]["email"]}), smtp_server("second")
    good = Settings(store_url=str(tmp_path / "store"), redis_url=redis_url, smtp_url=healthy_relay.url, shard_size=4,
                    signers=1, mailers=1, signer_key=str(keys_dir / "signer.key.pem"),
                    signer_cert=str(keys_dir / "signer.cert.pem"), signer_chain=str(keys_dir / "root.cert.pem"),
                    owner_password="notebook-owner-secret")
    broken = Settings(**{**good.__dict__, "owner_password": clients[victims[0]]["pan"], "smtp_url": failing_relay.url})
    first = run_day(broken, RunRequest(TRADE_DATE, str(tmp_path / "input")))  # fails one at sign, one at mail
    assert first["failed"] == 2
    for k, v in {"CN_SIGNER_KEY": good.signer_key, "CN_SIGNER_CERT": good.signer_cert,
                 "CN_SIGNER_CHAIN": good.signer_chain, "CN_OWNER_PASSWORD": good.owner_password,
                 "SMTP_URL": healthy_relay.url, "CN_SHARD_SIZE": "4",
                 "RAY_ADDRESS": ray_session.address_info["address"]}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PYTHONPATH", raising=False)  # as Jupyter starts it: in notebooks/, no import path set
    fresh_redis = redis_url.rsplit("/", 1)[0] + "/8"  # a laptop's: the cluster's Redis ended with the cluster
    redis.Redis.from_url(fresh_redis).flushdb()
    looked = nbformat.read(f"{ROOT}/notebooks/rerun.ipynb", as_version=4)  # Run All as it ships: mails nothing
    from pipeline.record.manifest import SplitResult, save_manifest
    save_manifest(open_store(good.store_url), "2026-11-19-abandoned", SplitResult([0], 10, 2))  # died mid-split
    # RUN_ID left None: a laptop's Redis holds no run, so the store's newest, not a run that died before it
    # (before: an IndexError; then the run that died, listed first as running)
    inject(looked, REDIS_URL=fresh_redis, STORE_URL=good.store_url, SMTP_URL=healthy_relay.url)
    NotebookClient(looked, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": f"{ROOT}/notebooks"}}).execute()
    [shown] = [o for o in looked.cells[-1].outputs if o["output_type"] == "execute_result"]
    assert {k: v for k, v in ast.literal_eval(shown["data"]["text/plain"]).items() if k.endswith("_now")} == {
        "delivered_now": 0, "unconfirmed_now": 0, "failed_now": 0}
    assert outbox_messages(healthy_relay.outbox) == [], "Run All with the defaults mailed (before: ACCOUNTS='failed')"
    nb = nbformat.read(f"{ROOT}/notebooks/rerun.ipynb", as_version=4)
    inject(nb, REDIS_URL=fresh_redis, STORE_URL=good.store_url, RUN_ID=first["run_id"], ACCOUNTS="failed",
           SMTP_URL=healthy_relay.url)  # not the run's own relay: told so
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": f"{ROOT}/notebooks"}}).execute()

    [last] = [o for o in nb.cells[-1].outputs if o["output_type"] == "execute_result"]
    result = ast.literal_eval(last["data"]["text/plain"])
    assert sorted(result["before"]) == sorted(victims) and result["after"] == []
    assert (result["delivered_now"], result["unconfirmed_now"], result["failed_now"]) == (2, 0, 0)  # as `rerun` says them
    outputs = "".join(str(o.get("data", "")) for c in nb.cells for o in c.get("outputs", []))
    assert "image/png" in outputs and victims[0] in outputs
    assert "Bounce window: **open**, until" in outputs
    [paper_cell] = [c for c in nb.cells if "paper_key" in c.source]
    paper = "".join(str(o.get("data", "")) for o in paper_cell.outputs if o["output_type"] == "execute_result")
    assert victims[1] in paper and "smtp permanent" in paper, "the relay's 550 is on the paper list"
    assert len(outbox_messages(failing_relay.outbox)) == first["delivered"]
    assert sorted(m["Subject"].split("(")[-1].rstrip(")") for m in outbox_messages(healthy_relay.outbox)) == victims


@pytest.mark.parametrize("accounts, arguments", [
    ("failed", {"failed": True}), ("unconfirmed", {"unconfirmed": True}),
    ("C0000042", {"accounts": ["C0000042"]}),  # before: its letters, each refused as no such account
    (["C0000042", "C0000043"], {"accounts": ["C0000042", "C0000043"]}),
])
def test_the_notebook_s_accounts_parameter_is_taken_as_rerun_takes_it(accounts, arguments):
    from pipeline.cluster.driver import chosen

    assert chosen(accounts) == arguments
    nb = nbformat.read(f"{ROOT}/notebooks/rerun.ipynb", as_version=4)
    assert "**chosen(ACCOUNTS)" in next(c.source for c in nb.cells if "rerun(settings, RUN_ID" in c.source)


@pytest.mark.parametrize("result, stops", [
    ({"rerun_outcomes": {"delivered": 2, "physical": 1}, "failed_now": 0, "unconfirmed_now": 0}, False),
    ({"rerun_outcomes": {"delivered": 1, "failed": 1}, "failed_now": 0, "unconfirmed_now": 0}, True),
    ({"rerun_outcomes": {"delivered": 2}, "failed_now": 1, "unconfirmed_now": 0}, True),  # a forced mail failed
    ({"rerun_outcomes": {"delivered": 2}, "failed_now": 0, "unconfirmed_now": 1}, True),  # one went unanswered
])
def test_the_notebook_stops_after_a_rerun_where_the_command_exits_1(result, stops):
    """The notebook's last cell, on what a rerun returned: it shows the result, then raises where
    `rerun` exits 1 (driver.undone), so a notebook run headless (`jupyter execute`) fails too."""
    import pandas as pd

    from pipeline.cluster.driver import undone

    nb = nbformat.read(f"{ROOT}/notebooks/rerun.ipynb", as_version=4)
    assert "left = undone(result)" in next(c.source for c in nb.cells if "rerun(settings, RUN_ID" in c.source)
    shown: list = []
    cell = {"failures": lambda: pd.DataFrame(index=[]), "counts": lambda: None, "display": lambda *a: shown.append(a),
            "before": pd.DataFrame(index=["C0000001"]), "result": {**result, "delivered_now": 1},
            "left": undone(result)}
    if stops:
        with pytest.raises(RuntimeError, match="not done"):
            exec(nb.cells[-1].source, cell)
        assert shown[-1][0]["before"] == ["C0000001"]  # the result shown before it stops
    else:
        exec(nb.cells[-1].source, cell)
        assert undone(result) == {}


def test_the_notebook_s_bounce_table_on_a_closed_run_says_what_its_report_says(redis_url, tmp_path):
    """What came back after the relay's 250, and where each account stands: once the window is
    closed, a deferred mail is delivered, final (the report's word; before, the table said
    "deferred")."""
    import pandas as pd

    from tests.test_api import closed_run

    state = closed_run(redis_url)
    nb = nbformat.read(f"{ROOT}/notebooks/rerun.ipynb", as_version=4)
    shown: list = []
    cell = {"state": state, "settings": Settings(), "display": lambda *a: shown.append(a), "Markdown": str,
            "pd": pd, "RUN_ID": state.run_id, "store": open_store(str(tmp_path / "store"))}
    exec(next(c.source for c in nb.cells if "bounced = pd.DataFrame" in c.source), cell)
    table = cell["bounced"].set_index("ucc")
    assert table["came_back"].to_dict() == {"C0000002": "deferred", "C0000003": "bounced"}
    assert table["status"].to_dict() == {"C0000002": "delivered", "C0000003": "bounced"}
    assert "Bounce window: **closed**" in shown[0][0]
