"""Targeted reruns: failed accounts are delivered once, from where they stopped; delivered ones
are not touched (counted at the SMTP servers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from pipeline.cluster.driver import RunRequest, rerun, run_day
from pipeline.embedded import free_port
from pipeline.record import keys
from pipeline.settings import ROOT
from tests.conftest import TRADE_DATE
from tests.helpers import client_rows, outbox_messages


def mids(outbox: Path) -> Counter:
    return Counter(m["Message-ID"] for m in outbox_messages(outbox))


def failing_first_run(settings, day: Path, smtp_server) -> tuple[dict, str, str, object]:
    """A run in which one account fails at signing (its PAN is the owner password) and one at
    the relay (it rejects that address): the run, the two victims, the relay."""
    clients = client_rows(day)
    traded = sorted({line.split(",")[4] for line in (day / "trades.csv").read_text().splitlines()[1:]})
    sign_victim, mail_victim = traded[0], traded[1]
    first_relay = smtp_server("first", reject={clients[mail_victim]["email"]})
    broken = settings.__class__(**{**settings.__dict__, "smtp_url": first_relay.url,
                                   "owner_password": clients[sign_victim]["pan"]})
    first = run_day(broken, RunRequest(TRADE_DATE, str(day)))
    assert first["failed"] == 2
    return first, sign_victim, mail_victim, first_relay


def test_rerun_failed_resumes_each_account_and_leaves_delivered_ones_alone(ray_session, settings, day, smtp_server):
    first, sign_victim, mail_victim, first_relay = failing_first_run(settings, day, smtp_server)
    traded = sorted({line.split(",")[4] for line in (day / "trades.csv").read_text().splitlines()[1:]})
    from pipeline.record.records import history
    from pipeline.record.state import RunState

    state = RunState(settings.redis_url, first["run_id"])
    records = state.accounts([sign_victim, mail_victim])
    assert (records[sign_victim]["failed_at"], records[mail_victim]["failed_at"]) == ("signed", "delivered")
    archived = Path(settings.store_url) / keys.signed_pdf_key(TRADE_DATE, mail_victim)
    archived_bytes = archived.read_bytes()

    second_relay = smtp_server("second")
    fixed = settings.__class__(**{**settings.__dict__, "smtp_url": second_relay.url})
    again = rerun(fixed, first["run_id"], failed=True, relays=fixed.relays())  # told: not the run's own relay

    assert again["rerun_accounts"] == sorted([sign_victim, mail_victim])
    assert again["delivered"] == again["accounts"] and again["failed"] == 0
    assert len(mids(first_relay.outbox)) == first["delivered"] == len(traded) - 2
    second = mids(second_relay.outbox)
    assert sorted(second.values()) == [1, 1]
    assert not set(second) & set(mids(first_relay.outbox))
    assert archived.read_bytes() == archived_bytes, "an archived note is mailed, not re-rendered"
    stages = [e["stage"] for e in history(state.accounts([mail_victim])[mail_victim])]
    assert stages.count("rendered") == 1 and stages[-1] == "delivered"

    assert rerun(fixed, first["run_id"], failed=True)["rerun_accounts"] == []
    forced = rerun(fixed, first["run_id"], accounts=[traded[2]], force=True)  # not told: the run's own relay
    assert forced["delivered_now"] == 1 and forced["relays"] == first_relay.url
    assert len(outbox_messages(second_relay.outbox)) == 2
    assert len(outbox_messages(first_relay.outbox)) == first["delivered"] + 1


def test_status_and_rerun_commands_speak_json(ray_session, settings, day, smtp_sink):
    summary = run_day(settings, RunRequest(TRADE_DATE, str(day)))
    env = {**os.environ, "REDIS_URL": settings.redis_url, "PYTHONPATH": ROOT,
           "RAY_ADDRESS": ray_session.address_info["address"], "CN_STORE": settings.store_url,
           "SMTP_URL": settings.smtp_url, "CN_SIGNER_KEY": settings.signer_key,
           "CN_SIGNER_CERT": settings.signer_cert, "CN_SIGNER_CHAIN": settings.signer_chain}
    run = lambda *a: subprocess.run([sys.executable, "-m", "pipeline", *a], capture_output=True, text=True,  # noqa: E731
                                    env=env, cwd=ROOT, timeout=300)

    status = run("status", summary["run_id"], "--json")
    assert status.returncode == 0
    shown = json.loads(status.stdout.splitlines()[-1])
    assert shown["counts"]["delivered"] == summary["delivered"] and shown["meta"]["date"] == TRADE_DATE
    assert run("status", "no-such-run").returncode == 2
    missing = run("rerun", "no-such-run", "--failed")
    assert missing.returncode == 2 and "no run" in missing.stdout
    assert [line[:6] for line in missing.stderr.splitlines()] == ["error:"], "refused in one line, before Ray"
    nothing = run("rerun", summary["run_id"], "--failed")
    assert nothing.returncode == 0, nothing.stderr[-2000:]
    assert json.loads(nothing.stdout.splitlines()[-1])["rerun_accounts"] == []

    env["REDIS_URL"] = f"redis://127.0.0.1:{free_port()}/0"  # the cluster's Redis is gone with the cluster
    later = run("status", summary["run_id"], "--json")
    assert later.returncode == 0, later.stderr[-2000:]
    record = json.loads(later.stdout.splitlines()[-1])
    assert record["source"] == "storage" and record["report"]["statuses"] == {"delivered": summary["delivered"]}
    assert run("status", "no-such-run").returncode == 2
    # one shape from Redis and from storage (before, storage nested all under `report`, without relays, and
    # mixed epoch and ISO times); a table for people
    same = ("trade_date", "input", "accounts", "statuses", "failed", "unconfirmed", "bounced", "paper_owed", "relay",
            "finished_at", "bounce_window", "sealed", "next")
    assert {k: shown[k] for k in same} == {k: record[k] for k in same}, (shown, record)
    assert record["relay"] == settings.smtp_url and record["finished_at"].endswith("+05:30")  # as the report's own times
    assert shown["started_at"][:16] == record["started_at"][:16]
    table = run("status", summary["run_id"]).stdout
    assert f"delivered {summary['delivered']}" in table and "bounce window  open until" in table, table
    assert f"bounces {summary['run_id']}" in table.splitlines()[-1], "what to do next"


def test_a_rerun_from_a_laptop_brings_the_run_back_from_storage_when_its_redis_is_gone(
        ray_session, settings, day, smtp_server):
    first, sign_victim, mail_victim, first_relay = failing_first_run(settings, day, smtp_server)
    archived = Path(settings.store_url) / keys.signed_pdf_key(TRADE_DATE, mail_victim)
    archived_bytes = archived.read_bytes()

    fresh_redis = settings.redis_url.rsplit("/", 1)[0] + "/9"  # a new cluster's Redis: the run is not in it
    import redis

    redis.Redis.from_url(fresh_redis).flushdb()
    second_relay = smtp_server("second")
    env = {**os.environ, "REDIS_URL": fresh_redis, "PYTHONPATH": ROOT, "CN_STORE": settings.store_url,
           "RAY_ADDRESS": ray_session.address_info["address"], "SMTP_URL": second_relay.url,
           "CN_SIGNER_KEY": settings.signer_key, "CN_SIGNER_CERT": settings.signer_cert,
           "CN_SIGNER_CHAIN": settings.signer_chain, "CN_OWNER_PASSWORD": settings.owner_password,
           "CN_SHARD_SIZE": str(settings.shard_size)}
    done = subprocess.run([sys.executable, "-m", "pipeline", "rerun", first["run_id"], "--failed", "--smtp",
                           second_relay.url],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)

    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["rerun_accounts"] == sorted([sign_victim, mail_victim])
    assert sorted(mids(second_relay.outbox).values()) == [1, 1], "each failed account once, nobody else"
    assert len(outbox_messages(first_relay.outbox)) == first["delivered"]
    assert archived.read_bytes() == archived_bytes, "an archived note is mailed, not re-rendered"
    report = json.loads((Path(settings.store_url) / keys.report_keys(first["run_id"])[0]).read_text())
    assert report["statuses"] == {"delivered": first["accounts"]}, "the report covers every account again"
    status = subprocess.run([sys.executable, "-m", "pipeline", "status", first["run_id"], "--json"], capture_output=True,
                            text=True, env=env, cwd=ROOT, timeout=300)
    counted = json.loads(status.stdout.splitlines()[-1])["statuses"]
    assert {k: v for k, v in counted.items() if v} == report["statuses"], "status adds up after restore + rerun"
    again = subprocess.run([sys.executable, "-m", "pipeline", "rerun", first["run_id"], "--failed"],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    nothing = json.loads(again.stdout.splitlines()[-1])
    assert nothing["rerun_accounts"] == [] and nothing["accounts"] == first["accounts"], "the run's, as ever (was 0)"
    assert len(outbox_messages(second_relay.outbox)) == 2


def test_a_run_brought_back_from_storage_keeps_its_start_entity_and_bounce_window_through_a_rerun(
        ray_session, settings, day, smtp_server, tmp_path):
    """Redis lost, a rerun brings the run back from its report: its first start, its issuing
    entity and its bounce window stay the run's, not the rebuild's time or the rerunning shell's
    settings. Before, Redis and then the report took the rebuild's time as the run's start (later
    than its finish), the re-rendered note named the shell's entity under the run's note
    numbers, and the window became the shell's. The run's record is as the version before this
    one wrote it (its entity file's path, no digest, no `made_with`): the rerun uses that path,
    and does not record its own shell's settings as the run's."""
    import dataclasses

    import redis

    from pipeline.record import made_with
    from pipeline.record.manifest import load_manifest, save_manifest
    from pipeline.record.report import started_at
    from pipeline.record.state import RunState
    from pipeline.record.storage import open_store
    from tests.test_entities import COMMODITY, OTHERS, entity_file
    from tests.test_every_segment import note_text

    name = "Example Rerun Broking Limited"
    own = dataclasses.replace(settings, broker_file=entity_file(tmp_path, name, OTHERS + COMMODITY, {}, "ERB"),
                              bounce_window_h=24.0)
    first, sign_victim, _, _ = failing_first_run(own, day, smtp_server)
    store, json_key = open_store(settings.store_url), keys.report_keys(first["run_id"])[0]
    older = {k: v for k, v in json.loads(store.get(json_key)).items() if k == "broker_file" or k not in made_with.KEYS}
    store.put(json_key, json.dumps(older).encode())
    save_manifest(store, first["run_id"], dataclasses.replace(load_manifest(store, first["run_id"]), made_with={}))
    if store.exists(made := keys.first_notes_key(first["run_id"])):
        store.put(made, json.dumps({k: v for k, v in json.loads(store.get(made)).items() if k != "made_with"}).encode())
    laptop = dataclasses.replace(settings, redis_url=settings.redis_url.rsplit("/", 1)[0] + "/10",
                                 smtp_url=smtp_server("second").url)  # the default entity, a 72-h window
    redis.Redis.from_url(laptop.redis_url).flushdb()

    again = rerun(laptop, first["run_id"], failed=True, relays=laptop.relays())  # the first relay rejects one

    assert sign_victim in again["rerun_accounts"] and again["failed"] == 0, again
    meta = RunState(laptop.redis_url, first["run_id"]).meta()
    report = json.loads((Path(settings.store_url) / keys.report_keys(first["run_id"])[0]).read_text())
    assert float(meta["started"]) == first["started_at"] == started_at(report) == again["started_at"]
    assert float(meta["last_started"]) > first["finished_at"] > first["started_at"]  # the rerun's own start
    assert float(meta["bounce_window_h"]) == report["bounce_window"]["hours"] == 24.0
    text = note_text(Path(settings.store_url) / keys.signed_pdf_key(TRADE_DATE, sign_victim),
                     client_rows(day)[sign_victim]["pan"])
    assert name in text and "ERB-26/27-" in text
    assert "made_with" not in meta and "made_with" not in report and "broker_file_sha256" not in report


def test_a_rerun_makes_its_notes_from_the_run_s_own_files_wherever_they_are_kept_now(ray_session, settings, day,
                                                                                    smtp_server, tmp_path):
    """A rerun on another machine (a laptop after the cluster, its Redis empty) where the run's
    entity file is not at the path the run recorded: CN_BROKER_FILE naming a copy of the same file
    is used, and anything else is refused, naming the file, before a note is rendered. Before, the
    rerun always took the recorded path: refused there ("cannot read the broker file") with no way
    to name the copy, and, when another file had been put at that path, re-rendered the run's
    notes under its note numbers with that file's entity and tariff. The run's holiday file is
    the rerun's too, though the laptop names none: before, the rerun's notes took the shell's
    CN_HOLIDAYS_FILE, and with it another settlement date; and so are its sender and its
    encryption (the shell's CN_ENCRYPTION=none archived and mailed the note unencrypted)."""
    import dataclasses

    import pytest
    import redis

    from pipeline.settings import ConfigError
    from tests.test_entities import COMMODITY, OTHERS, entity_file
    from tests.test_every_segment import note_text

    name = "Example Moved Broking Limited"
    recorded = entity_file(tmp_path, name, OTHERS + COMMODITY, {}, "EMB")
    holidays = tmp_path / "holidays.json"  # Monday the 23rd shut: the Friday's trades settle on the 24th
    holidays.write_text(json.dumps({ex: {"2026": {"holidays": {"2026-11-23": "a test holiday"}}} for ex in ("NSE", "BSE")}))
    desk = "Run Desk <notes@run-desk.example.com>"
    first, sign_victim, _, _ = failing_first_run(dataclasses.replace(settings, broker_file=recorded, mail_from=desk,
                                                                     holidays_file=str(holidays)), day, smtp_server)
    copy = tmp_path / "laptop" / "entity.json"
    copy.parent.mkdir()
    Path(recorded).rename(copy)
    second = smtp_server("second")
    laptop = dataclasses.replace(settings, redis_url=settings.redis_url.rsplit("/", 1)[0] + "/12",
                                 smtp_url=second.url, encryption="none")  # nor the run's sender, nor its encryption
    redis.Redis.from_url(laptop.redis_url).flushdb()
    rerun_failed = lambda s: rerun(s, first["run_id"], failed=True, relays=laptop.relays())  # noqa: E731

    refused = r"EMB\.json \(CN_BROKER_FILE\) as it was .* not on this machine; CN_BROKER_FILE \(unset\) is not"
    with pytest.raises(ConfigError, match=refused):
        rerun_failed(laptop)
    Path(recorded).write_text(copy.read_text().replace(name, "Another Broking Limited"))
    with pytest.raises(ConfigError, match="changed since"):
        rerun_failed(laptop)
    again = rerun_failed(dataclasses.replace(laptop, broker_file=str(copy)))

    assert sign_victim in again["rerun_accounts"] and again["failed"] == 0, again
    text = note_text(Path(settings.store_url) / keys.signed_pdf_key(TRADE_DATE, sign_victim),
                     client_rows(day)[sign_victim]["pan"])
    assert name in text and "Another" not in text and "EMB-26/27-" in text
    assert "settles 24-11-2026" in text and "settles 23-11-2026" not in text
    archived = Path(settings.store_url) / keys.signed_pdf_key(TRADE_DATE, sign_victim)
    assert subprocess.run(["qpdf", "--is-encrypted", str(archived)]).returncode == 0, "the run's AES-256, not none"
    assert {m["From"] for m in outbox_messages(second.outbox)} == {desk}


def test_a_run_resumed_mid_split_keeps_the_split_s_shard_count_and_files_whatever_the_shell_says_now(
        ray_session, settings, day, smtp_sink, tmp_path):
    """The head died with the split under way, and its Redis with it: the manifest says so
    (partial, with the shard count it planned and the files its notes are made from), and some
    shards' files are written. The same run id, run again on a new Redis from a shell whose
    CN_SHARD_SIZE and CN_BROKER_FILE differ, finishes that split as it began: every client
    mailed once, each note the run's entity's. Before, the resume planned the shard count again
    from the shell's shard size, kept the shard files written under the first count, and left
    out, unsaid, every account the new count put in those shards; and it rendered the shell's
    entity under the run's note numbers."""
    import dataclasses

    import redis

    from pipeline import credentials
    from tests.test_entities import COMMODITY, OTHERS, entity_file
    from tests.test_every_segment import note_text
    from pipeline.cluster.split_tasks import Split
    from pipeline.record.manifest import load_manifest, save_manifest
    from pipeline.record.storage import open_store

    run_id, store = f"{TRADE_DATE}-midsplit", open_store(settings.store_url)
    name = "Example Resumed Broking Limited"
    first = dataclasses.replace(settings, shard_size=1,  # a shard per client: more shards than the least a day has
                                broker_file=entity_file(tmp_path, name, OTHERS + COMMODITY, {}, "ERS"))
    split = Split.start(credentials.for_render(first), run_id, TRADE_DATE, str(day), 2, False, lambda: None)
    save_manifest(store, run_id, split.partial())  # as the driver saves it once the dumps are read
    split.done(block=True)
    shard_files = [k for s in split.shards() if store.exists(k := keys.shard_key(run_id, s))]
    planned = load_manifest(store, run_id).shard_count
    assert planned > 1 and len(shard_files) > 1, planned
    for key in shard_files[::2]:  # half the shards' files written before the driver died, the rest not
        (Path(settings.store_url) / key).unlink()

    new_head = dataclasses.replace(settings, redis_url=settings.redis_url.rsplit("/", 1)[0] + "/13")
    redis.Redis.from_url(new_head.redis_url).flushdb()
    resumed = run_day(new_head, RunRequest(TRADE_DATE, str(day), run_id=run_id))  # 8 clients a shard, the default entity

    clients = client_rows(day)
    sent = Counter(m["To"].addresses[0].addr_spec for m in outbox_messages(smtp_sink.outbox))
    assert sorted(sent.values()) == [1] * resumed["delivered"] and resumed["failed"] == 0, resumed
    assert sorted(sent) == sorted(c["email"] for c in clients.values() if c["email"]), "each client mailed once"
    assert resumed["accounts"] == len(clients) and load_manifest(store, run_id).shard_count == planned, resumed
    ucc = next(u for u, c in clients.items() if c["email"])
    text = note_text(Path(settings.store_url) / keys.signed_pdf_key(TRADE_DATE, ucc), clients[ucc]["pan"])
    assert name in text and "ERS-26/27-" in text


def test_a_run_resumed_after_its_first_notes_alone_splits_with_their_shard_count(
        ray_session, settings, day, smtp_sink, tmp_path):
    """The head died after the driver had mailed its first notes and recorded them, before the
    split's manifest was saved, and its Redis with it: the first notes' record is all the split
    left. The same run id, run again on a new Redis from a shell whose CN_SHARD_SIZE differs,
    splits with the record's shard count, so the first notes' shard's accounts are in the shard
    whose delivery log holds them: every other client mailed once, those not again. Planned from
    the shell's shard size, they fell in other shards and were mailed a second time."""
    import dataclasses
    import email
    import shutil
    from email import policy

    import redis

    from pipeline.day.split import shard_count
    from pipeline.record.manifest import load_first_notes, load_manifest
    from pipeline.record.storage import open_store

    clients = client_rows(day)
    first = dataclasses.replace(settings, shard_size=1)  # a shard per client: the first notes' shard is one of many
    done = run_day(first, RunRequest(TRADE_DATE, str(day)))
    run_id, root = done["run_id"], Path(settings.store_url)
    made = load_first_notes(open_store(settings.store_url), run_id)
    new_head = dataclasses.replace(settings, redis_url=settings.redis_url.rsplit("/", 1)[0] + "/13")
    assert made and made["numbers"] and made["shard_count"] != shard_count(len(clients), new_head.shard_size), made
    lead = {u for u in clients if keys.shard_of(u, made["shard_count"]) == made["shard"]}
    assert set(made["numbers"]) <= lead, made
    # the record as that moment left it: the first notes' shard's log and notes, no manifest, no shard's
    # files, no report, no other shard's log or note
    for key in [keys.manifest_key(run_id), *keys.report_keys(run_id), *(keys.shard_key(run_id, n) for n in
                range(made["shard_count"])), *(keys.signed_pdf_key(TRADE_DATE, u) for u in set(clients) - lead)]:
        (root / key).unlink(missing_ok=True)
    kept = root / keys.delivery_log_prefix(run_id, made["shard"])
    for log_dir in root.glob(f"*-delivery-log/{run_id}/shard-*"):
        if log_dir != kept:
            shutil.rmtree(log_dir)
    before = set(smtp_sink.outbox.glob("*.eml"))

    redis.Redis.from_url(new_head.redis_url).flushdb()
    run_day(new_head, RunRequest(TRADE_DATE, str(day), run_id=run_id))  # another CN_SHARD_SIZE than the run's

    sent = Counter(email.message_from_bytes(p.read_bytes(), policy=policy.default)["To"].addresses[0].addr_spec
                   for p in set(smtp_sink.outbox.glob("*.eml")) - before)
    others = {c["email"] for u, c in clients.items() if c["email"] and u not in lead}
    assert set(sent) == others and set(sent.values()) == {1}, (sent, lead)
    assert load_manifest(open_store(settings.store_url), run_id).shard_count == made["shard_count"]


def test_a_run_resumed_with_another_date_is_refused_naming_its_own(settings, day):
    """`run --run-id R --date D2` for a run of another day: before, nothing refused it, and the
    run's notes would have been dated, settled and archived for D2, and its record's date made D2
    (from then on, every link it had mailed for its own day refused by the status service)."""
    import pytest

    from pipeline.cluster.driver import preflight
    from pipeline.record.state import RunState
    from pipeline.record.storage import open_store
    from pipeline.settings import ConfigError

    store = open_store(settings.store_url)
    in_redis, reported, by_its_id = f"{TRADE_DATE}-dated", "resumed-by-hand", f"{TRADE_DATE}-0123abcd"
    RunState.of(settings, in_redis).start({"date": TRADE_DATE, "input": str(day)})
    store.put(keys.report_keys(reported)[0], json.dumps({"trade_date": TRADE_DATE, "accounts": 1}).encode())  # Redis forgot it
    for run_id in (in_redis, reported, by_its_id):  # each began: its split's manifest is in storage
        store.put(keys.manifest_key(run_id), b'{"shards": [0], "shard_count": 1}')
        with pytest.raises(ConfigError, match=f"run {run_id} is trade date {TRADE_DATE}'s, not --date 2026-11-23's"):
            preflight(settings, RunRequest("2026-11-23", str(day), run_id=run_id), run_id)
        preflight(settings, RunRequest(TRADE_DATE, str(day), run_id=run_id), run_id)  # its own date: goes on
    cut_short = "report-cut-short"  # its report edited: its date is not known, and the resume goes on
    store.put(keys.report_keys(cut_short)[0], b'{"trade_date": "2026-')
    store.put(keys.manifest_key(cut_short), b'{"shards": [0], "shard_count": 1}')
    preflight(settings, RunRequest(TRADE_DATE, str(day), run_id=cut_short), cut_short)


def test_a_run_that_died_before_its_split_wrote_anything_keeps_its_record_when_resumed_told(redis_url, settings):
    """A run's start recorded in Redis what its notes are made with; its driver died before the
    split wrote a manifest or its first notes' record. `run --run-id` resumes it from a shell told
    to take the Reply-To (CN_SHELL_SETTINGS): the record keeps the run's, and the shell's is what
    the driver's line in the run's log names as taken. Before, storage having nothing made the
    run look new, and the shell's Reply-To became the run's record, unsaid."""
    import dataclasses

    from pipeline.cluster.driver import _made_with_record
    from pipeline.record import made_with
    from pipeline.record.state import RunState

    run, shell = dataclasses.replace(settings, mail_reply_to="Desk <desk@broker.exmaple.com>"), dataclasses.replace(
        settings, mail_reply_to="Desk <desk@broker.example.com>", shell_settings="CN_MAIL_REPLY_TO")
    state = RunState(redis_url, f"{TRADE_DATE}-died-in-split")
    state.start({"date": TRADE_DATE, "input": "", **made_with.recorded(run)})
    record, begun = _made_with_record(shell, state, None, None)
    assert begun and made_with.value(record, "mail_reply_to") == run.mail_reply_to
    assert made_with.taken(shell, record) == {"mail_reply_to": shell.mail_reply_to}
    fresh = _made_with_record(shell, RunState(redis_url, f"{TRADE_DATE}-never-started"), None, None)
    assert fresh == (made_with.recorded(shell), False)


def test_a_rerun_told_to_take_a_setting_from_its_shell_mails_with_it_and_the_run_keeps_its_own(
        ray_session, settings, day, smtp_server, caplog):
    """The run's reply address was mistyped, and it was made unencrypted by mistake. Its rerun,
    told to (CN_SHELL_SETTINGS), mails the failed account with the shell's corrected address and
    says so, in the run's log in storage too; the run's record (Redis, the report, the manifest)
    keeps the address the run mailed with, and takes the stronger encryption the rerun asked for.
    The next rerun, not told, from the shell that made the mistake, uses the run's address and
    encryption. A setting whose change would break another record (the encryption made weaker,
    the bounce address `bounces` matches) cannot be taken from the shell, nor one the shell does
    not set. Before, nothing could correct a recorded setting for a rerun; and every rerun
    recorded its own settings as the run's. A run brought back from a report written before the
    encryption was made stronger keeps the stronger, which its manifest says."""
    import dataclasses
    import logging

    import pytest
    import redis

    from pipeline.record.manifest import load_manifest
    from pipeline.record.state import RunState
    from pipeline.record.storage import open_store
    from pipeline.settings import ConfigError
    from tests.helpers import attachment

    typo, fixed = "Desk <desk@broker.exmaple.com>", "Desk <desk@broker.example.com>"
    clients = client_rows(day)
    victim = sorted({line.split(",")[4] for line in (day / "trades.csv").read_text().splitlines()[1:]})[1]
    first = run_day(dataclasses.replace(settings, mail_reply_to=typo, encryption="none",
                                        smtp_url=smtp_server("first", reject={clients[victim]["email"]}).url),
                    RunRequest(TRADE_DATE, str(day)))
    run_id, relay, store = first["run_id"], smtp_server("second"), open_store(settings.store_url)
    assert first["failed"] == 1, first
    stale = {k: store.get(k) for k in keys.report_keys(run_id)}  # the report as it stood before the reruns
    shell = dataclasses.replace(settings, mail_reply_to=fixed)  # and CN_ENCRYPTION's default, aes256
    for told, refused in (("CN_MAIL_REPLYTO", "names CN_MAIL_REPLYTO: it takes only"),
                          ("CN_MAIL_REPLY_TO,CN_BOUNCE_DOMAIN", "names CN_BOUNCE_DOMAIN: it takes only"),
                          ("CN_SIGN_REASON", "names CN_SIGN_REASON, which this shell does not set")):
        with pytest.raises(ConfigError, match=refused):
            rerun(dataclasses.replace(shell, shell_settings=told), run_id, [victim], relays=relay.url)
    with caplog.at_level(logging.WARNING):
        again = rerun(dataclasses.replace(shell, shell_settings="CN_MAIL_REPLY_TO"), run_id, [victim],
                      relays=relay.url)
    assert again["rerun_outcomes"] == {"delivered": 1}, again
    assert caplog.text.count(f"CN_MAIL_REPLY_TO is this shell's {fixed!r}, as CN_SHELL_SETTINGS asks, not the run's "
                             f"{typo!r}") == 1, "said once, though the rerun and the run it resumes both find it"
    assert [m["Reply-To"] for m in outbox_messages(relay.outbox)] == [fixed]
    run_log = "".join(p.read_text() for p in sorted((Path(settings.store_url) / "logs" / run_id).glob("*.log")))
    assert f"made with this shell's CN_MAIL_REPLY_TO={fixed!r}" in caplog.text
    assert "made with this shell's CN_MAIL_REPLY_TO='Desk <d***@broker.example.com>'" in run_log, run_log  # masked

    report = json.loads(store.get(keys.report_keys(run_id)[0]))
    for record in (RunState.of(settings, run_id).meta(), report):
        assert json.loads(record["made_with"])["mail_reply_to"] == typo, "the run's own, as it mailed its day"
        assert json.loads(record["made_with"])["encryption"] == "aes256", "stronger from the rerun on"
    manifest = json.loads(load_manifest(store, run_id).made_with["made_with"])
    assert (manifest["mail_reply_to"], manifest["encryption"]) == (typo, "aes256"), "as Redis and the report say"
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # not told, from the shell that made the mistake: the run's
        rerun(dataclasses.replace(shell, encryption="none"), run_id, [victim], force=True, relays=relay.url)
    assert f"CN_MAIL_REPLY_TO is the run's {typo!r}, not this shell's {fixed!r}" in caplog.text
    assert "CN_ENCRYPTION is the run's 'aes256', not this shell's 'none'" in caplog.text
    assert sorted(m["Reply-To"] for m in outbox_messages(relay.outbox)) == sorted([fixed, typo])

    # The rerun that made it stronger died before its report; Redis has forgotten the run since.
    # Brought back from that report, the run keeps the encryption its manifest says: before, it
    # went back to none, and the next rerun from the shell that made the mistake made its notes so.
    for key, data in stale.items():
        (Path(settings.store_url) / key).write_bytes(data)
    new_head = dataclasses.replace(shell, encryption="none", redis_url=settings.redis_url.rsplit("/", 1)[0] + "/12")
    redis.Redis.from_url(new_head.redis_url).flushdb()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        rerun(new_head, run_id, [victim], force=True, relays=relay.url)
    assert "CN_ENCRYPTION is the run's 'aes256', not this shell's 'none'" in caplog.text
    assert json.loads(RunState.of(new_head, run_id).meta()["made_with"])["encryption"] == "aes256"
    archived = store.get(keys.signed_pdf_key(TRADE_DATE, victim))  # signed by the first run: never replaced
    assert [attachment(m)[1] for m in outbox_messages(relay.outbox)] == [archived] * 3


def test_a_rerun_exits_0_when_each_account_it_took_was_delivered_though_others_of_the_run_are_not(
        ray_session, settings, day, smtp_server):
    """The README: exit 0 only if each account the rerun takes is delivered or sent to paper.
    The run's other failed account (still failing: its PAN is the owner password) is not this
    rerun's; before, its failure made this rerun exit 1."""
    first, sign_victim, mail_victim, _ = failing_first_run(settings, day, smtp_server)
    relay = smtp_server("second")
    env = {**os.environ, "REDIS_URL": settings.redis_url, "PYTHONPATH": ROOT,
           "RAY_ADDRESS": ray_session.address_info["address"], "CN_STORE": settings.store_url,
           "CN_SIGNER_KEY": settings.signer_key, "CN_SIGNER_CERT": settings.signer_cert,
           "CN_SIGNER_CHAIN": settings.signer_chain, "CN_TOKEN_KEY_FILE": settings.token_key_file,
           "CN_OWNER_PASSWORD": client_rows(day)[sign_victim]["pan"]}
    run = lambda *a: subprocess.run([sys.executable, "-m", "pipeline", "rerun", first["run_id"], *a],  # noqa: E731
                                    capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    done = run("--accounts", mail_victim, "--smtp", relay.url)
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["rerun_outcomes"] == {"delivered": 1} and summary["failed"] == 1, summary
    assert done.returncode == 0, done.stderr[-2000:]
    still = run("--accounts", sign_victim, "--smtp", relay.url)
    assert json.loads(still.stdout.splitlines()[-1])["rerun_outcomes"] == {"failed": 1}
    assert still.returncode == 1
    assert len(mids(relay.outbox)) == 1


def test_the_message_id_domain_is_the_broker_s_and_a_rerun_keeps_the_run_s_own(ray_session, settings, day,
                                                                                smtp_server):
    """Before, every Message-ID ended in @contract-notes.invalid and nothing could change it."""
    import dataclasses

    relay = smtp_server("mid-domain")
    own = dataclasses.replace(settings, smtp_url=relay.url, message_id_domain="mail.broker.example.com")
    first = run_day(own, RunRequest(TRADE_DATE, str(day)))
    sent = mids(relay.outbox)
    assert len(sent) == first["delivered"] > 0 and all(m.endswith("@mail.broker.example.com>") for m in sent), sent
    ucc = next(iter(sent)).strip("<>").rsplit("@", 1)[0].split(".", 1)[1]
    again = rerun(dataclasses.replace(own, message_id_domain="other.example.com"), first["run_id"], accounts=[ucc],
                  force=True)  # this shell says another domain: the run's own is kept
    assert again["delivered_now"] == 1
    assert mids(relay.outbox) - sent == Counter({next(m for m in sent if f".{ucc}@" in m): 1})


def test_rerun_of_accounts_the_run_lacks_is_refused_before_ray_starts_naming_each(redis_url, tmp_path):
    """`rerun RUN --accounts C9999999,c0000001` exited 0 with both under `not_in_run`: a typo read as
    a success. Now: exit 2, one line naming each, the upper-case code hinted; Ray not started."""
    from pipeline.record.manifest import SplitResult, save_manifest
    from pipeline.record.records import Outcome
    from pipeline.record.state import RunState
    from pipeline.record.storage import open_store

    run_id = f"typo-{os.urandom(3).hex()}"
    state = RunState(redis_url, run_id)
    state.start({"date": TRADE_DATE, "input": str(tmp_path / "in"), "finished": "1"})
    state.record([Outcome("C0000001", "delivered", message_id="<m@x>", reply="250 ok")])
    save_manifest(open_store(str(tmp_path / "store")), run_id, SplitResult([0], 10, 1))
    env = {**os.environ, "REDIS_URL": redis_url, "CN_STORE": str(tmp_path / "store"), "RAY_ADDRESS": "127.0.0.1:1"}
    done = subprocess.run([sys.executable, "-m", "pipeline", "rerun", run_id, "--accounts", "C9999999,c0000001"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    said = [line for line in done.stderr.splitlines() if line.strip()]
    assert said[-1] == (f"error: run {run_id} has no account C9999999, c0000001 (client codes are upper-case: "
                        "C0000001)"), done.stderr


def test_a_second_fresh_run_of_a_day_is_refused_before_it_mails_the_first_run_s_notes_again(
        ray_session, settings, day, smtp_sink, tmp_path):
    """A day run, then the same date run again under a new run id on the same store: refused at
    once, one line naming the first run and `rerun`; the relay got each note once. Before, the
    second run found every note archived, rendered none and mailed the first run's notes again
    under its own mail guard: each client twice. A run that held the date and never started
    (refused at preflight) leaves it to the next."""
    from pipeline.errors import DayTaken
    from pipeline.record import day_claim
    from pipeline.record.storage import open_store

    first = run_day(settings, RunRequest(TRADE_DATE, str(day)))
    assert first["delivered"] > 0
    mailed = mids(smtp_sink.outbox)
    try:
        run_day(settings, RunRequest(TRADE_DATE, str(day)))
        raise AssertionError("the second run of the day was not refused")
    except DayTaken as e:
        assert f"run {first['run_id']}'s" in str(e) and f"rerun {first['run_id']}" in str(e), e
    assert mids(smtp_sink.outbox) == mailed and set(mailed.values()) == {1}

    other = open_store(str(tmp_path / "other-store"))
    day_claim.claim(other, TRADE_DATE, "never-started", lambda run: False)
    day_claim.claim(other, TRADE_DATE, "the-next", lambda run: False)  # the holder never started: taken over
    assert json.loads(other.get(keys.day_claim_key(TRADE_DATE)))["run_id"] == "the-next"


def test_a_rerun_stopped_midway_leaves_the_run_finished_again_in_every_view_and_closable(
        ray_session, settings, day, smtp_server, monkeypatch, capsys):
    """A rerun cleared the run's end when it began, and only its own end set it again: one that
    stopped (a notebook's interrupt, a role with no node) left `status` and the page saying
    running for good, `runs` saying finished with the counts before it, and `close` refusing a
    run that "has not finished". Now its stop ends the run again, its report written again
    from Redis, so every view says one thing, and each account it took has an outcome."""
    import dataclasses

    import pytest

    from pipeline.__main__ import main
    from pipeline.followup import close as proof
    from pipeline.record.state import RunState

    first, sign_victim, mail_victim, _ = failing_first_run(settings, day, smtp_server)
    run_id, state = first["run_id"], RunState(settings.redis_url, first["run_id"])
    slow = smtp_server("slow", delay_ms=3000)  # a relay slow to answer: the stop comes while the rerun waits on it
    fixed = dataclasses.replace(settings, smtp_url=slow.url)

    monkeypatch.setenv("REDIS_URL", settings.redis_url)
    during = {}

    def interrupted() -> None:  # the driver's wait, as a notebook's Ctrl-C or the capacity watch's stop meets it
        assert main(["status", run_id, "--store", settings.store_url, "--json"]) == 0
        during["status"] = json.loads(capsys.readouterr().out)["state"]
        assert main(["runs", "--store", settings.store_url, "--json"]) == 0  # before, "finished" (its report's)
        during["runs"] = next(r for r in json.loads(capsys.readouterr().out) if r["run_id"] == run_id)["state"]
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        run_day(fixed, RunRequest(TRADE_DATE, str(day), run_id, frozenset({sign_victim, mail_victim}),
                                  relays=fixed.relays()), watch=interrupted)

    assert during == {"status": "running", "runs": "running"}, "while the rerun ran, every view said so"
    assert state.final_counts()["pending"] == 0, "each account the rerun took has an outcome"
    assert main(["status", run_id, "--store", settings.store_url, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert main(["runs", "--store", settings.store_url, "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out) if r["run_id"] == run_id)
    assert status["state"] == row["state"] == "finished", (status["state"], row["state"])
    assert {k: status[k] for k in ("delivered", "failed", "unconfirmed")} == \
        {k: row[k] for k in ("delivered", "failed", "unconfirmed")}
    stopped = json.loads((Path(settings.store_url) / keys.report_keys(run_id)[0]).read_text())
    assert "KeyboardInterrupt" in stopped["last_stopped"] and stopped["finished_at"] > first["finished_at"]
    sealed = proof.close(settings, run_id, now=float(state.meta()["finished"]) + 73 * 3600)
    assert not sealed["already_sealed"], "closable: its window runs from the stop"


def test_a_rerun_stopped_before_it_began_leaves_the_run_as_its_last_driver_ended_it(ray_session, settings, day,
                                                                                     smtp_server):
    """Only a rerun that cleared the run's end (its start in Redis) ends the run again when it
    stops. One stopped before that, here by the store giving garbage for the run's first-notes
    record, has taken no account and mailed nothing: the run's end, its report and its accounts'
    outcomes stay as its last driver left them, not a new end and "the rerun stopped" for each."""
    import pytest

    from pipeline.record.state import RunState
    from pipeline.record.storage import Garbled

    first, sign_victim, mail_victim, _ = failing_first_run(settings, day, smtp_server)
    run_id, state, victims = first["run_id"], RunState(settings.redis_url, first["run_id"]), [sign_victim, mail_victim]
    reported = Path(settings.store_url) / keys.report_keys(run_id)[0]
    ended, report, outcomes = state.meta()["finished"], reported.read_bytes(), state.accounts(victims)
    garbled = Path(settings.store_url) / keys.first_notes_key(run_id)  # read by the rerun after its checks
    garbled.parent.mkdir(parents=True, exist_ok=True)
    garbled.write_text("{not json")

    with pytest.raises(Garbled):
        run_day(settings, RunRequest(TRADE_DATE, str(day), run_id, frozenset(victims), relays=settings.relays()))

    assert (state.meta()["finished"], reported.read_bytes(), state.accounts(victims)) == (ended, report, outcomes)


def test_run_with_the_run_id_keeps_the_run_s_own_relays_and_bounce_window(ray_session, settings, day, smtp_server,
                                                                          monkeypatch):
    """`run --run-id`, the way back from a lost head, recorded its shell's SMTP_URL and
    CN_BOUNCE_WINDOW_H over the run's own: the run's later reruns mailed through the other relay,
    and its close went by the other window. Now it keeps them, as `rerun` does, unless --smtp
    names another relay."""
    import dataclasses

    from pipeline.__main__ import main
    from pipeline.record import report
    from pipeline.record.state import RunState

    own = smtp_server("own")
    run_id = run_day(dataclasses.replace(settings, smtp_url=own.url), RunRequest(TRADE_DATE, str(day)))["run_id"]
    state = RunState(settings.redis_url, run_id)
    recorded = {k: state.meta()[k] for k in ("relays", "bounce_window_h")}
    other = smtp_server("other")
    for name, value in {"REDIS_URL": settings.redis_url, "CN_STORE": settings.store_url, "SMTP_URL": other.url,
                        "CN_BOUNCE_WINDOW_H": "1", "CN_SIGNER_KEY": settings.signer_key,
                        "CN_SIGNER_CERT": settings.signer_cert, "CN_SIGNER_CHAIN": settings.signer_chain,
                        "CN_TOKEN_KEY_FILE": settings.token_key_file, "CN_OWNER_PASSWORD": settings.owner_password,
                        "CN_SHARD_SIZE": "8", "CN_WINDOW": "4", "CN_SIGNERS": "1", "CN_MAILERS": "1"}.items():
        monkeypatch.setenv(name, value)
    resume = ["run", "--date", TRADE_DATE, "--input", str(day), "--run-id", run_id, "--accept-volatile-redis"]
    assert main(resume) != 2
    assert {k: state.meta()[k] for k in recorded} == recorded, "the run's own, not the shell's"
    written = json.loads((Path(settings.store_url) / keys.report_keys(run_id)[0]).read_text())
    assert (written["relays"], report.window_h(state.meta())) == (recorded["relays"], 72.0)
    lost = settings.redis_url.rsplit("/", 1)[0] + "/12"  # the head lost with its Redis: the run's report keeps them
    RunState(lost, run_id).r.flushdb()
    monkeypatch.setenv("REDIS_URL", lost)
    assert main(resume) != 2
    assert {k: RunState(lost, run_id).meta()[k] for k in recorded} == recorded, "from its report"
