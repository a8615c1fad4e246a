"""The live page in headless Chromium during a real run: counters advance, a failure is
listed, the rerun button delivers it."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
import uvicorn

from pipeline.api import create_app
from pipeline.cluster.driver import RunRequest, run_day
from pipeline.day.synth import SynthOptions, write_dumps
from pipeline.embedded import free_port, start_smtp_sink
from pipeline.record.records import Outcome
from pipeline.record.state import RunState
from pipeline.settings import ROOT, Settings
from tests.conftest import TRADE_DATE
from tests.helpers import client_rows, outbox_messages

TOKEN = "browser-test-token"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def serve(app, port: int) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    return server


def test_the_page_follows_a_run_and_its_rerun_button_delivers_the_failure(
        ray_session, redis_url, keys_dir, tmp_path, monkeypatch):
    from playwright.sync_api import expect, sync_playwright

    write_dumps(tmp_path / "input", SynthOptions(dt.date.fromisoformat(TRADE_DATE), 70, seed=31))
    clients = client_rows(tmp_path / "input")
    traded = sorted({line.split(",")[4] for line in (tmp_path / "input" / "trades.csv").read_text().splitlines()[1:]})
    victim = traded[len(traded) // 2]
    faults = tmp_path / "faults.json"
    faults.write_text('{"delay_ms": 200}')
    smtp = start_smtp_sink(tmp_path / "outbox", tmp_path / "smtp.log", ["--faults", str(faults)])
    good = Settings(store_url=str(tmp_path / "store"), redis_url=redis_url, smtp_url=smtp.url, shard_size=4,
                    window=3, signers=1, mailers=1, smtp_connections=2, signer_key=str(keys_dir / "signer.key.pem"),
                    signer_cert=str(keys_dir / "signer.cert.pem"), signer_chain=str(keys_dir / "root.cert.pem"),
                    owner_password="browser-owner-secret", api_token=TOKEN)
    broken = Settings(**{**good.__dict__, "owner_password": clients[victim]["pan"]})  # the victim's note fails to sign
    env = {"REDIS_URL": redis_url, "CN_STORE": good.store_url, "SMTP_URL": smtp.url, "CN_SIGNER_KEY": good.signer_key,
           "CN_SIGNER_CERT": good.signer_cert, "CN_SIGNER_CHAIN": good.signer_chain, "CN_SHARD_SIZE": "4",
           "CN_OWNER_PASSWORD": good.owner_password, "RAY_ADDRESS": ray_session.address_info["address"],
           "PYTHONPATH": ROOT, "CN_RERUN_LOG": str(tmp_path / "rerun.log")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    port = free_port()
    server = serve(create_app(good), port)
    run_id = f"browser-{uuid.uuid4().hex[:6]}"
    run = threading.Thread(target=run_day, args=(broken, RunRequest(TRADE_DATE, str(tmp_path / "input"), run_id)))
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page()
            run.start()
            page.goto(f"http://127.0.0.1:{port}/?run={run_id}")
            seen = set()
            deadline = time.monotonic() + 120
            while run.is_alive() and time.monotonic() < deadline:
                seen.add(int(page.locator("#delivered-count").inner_text() or 0))
                time.sleep(0.3)
            run.join(timeout=120)
            assert len([n for n in seen if 0 < n < len(traded)]) >= 2, f"counters did not advance: {sorted(seen)}"
            failures = page.locator("#failures tbody tr")
            expect(failures).to_have_count(1, timeout=10_000)
            expect(failures.first).to_contain_text(victim)
            expect(failures.first).to_contain_text("owner password")
            expect(page.locator("#delivered-count")).to_have_text(str(len(traded) - 1))

            page.fill("#token", TOKEN)
            page.click("#rerun-button")
            expect(page.locator("#rerun-status")).to_have_text("rerun started", timeout=10_000)
            # 240 s: on a slow hour the rerun's signer and mailer took 70 s to start in the session's Ray (272f1fb's
            # suite), and the sink was stopped under its one mail at 120 s
            expect(page.locator("#delivered-count")).to_have_text(str(len(traded)), timeout=240_000)
            expect(failures).to_have_count(0, timeout=10_000)
            page.screenshot(path=str(tmp_path / "status.png"), full_page=True)

            # the same run once its Redis is gone, on a read-only service: the report's own counts, no write
            # controls; then the service failing: said on the page (before: zeros and dashes, no error, and
            # the token box and rerun button on a service that refuses them)
            gone = Settings(**{**good.__dict__, "redis_url": f"redis://127.0.0.1:{free_port()}/0"})
            stored_port = free_port()
            stored = serve(create_app(gone, read_only=True), stored_port)
            page.goto(f"http://127.0.0.1:{stored_port}/?run={run_id}")
            expect(page.locator("#source")).to_contain_text("From the run's report in storage", timeout=10_000)
            expect(page.locator("#delivered-count")).to_have_text(str(len(traded)))
            expect(page.locator("#rendered-count")).not_to_have_text("0")
            kept = json.loads((Path(good.store_url) / f"reports/{run_id}.json").read_text())["notes_per_s"]
            assert kept > 0
            expect(page.locator("#rate")).to_have_text(f"{kept:.2f}")  # the report's (the last rerun's), not 0
            expect(page.locator("#relays tbody tr")).to_have_count(1)
            assert page.locator("#token").count() == 0 and page.locator("#rerun-button").count() == 0
            shutil.rmtree(good.store_url)  # storage goes too: every request now fails
            expect(page.locator("#error")).to_contain_text("did not answer", timeout=10_000)
            expect(page.locator("#delivered-count")).to_have_text(str(len(traded)))  # the last figures, said as such
            stored.should_exit = True
            docs = page.goto(f"http://127.0.0.1:{port}/docs")
            assert docs.ok and "/runs/{run_id}/rerun" in page.content()
            assert "<script" not in page.content() and "https://" not in page.content(), "nothing fetched from elsewhere"
            browser.close()
    finally:
        server.should_exit = True
        smtp.stop()
    mailed = [m for m in outbox_messages(tmp_path / "outbox") if victim in m["Subject"]]
    assert len(mailed) == 1


def test_script_like_text_in_every_field_the_page_shows_runs_nothing_and_the_token_stays_in_the_tab(
        redis_url, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    from pipeline.record.records import Outcome
    from pipeline.record.state import RunState

    evil = '<img src=x onerror="window.__pwned=1">'
    run_id = f"xss-{uuid.uuid4().hex[:6]}"
    state = RunState(redis_url, run_id)
    state.start({"date": "<script>window.__pwned=2</script>", "input": evil, "config": "{}", "finished": ""})
    state.update_meta(accounts=2)
    state.record([Outcome("<svg onload=window.__pwned=3>", "delivered", "failed", reason=evil),
                  Outcome("C1", "delivered", "failed", reason="<script>window.__pwned=4</script>")])
    settings = Settings(store_url=str(tmp_path / "store"), redis_url=redis_url, api_token=TOKEN)
    port = free_port()
    server = serve(create_app(settings), port)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page()
            response = page.goto(f"http://127.0.0.1:{port}/?run={run_id}")
            csp = response.headers["content-security-policy"]
            assert "script-src 'sha256-" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
            failures = page.locator("#failures tbody tr")
            expect(failures).to_have_count(2, timeout=10_000)  # the page's own script runs under the policy
            expect(page.locator("#failures")).to_contain_text(evil)  # shown as text, whole
            expect(page.locator("#failures")).to_contain_text("<svg onload=window.__pwned=3>")
            expect(page.locator("#date")).to_have_text("<script>window.__pwned=2</script>")
            page.fill("#token", TOKEN)
            page.locator("#token").dispatch_event("change")
            assert page.evaluate("window.__pwned") is None
            assert page.evaluate("JSON.stringify(localStorage)") == "{}"
            assert page.evaluate("sessionStorage.getItem('cn-token')") == TOKEN
            browser.close()
    finally:
        server.should_exit = True


def test_the_link_in_a_received_email_downloads_the_clients_own_note_in_chromium(
        ray_session, settings, day, smtp_sink, tmp_path):
    import dataclasses
    import re

    import httpx
    from playwright.sync_api import expect, sync_playwright

    from pipeline.mail import link
    from pipeline.record import delivery_log
    from pipeline.record.storage import open_store
    from tests.helpers import assert_signed_and_encrypted

    port = free_port()
    settings = dataclasses.replace(settings, link_base=f"http://127.0.0.1:{port}", api_token=TOKEN)
    summary = run_day(settings, RunRequest(TRADE_DATE, str(day)))
    ucc = "C0000003"
    [msg] = [m for m in outbox_messages(smtp_sink.outbox) if ucc in m["Subject"]]
    url = re.search(r"http://127\.0\.0\.1:\d+/notes/\S+", msg.get_body(("plain",)).get_content()).group(0)
    server = serve(create_app(settings), port)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page(accept_downloads=True)
            with page.expect_download() as download:  # the client clicks the link in their mail
                page.set_content(f'<a id="mine" href="{url}">your contract note</a>')
                page.click("#mine")
            download.value.save_as(tmp_path / "mine.pdf")
            page.goto(f"http://127.0.0.1:{port}/?run={summary['run_id']}")  # the operator's page: the window
            expect(page.locator("#window")).to_contain_text("open until", timeout=10_000)
            assert page.locator("#paper-link").get_attribute("href") == f"/runs/{summary['run_id']}/paper.csv"
            browser.close()
        pan = client_rows(day)[ucc]["pan"]
        assert_signed_and_encrypted(tmp_path / "mine.pdf", pan)  # qpdf --requires-password, pdfsig -upw PAN
        store = open_store(settings.store_url)
        fetched = [e for e in delivery_log.entries(store, summary["run_id"]) if e["status"] == "fetched"]
        assert [e["ucc"] for e in fetched] == [ucc], "the fetch is in the delivery log: it proves receipt"

        token = url.rsplit("/", 1)[1]
        key = settings.hmac_key()
        wrong = {
            "tampered": token[:-2] + ("AA" if token[-2:] != "AA" else "BB"),
            "expired": link.make(key, summary["run_id"], ucc, TRADE_DATE, 60, now=0),
            "no such note": link.make(key, summary["run_id"], "C9999999", TRADE_DATE, 600),
            "another key": link.make(b"not-the-key", summary["run_id"], ucc, TRADE_DATE, 600),
        }
        answers = {why: httpx.get(f"http://127.0.0.1:{port}/notes/{t}") for why, t in wrong.items()}
        assert {why: (r.status_code, r.text) for why, r in answers.items()} == \
            {why: (404, '{"detail":"no such note"}') for why in wrong}, "every wrong link looks the same"
        codes = [httpx.get(f"http://127.0.0.1:{port}/notes/{wrong['tampered']}").status_code for _ in range(25)]
        assert 429 in codes, "a guesser is slowed down"
    finally:
        server.should_exit = True


def _day_in_redis(redis_url: str, run_id: str, started: float, delivered: int, failed: int = 0,
                  rejected: int = 0, **meta) -> RunState:
    """A run as the driver leaves it in Redis (meta, counts), without Ray: the page's views of
    many runs at once are about their shapes, not about making notes."""
    state = RunState(redis_url, run_id)
    state.start({"date": TRADE_DATE, "input": "grid", "config": "{}", "finished": ""})
    state.update_meta(**{"accounts": delivered + failed + rejected, "started": started, "last_started": started, **meta})
    state.record([Outcome(f"D{i:07d}", "delivered") for i in range(delivered)]
                 + [Outcome(f"F{i:07d}", "signed", "failed", reason="owner password") for i in range(failed)]
                 + [Outcome(f"R{i:07d}", "validated", "rejected", reason="no PAN") for i in range(rejected)])
    return state


def _timeline(state, points: list[tuple[float, int]]) -> None:
    """Snapshots as the driver takes them (about one a second), at the times given."""
    from pipeline.record import keys

    state.r.rpush(keys.run_timeline(state.run_id), *[json.dumps({"at": at, "delivered": n}) for at, n in points])


@pytest.fixture
def three_runs(redis_url):
    """A run still running, one closing (its close began), and one finished whose failed accounts
    were rerun after a 100 s pause: the timeline the issue saw, with a gap in it."""
    tag, now = uuid.uuid4().hex[:6], time.time()
    t0 = now - 400
    rerun = _day_in_redis(redis_url, f"grid-rerun-{tag}", t0, 120, failed=1, rejected=2, last_started=t0 + 120,
                          finished=t0 + 130, notes_per_s=3.64)  # the rerun's own figure, as its report has it
    _timeline(rerun, [(t0 + s, 5 * s) for s in range(21)] + [(t0 + 120 + s, 100 + 2 * s) for s in range(11)])
    _day_in_redis(redis_url, f"grid-closing-{tag}", t0 - 86_400, 40, finished=t0 - 86_000, notes_per_s=0.1,
                  closed_at=t0 - 3600)
    _day_in_redis(redis_url, f"grid-running-{tag}", now - 20, 30)
    return {"rerun": rerun.run_id, "closing": f"grid-closing-{tag}", "running": f"grid-running-{tag}"}


def _page(settings: Settings, url_path: str, test):
    from playwright.sync_api import sync_playwright

    port = free_port()
    server = serve(create_app(settings), port)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.goto(f"http://127.0.0.1:{port}{url_path}")
            test(page)
            browser.close()
    finally:
        server.should_exit = True


def test_the_page_lists_recent_runs_as_a_grid_with_their_states_and_a_click_selects_one(
        three_runs, redis_url, tmp_path):
    from playwright.sync_api import expect

    def check(page):
        grid = page.locator("#run-grid tbody tr")
        expect(grid.first).to_be_visible(timeout=10_000)
        for which, state in (("running", "running"), ("closing", "closing"), ("rerun", "finished")):
            row = page.locator(f'#run-grid tbody tr[data-run="{three_runs[which]}"]')
            expect(row).to_contain_text(state)
            expect(row).to_contain_text(TRADE_DATE)
        expect(page.locator("#rate-of")).to_be_hidden()  # a run never rerun: its rate is its own
        rerun = page.locator(f'#run-grid tbody tr[data-run="{three_runs["rerun"]}"]')
        expect(rerun.locator("td.delivered")).to_have_text("120")
        expect(rerun.locator("td.failed")).to_have_text("1")
        expect(rerun.locator("td.rejected")).to_have_text("2")
        expect(rerun.locator("td.duration")).to_have_text("2m10s")  # first start to last end, as `runs` says
        rerun.click()
        expect(page.locator("#run-id")).to_have_text(three_runs["rerun"])
        expect(rerun).to_have_attribute("aria-selected", "true")
        assert f"run={three_runs['rerun']}" in page.url, "a reload shows the run chosen"
        page.screenshot(path=str(tmp_path / "grid.png"), full_page=True)
        shutil.copy(tmp_path / "grid.png", Path("/tmp/cn-page-grid.png"))

    _page(Settings(store_url=str(tmp_path / "store"), redis_url=redis_url, api_token=TOKEN),
          f"/?run={three_runs['running']}", check)


def test_a_pause_before_a_rerun_is_a_gap_in_the_chart_and_the_header_shows_the_runs_own_rate(
        three_runs, redis_url, tmp_path):
    from playwright.sync_api import expect

    def check(page):
        expect(page.locator("#run-id")).to_have_text(three_runs["rerun"], timeout=10_000)
        lines = page.locator("#chart polyline")
        expect(lines).to_have_count(2)  # before: one line, drawn diagonally across the 100 s pause
        first, second = (lines.nth(i).get_attribute("points").split() for i in (0, 1))
        assert len(first) == 20 and len(second) == 10
        assert float(first[-1].split(",")[0]) < float(second[0].split(",")[0])
        expect(page.locator("#rate")).to_have_text("3.64")  # before: 1.0, 121 notes over 130 s pause and all
        expect(page.locator("#rate-of")).to_have_text("(its last rerun's)")
        shown = page.evaluate("fetch('/runs').then(r => r.json())")["runs"]
        assert [r["notes_per_s"] for r in shown if r["run_id"] == three_runs["rerun"]] == [3.64]
        page.screenshot(path=str(tmp_path / "gap.png"), full_page=True)
        shutil.copy(tmp_path / "gap.png", Path("/tmp/cn-page-gap.png"))

    _page(Settings(store_url=str(tmp_path / "store"), redis_url=redis_url, api_token=TOKEN),
          f"/?run={three_runs['rerun']}", check)
