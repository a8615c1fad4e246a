"""After the day, every command works on the run's own record, from anywhere, or stops with one
line and writes nothing (issue 36): the store and keys a run recorded, never the ones the
current folder or CN_STORE imply."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import boto3
import pytest
import redis

from pipeline.__main__ import main
from pipeline.cluster import fleet
from pipeline.cluster.driver import RunRequest, rerun, run_day
from pipeline.record import keys
from pipeline.record.storage import StorageError
from pipeline.settings import ROOT, ConfigError
from tests import servers
from tests.conftest import TRADE_DATE
from tests.helpers import client_rows, outbox_messages


def folder_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def bucket_tree(bucket: str) -> dict[str, bytes]:
    s3 = boto3.client("s3")
    found = s3.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in found}


def redis_dump(url: str) -> dict[bytes, bytes]:
    r = redis.Redis.from_url(url)
    return {k: r.dump(k) for k in sorted(r.scan_iter(count=1000))}


def follow_ups(run_id: str, tmp_path: Path) -> list[list[str]]:
    (tmp_path / "relay.log").write_text("")
    (tmp_path / "bounces.mbox").write_text("")
    return [["rerun", run_id, "--failed"], ["reconcile", run_id, "--relay-log", str(tmp_path / "relay.log")],
            ["bounces", run_id, "--mbox", str(tmp_path / "bounces.mbox")], ["close", run_id], ["verify", run_id],
            ["status", run_id]]


@pytest.mark.parametrize("backend", ["folder", "s3"])
def test_every_follow_up_command_on_a_wrong_store_stops_with_one_line_and_writes_nothing(
        backend, ray_session, settings, day, s3_bucket, tmp_path, monkeypatch, capsys):
    if backend == "folder":
        right, wrong = settings.store_url, str(tmp_path / "other-store")
        (tmp_path / "other-store").mkdir()
        (tmp_path / "other-store" / "kept.txt").write_text("another record")
        snapshot = lambda: (folder_tree(Path(right)), folder_tree(tmp_path / "other-store"))  # noqa: E731
    else:
        right, wrong = f"s3://{s3_bucket}/right", f"s3://{s3_bucket}/wrong"
        boto3.client("s3").put_object(Bucket=s3_bucket, Key="wrong/kept.txt", Body=b"another record")
        snapshot = lambda: bucket_tree(s3_bucket)  # noqa: E731
    run_id = run_day(settings.__class__(**{**settings.__dict__, "store_url": right}),
                     RunRequest(TRADE_DATE, str(day)))["run_id"]
    empty_redis = settings.redis_url.rsplit("/", 1)[0] + "/7"
    redis.Redis.from_url(empty_redis).flushdb()
    for k, v in {"CN_SIGNER_KEY": settings.signer_key, "CN_SIGNER_CERT": settings.signer_cert,
                 "CN_SIGNER_CHAIN": settings.signer_chain, "CN_TOKEN_KEY_FILE": settings.token_key_file}.items():
        monkeypatch.setenv(k, v)
    before = snapshot(), redis_dump(settings.redis_url), redis_dump(empty_redis)

    cases = [({"REDIS_URL": empty_redis, "CN_STORE": wrong}, [], "Redis does not hold it either"),  # CN_STORE
             ({"REDIS_URL": settings.redis_url}, ["--store", wrong], f"the run recorded {right}")]  # --store
    for env, flag, says in cases:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        for command in follow_ups(run_id, tmp_path):
            capsys.readouterr()
            assert main(command + flag) == 2, command
            errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
            assert len(errors) == 1, (command, errors)
            assert run_id in errors[0] and wrong in errors[0] and says in errors[0], (command, errors[0])

    assert (snapshot(), redis_dump(settings.redis_url), redis_dump(empty_redis)) == before


@pytest.mark.parametrize("command", [["verify", "R1"], ["status", "R1"], ["runs"]])
def test_an_s3_endpoint_that_refuses_is_said_in_one_line_in_seconds_not_after_80(command, tmp_path):
    """Before, `verify RUN --store s3://bucket/x` with an endpoint refusing connections retried
    for ~80 s (the day's ten attempts) and ended in tracebacks."""
    from pipeline.embedded import free_port

    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "y", "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "CN_STORE": "s3://bucket/x",
           "PYTHONPATH": str(ROOT)}  # typed in another folder
    done = subprocess.run([sys.executable, "-m", "pipeline", *command], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=40)  # 80 s before
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "does not answer" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "botocore" not in done.stderr


def test_a_rerun_typed_in_another_folder_uses_the_run_s_store_and_keys_and_writes_nothing_where_it_stands(
        ray_session, redis_url, day, smtp_server, tmp_path):
    clients = client_rows(day)
    traded = sorted({line.split(",")[4] for line in (day / "trades.csv").read_text().splitlines()[1:]})
    refused = {clients[u]["email"] for u in traded[:3]}
    quota, fresh = smtp_server("quota", reject=refused), smtp_server("fresh")
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CN_", "SMTP_URL"))}
    env.update(REDIS_URL=redis_url, RAY_ADDRESS=ray_session.address_info["address"], PYTHONPATH=ROOT)
    cli = lambda where, *a: subprocess.run([sys.executable, "-m", "pipeline", *a], cwd=where, env=env,  # noqa: E731
                                           capture_output=True, text=True, timeout=300)

    first = cli(here, "run", "--date", TRADE_DATE, "--input", str(day), "--store", "rec", "--smtp", quota.url,
                "--test-keys")
    assert first.returncode == 1, first.stderr[-3000:]
    summary = json.loads(first.stdout.splitlines()[-1])
    assert summary["failed"] == 3 and summary["store_url"] == str(here / "rec")
    assert summary["key_dir"] == str(here / ".keys") and summary["token_key_id"]
    stored_before = set(folder_tree(here / "rec"))

    again = cli(elsewhere, "rerun", summary["run_id"], "--failed", "--smtp", fresh.url)

    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    result = json.loads(again.stdout.splitlines()[-1])
    assert result["rerun_outcomes"] == {"delivered": 3} and result["failed"] == 0
    assert result["store"] == str(here / "rec") and "the run's own" in result["store_from"]
    assert f"store {here / 'rec'} (the run's own, recorded in Redis)" in again.stderr
    assert sorted(Counter(m["To"] for m in outbox_messages(fresh.outbox)).values()) == [1, 1, 1]
    assert list(elsewhere.iterdir()) == [], "nothing written where the rerun was typed"
    report = json.loads((here / "rec" / keys.report_keys(summary["run_id"])[0]).read_text())
    assert report["statuses"] == {"delivered": summary["accounts"]}
    new = set(folder_tree(here / "rec")) - stored_before
    assert not [k for k in new if "manifest" in k or "contract-notes-data" in k], "the day was not split again"


def test_a_store_that_takes_a_second_create_only_write_is_refused_before_the_first_note(
        ray_session, settings, day, smtp_sink, tmp_path, monkeypatch):
    lax = servers.start_versitygw(tmp_path / "lax-s3", nometa=True)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", lax.url)
        boto3.client("s3").create_bucket(Bucket="lax")
        with pytest.raises(StorageError, match=r"s3://lax accepted a second create-only write"):
            run_day(settings.__class__(**{**settings.__dict__, "store_url": "s3://lax"}), RunRequest(TRADE_DATE, str(day)))
        written = bucket_tree("lax")
    finally:
        lax.stop()
    assert outbox_messages(smtp_sink.outbox) == []
    assert [k for k in written if not k.endswith((".write-check", ".create-only-check"))] == []


def test_a_rerun_whose_signing_key_cannot_be_read_exits_2_with_every_account_as_it_was(
        ray_session, settings, day, smtp_server, monkeypatch, capsys):
    clients = client_rows(day)
    traded = sorted({line.split(",")[4] for line in (day / "trades.csv").read_text().splitlines()[1:]})
    relay = smtp_server("first", reject={clients[traded[0]]["email"]})
    first = run_day(settings.__class__(**{**settings.__dict__, "smtp_url": relay.url}), RunRequest(TRADE_DATE, str(day)))
    assert first["failed"] == 1
    r = redis.Redis.from_url(settings.redis_url)
    records = lambda: (r.hgetall(keys.run_accounts(first["run_id"])), r.hgetall(keys.run_counts(first["run_id"])),  # noqa: E731
                       r.zrange(keys.run_failed(first["run_id"]), 0, -1))
    before = records(), folder_tree(Path(settings.store_url))
    monkeypatch.setenv("REDIS_URL", settings.redis_url)
    monkeypatch.setenv("CN_SIGNER_KEY", str(Path(settings.signer_key).parent / "gone.key.pem"))

    assert main(["rerun", first["run_id"], "--failed"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "gone.key.pem" in errors[0], errors
    assert (records(), folder_tree(Path(settings.store_url))) == before
    assert len(outbox_messages(relay.outbox)) == first["delivered"]


def test_an_actor_that_cannot_start_stops_the_run_with_its_cause_in_one_line(ray_session, settings):
    broken = settings.__class__(**{**settings.__dict__, "signer_key": "/nonexistent/signer.key.pem"})
    actors = fleet.start(broken, f"no-run-{os.getpid()}", False, False, "")
    try:
        with pytest.raises(ConfigError) as stopped:
            actors.started(lambda: None)
    finally:
        actors.close()
    assert "could not start" in str(stopped.value) and "/nonexistent/signer.key.pem" in str(stopped.value)
    assert "\n" not in str(stopped.value)


def test_an_archived_note_the_store_lost_is_signed_again_with_its_number_unless_it_was_mailed(
        ray_session, settings, day, smtp_server):
    clients = client_rows(day)
    traded = sorted({line.split(",")[4] for line in (day / "trades.csv").read_text().splitlines()[1:]})
    lost, mailed = traded[0], traded[1]
    relay = smtp_server("first", reject={clients[lost]["email"]})
    first = run_day(settings.__class__(**{**settings.__dict__, "smtp_url": relay.url}), RunRequest(TRADE_DATE, str(day)))
    store = Path(settings.store_url)
    pdf = {u: store / keys.signed_pdf_key(TRADE_DATE, u) for u in (lost, mailed)}
    number = lambda u: next(a["note_no"] for s in store.glob(f"*-contract-notes-data/{first['run_id']}/*.jsonl")  # noqa: E731
                            for a in map(json.loads, s.read_text().splitlines()) if a["ucc"] == u)
    for p in pdf.values():
        p.unlink()
    fresh = smtp_server("fresh")
    fixed = settings.__class__(**{**settings.__dict__, "smtp_url": fresh.url})

    again = rerun(fixed, first["run_id"], failed=True, relays=fixed.relays())
    assert again["rerun_outcomes"] == {"delivered": 1}
    text = subprocess.run(["pdftotext", "-upw", clients[lost]["pan"], str(pdf[lost]), "-"], capture_output=True,
                          text=True, check=True).stdout
    assert str(number(lost)) in text, "signed again with the note number it had"
    forced = rerun(fixed, first["run_id"], accounts=[mailed], force=True, relays=fixed.relays())
    assert forced["delivered_now"] == 0 and not pdf[mailed].exists(), "a mailed note is never rebuilt"
    assert len(outbox_messages(fresh.outbox)) == 1


def test_a_follow_up_that_writes_makes_its_paper_list_with_the_run_s_settings_not_the_shell_s(redis_url, tmp_path,
                                                                                               caplog):
    """`close`, `reconcile`, `bounces` and `rerun` rewrite the report's paper list (its due dates)
    and make notes and mails: with the run's CN_PAPER_DUE_DAYS and CN_ENCRYPTION, each that
    differs said; a shell asking for stronger encryption than the run's gets it. `status` and
    `verify`, which only read, are not told. Before, each took the shell's."""
    import logging

    from pipeline.followup.located import locate
    from pipeline.record.manifest import SplitResult, save_manifest
    from pipeline.record.state import RunState
    from pipeline.record.storage import open_store
    from pipeline.settings import Settings

    store = open_store(str(tmp_path / "store"))
    state = RunState(redis_url, f"{TRADE_DATE}-madewith")
    save_manifest(store, state.run_id, SplitResult([0], 20))
    state.start({"date": TRADE_DATE, "store_url": store.url,
                 "made_with": json.dumps({"paper_due_days": 5, "encryption": "aes256", "mail_from": "Desk <d@x.test>"})})
    shell = Settings(redis_url=redis_url, store_url=store.url, paper_due_days=1, encryption="none")
    with caplog.at_level(logging.WARNING):
        writes = locate(shell, state.run_id, writes=True, command="close").settings
    reads = locate(shell, state.run_id, command="status").settings
    assert (writes.paper_due_days, writes.encryption, writes.mail_from) == (5, "aes256", "Desk <d@x.test>")
    assert (reads.paper_due_days, reads.encryption) == (1, "none")
    assert f"close {state.run_id}: CN_PAPER_DUE_DAYS is the run's 5, not this shell's 1" in caplog.text
    state.update_meta(made_with=json.dumps({"encryption": "none"}))  # a run made unencrypted by mistake
    stronger = locate(dataclasses.replace(shell, encryption="aes256"), state.run_id, writes=True).settings
    assert stronger.encryption == "aes256"
