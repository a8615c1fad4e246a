"""The status service over the state of a real small run (one account made to fail)."""

from __future__ import annotations

import csv
import datetime as dt
import io
import os
import subprocess
import sys
import time

import pytest
from fastapi.testclient import TestClient

from pipeline.api import create_app
from pipeline.cluster.driver import RunRequest, run_day
from pipeline.day.synth import SynthOptions, write_dumps
from pipeline.embedded import start_smtp_sink
from pipeline.record import keys
from pipeline.settings import ROOT, Settings
from tests.conftest import TRADE_DATE
from tests.helpers import client_rows

TOKEN = "test-api-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def api_run(ray_session, redis_url, keys_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("api")
    write_dumps(work / "input", SynthOptions(dt.date.fromisoformat(TRADE_DATE), 24, seed=21))
    clients = client_rows(work / "input")
    victim = sorted(clients)[0]
    faults = work / "faults.json"
    faults.write_text('{"reject": ["%s"]}' % clients[victim]["email"])
    smtp = start_smtp_sink(work / "outbox", work / "smtp.log", ["--faults", str(faults)])
    settings = Settings(store_url=str(work / "store"), redis_url=redis_url, smtp_url=smtp.url, shard_size=5,
                        signers=1, mailers=1, signer_key=str(keys_dir / "signer.key.pem"),
                        signer_cert=str(keys_dir / "signer.cert.pem"), signer_chain=str(keys_dir / "root.cert.pem"),
                        owner_password="api-owner-secret", api_token=TOKEN)
    summary = run_day(settings, RunRequest(TRADE_DATE, str(work / "input")))
    smtp.stop()
    yield settings, summary, victim, clients


@pytest.fixture
def client(api_run):
    settings = api_run[0]
    launched = []
    app = create_app(settings, launch=lambda *args: launched.append(args) or 4242)
    with TestClient(app) as c:
        c.launched = launched
        yield c


def test_health_runs_and_a_run_with_counters_rate_and_timeline(client, api_run):
    _, summary, _, _ = api_run
    assert client.get("/healthz").json() == {"ok": True}
    runs = client.get("/runs").json()["runs"]
    assert summary["run_id"] in [r["run_id"] for r in runs]
    run = client.get(f"/runs/{summary['run_id']}").json()
    assert run["accounts"] == summary["accounts"]
    assert run["counts"]["delivered"] == summary["delivered"] and run["counts"]["failed"] == 1
    assert run["notes_per_s"] > 0 and run["finished"] and run["eta_s"] is None
    assert run["notes_per_s"] == summary["notes_per_s"], "the run's own rate, as its report has it"
    [listed] = [r for r in runs if r["run_id"] == summary["run_id"]]
    assert listed["notes_per_s"] == summary["notes_per_s"] and listed["state"] == "finished"
    assert run["timeline"] and run["timeline"][-1]["delivered"] == summary["delivered"]


def test_a_run_only_storage_holds_is_listed_beside_the_runs_redis_holds(client, api_run):
    """The grid listed storage's runs only when Redis held none: a run Redis lost (a cluster's
    ended with it) vanished from the page the moment any other run started, while `runs` listed it."""
    import uuid

    from pipeline.record import report
    from pipeline.record.manifest import SplitResult, save_manifest
    from pipeline.record.records import Outcome
    from pipeline.record.state import RunState
    from pipeline.record.storage import open_store

    settings, summary = api_run[0], api_run[1]
    run_id = f"2026-11-19-{uuid.uuid4().hex[:8]}"
    gone = RunState(settings.redis_url.rsplit("/", 1)[0] + "/15", run_id)  # the Redis that ran it, not the service's
    gone.start({"date": "2026-11-19", "finished": time.time() - 86400, "bounce_window_h": 72})
    gone.record([Outcome(u, "delivered", message_id=f"<{u}@x>", reply="250 ok") for u in ("C1", "C2")])
    store = open_store(settings.store_url)
    save_manifest(store, run_id, SplitResult([0], 10, 2))
    report.write(store, gone, run_id, {"run_id": run_id, "trade_date": "2026-11-19", "accounts": 2,
                                      "finished_at": time.time() - 86400}, [])
    gone.r.flushdb()

    runs = client.get("/runs", params={"limit": 500}).json()["runs"]
    [live] = [r for r in runs if r["run_id"] == summary["run_id"]]
    [stored] = [r for r in runs if r["run_id"] == run_id]
    assert (live["source"], stored["source"], stored["delivered"], stored["state"]) == ("redis", "storage", 2,
                                                                                       "finished"), stored
    # its rerun, as `rerun` reruns it: brought back from storage first (before, 404 "no run")
    started = client.post(f"/runs/{run_id}/rerun", json={"failed": True}, headers=AUTH)
    assert started.status_code == 202 and started.json()["from_storage"] == store.url, started.text
    assert client.launched[-1] == (run_id, None, True, False)
    assert client.post(f"/runs/{run_id}/rerun", json={"accounts": ["C9"]}, headers=AUTH).status_code == 422
    named = client.post(f"/runs/{run_id}/rerun", json={"accounts": ["C1"], "force": True}, headers=AUTH)
    assert named.status_code == 202 and named.json()["accounts"] == ["C1"], named.text
    assert client.post("/runs/2026-11-19-00000000/rerun", json={"failed": True}, headers=AUTH).status_code == 404


def test_accounts_page_through_every_account_and_filter_by_status(client, api_run):
    _, summary, victim, _ = api_run
    seen, cursor = [], 0
    while True:
        page = client.get(f"/runs/{summary['run_id']}/accounts", params={"cursor": cursor, "limit": 5}).json()
        seen += [a["ucc"] for a in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == len(set(seen)) == summary["accounts"]
    failed = client.get(f"/runs/{summary['run_id']}/accounts", params={"status": "failed"}).json()["items"]
    assert [a["ucc"] for a in failed] == [victim] and "550" in failed[0]["reason"]


def test_an_account_shows_its_history_and_masks_pii_without_the_token(client, api_run):
    _, summary, victim, clients = api_run
    url = f"/runs/{summary['run_id']}/accounts/{victim}"
    masked = client.get(url).json()
    assert masked["pii"] == "masked"
    assert clients[victim]["pan"] not in str(masked) and clients[victim]["email"] not in str(masked)
    assert masked["client"]["pan"].endswith(clients[victim]["pan"][-4:])
    # who the client is needs the token: a name shows as initials, the state not at all
    names = [w for w in clients[victim]["name"].split() if len(w) > 1]
    assert names and not any(w in str(masked) for w in names), masked["client"]
    assert masked["client"]["name"] == " ".join(f"{w[0]}***" for w in clients[victim]["name"].split())
    assert masked["client"]["state"] == "***"
    assert [e["stage"] for e in masked["history"]][:4] == ["validated", "rendered", "signed", "archived"]
    assert masked["history"][-1]["status"] == "failed"
    # the record's own word on it too, the relay's refusal masked (docs/operations.md said so; it was not there)
    assert [e["status"] for e in masked["delivery_log"]] == ["sending", "failed"], masked["delivery_log"]
    assert "550" in masked["delivery_log"][-1]["reason"] and masked["delivery_log"][0]["message_id"]
    full = client.get(url, headers=AUTH).json()
    assert full["pii"] == "shown" and full["client"]["pan"] == clients[victim]["pan"]
    assert full["client"]["email"] == clients[victim]["email"]
    assert (full["client"]["name"], full["client"]["state"]) == (clients[victim]["name"], clients[victim]["state"])
    assert client.get(url, headers={"Authorization": "Bearer wrong"}).json()["pii"] == "masked"


def test_the_report_csv_has_a_row_per_account(client, api_run):
    _, summary, victim, _ = api_run
    response = client.get(f"/runs/{summary['run_id']}/report.csv")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/csv")
    rows = {r["ucc"]: r for r in csv.DictReader(io.StringIO(response.text))}
    assert len(rows) == summary["accounts"] and rows[victim]["physical_dispatch"] == "Y"


def test_rerun_needs_the_token_and_a_valid_body(client, api_run):
    _, summary, victim, _ = api_run
    url = f"/runs/{summary['run_id']}/rerun"
    assert client.post(url, json={"failed": True}).status_code == 401
    assert client.post(url, json={"failed": True}, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.launched == []
    for bad in ({}, {"failed": True, "accounts": ["C1"]}, {"accounts": []}, {"accounts": ["bad id!"]},
                {"failed": "maybe"}):
        assert client.post(url, json=bad, headers=AUTH).status_code == 422, bad
    accepted = client.post(url, json={"failed": True}, headers=AUTH)
    assert accepted.status_code == 202 and accepted.json()["accounts"] == [victim]
    assert client.post(url, json={"accounts": [victim], "force": True}, headers=AUTH).status_code == 202
    assert client.launched == [(summary["run_id"], None, True, False), (summary["run_id"], [victim], False, True)]


def closed_run(redis_url: str):
    """A closed run in Redis: three delivered mails, one of them deferred (its recipient's server
    still retrying when the window ended), one bounced."""
    from pipeline.record.records import Outcome
    from pipeline.record.state import RunState

    state = RunState(redis_url, f"closed-{time.time_ns()}")
    state.start({"date": TRADE_DATE, "input": "", "finished": time.time(), "bounce_window_h": 1})
    state.record([Outcome(u, "delivered", reply="250 OK") for u in ("C0000001", "C0000002", "C0000003")])
    state.bounce([("C0000002", "deferred", "4.2.2", "mailbox full", time.time()),
                  ("C0000003", "bounced", "5.1.1", "user unknown", time.time())])
    state.update_meta(closed_at=time.time())
    return state


def test_a_closed_run_s_accounts_page_and_account_say_what_its_report_says(redis_url, tmp_path):
    """Once `close` ends the bounce window, a mail the recipient's server was still retrying is
    delivered, final: the report, the run's counts and the accounts' pages all say so. Before, the
    pages filtered and named each account by its status as if the window were open: a closed
    run's deferred accounts listed under `deferred` (its counts said 0) and left out of
    `delivered`."""
    from pipeline.record.report import csv_chunks

    state = closed_run(redis_url)
    run_id = state.run_id
    app = create_app(Settings(store_url=str(tmp_path / "store"), redis_url=redis_url, api_token=TOKEN),
                     launch=lambda *args: 0)
    with TestClient(app) as api:
        run = api.get(f"/runs/{run_id}").json()
        listed = {s: sorted(a["ucc"] for a in api.get(f"/runs/{run_id}/accounts", params={"status": s}).json()["items"])
                  for s in ("delivered", "deferred", "bounced")}
        one = api.get(f"/runs/{run_id}/accounts/C0000002").json()
    reported = {row["ucc"]: row["status"] for row in csv.DictReader(io.StringIO("".join(csv_chunks(state))))}
    assert reported == {"C0000001": "delivered", "C0000002": "delivered", "C0000003": "bounced"}
    assert (run["counts"]["delivered"], run["counts"]["deferred"]) == (2, 0)
    assert listed == {"delivered": ["C0000001", "C0000002"], "deferred": [], "bounced": ["C0000003"]}
    assert one["status"] == "delivered"


def test_a_rerun_the_run_would_refuse_at_once_is_409_naming_why_not_202(redis_url, tmp_path):
    """The page's rerun starts `rerun` in the background, whose output is not the page's: a run
    closed, held by a live driver, or whose entity file is neither where it was nor named by the
    service's CN_BROKER_FILE, was answered 202 ("rerun started") and the refusal lost."""
    from pipeline.record.records import Outcome

    state = closed_run(redis_url)
    launched: list = []
    app = create_app(Settings(store_url=str(tmp_path / "store"), redis_url=redis_url, api_token=TOKEN, lease_s=30),
                     launch=lambda *args: launched.append(args) or 4242)
    with TestClient(app) as api:
        closed = api.post(f"/runs/{state.run_id}/rerun", json={"failed": True}, headers=AUTH)
        state.r.hdel(keys.run_meta(state.run_id), "closed_at")
        state.record([Outcome("C0000009", "validated", "rejected", reason="bad PAN")])
        lease = state.take_lease(30)
        held = api.post(f"/runs/{state.run_id}/rerun", json={"failed": True}, headers=AUTH)
        state.release_lease(lease.token)
        unknown = api.post(f"/runs/{state.run_id}/rerun", json={"accounts": ["C0000001", "C0000404"]}, headers=AUTH)
        entity = tmp_path / "entity.json"
        state.update_meta(broker_file=str(entity), broker_file_sha256="0" * 64)  # the run's: not on this machine
        moved = api.post(f"/runs/{state.run_id}/rerun", json={"failed": True}, headers=AUTH)
        state.r.hdel(keys.run_meta(state.run_id), "broker_file", "broker_file_sha256")
        taken = api.post(f"/runs/{state.run_id}/rerun", json={"failed": True}, headers=AUTH)
    assert closed.status_code == 409 and "its close began" in closed.json()["detail"]  # as `rerun` says it: no seal yet
    assert moved.status_code == 409 and f"{entity} (CN_BROKER_FILE)" in moved.json()["detail"], moved.text
    assert held.status_code == 409 and f"(pid {os.getpid()})" in held.json()["detail"]
    assert unknown.status_code == 422 and "has no account C0000404" in unknown.json()["detail"], unknown.text
    assert taken.status_code == 202 and taken.json()["accounts"] == [], "a rejected account is not rerun"
    assert launched == [(state.run_id, None, True, False)]


def test_a_run_recorded_on_another_store_is_shown_from_that_store_as_its_commands_read_it(redis_url, tmp_path,
                                                                                          keys_dir):
    """A run started with --store elsewhere: its seal, its paper list, its clients and their notes
    are in its own store, which `status` and `close` open (Redis recorded it). Before, the service
    looked in its own CN_STORE: the page said "closing" where `status` said sealed, paper.csv was
    404 while `status` said to post the notes on it, an account showed no client, and a client's
    link was 404. A bounce's paper note is due the run's CN_PAPER_DUE_DAYS after it, on that page
    too (it said 1 day, then the service's own setting)."""
    import json

    from pipeline.mail import link
    from pipeline.record import delivery_log
    from pipeline.record.report import due_date, paper_key
    from pipeline.record.storage import open_store

    state = closed_run(redis_url)
    elsewhere = open_store(str(tmp_path / "elsewhere"))
    state.update_meta(store_url=elsewhere.url, made_with=json.dumps({"paper_due_days": 5}))  # the run's, not the page's 3
    proof, signature = keys.proof_keys(state.run_id)
    elsewhere.put(proof, b'{"run_id": "%s", "tsa": null}' % state.run_id.encode())
    elsewhere.put(signature, b"(the proof's CMS signature)")
    elsewhere.put(paper_key(state.run_id), b"ucc,why,due\nC0000003,bounced,2026-11-23\n")
    elsewhere.put(keys.manifest_key(state.run_id), b'{"shards": [0], "shard_count": 1}')
    client = {"name": "Asha Rao", "email": "asha@example.com", "pan": "ABCDE1234F", "state": "Karnataka"}
    elsewhere.put(keys.shard_key(state.run_id, 0), json.dumps({"ucc": "C0000003", "client": client, "trades": []})
                  .encode() + b"\n")
    elsewhere.put(keys.signed_pdf_key(TRADE_DATE, "C0000003"), b"%PDF-1.7 (the client's signed note)")
    settings = Settings(store_url=str(tmp_path / "service-store"), redis_url=redis_url, api_token=TOKEN,
                        paper_due_days=3, token_key_file=str(keys_dir / "token.key"))
    with TestClient(create_app(settings, launch=lambda *args: 0)) as api:
        run = api.get(f"/runs/{state.run_id}").json()
        paper = api.get(f"/runs/{state.run_id}/paper.csv", headers=AUTH)
        account = api.get(f"/runs/{state.run_id}/accounts/C0000003", headers=AUTH).json()
        note = api.get(f"/notes/{link.make(settings.hmac_key(), state.run_id, 'C0000003', TRADE_DATE, 3600)}")
    assert run["state"] == "sealed", run["state"]
    assert paper.status_code == 200 and "C0000003,bounced" in paper.text
    assert account["client"] == client
    assert note.status_code == 200 and note.content == b"%PDF-1.7 (the client's signed note)"
    fetched = [e["status"] for e in delivery_log.entries(elsewhere, state.run_id)]
    assert fetched == ["fetched"], "the fetch is proof of receipt in the run's own log"
    bounce = state.accounts(["C0000003"])["C0000003"]["bounce"]
    assert account["bounce"]["due_date"] == due_date(bounce["at"], 5) != due_date(bounce["at"], 3)


def test_a_run_s_links_open_after_the_service_s_key_was_rotated_and_no_other_key_s_do(redis_url, tmp_path, keys_dir,
                                                                                        caplog, monkeypatch):
    """A run signed its clients' links with the HMAC key it recorded (its fingerprint and file);
    the service now runs with a new key. A link of that run is checked with the run's key, read
    where the run recorded it. Before, every link of the run was 404 from the day the key changed
    (for the 90 days the links are valid), and one signed with the service's new key, which the
    run never signed with, was let through. A link of that run signed with any other key, the
    service's own included, is 404; so is every link of a run whose key is not where it recorded
    it (said once in the service's log, not tried again at every link). Once Redis has forgotten
    the run (14 days; its links work 90), its report says where its key is. A run's key opens
    only that run's day: the note a link names is found by its date and account, and an old key
    (one that leaked, say) opened every later day's notes too. A key deleted is refused once
    it is read again (KEY_KEPT_S): before, it opened links until the service restarted; a key
    due to be read again while storage fails goes on being used, for a while (OUTAGE_KEPT_S)."""
    import json
    import logging

    import redis

    from pipeline import api as service
    from pipeline.mail import link
    from pipeline.record.storage import open_store
    from pipeline.settings import key_id

    store, old_key = open_store(str(tmp_path / "store")), b"the key the runs signed their links with"
    (tmp_path / "old.key").write_text(old_key.decode())
    rotated, lost = closed_run(redis_url), closed_run(redis_url)
    for state, key_file in ((rotated, tmp_path / "old.key"), (lost, tmp_path / "gone.key")):
        state.update_meta(store_url=store.url, token_key_file=str(key_file), token_key_id=key_id(old_key))
        store.put(keys.manifest_key(state.run_id), b'{"shards": [0], "shard_count": 1}')
    store.put(keys.signed_pdf_key(TRADE_DATE, "C0000003"), b"%PDF-1.7 (the client's signed note)")
    store.put(keys.signed_pdf_key("2026-11-23", "C0000009"), b"%PDF-1.7 (a later day's note, its links a new key's)")
    settings = Settings(store_url=str(tmp_path / "service-store"), redis_url=redis_url,
                        token_key_file=str(keys_dir / "token.key"))  # the new key
    signed = lambda key, state: link.make(key, state.run_id, "C0000003", TRADE_DATE, 3600)  # noqa: E731
    forgotten = closed_run(redis_url)  # Redis has forgotten it (14 days); its record, in the service's store, has not
    service_store = open_store(settings.store_url)
    service_store.put(keys.report_keys(forgotten.run_id)[0], json.dumps(
        {"run_id": forgotten.run_id, "trade_date": TRADE_DATE, "accounts": 3, "token_key_file": str(tmp_path / "old.key"),
         "token_key_id": key_id(old_key)}).encode())
    service_store.put(keys.manifest_key(forgotten.run_id), b'{"shards": [0], "shard_count": 1}')
    service_store.put(keys.signed_pdf_key(TRADE_DATE, "C0000003"), b"%PDF-1.7 (the client's signed note)")
    redis.Redis.from_url(redis_url).delete(keys.run_meta(forgotten.run_id))
    with TestClient(create_app(settings, launch=lambda *args: 0)) as api, caplog.at_level(logging.WARNING):
        opened = api.get(f"/notes/{signed(old_key, rotated)}")
        other_day = api.get(f"/notes/{link.make(old_key, rotated.run_id, 'C0000009', '2026-11-23', 3600)}").status_code
        refused = [api.get(f"/notes/{signed(k, rotated)}").status_code for k in (settings.hmac_key(), b"forged")]
        unread = [api.get(f"/notes/{signed(old_key, lost)}").status_code for _ in range(2)]
        later = [api.get(f"/notes/{signed(k, forgotten)}").status_code for k in (old_key, settings.hmac_key())]
        late = closed_run(redis_url)  # asked about before its key's record reached Redis (a failover), then after
        store.put(keys.manifest_key(late.run_id), b'{"shards": [0], "shard_count": 1}')
        before_record = api.get(f"/notes/{signed(old_key, late)}").status_code
        late.update_meta(store_url=store.url, token_key_file=str(tmp_path / "old.key"), token_key_id=key_id(old_key))
        after_record = api.get(f"/notes/{signed(old_key, late)}").status_code
        (tmp_path / "old.key").unlink()  # read once: the service does not go back to it at each link
        again = api.get(f"/notes/{signed(old_key, rotated)}").status_code
        monkeypatch.setattr(service, "KEY_KEPT_S", 0.0)  # as when five minutes have passed
        report_at = tmp_path / "service-store" / keys.report_keys(forgotten.run_id)[0]
        report_at.unlink()
        report_at.mkdir()  # the service store's disk fails under the report (EISDIR, as EIO would be)
        through_outage = api.get(f"/notes/{signed(old_key, forgotten)}").status_code  # the key read before goes on
        monkeypatch.setattr(service, "OUTAGE_KEPT_S", 0.0)  # as when the store has failed a quarter of an hour
        past_outage = api.get(f"/notes/{signed(old_key, forgotten)}").status_code  # its key deleted meanwhile
        deleted = api.get(f"/notes/{signed(old_key, rotated)}").status_code
    assert opened.status_code == 200 and opened.content == b"%PDF-1.7 (the client's signed note)"
    assert refused == [404, 404] and unread == [404, 404] and other_day == 404
    assert caplog.text.count(f"run {lost.run_id}: its links cannot be checked: the run's HMAC key file") == 1
    assert later == [200, 404] and again == 200 and (before_record, after_record) == (404, 200)
    assert deleted == 404 and f"run {rotated.run_id}: its links cannot be checked" in caplog.text
    assert through_outage == 200 and f"run {forgotten.run_id}: its record cannot be read" in caplog.text
    assert past_outage == 404, "a record unreadable for good does not keep a deleted key opening links"


def test_a_client_s_link_opens_with_redis_away_as_it_did_before_runs_recorded_their_keys(tmp_path, keys_dir):
    """A link needs no Redis: with it not answering, the service checks the link with its own
    key and serves the note from its own store. Checking which key a run signed with must not
    make every link a 503 while Redis is away (it did, once the run's key was looked up)."""
    from pipeline.embedded import free_port
    from pipeline.mail import link
    from pipeline.record.storage import open_store

    settings = Settings(store_url=str(tmp_path / "store"), redis_url=f"redis://127.0.0.1:{free_port()}/0",
                        token_key_file=str(keys_dir / "token.key"))
    store, run_id = open_store(settings.store_url), f"{TRADE_DATE}-away"
    store.put(keys.manifest_key(run_id), b'{"shards": [0], "shard_count": 1}')
    store.put(keys.signed_pdf_key(TRADE_DATE, "C0000003"), b"%PDF-1.7 (the client's signed note)")
    with TestClient(create_app(settings, launch=lambda *args: 0)) as api:
        note = api.get(f"/notes/{link.make(settings.hmac_key(), run_id, 'C0000003', TRADE_DATE, 3600)}")
    assert note.status_code == 200 and note.content == b"%PDF-1.7 (the client's signed note)"


def test_a_client_s_link_opens_with_the_service_s_store_failing_under_a_run_redis_forgot(redis_url, tmp_path,
                                                                                        keys_dir, caplog):
    """The run's record looked for in the service's folder store, whose disk fails (an OSError,
    not a StorageError): an outage, so the link is checked with the service's key, as with Redis
    away. Before, the run's links were refused as if its key could not be read, and the log said
    so, for a minute at a time. The outage is said in the service's log."""
    import logging

    from pipeline.mail import link
    from pipeline.record.storage import open_store

    settings = Settings(store_url=str(tmp_path / "store"), redis_url=redis_url, token_key_file=str(keys_dir / "token.key"))
    store, run_id = open_store(settings.store_url), f"{TRADE_DATE}-failing-disk"
    store.put(keys.manifest_key(run_id), b'{"shards": [0], "shard_count": 1}')
    store.put(keys.signed_pdf_key(TRADE_DATE, "C0000003"), b"%PDF-1.7 (the client's signed note)")
    (tmp_path / "store" / keys.report_keys(run_id)[0]).mkdir(parents=True)  # read: EISDIR, as EIO would be
    with TestClient(create_app(settings, launch=lambda *args: 0)) as api, caplog.at_level(logging.WARNING):
        note = api.get(f"/notes/{link.make(settings.hmac_key(), run_id, 'C0000003', TRADE_DATE, 3600)}")
    assert note.status_code == 200 and note.content == b"%PDF-1.7 (the client's signed note)"
    assert f"run {run_id}: its record cannot be read" in caplog.text and "cannot be checked" not in caplog.text


def test_a_client_s_link_is_503_not_500_when_a_folder_store_s_disk_fails_under_the_note(tmp_path, keys_dir):
    """The note's own read failing in a folder store (an OSError, not a StorageError) is storage
    unavailable, as on S3: 503, which a client's browser may try again. Before, a 500."""
    from pipeline.embedded import free_port
    from pipeline.mail import link
    from pipeline.record.storage import open_store

    settings = Settings(store_url=str(tmp_path / "store"), redis_url=f"redis://127.0.0.1:{free_port()}/0",
                        token_key_file=str(keys_dir / "token.key"))
    store, run_id = open_store(settings.store_url), f"{TRADE_DATE}-note-disk"
    store.put(keys.manifest_key(run_id), b'{"shards": [0], "shard_count": 1}')
    (tmp_path / "store" / keys.signed_pdf_key(TRADE_DATE, "C0000003")).mkdir(parents=True)  # read: EISDIR, as EIO
    with TestClient(create_app(settings, launch=lambda *args: 0), raise_server_exceptions=False) as api:
        note = api.get(f"/notes/{link.make(settings.hmac_key(), run_id, 'C0000003', TRADE_DATE, 3600)}")
    assert note.status_code == 503, note.text


def test_unknown_runs_and_accounts_are_404_and_bad_queries_422_never_500(client, api_run):
    _, summary, _, _ = api_run
    run = summary["run_id"]
    for url in ("/runs/no-such-run", "/runs/no-such-run/accounts", "/runs/no-such-run/accounts/C1",
                "/runs/..%2F..%2Fetc/accounts", f"/runs/{run}/accounts/ZZZ9", f"/runs/{run}/accounts/not-a-ucc!",
                "/runs/no-such-run/report.csv", "/runs/%00/report.csv"):
        assert client.get(url).status_code == 404, url
    assert client.post("/runs/no-such-run/rerun", json={"failed": True}, headers=AUTH).status_code == 404
    for params in ({"cursor": "x"}, {"cursor": -1}, {"cursor": 10**30}, {"limit": 0}, {"status": "exploded"}):
        assert client.get(f"/runs/{run}/accounts", params=params).status_code == 422, params
    assert client.get("/openapi.json").json()["info"]["title"].startswith("Contract notes")
    assert "<title>" in client.get("/").text


def test_a_redis_outage_is_503_at_once_not_500(api_run):
    """Not after the 30 s of patience a run gives a Redis restart: the page asks again anyway."""
    settings = api_run[0]
    down = Settings(**{**settings.__dict__, "redis_url": "redis://127.0.0.1:1/0"})
    with TestClient(create_app(down), raise_server_exceptions=False) as c:
        started = time.monotonic()
        listed = c.get("/runs")  # the runs in storage: before, 503 while every report was there
        assert listed.status_code == 200 and api_run[1]["run_id"] in {r["run_id"] for r in listed.json()["runs"]}
        assert c.get(f"/runs/{api_run[1]['run_id']}").json()["source"] == "storage"
        assert c.get("/runs/x/accounts").status_code == 503
        assert c.get("/runs/x/report.csv").status_code == 503
        assert time.monotonic() - started < 5


def test_without_the_token_no_address_or_pan_appears_anywhere_relay_replies_included(client, api_run):
    _, summary, victim, clients = api_run
    run = summary["run_id"]
    email, pan = clients[victim]["email"], clients[victim]["pan"]
    full = client.get(f"/runs/{run}/accounts", params={"status": "failed"}, headers=AUTH).json()
    assert email in str(full)  # the relay's 550 quotes the address: the token shows it
    for url in (f"/runs/{run}/accounts?status=failed", f"/runs/{run}/accounts?limit=500",
                f"/runs/{run}/accounts/{victim}", f"/runs/{run}/report.csv"):
        body = client.get(url).text
        assert email not in body and pan not in body, url
        assert not any(c["email"] in body or c["pan"] in body for c in clients.values()), url
    assert email in client.get(f"/runs/{run}/report.csv", headers=AUTH).text


def test_a_read_only_service_shows_no_pii_and_reruns_nothing_even_with_the_token(api_run):
    settings, summary, victim, clients = api_run
    launched = []
    app = create_app(settings, launch=lambda *a: launched.append(a) or 1, read_only=True)
    with TestClient(app) as c:
        record = c.get(f"/runs/{summary['run_id']}/accounts/{victim}", headers=AUTH).json()
        assert record["pii"] == "masked" and clients[victim]["email"] not in str(record)
        assert c.post(f"/runs/{summary['run_id']}/rerun", json={"failed": True}, headers=AUTH).status_code == 403
    assert launched == []


def test_serve_without_a_token_refuses_to_start_unless_read_only():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "CN_API_TOKEN"}
    done = subprocess.run([sys.executable, "-m", "pipeline", "serve", "--port", "1"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 2 and "error: CN_API_TOKEN is not set" in done.stderr


def test_behind_no_trusted_proxy_a_forged_x_forwarded_for_does_not_dodge_the_link_limit(redis_url, keys_dir, tmp_path):
    """The limiter keys by the client address; uvicorn believes X-Forwarded-For only from the
    proxies named with --forwarded-allow-ips (default: none)."""
    import urllib.error
    import urllib.request

    from pipeline.api import NOTE_FETCHES
    from pipeline.embedded import EmbeddedError, free_port, wait_for_port

    def serving(trusting: list[str]) -> tuple[int, subprocess.Popen]:
        """The service on a free port, once it listens there itself: a program of the other test
        sessions that took the port meanwhile (Ray's, answering 401) must not answer for it."""
        env = {**os.environ, "REDIS_URL": redis_url, "CN_STORE": str(tmp_path / "store"), "PYTHONPATH": ROOT,
               "CN_TOKEN_KEY_FILE": str(keys_dir / "token.key")}
        for attempt in range(3):
            port = free_port()
            server = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", "--read-only", "--port", str(port),
                                       *trusting], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_for_port(port, server, "serve", own=True)
                return port, server
            except EmbeddedError:
                server.kill()
                server.wait(10)
                if attempt == 2:
                    raise

    def statuses(trusting: list[str]) -> list[int]:
        port, server = serving(trusting)
        try:
            found = []
            for n in range(NOTE_FETCHES[0] + 5):
                request = urllib.request.Request(f"http://127.0.0.1:{port}/notes/x.y",
                                                 headers={"X-Forwarded-For": f"203.0.113.{n}"})
                try:
                    found.append(urllib.request.urlopen(request, timeout=10).status)
                except urllib.error.HTTPError as e:
                    found.append(e.code)
            return found
        finally:
            server.terminate()
            server.wait(10)

    assert 429 in statuses([]), "a forged header from an untrusted address is ignored: one client, limited"
    assert set(statuses(["--forwarded-allow-ips", "127.0.0.1"])) == {404}, "a trusted proxy's header names each client"


def test_a_signed_link_naming_a_path_outside_the_store_gets_the_same_404(redis_url, keys_dir, tmp_path, s3_bucket):
    """Links stay inside the store: the date is checked before a key is built, and no store
    (a folder, S3) takes a key that climbs out of it."""
    from pipeline.mail import link
    from pipeline.record.manifest import SplitResult, save_manifest
    from pipeline.record.storage import StorageError, open_store

    settings = Settings(store_url=str(tmp_path / "store"), redis_url=redis_url,
                        token_key_file=str(keys_dir / "token.key"))
    save_manifest(open_store(settings.store_url), "run-1", SplitResult([0], 10, 1))
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "C1.pdf").write_bytes(b"%PDF- not the store's")
    for partition in range(10):  # wherever the account's partition puts it, ../../outside is beside the store
        (tmp_path / "store" / f"{partition}-signed-pdf").mkdir(parents=True, exist_ok=True)
    token = link.make(settings.hmac_key(), "run-1", "C1", "../../outside", 3600)
    with TestClient(create_app(settings, read_only=True)) as api:
        assert api.get(f"/notes/{token}").status_code == 404
    for store in (open_store(settings.store_url), open_store(f"s3://{s3_bucket}/notes")):
        for key in ("../outside/C1.pdf", "0-signed-pdf/../../outside/C1.pdf", "/etc/passwd"):
            with pytest.raises(StorageError, match="would leave the store"):
                store.get(key)


def test_every_route_in_the_schema_says_what_it_does_beyond_its_name(tmp_path):
    """/docs is made from these: a summary that only repeats the route's name tells a reader nothing."""
    app = create_app(Settings(store_url=str(tmp_path / "store"), api_token=TOKEN))
    names = {(m.lower(), r.path): r.name for r in app.routes if hasattr(r, "methods") for m in r.methods}
    schema = TestClient(app).get("/openapi.json").json()
    vague = []
    for path, methods in schema["paths"].items():
        for method, op in methods.items():
            name = names[(method, path)].replace("_", " ").lower()
            summary, description = op.get("summary", "").strip(), (op.get("description") or "").strip()
            if not summary or summary.lower() == name or not description or description.lower() in (summary.lower(), name):
                vague.append(f"{method.upper()} {path}: {summary!r} / {description!r}")
    assert len(schema["paths"]) >= 10 and not vague, vague
