"""The fault matrix: a process, Redis or the relay fails mid-run, and every account still ends
delivered exactly once, or unconfirmed and then settled by `reconcile` / `rerun --unconfirmed`.
Counted at the relay (by Message-ID), never from our own report; the delivery log in storage
must agree with the relay."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import boto3
import psutil
import pytest
import redis

from pipeline.cluster.driver import RunRequest, Rerun, _fail_accounts, _left_now, rerun, run_day
from pipeline.followup.reconcile import reconcile
from pipeline.day.synth import SynthOptions, write_dumps
from pipeline.embedded import start_redis
from pipeline.mail.message import message_id
from pipeline.record import delivery_log, keys, note_numbers
from pipeline.record.guard import StateLostError
from pipeline.record.records import Outcome
from pipeline.record.state import RunState
from pipeline.record.statuses import final_status
from pipeline.record.storage import open_store
from pipeline.settings import ROOT
from tests.conftest import NEXT_DATE, TRADE_DATE
from tests.helpers import attachment, client_rows, outbox_messages
from tests.servers import S3_ACCESS_KEY, S3_SECRET_KEY, start_versitygw

ACCOUNTS = int(os.environ.get("CN_FAULT_ACCOUNTS", "60"))  # the closing note's matrix ran with 300-500


@pytest.fixture
def busy_day(tmp_path) -> Path:
    """Enough mail for a fault to land in the middle of it."""
    out = tmp_path / "busy"
    write_dumps(out, SynthOptions(dt.date.fromisoformat(TRADE_DATE), ACCOUNTS, seed=11))
    return out


def at_relay(outbox: Path) -> Counter:
    return Counter(m["Message-ID"] for m in outbox_messages(outbox))


def mailable(day: Path) -> set[str]:
    traded = {line.split(",")[4] for line in (day / "trades.csv").read_text().splitlines()[1:]}
    return {u for u, c in client_rows(day).items() if u in traded and c["ecn_opt_in"] == "Y"}


def relay_log(outbox: Path, path: Path) -> Path:
    """The relay's log as a plain list of the Message-IDs it accepted."""
    path.write_text("".join(f"{mid}\n" for mid in at_relay(outbox)))
    return path


def wait_for(outbox: Path, n: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len(list(outbox.glob("*.eml"))) < n:
        assert time.monotonic() < deadline, f"the relay never got {n} messages"
        time.sleep(0.01)


def assert_each_account_once(settings, run_id: str, day: Path, outbox: Path, fault: str, first: dict,
                             settled: dict | None = None) -> None:
    """Every account that should get a note got exactly one, under its own Message-ID, and
    the delivery log in storage says so for each (and for no one else). Prints the row of
    the fault matrix (pytest -s)."""
    expected = {message_id(run_id, u, settings.hmac_key()): u for u in mailable(day)}
    got = at_relay(outbox)
    print(json.dumps({"fault": fault, "accounts": ACCOUNTS, "to_mail": len(expected), "at_relay": len(got),
                      "duplicates": sum(n - 1 for n in got.values()),
                      "after_the_run": {k: first.get(k) for k in ("delivered", "unconfirmed", "failed")},
                      "settled": settled or {}}))
    assert {m: n for m, n in got.items() if n > 1} == {}, "mailed twice"
    assert set(got) == set(expected), f"missing: {sorted(set(expected) - set(got))[:5]}"
    log = delivery_log.latest(delivery_log.entries(open_store(settings.store_url), run_id))
    delivered = {e["message_id"] for e in log.values() if e["status"] == "delivered"}
    assert delivered == set(got), "the delivery log disagrees with the relay"


def in_background(fn, *args):
    result = {}

    def go():
        try:
            result["value"] = fn(*args)
        except BaseException as e:  # handed to the test thread
            result["error"] = e

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread, result


def test_a_relay_that_drops_after_accepting_leaves_unconfirmed_accounts_that_reconcile_and_rerun_settle(
        ray_session, settings, busy_day, smtp_server, tmp_path):
    uccs = sorted(mailable(busy_day))
    emails = {u: client_rows(busy_day)[u]["email"] for u in uccs}
    kept, lost = uccs[:4], uccs[4:6]
    server = smtp_server(accept_then_drop={emails[u] for u in kept}, drop_once={emails[u] for u in lost})
    relay = settings.__class__(**{**settings.__dict__, "smtp_url": server.url})

    first = run_day(relay, RunRequest(TRADE_DATE, str(busy_day)))

    run_id = first["run_id"]
    assert (first["unconfirmed"], first["failed"]) == (6, 0)
    assert all(n == 1 for n in at_relay(server.outbox).values()), "an ambiguous send was retried blindly"
    state = RunState(settings.redis_url, run_id)
    assert sorted(state.unconfirmed()) == sorted(kept + lost)

    # settled from a laptop after the cluster (and its Redis) is gone: the run comes back from storage
    laptop = relay.__class__(**{**relay.__dict__, "redis_url": relay.redis_url.rsplit("/", 1)[0] + "/7"})
    redis.Redis.from_url(laptop.redis_url).flushdb()
    settled = reconcile(laptop, run_id, [relay_log(server.outbox, tmp_path / "relay.log")])
    assert (settled["reconciled"], settled["still_unconfirmed"]) == (4, 2)
    again = rerun(laptop, run_id, unconfirmed=True)
    assert again["rerun_accounts"] == sorted(lost) and again["unconfirmed"] == 0

    assert_each_account_once(settings, run_id, busy_day, server.outbox, "relay drops after accepting", first,
                             {"reconciled": settled["reconciled"], "resent": len(again["rerun_accounts"])})
    report = {r["ucc"]: r for r in _report_rows(settings, run_id)}
    assert {u for u, r in report.items() if r["possible_duplicate"] == "Y"} == set(lost)
    assert all(report[u]["status"] == "delivered" for u in uccs)


def test_a_mailer_killed_mid_run_by_pid_leaves_unconfirmed_accounts_never_lost_or_doubled(
        ray_session, settings, busy_day, smtp_server, tmp_path):
    import ray

    server = smtp_server(delay_ms=25)
    slow = settings.__class__(**{**settings.__dict__, "smtp_url": server.url, "window": 2})
    run_id = f"kill-mailer-{uuid.uuid4().hex[:6]}"
    thread, result = in_background(run_day, slow, RunRequest(TRADE_DATE, str(busy_day), run_id))
    wait_for(server.outbox, 8)
    mailer = ray.get_actor(f"mailer-0-{run_id}")
    os.kill(ray.get(mailer.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)
    thread.join(300)

    first = result["value"]
    assert first["failed"] == 0 and first["delivered"] + first["unconfirmed"] == len(mailable(busy_day))
    settled = reconcile(slow, run_id, [relay_log(server.outbox, tmp_path / "relay.log")])
    again = rerun(slow, run_id, unconfirmed=True)
    assert_each_account_once(settings, run_id, busy_day, server.outbox, "mailer SIGKILLed mid-run", first,
                             {"reconciled": settled["reconciled"], "resent": len(again["rerun_accounts"])})


def test_a_mailer_killed_mid_forced_rerun_mails_no_account_a_second_time_under_that_rerun(
        ray_session, settings, busy_day, smtp_server):
    """`rerun --force` mails every account once more. Its mailer is SIGKILLed mid-batch, and the
    fleet resends the batch to a new mailer: an account the dead mailer claimed is its rerun's own
    claim, never taken over by the same rerun, so no account reaches the relay a third time; and one
    whose answer it never recorded is unconfirmed (its mail may or may not have left), not the run's
    earlier delivery logged again as this rerun's."""
    import ray

    uccs = sorted(mailable(busy_day))
    server = smtp_server(delay_ms=25, hold_after=len(uccs) + 8)  # the rerun's 9th mail: in flight at the kill
    slow = settings.__class__(**{**settings.__dict__, "smtp_url": server.url, "window": 2})
    run_id = f"kill-forced-{uuid.uuid4().hex[:6]}"
    first = run_day(slow, RunRequest(TRADE_DATE, str(busy_day), run_id))
    assert first["delivered"] == len(uccs) and len(at_relay(server.outbox)) == len(uccs)

    rerun_at = time.time()
    thread, result = in_background(lambda: rerun(slow, run_id, uccs, force=True))
    wait_for(server.outbox, len(uccs) + 9)
    mailer = ray.get_actor(f"mailer-0-{run_id}")
    os.kill(ray.get(mailer.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)
    thread.join(300)

    again = result.get("value") or result
    assert "error" not in again and again["failed"] == 0, again
    assert again["resent_chains"] > 0, "the mailer died after its batches were done"
    got = at_relay(server.outbox)
    expected = {message_id(run_id, u, settings.hmac_key()) for u in uccs}
    assert set(got) == expected
    assert {m: n for m, n in got.items() if n > 2} == {}, "mailed a third time: once by the run, twice by its rerun"
    assert sum(got.values()) > len(uccs) + 8, "the rerun stopped mailing when its mailer died"
    entries = list(delivery_log.entries(open_store(settings.store_url), run_id))
    log = delivery_log.latest(entries)
    assert {e["ucc"] for e in log.values() if e["status"] == "delivered"} == set(uccs)
    # the relay names each copy it queues apart ("queued as"): a mail the dead mailer claimed with no answer
    # recorded is unconfirmed, never the run's earlier answer logged again as this rerun's delivery
    earlier = {e["ucc"]: e["reply"] for e in entries if e["status"] == "delivered" and e["at"] < rerun_at}
    told_again = sorted(e["ucc"] for e in entries
                        if e["status"] == "delivered" and e["at"] >= rerun_at and e["reply"] == earlier[e["ucc"]])
    assert told_again == [], "the run's earlier delivery logged as this rerun's"
    unanswered = [e for e in entries if e["status"] == "unconfirmed"]
    assert len(unanswered) == again["unconfirmed_now"] > 0, "the kill landed with no mail of the rerun's in flight"
    assert all(f"rerun {run_id} --accounts {e['ucc']} --force" in e["reason"] for e in unanswered)
    state = RunState(settings.redis_url, run_id)
    assert all("u" in {e[1] for e in state.accounts([u])[u]["events"]} for u in {e["ucc"] for e in unanswered})
    assert state.unconfirmed() == [], "a delivered account, which the first mail's acceptance would settle"


def test_a_forced_rerun_s_chain_failed_for_good_says_what_became_of_each_delivered_account_s_new_mail(settings):
    """A forced rerun's chain that fails for good (its actors lost past their resends, its store
    refusing the log, its deadline passed before it started) answers for the accounts it took,
    each staying delivered, where it recorded nothing of their new mail: claimed under its lease,
    unconfirmed; still under the first mailing's claim, failed ("never left", for `rerun --failed
    --force`); its claim let go with the relay's refusal lost, failed. An answer recorded (a
    delivery, a refusal) is left as it is, and so are accounts it did not take, one on paper, and
    one failed with its reason. The rerun's counts come from the records (the chain's tally
    never came back). Before, the delivered accounts were left out, the shard's accounts the rerun
    did not take were failed anew, and one owed on paper was failed."""
    run_id = f"forced-left-{uuid.uuid4().hex[:6]}"
    state, key = RunState(settings.redis_url, run_id), settings.hmac_key()
    epoch, first = state.start({}), state.take_lease(30).token
    mid = {u: message_id(run_id, u, key) for u in "ABCDEFGHI"}
    assert all(state.claim_mail(u, mid[u], epoch, first) for u in "ABCDEH")
    state.record([Outcome(u, "delivered", message_id=mid[u], reply="250 queued as 1") for u in "ABCDEH"]
                 + [Outcome("F", "archived", "physical", reason="no ECN consent: physical dispatch")]
                 + [Outcome(u, "rendered", "failed", reason="render: a bad row") for u in "GI"])
    state.r.delete(keys.run_lease(run_id))
    time.sleep(0.01)
    started, lease = time.time(), state.take_lease(30).token  # the rerun's: it claims B, C, E and H again
    assert all(state.claim_mail(u, mid[u], epoch, lease, resend=True) for u in "BCEH")
    state.record([Outcome("C", "delivered", message_id=mid["C"], reply="250 queued as 2"),
                  Outcome("E", "delivered", "failed", reason="smtp permanent: 550 no such user", message_id=mid["E"])])
    for u in "EH":  # the relay refused both; H's answer was lost with its mailer
        state.release_mail(u, state.claim_tokens([u])[u])

    took = frozenset("ABCEFHI")
    left = _fail_accounts(settings, run_id, list("ABCDEFGHI"), "shard 0: the mailer was lost", Rerun(lease, took, True, started))

    assert left["tally"] == {"failed": 2, "unconfirmed": 1}, left
    records = state.accounts(list("ABCDEFGHI"))
    assert {u: final_status(r) for u, r in records.items()} == {**dict.fromkeys("ABCDEH", "delivered"),
                                                                 "F": "physical", "G": "failed", "I": "failed"}
    reasons = {u: r["reason"] for u, r in records.items()}
    assert "(it never left)" in reasons["A"] and "may or may not have left" in reasons["B"]
    assert "the relay refused it, and its answer was lost" in reasons["H"]
    assert records["C"]["reply"] == "250 queued as 2" and reasons["E"].startswith("smtp permanent")
    assert reasons["I"] == reasons["G"] == "render: a bad row" and records["D"]["events"] == []
    assert f"rerun {run_id} --accounts A --force" in reasons["A"]
    assert (sorted(state.failed()), state.unconfirmed()) == (list("AEGHI"), []), "B: nothing the relay's log settles"
    assert _left_now(state, took, started) == {"failed_now": 3, "unconfirmed_now": 1}


@pytest.mark.waits
def test_a_relay_down_for_20_s_mid_run_pauses_mailing_and_the_run_still_delivers_everyone(
        ray_session, settings, busy_day, smtp_server, tmp_path):
    """Nothing fails for the outage. A transaction whose message was sent (its BDAT chunk, the
    sink offering CHUNKING) when the relay went down has no answer, so it is unconfirmed (at
    most one per connection) and settled by the relay's list, as in production."""
    server = smtp_server(outage={"after": 10, "seconds": 20})
    relay = settings.__class__(**{**settings.__dict__, "smtp_url": server.url})

    summary = run_day(relay, RunRequest(TRADE_DATE, str(busy_day)))

    assert summary["failed"] == 0 and summary["unconfirmed"] <= relay.smtp_connections * relay.mailers
    assert summary["delivered"] + summary["unconfirmed"] == len(mailable(busy_day))
    assert summary["elapsed_s"] > 20, "the outage happened mid-run"
    run_id, settled = summary["run_id"], {}
    if summary["unconfirmed"]:
        settled = {"reconciled": reconcile(relay, run_id, [relay_log(server.outbox, tmp_path / "relay.log")])
                   ["reconciled"], "resent": len(rerun(relay, run_id, unconfirmed=True)["rerun_accounts"])}
    assert_each_account_once(settings, run_id, busy_day, server.outbox, "relay down 20 s", summary, settled)


@pytest.mark.waits
def test_s3_stopped_mid_run_past_each_request_s_attempts_holds_the_day_and_fails_nothing(
        settings, busy_day, smtp_server, tmp_path, monkeypatch):
    """S3 stopped (each connection refused) mid-run, longer than a request's own attempts
    (AWS_MAX_ATTEMPTS=2 here, ~1-2 s; a day's ten ride out ~80 s): the run waits for it
    (CN_STORE_PATIENCE_S, then its deadline) and every account is delivered once, nothing failed.
    CN_FAULT_S3_OUTAGE_S=100 without AWS_MAX_ATTEMPTS shows the same past the ten attempts."""
    outage_s = float(os.environ.get("CN_FAULT_S3_OUTAGE_S", "15"))
    s3 = start_versitygw(tmp_path / "s3")
    aws = {"AWS_ENDPOINT_URL": s3.url, "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY,
           "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in aws.items():
        monkeypatch.setenv(k, v)
    boto3.client("s3").create_bucket(Bucket="day")
    server = smtp_server(delay_ms=25)
    run_id = f"s3-out-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, **aws, "AWS_MAX_ATTEMPTS": os.environ.get("AWS_MAX_ATTEMPTS", "2"),
           "CN_SIGNER_KEY": settings.signer_key, "CN_SIGNER_CERT": settings.signer_cert,
           "CN_TOKEN_KEY_FILE": settings.token_key_file, "CN_SIGNER_CHAIN": settings.signer_chain,
           "CN_OWNER_PASSWORD": settings.owner_password, "CN_STORE": "s3://day", "REDIS_URL": settings.redis_url,
           "SMTP_URL": server.url, "CN_SHARD_SIZE": "8", "CN_WINDOW": "2", "RAY_ADDRESS": "", "CN_STORE_PATIENCE_S": "5"}
    back, driver = [], None
    try:
        driver = subprocess.Popen([sys.executable, "-m", "pipeline", "run", "--date", TRADE_DATE, "--input",
                                   str(busy_day), "--run-id", run_id, "--deadline-min", "10"], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(server.outbox, 8, timeout_s=180)
        s3.stop()
        stopped, noted, meta = len(list(server.outbox.glob("*.eml"))), None, redis.Redis.from_url(settings.redis_url)
        out_until = time.monotonic() + outage_s
        while time.monotonic() < out_until:
            noted = noted or meta.hget(keys.run_meta(run_id), "waiting:store")  # what the live page shows
            time.sleep(0.2)
        back.append(start_versitygw(tmp_path / "s3", port=urlsplit(s3.url).port))
        out, err = driver.communicate(timeout=600)
        assert driver.returncode == 0, out[-2000:] + err[-3000:]
        summary = json.loads(out.strip().splitlines()[-1])
        assert stopped < len(mailable(busy_day)), "S3 stopped mid-run"
        assert noted  # by whichever process met the outage first (the WARNINGs and the note's end: test_s3_store)
        assert (summary["failed"], summary["unconfirmed"]) == (0, 0), summary
        assert summary["delivered"] == len(mailable(busy_day))
        assert_each_account_once(dataclasses.replace(settings, store_url="s3://day"), run_id, busy_day,
                                 server.outbox, f"S3 stopped {outage_s:g} s", summary)
    finally:
        if driver and driver.poll() is None:
            driver.kill()  # a failed wait: the run and its local Ray (which end with their driver)
            driver.communicate()
        for service in [s3, *back]:
            service.stop()


@pytest.mark.parametrize("aof", [True, False], ids=["with-aof", "without-persistence"])
def test_redis_restarted_mid_run(ray_session, settings, busy_day, smtp_server, tmp_path, aof):
    """With AOF the run carries on; without persistence it stops (nothing resent) and the
    same run id again rebuilds from the delivery log: 0 duplicates, 0 losses, and no note
    number handed out twice."""
    redis = start_redis(tmp_path / "redis", aof=aof)
    port = int(redis.url.rsplit(":", 1)[1].split("/")[0])
    server = smtp_server(delay_ms=25)
    live = settings.__class__(**{**settings.__dict__, "smtp_url": server.url, "redis_url": redis.url, "window": 2})
    run_id = f"redis-restart-{uuid.uuid4().hex[:6]}"
    try:
        thread, result = in_background(run_day, live, RunRequest(TRADE_DATE, str(busy_day), run_id))
        wait_for(server.outbox, 12)
        redis.stop()
        redis = start_redis(tmp_path / "redis", aof=aof, port=port)
        thread.join(300)
        if aof:
            summary = first = result["value"]
            assert (summary["failed"], summary["unconfirmed"]) == (0, 0)
        else:
            assert isinstance(result.get("error"), StateLostError), result
            assert "run the same run id again" in str(result["error"])
            summary = first = run_day(live, RunRequest(TRADE_DATE, str(busy_day), run_id))
            assert summary["unconfirmed"] == 0, "every mail in flight at the loss was logged with its answer"
            elsewhere = settings.__class__(**{**live.__dict__, "smtp_url": smtp_server("later").url})
            next_day = tmp_path / "next"  # the date's notes are the first run's: the next day's numbers follow on
            write_dumps(next_day, SynthOptions(dt.date.fromisoformat(NEXT_DATE), ACCOUNTS, seed=11))
            later = run_day(elsewhere, RunRequest(NEXT_DATE, str(next_day)))
            first_issued, last_issued = _note_numbers(live, run_id), _note_numbers(live, later["run_id"])
            assert min(last_issued) > max(first_issued), "a note number was issued twice"
        assert summary["delivered"] == len(mailable(busy_day))
        assert_each_account_once(settings, run_id, busy_day, server.outbox,
                                 f"Redis restarted {'with AOF' if aof else 'without persistence'}", first)
    finally:
        redis.stop()


def test_a_killed_driver_leaves_no_process_behind_and_the_same_run_id_finishes_the_day(
        settings, busy_day, smtp_server, tmp_path, keys_dir):
    server = smtp_server(delay_ms=25)
    run_id = f"kill-driver-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "CN_SIGNER_KEY": settings.signer_key, "CN_SIGNER_CERT": settings.signer_cert,
           "CN_TOKEN_KEY_FILE": settings.token_key_file,
           "CN_SIGNER_CHAIN": settings.signer_chain, "CN_OWNER_PASSWORD": settings.owner_password,
           "CN_STORE": settings.store_url, "REDIS_URL": settings.redis_url, "SMTP_URL": server.url,
           "CN_SHARD_SIZE": "8", "CN_WINDOW": "2", "RAY_ADDRESS": "", "CN_LEASE_S": "12"}
    command = [sys.executable, "-m", "pipeline", "run", "--date", TRADE_DATE, "--input", str(busy_day),
               "--run-id", run_id]
    driver = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    wait_for(server.outbox, 8, timeout_s=180)
    helpers = psutil.Process(driver.pid).children(recursive=True)
    assert any("raylet" in " ".join(p.cmdline()) for p in helpers if p.is_running())
    driver.kill()
    driver.wait()
    killed_at = time.monotonic()
    gone, alive = psutil.wait_procs(helpers, timeout=30)
    assert not alive, f"left behind: {[p.cmdline()[:2] for p in alive]}"

    # the dead driver's lease still looks alive: refused, naming it. Its last renewal may be a third of
    # CN_LEASE_S before the kill, and a second driver's start a few seconds on a busy machine: with 6 s
    # and 4 s gone, one once took the lease over instead
    if time.monotonic() - killed_at < 4:
        early = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert early.returncode == 2 and f"(pid {driver.pid})" in early.stderr, early.stderr[-2000:]
    time.sleep(max(0.0, 12.5 - (time.monotonic() - killed_at)))  # CN_LEASE_S without a renewal: taken over
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["lease_taken_over_from"]["pid"] == driver.pid
    assert summary["failed"] == 0 and summary["delivered"] + summary["unconfirmed"] == len(mailable(busy_day))
    settled = {}
    if summary["unconfirmed"]:
        relay_file = relay_log(server.outbox, tmp_path / "relay.log")
        settle = subprocess.run([sys.executable, "-m", "pipeline", "reconcile", run_id, "--relay-log",
                                 str(relay_file)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert settle.returncode in (0, 1), settle.stderr
        settled = {"reconciled": json.loads(settle.stdout)["reconciled"], "resent": 0}
        if json.loads(settle.stdout)["still_unconfirmed"]:
            resend = subprocess.run([sys.executable, "-m", "pipeline", "rerun", run_id, "--unconfirmed"], cwd=ROOT,
                                    env=env, capture_output=True, text=True, timeout=600)
            assert resend.returncode == 0, resend.stderr[-2000:]
            settled["resent"] = len(json.loads(resend.stdout.strip().splitlines()[-1])["rerun_accounts"])
    assert_each_account_once(settings, run_id, busy_day, server.outbox, "driver SIGKILLed, same run id again", summary,
                             settled)


def test_two_drivers_on_one_run_id_one_runs_the_other_exits_naming_it(
        settings, busy_day, smtp_server, tmp_path, keys_dir):
    """Two `run`s of one run id started within 100 ms: the second exits 2 naming the first, and
    the day is as one driver makes it, counted at the relay: each account mailed once, the
    report's Message-IDs the relay's, each archived PDF the one mailed, one note number each."""
    own_redis = start_redis(tmp_path / "redis")  # the year's note counter starts at 0 here
    server = smtp_server(delay_ms=10)
    run_id = f"two-drivers-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "CN_SIGNER_KEY": settings.signer_key, "CN_SIGNER_CERT": settings.signer_cert,
           "CN_TOKEN_KEY_FILE": settings.token_key_file,
           "CN_SIGNER_CHAIN": settings.signer_chain, "CN_OWNER_PASSWORD": settings.owner_password,
           "CN_STORE": settings.store_url, "REDIS_URL": own_redis.url, "SMTP_URL": server.url,
           "CN_SHARD_SIZE": "8", "RAY_ADDRESS": ""}
    command = [sys.executable, "-m", "pipeline", "run", "--date", TRADE_DATE, "--input", str(busy_day),
               "--run-id", run_id]
    try:
        drivers = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)]
        time.sleep(0.05)
        drivers.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True))
        outs = [d.communicate(timeout=600) for d in drivers]
    finally:
        own_redis.stop()
    codes = [d.returncode for d in drivers]
    assert sorted(codes) == [0, 2], [o[1][-2000:] for o in outs]
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    refusal = outs[loser][1].strip().splitlines()
    assert refusal[-1].startswith(f"error: run {run_id} is held by a driver on ") and "Traceback" not in outs[loser][1]
    assert f"(pid {drivers[winner].pid})" in refusal[-1]
    summary = json.loads(outs[winner][0].strip().splitlines()[-1])
    assert_each_account_once(settings, run_id, busy_day, server.outbox, "two drivers, one run id", summary)

    mailed = {m["Message-ID"]: attachment(m)[1] for m in outbox_messages(server.outbox)}
    rows = [r for r in _report_rows(settings, run_id) if r["status"] == "delivered"]
    assert {r["message_id"] for r in rows} == set(mailed) and all(r["reply"] for r in rows)
    store = open_store(settings.store_url)
    for r in rows:
        assert store.get(keys.signed_pdf_key(TRADE_DATE, r["ucc"])) == mailed[r["message_id"]], r["ucc"]
    fy = note_numbers.financial_year(TRADE_DATE)
    assert note_numbers.high_water_mark(store, fy) == len(_note_numbers(settings, run_id)) == summary["accounts"] - \
        summary["rejected"]


def _report_rows(settings, run_id: str) -> list[dict]:
    import csv

    return list(csv.DictReader((Path(settings.store_url) / keys.report_keys(run_id)[1]).open()))


def _note_numbers(settings, run_id: str) -> list[int]:
    store = open_store(settings.store_url)
    numbers = []
    for shard in json.loads(store.get(keys.manifest_key(run_id)))["shards"]:
        for line in store.get(keys.shard_key(run_id, shard)).decode().splitlines():
            numbers.append(int(json.loads(line)["note_no"].rsplit("-", 1)[-1]))
    return numbers


def test_run_refuses_a_redis_that_keeps_nothing_on_disk_unless_told(busy_day, tmp_path, settings):
    volatile = start_redis(tmp_path / "volatile", aof=False)
    env = {**os.environ, "REDIS_URL": volatile.url, "CN_STORE": settings.store_url, "RAY_ADDRESS": "",
           "CN_OWNER_PASSWORD": "an-owner-secret", "CN_SIGNER_KEY": settings.signer_key,
           "CN_SIGNER_CERT": settings.signer_cert}
    try:
        done = subprocess.run([sys.executable, "-m", "pipeline", "run", "--date", TRADE_DATE, "--input",
                               str(busy_day)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    finally:
        volatile.stop()
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "keeps nothing on disk" in done.stderr and "--accept-volatile-redis" in done.stderr
