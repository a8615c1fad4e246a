"""Delivered means in the client's mailbox, provably: DSNs come back to the VERP addresses of a
real run, through a real IMAP server (Dovecot), and become bounced or deferred accounts and
paper notes; hostile ones change nothing; `close` seals the delivery log, `openssl cms`
checks the seal, and `verify` names the object an edit or a deletion touched."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import imaplib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.followup import bounces, close as proof
from pipeline.followup import verify as verifier
from pipeline.cluster.driver import RunRequest, rerun, run_day, undone
from pipeline.mail import bounce, verp
from pipeline.mail.smtp_sink import dsn
from pipeline.record import delivery_log, keys, report
from pipeline.record.keys import message_id
from pipeline.record.manifest import load_manifest
from pipeline.record.state import RunState
from pipeline.record.storage import open_store
from pipeline.settings import ROOT
from tests import servers
from tests.conftest import TRADE_DATE
from tests.helpers import client_rows

SAMPLES = Path(__file__).parent / "data" / "bounces"


def deliver(imap_url: str, messages: list[bytes]) -> None:
    """What the bounce domain's MX does: each DSN into the bounce mailbox."""
    box = imaplib.IMAP4("127.0.0.1", int(imap_url.rsplit(":", 1)[1].split("/")[0]))
    box.login(servers.DOVECOT_USER, servers.DOVECOT_PASSWORD)
    for raw in messages:
        assert box.append("INBOX", None, None, raw)[0] == "OK"
    box.logout()


def rows(settings, run_id: str, which: str = "csv") -> dict[str, dict]:
    key = keys.report_keys(run_id)[1] if which == "csv" else report.paper_key(run_id)
    return {r["ucc"]: r for r in csv.DictReader((Path(settings.store_url) / key).open())}


def test_bounces_from_imap_paper_notes_deemed_delivery_and_a_sealed_record(
        ray_session, settings, day, smtp_server, imap_box, tmp_path):
    clients = client_rows(day)
    uccs = sorted(clients)
    no_consent, malformed, rejected = uccs[0], uccs[1], uccs[2]
    text = (day / "clients.csv").read_text()
    text = text.replace(f"{clients[malformed]['email']},", "not-an-address,")
    lines = text.splitlines()
    lines = [line[:-1] + "N" if line.startswith(no_consent + ",") else line for line in lines]
    (day / "clients.csv").write_text("\n".join(lines) + "\n")
    bounce_box = tmp_path / "relay-dsns"
    relay = smtp_server(reject={clients[rejected]["email"]}, bounce_rate=0.4, bounces=str(bounce_box))
    settings = dataclasses.replace(settings, smtp_url=relay.url)

    summary = run_day(settings, RunRequest(TRADE_DATE, str(day)))
    run_id = summary["run_id"]

    # every message left with its own VERP envelope sender, and the delivery log says which
    sent = [json.loads(line) for line in bounce_box.with_suffix(".jsonl").read_text().splitlines()]
    by_email = {c["email"]: u for u, c in clients.items()}
    expected = {by_email[s["rcpt"]]: s["kind"] for s in sent}
    assert {"bounced", "deferred"} <= set(expected.values()), "the relay returned both kinds"
    v = verp.Verp(settings.bounce_local, settings.bounce_domain, settings.hmac_key())
    assert all(s["mail_from"] == v.address(run_id, by_email[s["rcpt"]]) for s in sent)
    logged = delivery_log.latest(delivery_log.entries(open_store(settings.store_url), run_id))
    assert logged[uccs[5]]["mail_from"] == v.address(run_id, uccs[5])

    # the report says the window is open, and until when
    window = json.loads((Path(settings.store_url) / keys.report_keys(run_id)[0]).read_text())["bounce_window"]
    assert window["state"] == "open" and window["closes_at"] and window["hours"] == 72

    # the DSNs come back through the bounce domain's IMAP mailbox
    deliver(imap_box.url, [p.read_bytes() for p in sorted((bounce_box / "new").iterdir())])
    first = bounces.collect(settings, run_id, [imap_box.url])
    assert first["read"] == len(sent) and first["refused"] == 0
    assert (first["bounced"], first["deferred"]) == (list(expected.values()).count("bounced"),
                                                     list(expected.values()).count("deferred"))
    assert servers.DOVECOT_PASSWORD not in json.dumps(first)
    csv_rows = rows(settings, run_id)
    assert {u: r["status"] for u, r in csv_rows.items() if r["status"] in ("bounced", "deferred")} == expected
    some = next(u for u, k in expected.items() if k == "bounced")
    assert csv_rows[some]["bounce_status"] == "5.1.1" and "User unknown" in csv_rows[some]["bounce_reason"]
    assert csv_rows[some]["bounced_at"] and csv_rows[some]["due_date"]
    paper = rows(settings, run_id, "paper")
    assert set(paper) == {no_consent, malformed, rejected} | {u for u, k in expected.items() if k == "bounced"}
    assert all(r["due_date"] for r in paper.values())
    from fastapi.testclient import TestClient

    from pipeline.api import create_app

    served = TestClient(create_app(settings, read_only=True)).get(f"/runs/{run_id}/paper.csv")
    assert served.status_code == 200 and {r["ucc"] for r in csv.DictReader(served.text.splitlines())} == set(paper)
    assert "@" not in served.text.replace("***@", ""), "addresses in a bounce's reason are masked without the token"
    page = TestClient(create_app(settings, read_only=True)).get(f"/runs/{run_id}/accounts/{some}").json()
    bounce_entry = next(e for e in delivery_log.entries(open_store(settings.store_url), run_id,
                                                          keys.shard_of(some, load_manifest(open_store(
                                                              settings.store_url), run_id).shard_count))
                        if e["ucc"] == some and e["status"] == "bounced")
    assert bounce_entry.get("token") and "bounced" in [e["status"] for e in page["delivery_log"]]
    assert bounce_entry["token"] not in json.dumps(page), "a bounce's VERP token (it proves one) needs the API token"
    assert RunState(settings.redis_url, run_id).counts()["bounced"] == list(expected.values()).count("bounced")

    # hostile DSNs, and the same ones again: nothing changes
    report_before = (Path(settings.store_url) / keys.report_keys(run_id)[1]).read_bytes()
    genuine = (bounce_box / "new").iterdir().__next__().read_bytes()
    victim = next(u for u in uccs[3:] if u not in expected)
    forged = dsn("bounced", v.address(run_id, victim)[:-len(settings.bounce_domain) - 3] + "00@" +
                 settings.bounce_domain, clients[victim]["email"], b"Subject: x\r\n\r\n")
    other_run = dsn("bounced", v.address("another-run", victim), clients[victim]["email"], b"Subject: x\r\n\r\n")
    huge = genuine + b"\r\n" + b"x" * (20 * 1024 * 1024)
    broken = (b"Delivered-To: " + v.address(run_id, victim).encode() +
              b"\r\nContent-Type: multipart/report; boundary=\"nowhere\"\r\n\r\n\xff\xfe--nowhere\r\nContent-Type: "
              b"message/delivery-status\r\n\r\nAction: \x00\r\n")
    deliver(imap_box.url, [forged, other_run, huge, broken] + [p.read_bytes() for p in (bounce_box / "new").iterdir()])
    again = bounces.collect(settings, run_id, [imap_box.url])
    assert (again["bounced"], again["deferred"], again["unchanged"], again["refused"]) == (0, 0, len(sent), 3), again
    assert again["left_for_other_runs"] == 1, "another run's bounce is left unseen for it"
    why = " | ".join(r["why"] for r in again["refused_first"])
    for cause in ("forged", "over CN_BOUNCE_MAX_BYTES", "not a readable message"):
        assert cause in why, why
    assert (Path(settings.store_url) / keys.report_keys(run_id)[1]).read_bytes() == report_before
    assert rows(settings, run_id)[victim]["status"] == "delivered"

    # a bounced and a deferred client mailed again, each new mail accepted: the rerun did what it could (its
    # exit 0), and each stays as its bounce says (paper owed; the recipient's server retrying). Before, exit 1.
    deferred_one = next(u for u, k in expected.items() if k == "deferred")
    again_mailed = rerun(settings, run_id, accounts=[some, deferred_one], force=True)
    assert again_mailed["rerun_outcomes"] == {"bounced": 1, "deferred": 1} and undone(again_mailed) == {}, again_mailed
    assert {u: r["status"] for u, r in rows(settings, run_id).items() if u in (some, deferred_one)} == \
        {some: "bounced", deferred_one: "deferred"}

    # verify before the seal: every chain whole
    store = open_store(settings.store_url)
    checked = verifier.verify(store, run_id)
    assert checked["ok"] and not checked["sealed"] and checked["log_objects"] > 0, checked

    # close: refused while the window is open, then deemed delivery and a signed proof
    finished = float(RunState(settings.redis_url, run_id).meta()["finished"])
    with pytest.raises(proof.WindowOpen, match="open until"):
        proof.close(settings, run_id, now=finished + 3600)
    closed = proof.close(settings, run_id, now=finished + 72 * 3600 + 1)
    after = rows(settings, run_id)
    assert closed["bounced"] == list(expected.values()).count("bounced")
    assert {u for u, r in after.items() if r["status"] == "delivered"} == \
        {u for u, r in csv_rows.items() if r["status"] in ("delivered", "deferred")}
    assert after[victim]["reason"] == "delivered, no bounce within 72 h"
    proof_key, sig_key = proof.proof_keys(run_id)
    root = Path(settings.store_url)
    openssl = subprocess.run(["openssl", "cms", "-verify", "-binary", "-inform", "DER", "-in", str(root / sig_key),
                              "-content", str(root / proof_key), "-CAfile", settings.signer_chain, "-purpose", "any",
                              "-out", "/dev/null"], capture_output=True, text=True)
    assert openssl.returncode == 0, openssl.stderr
    sealed = verifier.verify(store, run_id, Path(settings.signer_cert).read_bytes())
    assert sealed["ok"] and sealed["sealed"] and "Signatory" in sealed["signed_by"], sealed
    assert "not by the certificate given" in verifier.verify(store, run_id, Path(settings.signer_chain).read_bytes())[
        "first_problem"], "a proof signed again with another key is caught when the broker's certificate is given"

    # one byte of one delivery-log object changed: verify names it; so does a deletion
    shard = keys.shard_of(some, load_manifest(store, run_id).shard_count)
    objects = sorted(store.keys(keys.delivery_log_prefix(run_id, shard)))
    assert len(objects) >= 3, objects  # intent, outcomes, the bounce
    middle = root / objects[1]
    original = middle.read_bytes()
    at = original.index(b'"status":"delivered"') + 11
    middle.write_bytes(original[:at] + b"D" + original[at + 1:])
    edited = verifier.verify(store, run_id)
    assert not edited["ok"] and edited["first_problem"].startswith(f"{objects[1]}: changed"), edited
    cli = subprocess.run([sys.executable, "-m", "pipeline", "verify", run_id], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "CN_STORE": settings.store_url})
    assert cli.returncode == 1 and json.loads(cli.stdout)["first_problem"] == edited["first_problem"]
    middle.write_bytes(original)
    last = root / objects[-1]
    kept = last.read_bytes()
    last.unlink()
    removed = verifier.verify(store, run_id)
    assert not removed["ok"] and removed["first_problem"].startswith(f"{objects[-1]}: removed"), removed
    last.write_bytes(kept)
    assert verifier.verify(store, run_id)["ok"]
    data = (root / proof_key).read_bytes()
    at = data.index(b'"sha256": "') + 11
    (root / proof_key).write_bytes(data[:at] + (b"1" if data[at:at + 1] == b"0" else b"0") + data[at + 1:])
    assert not verifier.verify(store, run_id)["ok"], "a proof edited after signing"


@pytest.mark.parametrize("shape", sorted(p.name for p in SAMPLES.glob("*.eml")))
def test_the_shapes_providers_send_are_read_as_permanent_failures_of_the_right_account(shape):
    v = verp.Verp("bounces", "bounces.broker.example.com", b"test-key")
    raw = (SAMPLES / shape).read_text().format(verp=v.address("run-1", "C0000042"), rcpt="c42@client.example",
                                               message_id=message_id("run-1", "C0000042"))
    b = bounce.read(raw.replace("\n", "\r\n").encode(), v.pattern(), 10**7)
    assert b.kind == "bounced" and b.reason
    t = verp.parse(b.token)
    assert t is not None and t.ucc == "C0000042" and verp.genuine(b"test-key", "run-1", t)
    assert not verp.genuine(b"other-key", "run-1", t) and not verp.genuine(b"test-key", "run-2", t)


def test_a_vERP_token_survives_case_folding_and_a_mangled_one_names_no_account():
    v = verp.Verp("bounces", "b.example", b"k")
    address = v.address("2026-11-20-abc", "C0000007")
    assert len(address.split("@")[0]) <= 64
    token = v.pattern().search(address.upper()).group(1)
    assert verp.genuine(b"k", "2026-11-20-abc", verp.parse(token))
    assert verp.parse(token.replace("-", "")) is None
    assert not verp.genuine(b"k", "2026-11-20-abc", verp.parse(token[:-1] + ("0" if token[-1] != "0" else "1")))


def test_a_real_mta_bounces_unknown_users_to_the_verp_addresses_read_over_imap_into_paper_notes(
        ray_session, settings, day, tmp_path):
    """Postfix takes every message with a 250, then bounces those for unknown users back to
    each message's VERP envelope sender: the DSNs are Postfix's own, delivered into the bounce
    mailbox's maildir and read through Dovecot's IMAP, as the bounce domain's MX would have it."""
    import time

    clients = client_rows(day)
    uccs = sorted(clients)
    known = {clients[u]["email"]: "clients" for u in uccs[::2]}
    mta = servers.start_postfix(known, {c["email"].split("@")[1] for c in clients.values()}, settings.bounce_domain)
    try:
        imap = servers.start_dovecot(mta.root / "vmail")
    except BaseException:
        mta.stop()
        raise
    try:
        settings = dataclasses.replace(settings, smtp_url=mta.url)
        summary = run_day(settings, RunRequest(TRADE_DATE, str(day)))
        assert summary["delivered"] == len(uccs), "the MTA accepted every message"
        unknown = {u for u in uccs if clients[u]["email"] not in known}
        box = mta.root / "vmail" / "bounces"
        deadline = time.monotonic() + 60
        while len(list((box / "new").glob("*")) if (box / "new").exists() else []) < len(unknown):
            assert time.monotonic() < deadline, (mta.root / "maillog").read_text()[-3000:]
            time.sleep(0.2)
        result = bounces.collect(settings, summary["run_id"], [imap.url])
    finally:
        imap.stop()
        mta.stop()
    assert (result["bounced"], result["deferred"], result["refused"]) == (len(unknown), 0, 0), result
    csv_rows = rows(settings, summary["run_id"])
    assert {u for u, r in csv_rows.items() if r["status"] == "bounced"} == unknown
    for u in unknown:
        assert csv_rows[u]["bounce_status"] == "5.1.1" and "unknown user" in csv_rows[u]["bounce_reason"], csv_rows[u]
    assert set(rows(settings, summary["run_id"], "paper")) == unknown


def test_a_bounce_without_a_token_is_matched_by_the_message_id_it_returns_read_from_an_mbox(
        redis_url, keys_dir, tmp_path):
    """A relay that rewrote the envelope sender (no VERP token in the DSN) still returns the
    original's headers: the run's own Message-ID names the account; another run's names none."""
    import mailbox
    import uuid

    from pipeline.record.manifest import SplitResult, save_manifest
    from pipeline.record.records import Outcome
    from pipeline.settings import Settings

    run_id = f"mbox-{uuid.uuid4().hex[:6]}"
    settings = Settings(store_url=str(tmp_path / "store"), redis_url=redis_url,
                        token_key_file=str(keys_dir / "token.key"))
    state, store = RunState(redis_url, run_id), open_store(settings.store_url)
    state.start({"date": TRADE_DATE, "finished": 1.0, "bounce_window_h": 72})
    state.record([Outcome(u, "delivered", message_id=message_id(run_id, u), reply="250 ok") for u in ("C1", "C2")])
    save_manifest(store, run_id, SplitResult([0], 10, 2))
    box = mailbox.mbox(tmp_path / "bounces.mbox")
    for ucc, run in (("C1", run_id), ("C2", "some-other-run")):
        original = f"From: notes@broker.example.com\r\nMessage-ID: {message_id(run, ucc)}\r\n\r\n".encode()
        box.add(dsn("bounced", "rewritten@relay.example", f"{ucc.lower()}@clients.test", original))
    box.flush()

    result = bounces.collect(settings, run_id, [str(tmp_path / "bounces.mbox")])

    assert (result["bounced"], result["refused"], result["left_for_other_runs"]) == (1, 0, 1), result
    records = state.accounts(["C1", "C2"])
    assert records["C1"]["bounce"]["kind"] == "bounced" and "bounce" not in records["C2"]
    logged = [e for e in delivery_log.entries(store, run_id) if e["status"] == "bounced"]
    assert [(e["ucc"], e["token"], e["message_id"]) for e in logged] == [("C1", "", message_id(run_id, "C1"))]


@contextlib.contextmanager
def _watching(redis_url: str, keys_dir: Path, tmp_path: Path):
    """A mailed run of two accounts (C1, C2) on `redis_url`, and `bounces --watch` on an empty
    maildir polling every 0.2 s: (run_id, settings, state, box, watcher, the DSN for an account).
    The watch is killed on the way out if it is still running, whatever failed."""
    import time
    import uuid

    from pipeline.record.manifest import SplitResult, save_manifest
    from pipeline.record.records import Outcome
    from pipeline.settings import Settings

    run_id = f"watch-{uuid.uuid4().hex[:6]}"
    settings = Settings(store_url=str(tmp_path / "store"), redis_url=redis_url,
                        token_key_file=str(keys_dir / "token.key"))
    state, store = RunState(redis_url, run_id), open_store(settings.store_url)
    state.start({"date": TRADE_DATE, "finished": time.time(), "bounce_window_h": 72})
    state.record([Outcome(u, "delivered", message_id=message_id(run_id, u), reply="250 ok") for u in ("C1", "C2")])
    save_manifest(store, run_id, SplitResult(sorted({keys.shard_of(u, 10) for u in ("C1", "C2")}), 10, 2))
    for u in ("C1", "C2"):  # its shards' files (what a restore reads the accounts from) and the mail its log says left
        store.put(keys.shard_key(run_id, keys.shard_of(u, 10)), json.dumps({"ucc": u}).encode() + b"\n")
        delivery_log.append(store, run_id, keys.shard_of(u, 10), [
            {"ucc": u, "status": "delivered", "message_id": message_id(run_id, u), "reply": "250 ok", "at": time.time()}])
    report.write(store, state, run_id, {"run_id": run_id, "trade_date": TRADE_DATE}, [])
    box = tmp_path / "box"
    for sub in ("new", "cur", "tmp"):
        (box / sub).mkdir(parents=True)
    env = {**os.environ, "REDIS_URL": redis_url, "CN_STORE": settings.store_url,
           "CN_TOKEN_KEY_FILE": settings.token_key_file, "PYTHONPATH": ROOT}
    v = verp.Verp(settings.bounce_local, settings.bounce_domain, settings.hmac_key())
    watcher = subprocess.Popen([sys.executable, "-m", "pipeline", "bounces", run_id, "--maildir", str(box), "--watch",
                                "--every", "0.2"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        yield run_id, settings, state, box, watcher, lambda ucc: dsn("bounced", v.address(run_id, ucc),
                                                                     f"{ucc.lower()}@clients.test", b"\r\n")
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.communicate()


def _deliver(box: Path, name: str, message: bytes) -> None:
    """As an MTA delivers to a maildir: written in tmp/, then renamed into new/ whole (written in
    new/ itself, a poll could read the file empty and refuse it, as it should, on a busy machine)."""
    (box / "tmp" / name).write_bytes(message)
    (box / "tmp" / name).rename(box / "new" / name)


def _polling(state: RunState, run_id: str, watcher: subprocess.Popen) -> None:
    import time

    deadline = time.monotonic() + 60
    while not state.r.exists(keys.run_bounce_reader(run_id)):  # the watch polling, its handlers set
        if watcher.poll() is not None or time.monotonic() > deadline:
            watcher.kill()
            pytest.fail(f"the watch is not polling: {watcher.communicate()[1][-2000:]}")
        time.sleep(0.1)


def test_bounces_watch_records_what_arrives_and_a_sigterm_ends_it_with_the_report_written(
        redis_url, keys_dir, tmp_path):
    import signal
    import time

    with _watching(redis_url, keys_dir, tmp_path) as (run_id, settings, state, box, watcher, returned):
        time.sleep(1)
        _deliver(box, "1.dsn", returned("C2"))
        _recorded(state, "C2", watcher, box)
        watcher.send_signal(signal.SIGTERM)
        out, err = watcher.communicate(timeout=30)
    assert watcher.returncode == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1])["bounced"] == 1
    assert rows(settings, run_id)["C2"]["status"] == "bounced", "the report got what the watch recorded"
    assert list((box / "cur").iterdir())[0].name.endswith(":2,S"), "the maildir message is marked seen"


def _recorded(state: RunState, ucc: str, watcher: subprocess.Popen, box: Path) -> None:
    import time

    deadline = time.monotonic() + 60
    while "bounce" not in state.accounts([ucc]).get(ucc, {}):
        if watcher.poll() is not None or time.monotonic() > deadline:
            watcher.kill()
            out, err = watcher.communicate()
            pytest.fail(f"the watch did not record the bounce: exit {watcher.returncode}, {out[-1000:]}"
                        f"{err[-2000:]}, the maildir {sorted(p.name for p in box.rglob('*'))}")
        time.sleep(0.1)


def _sigterm_while_redis_waits(redis, state: RunState, run_id: str, watcher: subprocess.Popen,
                               arrive) -> tuple[str, str]:
    """Redis paused (SIGSTOP), then `arrive()` delivers DSNs, so the poll that reads them waits on
    Redis when the SIGTERM comes; Redis resumed after it. The watch's (stdout, stderr). The polls
    are first held at their start, before they read the mailbox (a close waiting, for 3 s by the
    clock): the one Redis pauses has read nothing yet. Paused once it had read an empty mailbox,
    it would end leaving the arrivals unseen for the next reader, as it should."""
    import signal
    import time

    state.r.set(keys.run_close_waiting(run_id), "close", px=3000)
    try:
        time.sleep(1)  # no poll under way: each gives way at its start
        redis.process.send_signal(signal.SIGSTOP)
        arrive()
        time.sleep(2.5)  # the wait has expired when Redis resumes; the watch waits on Redis at its poll's start
        watcher.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        redis.process.send_signal(signal.SIGCONT)
        return watcher.communicate(timeout=60)
    finally:
        redis.process.send_signal(signal.SIGCONT)
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()


def test_a_sigterm_while_the_watch_waits_on_redis_ends_it_after_that_poll_its_bounce_counted(keys_dir, tmp_path):
    """CI's watch test once saw the bounce in Redis and a summary of 0 bounced: the SIGTERM was
    raised inside the poll, between Redis and the count. Here, once the watch has recorded a
    first bounce, Redis is paused (SIGSTOP) before a second arrives, so the poll that reads it
    waits on Redis when the SIGTERM comes; Redis then resumes. The watch ends after that poll,
    both bounces recorded, counted and marked seen. Before, the poll was cut where it stood."""
    from pipeline.embedded import start_redis

    redis = start_redis(tmp_path / "redis", aof=False)
    try:
        with _watching(redis.url, keys_dir, tmp_path) as (run_id, settings, state, box, watcher, returned):
            _deliver(box, "1.dsn", returned("C1"))
            _recorded(state, "C1", watcher, box)  # the watch polling
            out, err = _sigterm_while_redis_waits(redis, state, run_id, watcher,
                                                  lambda: _deliver(box, "2.dsn", returned("C2")))
        assert watcher.returncode == 0, err[-2000:]
        said = json.loads(out.strip().splitlines()[-1])
        assert said["bounced"] == 2 and "bounce" in state.accounts(["C2"])["C2"], (said["bounced"], err[-2000:])
        assert {r["status"] for r in rows(settings, run_id).values()} == {"bounced"}, "the report as recorded"
        assert sorted(p.name[-4:] for p in (box / "cur").iterdir()) == [":2,S", ":2,S"], "both marked seen"
    finally:
        redis.stop()


def test_a_sigterm_during_a_backlog_ends_the_watch_at_the_message_being_read_the_rest_left_unseen(
        keys_dir, tmp_path):
    """A watch meeting a backlog read it to its end before a SIGTERM was heeded: a large one at
    ~2,000 DSNs a second, or an IMAP server's one round trip a message, outlasts a service
    manager's patience. Here two arrive while Redis is paused (SIGSTOP), so the poll that reads
    them waits on Redis when the SIGTERM comes. The watch ends after the first: its bounce
    recorded, counted and marked seen, the other left unseen, and a later `bounces` records it.
    Before, both."""

    from pipeline.embedded import start_redis

    redis = start_redis(tmp_path / "redis", aof=False)
    try:
        with _watching(redis.url, keys_dir, tmp_path) as (run_id, settings, state, box, watcher, returned):
            _polling(state, run_id, watcher)
            out, err = _sigterm_while_redis_waits(redis, state, run_id, watcher, lambda: [
                _deliver(box, f"{n}.dsn", returned(f"C{n}")) for n in (1, 2)])
        assert watcher.returncode == 0, err[-2000:]
        said = json.loads(out.strip().splitlines()[-1])
        recorded = [u for u, a in state.accounts(["C1", "C2"]).items() if "bounce" in a]
        assert said["bounced"] == 1 and len(recorded) == 1, (said, recorded, err[-2000:])
        assert [p.name[-4:] for p in (box / "cur").iterdir()] == [":2,S"] and len(list((box / "new").iterdir())) == 1
        assert bounces.collect(settings, run_id, [str(box)])["bounced"] == 1, "a later reader records the other"
        assert {r["status"] for r in rows(settings, run_id).values()} == {"bounced"}
    finally:
        redis.stop()


def _hold(state: RunState, key: str, host: str) -> None:
    """The run's record held as another host's close or poll holds it, once the watch's poll under
    way lets it go (each poll holds it while it reads and records)."""
    import time

    deadline = time.monotonic() + 30
    while not state.r.set(key, json.dumps({"host": host, "pid": 1, "since": time.time()}), nx=True, px=30_000):
        assert time.monotonic() < deadline, "the watch's poll kept the run's record"
        time.sleep(0.01)


def test_a_watch_records_nothing_while_close_seals_and_close_waits_for_a_poll_being_recorded(
        redis_url, keys_dir, tmp_path):
    """A watch read the run's state once a poll, then logged its bounces: one that read it just
    before a close began logged a bounce after the seal's heads (verify: a 'bounced' entry after
    the seal, and no close could ever seal again), or one the sealed report did not have. Now the
    run's record is held by close from its first read to its seal, and by a watch's poll while it
    records: a bounce arriving during a close waits, unseen; a close waits for a poll being
    recorded, saying so; and a watch polling beside a real close logs a bounce after the seal as
    refused after close, the seal whole."""
    import signal
    import threading
    import time

    with _watching(redis_url, keys_dir, tmp_path) as (run_id, settings, state, box, watcher, returned):
        _polling(state, run_id, watcher)
        fence = keys.run_recording(run_id)
        _hold(state, fence, "head")
        _deliver(box, "1.dsn", returned("C2"))  # while a close seals (its hold, as close takes it)
        time.sleep(2)  # ten polls
        assert "bounce" not in state.accounts(["C2"])["C2"] and len(list((box / "new").iterdir())) == 1
        assert not [e for e in delivery_log.entries(open_store(settings.store_url), run_id) if e["status"] == "bounced"]
        state.r.delete(fence)  # the close ended without closing (its window open): the bounce is a bounce
        _recorded(state, "C2", watcher, box)

        window_over = time.time() + 73 * 3600
        _hold(state, fence, "here")
        signing = dataclasses.replace(settings, signer_key=str(keys_dir / "signer.key.pem"),
                                      signer_cert=str(keys_dir / "signer.cert.pem"),
                                      signer_chain=str(keys_dir / "root.cert.pem"))
        closing = threading.Thread(target=proof.close, args=(signing, run_id, window_over))
        closing.start()  # a poll is being recorded (its hold, as a poll takes it): close waits for it
        time.sleep(1.5)
        assert not (Path(settings.store_url) / keys.closing_keys(run_id)[0]).exists(), "close began beside the poll"
        assert state.r.exists(keys.run_close_waiting(run_id)), "it says it waits: the watch's next poll lets it in"
        state.r.delete(fence)
        closing.join(timeout=60)
        assert not closing.is_alive()
        _deliver(box, "2.dsn", returned("C1"))  # the watch polled beside the close; after the seal, refused
        deadline = time.monotonic() + 60
        while not any(e["status"] == "refused_after_close" and e["ucc"] == "C1"
                      for e in delivery_log.entries(open_store(settings.store_url), run_id)):
            assert watcher.poll() is None and time.monotonic() < deadline, watcher.communicate()[1][-2000:]
            time.sleep(0.1)
        watcher.send_signal(signal.SIGTERM)
        out, err = watcher.communicate(timeout=30)
    assert watcher.returncode == 0, err[-2000:]
    said = json.loads(out.strip().splitlines()[-1])
    assert (said["bounced"], said["refused_after_close"]) == (1, 1), said
    sealed = verifier.verify(open_store(settings.store_url), run_id, (keys_dir / "signer.cert.pem").read_bytes())
    assert sealed["ok"] and sealed["sealed"], sealed["first_problem"]  # (this made-up run recorded no certificate)


def test_a_watch_whose_redis_lost_the_run_brings_it_back_and_records_the_bounce_not_refuses_it(
        keys_dir, tmp_path):
    """Redis restarted without its data while a watch polled: each bounce then named "no such
    account in the run" and was marked seen, lost from the mailbox and never logged. Now the
    poll brings the run back from storage, as any follow-up does, and records it."""
    from pipeline.embedded import start_redis

    redis = start_redis(tmp_path / "redis", aof=False)
    try:
        with _watching(redis.url, keys_dir, tmp_path) as (run_id, settings, state, box, watcher, returned):
            _polling(state, run_id, watcher)
            state.r.flushall()  # what a Redis restarted without persistence holds
            _deliver(box, "1.dsn", returned("C2"))
            _recorded(state, "C2", watcher, box)
        logged = delivery_log.scan(open_store(settings.store_url), run_id, keys.shard_of("C2", 10), ("bounced",))[0]
        assert [e["ucc"] for e in logged] == ["C2"], logged
        assert state.meta()["restored_from"] and [p.name[-4:] for p in (box / "cur").iterdir()] == [":2,S"]
    finally:
        redis.stop()


def test_a_bounce_source_that_is_not_there_is_said_so_not_called_the_wrong_kind(tmp_path):
    from pipeline.mail.mailbox import MailboxError, open_source

    with pytest.raises(MailboxError, match="no such file or folder"):
        open_source(str(tmp_path / "bounces"), 1 << 20)
    (tmp_path / "folder").mkdir()
    with pytest.raises(MailboxError, match="not an imap"):
        open_source(str(tmp_path / "folder"), 1 << 20)


def test_the_demo_s_bounce_folder_without_a_bounce_rate_is_an_empty_maildir(tmp_path):
    """README, "After the demo": `bounces $RUN_ID --maildir demo/bounces` on a demo made without
    --bounce-rate reads no bounce (it said "not an imap(s):// URL, a maildir or an mbox file")."""
    from pipeline.embedded import sink_args
    from pipeline.mail.mailbox import open_source

    assert sink_args(tmp_path, 0.0) == []
    assert list(open_source(str(tmp_path / "bounces"), 1 << 20).unseen()) == []
