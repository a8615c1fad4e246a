"""Hostile and broken input at the edge: one bad byte, field or row rejects its own account,
named by file, row and field; its shard-mates go on; a file that cannot be used at all stops
the run with one line and exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipeline.day.dumps import InputError, parse_trade
from pipeline.day.split import split_day
from pipeline.record.records import Outcome
from pipeline.record.state import RunState
from pipeline.record.storage import open_store
from pipeline.settings import ROOT
from tests.test_note_correctness import CLIENT, DATE, HAND_MADE, N, write_day

INNOCENTS = [dict(CLIENT, ucc=f"OK{i}", pan=f"ABCDE{1000 + i}F", email=f"ok{i}@example.com") for i in range(6)]
POISONED = dict(CLIENT, ucc="BAD1", pan="ABCDE9999F", email="bad1@example.com")


def trades_for(clients) -> list[dict]:
    out = []
    for i, c in enumerate(clients):
        out += [dict(t, ucc=c["ucc"], order_no=N(1000 * i + int(t["order_no"])), trade_no=N(1000 * i + int(t["trade_no"])))
                for t in HAND_MADE[:2]]
    return out


def split_with(tmp_path, redis_url, poison: dict | None = None, raw: bytes | None = None, client=POISONED):
    """A day of six innocent accounts and one poisoned one; `poison` replaces fields of the
    poisoned account's first trade, `raw` replaces that trade's row bytes in trades.csv."""
    clients = INNOCENTS + [client]
    trades = trades_for(clients)
    if poison:
        trades[-2] = {**trades[-2], **poison}
    folder = write_day(tmp_path / "in", trades=trades, clients=clients)
    if raw is not None:
        lines = (folder / "trades.csv").read_bytes().split(b"\r\n")
        lines[-3] = raw  # the poisoned account's first trade (the file ends with CRLF)
        (folder / "trades.csv").write_bytes(b"\r\n".join(lines))
    run_id = f"hostile-{os.urandom(3).hex()}"
    state = RunState(redis_url, run_id)
    split = split_day(open_store(str(folder)), open_store(str(tmp_path / "store")), state, run_id, DATE, 4, "CNT")
    return split, state.accounts([c["ucc"] for c in clients])


def assert_only_the_poisoned_account_is_rejected(split, records, field: str, problem: str, row: int = 13):
    assert split.accounts == 6 and split.rejected == 1, split
    assert all(records[c["ucc"]]["stage"] == "validated" for c in INNOCENTS)
    reason = records["BAD1"]["reason"]
    assert reason.startswith(f"trades.csv row {row} field '{field}'") and problem in reason, reason


@pytest.mark.parametrize("field,value,problem", [
    ("price", "1e30", "is not a number"),
    ("price", "1e-30", "is not a number"),
    ("price", "20000000", "outside 0.01 to 10,000,000"),
    ("price", "0.001", "outside 0.01 to 10,000,000"),
    ("quantity", str(10**30), "is not a whole number"),
    ("quantity", "1_000", "is not a whole number"),
    ("quantity", "١٠", "is not a whole number"),
    ("symbol", "SBIN\nEQ FORGED ROW", "contains a control character"),
    ("symbol", "SBIN EQ", "must be 1-30 capitals"),
    ("isin", "INE062A0102", "is not an Indian ISIN"),
    ("symbol", "S" * 200_000, "200,000 characters long"),
])
def test_one_bad_field_rejects_its_account_by_file_row_and_field_and_spares_its_shard_mates(
        tmp_path, redis_url, field, value, problem):
    split, records = split_with(tmp_path, redis_url, {field: value})
    assert_only_the_poisoned_account_is_rejected(split, records, field, problem)


def test_a_field_in_cp1252_is_a_row_error_not_a_crash(tmp_path, redis_url):
    row = ",".join([DATE, "NSE", "CM", "CM2026327", "BAD1", N(1), "10:00:00", N(2), "10:00:05", "SBIN",
                    "INE062A01020", "EQ", "", "", "", "B", "10", "820.00", "MIS", "11"]).encode()
    split, records = split_with(tmp_path, redis_url, raw=row.replace(b"SBIN,", b"SB\xe9N,"))  # é in cp1252
    assert_only_the_poisoned_account_is_rejected(split, records, "symbol", "is not UTF-8")


def test_a_row_the_csv_module_cannot_parse_is_a_row_error(tmp_path, redis_url):
    split, _ = split_with(tmp_path, redis_url, raw=b'x,"unterminated\x00')
    assert split.accounts == 6 and any(e["row"] == 13 for e in split.input_errors), split.input_errors


def test_a_byte_order_mark_and_crlf_line_ends_are_accepted(tmp_path, redis_url):
    folder = write_day(tmp_path / "in", trades=trades_for(INNOCENTS), clients=INNOCENTS)
    for name in ("clients.csv", "trades.csv", "bhavcopy.csv"):
        (folder / name).write_bytes(b"\xef\xbb\xbf" + (folder / name).read_bytes())
    assert b"\r\n" in (folder / "trades.csv").read_bytes()
    state = RunState(redis_url, "bom")
    split = split_day(open_store(str(folder)), open_store(str(tmp_path / "store")), state, "bom", DATE, 4, "CNT")
    assert (split.accounts, split.rejected, split.input_errors) == (6, 0, [])


def test_a_client_with_a_control_character_or_a_non_ascii_address_is_caught(tmp_path, redis_url):
    from pipeline.day.dumps import EMAIL

    split, records = split_with(tmp_path, redis_url, client=dict(POISONED, name="Evil\rName"))
    assert split.rejected == 1 and "field 'name': contains a control character" in records["BAD1"]["reason"]
    assert not EMAIL.match("üé@example.com")  # goes to physical dispatch instead of crashing the mailer


@pytest.mark.parametrize("field,value,problem", [
    ("expiry", "garbage", "not a date"),
    ("strike", "abc", "not a number"),
])
def test_derivatives_fields_are_checked_at_validation_not_at_rendering(field, value, problem):
    from pipeline.day.dumps import RowError

    opt = dict(HAND_MADE[-5], **{field: value})
    with pytest.raises(RowError, match=problem):
        parse_trade("trades.csv", 9, opt, DATE)


def test_a_missing_column_or_a_missing_file_is_an_input_error_of_the_run(tmp_path, redis_url):
    folder = write_day(tmp_path / "in")
    (folder / "trades.csv").write_text((folder / "trades.csv").read_text().replace("quantity", "qty", 1))
    with pytest.raises(InputError, match="trades.csv: the header lacks column"):
        split_day(open_store(str(folder)), open_store(str(tmp_path / "s")), RunState(redis_url, "x"), "x", DATE, 4,
                  "CNT")
    (folder / "clients.csv").unlink()
    with pytest.raises(InputError, match="clients.csv: not found"):
        split_day(open_store(str(folder)), open_store(str(tmp_path / "s")), RunState(redis_url, "x"), "x", DATE, 4,
                  "CNT")


def test_run_with_a_missing_column_exits_2_with_one_line_and_no_traceback(tmp_path, redis_url):
    folder = write_day(tmp_path / "in")
    (folder / "clients.csv").write_text((folder / "clients.csv").read_text().replace("pan,", "", 1))
    env = {**os.environ, "REDIS_URL": redis_url, "CN_STORE": str(tmp_path / "store"), "RAY_ADDRESS": "",
           "CN_OWNER_PASSWORD": "an-owner-secret"}
    done = subprocess.run([sys.executable, "-m", "pipeline", "run", "--date", DATE, "--input", str(folder)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: clients.csv: the header lacks column(s) pan"]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("run_id", ["<img src=x onerror=alert(document.domain)>", "../../escape", "..", ".",
                                    "a" * 65, "run id", "", "x\n", "x\r"])
def test_a_run_id_outside_the_pattern_is_refused_before_it_reaches_redis_or_storage(run_id, tmp_path):
    from pipeline.record.keys import check_run_id

    with pytest.raises(ValueError, match="is not 1-64 letters"):
        check_run_id(run_id)
    if run_id:
        done = subprocess.run([sys.executable, "-m", "pipeline", "status", run_id], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "REDIS_URL": "redis://127.0.0.1:1/0"})
        assert done.returncode == 2 and "is not 1-64 letters" in done.stderr and "Traceback" not in done.stderr


def test_a_run_id_inside_the_pattern_is_kept_as_it_is():
    from pipeline.record.keys import check_run_id

    assert check_run_id("2026-11-20-ab12cd34") == "2026-11-20-ab12cd34" and check_run_id("a.b_c-9") == "a.b_c-9"


def test_report_cells_that_a_spreadsheet_would_run_are_neutralised(redis_url):
    from pipeline.record import report
    from pipeline.record.records import Outcome

    state = RunState(redis_url, f"csv-{os.urandom(3).hex()}")
    state.record([Outcome("R1", "delivered", "failed", reason="=HYPERLINK(\"http://x\",\"y\")"),
                  Outcome("R2", "delivered", "failed", reason="@SUM(1)"), Outcome("R3", "rendered")])
    rows = "".join(report.csv_chunks(state))
    assert "'=HYPERLINK" in rows and "'@SUM(1)" in rows
    assert not any(cell.startswith(("=", "@", "+", "-")) for line in rows.splitlines() for cell in line.split(","))


def test_run_with_redis_down_exits_2_naming_redis(tmp_path):
    folder = write_day(tmp_path / "in")
    env = {**os.environ, "REDIS_URL": "redis://127.0.0.1:1/0", "CN_STORE": str(tmp_path / "store"), "RAY_ADDRESS": "",
           "CN_OWNER_PASSWORD": "an-owner-secret"}
    done = subprocess.run([sys.executable, "-m", "pipeline", "run", "--date", DATE, "--input", str(folder)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "error: Redis at redis://127.0.0.1:1/0 cannot be reached" in done.stderr


def test_a_poisoned_account_is_rejected_and_reported_while_its_shard_mates_are_delivered(
        ray_session, settings, smtp_sink, tmp_path):
    import json
    from pathlib import Path

    from pipeline.cluster.driver import RunRequest, run_day
    from pipeline.record import keys

    clients = INNOCENTS + [POISONED]
    trades = trades_for(clients)
    trades[-2] = {**trades[-2], "price": "1e30"}
    folder = write_day(tmp_path / "in", trades=trades, clients=clients)
    summary = run_day(settings, RunRequest(DATE, str(folder)))
    assert (summary["delivered"], summary["failed"], summary["rejected"]) == (6, 0, 1)
    assert len(list(smtp_sink.outbox.glob("*.eml"))) == 6  # counted at the relay
    report = json.loads((Path(settings.store_url) / keys.report_keys(summary["run_id"])[0]).read_text())
    assert report["statuses"] == {"delivered": 6, "rejected": 1}
    rows = (Path(settings.store_url) / keys.report_keys(summary["run_id"])[1]).read_text()
    bad = next(line for line in rows.splitlines() if line.startswith("BAD1,"))
    assert "rejected" in bad and "trades.csv row 13 field 'price'" in bad


def test_run_refuses_the_public_placeholder_owner_password_unless_told_it_is_a_test(tmp_path):
    folder = write_day(tmp_path / "in")
    env = {k: v for k, v in os.environ.items() if k != "CN_OWNER_PASSWORD"}
    env.update(REDIS_URL="redis://127.0.0.1:1/0", CN_STORE=str(tmp_path / "store"), RAY_ADDRESS="")
    command = [sys.executable, "-m", "pipeline", "run", "--date", DATE, "--input", str(folder)]
    for k in ("CN_SIGNER_KEY", "CN_SIGNER_CERT", "CN_SIGNER_CHAIN", "CN_TOKEN_KEY_FILE", "CN_SECRET"):
        env.pop(k, None)  # the default key files, in ./.keys
    cwd = tmp_path / "fresh"
    cwd.mkdir()
    done = subprocess.run(command, capture_output=True, text=True, env={**env, "PYTHONPATH": ROOT}, timeout=120,
                          cwd=cwd)
    assert done.returncode == 2 and "error: CN_OWNER_PASSWORD is not set" in done.stderr
    assert [line[:6] for line in done.stderr.splitlines()] == ["error:"], done.stderr
    assert list(cwd.iterdir()) == [], "a refused run wrote nothing (before: a LOCAL TEST key in ./.keys)"
    tested = subprocess.run(command + ["--test-keys"], capture_output=True, text=True, env=env, timeout=120)
    assert tested.returncode == 2 and "CN_OWNER_PASSWORD" not in tested.stderr  # it got past: Redis is down


def test_a_mail_that_cannot_be_built_takes_no_claim_so_the_next_attempt_sends_it(settings, smtp_sink, tmp_path):
    import asyncio

    from pipeline.record import keys
    from pipeline.stages import Batch, mail_context, mail_stage

    run_id = f"unbuilt-{os.urandom(3).hex()}"
    state, store = RunState(settings.redis_url, run_id), open_store(settings.store_url)
    state.start({})
    lease = state.take_lease(60).token
    item = {"ucc": "A1", "name": "Client", "email": "a1@example.com", "pan": "ABCDE1234F", "ecn": True, "pdf": None}

    async def mail() -> dict:
        return await mail_stage(Batch(run_id, DATE, 0, [dict(item)], lease=lease), mail_context(settings, state, store))

    first = asyncio.run(mail())  # the archived PDF cannot be read (not there yet)
    assert first["tally"] == {"failed": 1} and "mail not built, nothing sent" in state.accounts(["A1"])["A1"]["reason"]
    store.put(keys.signed_pdf_key(DATE, "A1"), b"%PDF-1.7 archived")
    second = asyncio.run(mail())  # the archive is back: no claim was left behind
    assert second["tally"] == {"ok": 1} and len(list(smtp_sink.outbox.glob("*.eml"))) == 1


def test_a_client_name_of_100_kb_rejects_its_account_instead_of_breaking_the_page_count(tmp_path, redis_url):
    split, records = split_with(tmp_path, redis_url, client=dict(POISONED, name="N" * 100_000))
    assert split.accounts == 6 and split.rejected == 1
    assert "field 'name': is 100,000 characters long (at most 256)" in records["BAD1"]["reason"]


def test_run_with_an_unwritable_store_exits_2_naming_the_store(tmp_path, redis_url):
    folder = write_day(tmp_path / "in")
    (tmp_path / "a-file").write_text("not a folder")
    store = tmp_path / "a-file" / "store"
    env = {**os.environ, "REDIS_URL": redis_url, "CN_STORE": str(store), "RAY_ADDRESS": "",
           "CN_OWNER_PASSWORD": "an-owner-secret"}
    done = subprocess.run([sys.executable, "-m", "pipeline", "run", "--date", DATE, "--input", str(folder)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"error: storage {store} cannot be written" in done.stderr


def test_an_account_whose_rendering_raises_fails_alone_and_its_shard_mates_render(tmp_path, redis_url):
    from decimal import InvalidOperation

    from pipeline.record.manifest import load_manifest, save_manifest
    from pipeline.stages import Batch, load_shard, render_stage

    folder = write_day(tmp_path / "in", trades=trades_for(INNOCENTS + [POISONED]), clients=INNOCENTS + [POISONED])
    store, run_id = open_store(str(tmp_path / "store")), "contain"
    state = RunState(redis_url, run_id)
    save_manifest(store, run_id, split_day(open_store(str(folder)), store, state, run_id, DATE, 100, "CNT"))

    def render_notes(notes: list[dict]) -> list[bytes | Exception]:
        return [InvalidOperation("[<class 'decimal.InvalidOperation'>]") if n["client"]["ucc"] == "BAD1"
                else b"%PDF-1.7" for n in notes]

    shard = next(s for s in load_manifest(store, run_id).shards
                 if "BAD1" in {a["ucc"] for a in load_shard(store, run_id, s)})
    accounts = load_shard(store, run_id, shard)
    batch = render_stage(Batch(run_id, DATE, shard), accounts, state, render_notes=render_notes)
    assert [i["ucc"] for i in batch.items] == [a["ucc"] for a in accounts if a["ucc"] != "BAD1"]
    assert len(accounts) > 1 and batch.dropped == {"failed": 1}
    assert state.accounts(["BAD1"])["BAD1"]["reason"].startswith("render: InvalidOperation")


def test_a_contract_listed_twice_at_two_prices_or_priced_1e30_is_a_bhavcopy_row_error():
    from pipeline.day import bhavcopy
    from tests.test_note_correctness import BHAVCOPY

    def rows(*extra) -> list[str]:
        fields = list(BHAVCOPY[0])
        return [",".join(fields)] + [",".join(r[f] for f in fields) for r in (*BHAVCOPY, *extra)]

    errors: list[dict] = []
    twice = dict(BHAVCOPY[0], SttlmPric="900.00")
    closes = bhavcopy.read(rows(twice), DATE, errors)
    assert errors == [{"file": "bhavcopy.csv", "row": 3, "field": "SttlmPric", "ucc": "", "error": (
        "ITC 2026-11-26 is listed again, at 900.00 where row 1 says 497.35: its trades are rejected")}]
    assert len(closes) == 1, "neither price of the contract listed twice is used"
    errors.clear()
    bhavcopy.read(rows(dict(BHAVCOPY[0], TckrSymb="SBIN", SttlmPric="1e30")), DATE, errors)
    assert errors == [{"file": "bhavcopy.csv", "row": 3, "field": "SttlmPric", "ucc": "",
                       "error": "'1e30' is not a price (digits, at most 4 decimal places)"}]


def test_a_multi_line_address_rejects_its_account_saying_why_and_how_to_fix_it(tmp_path, redis_url):
    split, records = split_with(tmp_path, redis_url, client=dict(POISONED, address="1 MG Road\nBengaluru"))
    assert split.accounts == 6 and split.rejected == 1
    reason = records["BAD1"]["reason"]
    assert "clients.csv" in reason and "field 'address'" in reason and "join its lines with commas" in reason


@pytest.mark.parametrize("field,value", [("signer_key_pem", 12345), ("owner_password", ["owner", "secret"])])
def test_a_secret_field_of_the_wrong_type_stops_the_run_naming_the_field_never_its_value(
        tmp_path, redis_url, keys_dir, field, value):
    import json

    secret = {"signer_key_pem": (keys_dir / "signer.key.pem").read_text(),
              "signer_cert_pem": (keys_dir / "signer.cert.pem").read_text(), "owner_password": "owner-secret-77"}
    (tmp_path / "secret.json").write_text(json.dumps({**secret, field: value}))
    env = {**os.environ, "REDIS_URL": redis_url, "CN_STORE": str(tmp_path / "store"), "RAY_ADDRESS": "",
           "CN_SECRET": f"file:{tmp_path / 'secret.json'}"}
    done = subprocess.run([sys.executable, "-m", "pipeline", "run", "--date", DATE, "--input",
                           str(write_day(tmp_path / "in"))], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"error: CN_SECRET file:{tmp_path / 'secret.json'}: {field} must be a string"
    assert json.dumps(value) not in done.stderr and str(value) not in done.stderr.replace(str(tmp_path), "")


def test_a_rerun_of_100000_named_accounts_goes_through_the_api_and_one_more_is_422(
        ray_session, redis_url, tmp_path, monkeypatch):
    import time

    from fastapi.testclient import TestClient

    from pipeline.api import MAX_RERUN_ACCOUNTS, create_app
    from pipeline.settings import Settings

    from pipeline.record import keys

    run_id = f"api-many-{os.urandom(3).hex()}"
    state = RunState(redis_url, run_id)
    state.start({"date": DATE, "input": str(tmp_path / "in")})
    # its record, a day of no accounts: a rerun opens no other
    open_store(str(tmp_path / "store")).put(keys.manifest_key(run_id), b'{"shards": [], "shard_count": 1}')
    log = tmp_path / "rerun.log"
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("RAY_ADDRESS", ray_session.address_info["address"])
    monkeypatch.setenv("CN_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("CN_RERUN_LOG", str(log))
    codes = [f"C{i}" for i in range(MAX_RERUN_ACCOUNTS)]
    # in the run, each rejected at validation (its input wrong): the rerun is handed them all and takes none
    state.record(Outcome(u, "validated", "rejected", reason="bad PAN") for u in codes)
    auth = {"Authorization": "Bearer t0ken-for-the-api"}
    with TestClient(create_app(Settings(redis_url=redis_url, api_token="t0ken-for-the-api"))) as api:
        too_many = api.post(f"/runs/{run_id}/rerun", json={"accounts": codes + ["C100000"]}, headers=auth)
        assert too_many.status_code == 422 and "at most 100,000 accounts" in too_many.text
        typo = api.post(f"/runs/{run_id}/rerun", json={"accounts": ["C0", "C100001"]}, headers=auth)
        assert typo.status_code == 422 and f"run {run_id} has no account C100001" in typo.text, typo.text
        accepted = api.post(f"/runs/{run_id}/rerun", json={"accounts": codes}, headers=auth)
    assert accepted.status_code == 202 and accepted.json()["accounts"] == [], accepted.text
    pid, deadline = accepted.json()["pid"], time.monotonic() + 120
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        assert time.monotonic() < deadline, "the rerun did not end"
        time.sleep(0.2)
    out = log.read_text()
    assert "Argument list too long" not in out and "Traceback" not in out
    # every code reached the rerun, which names each as one it cannot take
    said = json.loads(out.strip().splitlines()[-1])
    assert len(said["not_rerunnable"]["rejected_at_validation"]) == len(codes) and said["rerun_accounts"] == [], \
        out[-2000:]


def test_a_shard_whose_every_account_was_rejected_is_no_error(ray_session, settings, smtp_sink, tmp_path, caplog):
    import dataclasses

    from pipeline.cluster.driver import RunRequest, run_day
    from pipeline.record.keys import shard_of

    innocent_shards = {shard_of(c["ucc"], 10) for c in INNOCENTS}
    alone = next(u for u in (f"BAD{i}" for i in range(1, 50)) if shard_of(u, 10) not in innocent_shards)
    clients = INNOCENTS + [dict(POISONED, ucc=alone)]
    trades = trades_for(clients)
    trades[-2] = {**trades[-2], "price": "1e30"}
    with caplog.at_level("INFO", logger="pipeline"):
        summary = run_day(dataclasses.replace(settings, shard_size=1),
                          RunRequest(DATE, str(write_day(tmp_path / "in", trades=trades, clients=clients))))
    assert (summary["delivered"], summary["failed"], summary["rejected"]) == (6, 0, 1)
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
    assert len(list(smtp_sink.outbox.glob("*.eml"))) == 6


@pytest.fixture(scope="module")
def stored_run(ray_session, redis_url, keys_dir, tmp_path_factory):
    """A finished run of seven accounts, its record in storage."""
    from pipeline.cluster.driver import RunRequest, run_day
    from pipeline.embedded import start_smtp_sink
    from pipeline.settings import Settings

    work = tmp_path_factory.mktemp("stored")
    smtp = start_smtp_sink(work / "outbox", work / "smtp.log")
    clients = INNOCENTS + [dict(POISONED, ucc="OK9")]
    settings = Settings(store_url=str(work / "store"), redis_url=redis_url, smtp_url=smtp.url, shard_size=1,
                        signer_key=str(keys_dir / "signer.key.pem"), signer_cert=str(keys_dir / "signer.cert.pem"),
                        signer_chain=str(keys_dir / "root.cert.pem"), owner_password="stored-owner-secret")
    summary = run_day(settings, RunRequest(DATE, str(write_day(work / "in", trades=trades_for(clients),
                                                               clients=clients))))
    smtp.stop()
    assert summary["delivered"] == 7
    return settings, summary


def _commands(settings, run_id: str, store: str, db: int, tmp_path, ray_session) -> dict:
    """status, rerun --failed and reconcile on `store`, with an empty Redis: the answers."""
    (tmp_path / "relay.log").write_text("")
    env = {**os.environ, "REDIS_URL": settings.redis_url.rsplit("/", 1)[0] + f"/{db}", "CN_STORE": store,
           "RAY_ADDRESS": ray_session.address_info["address"], "CN_SIGNER_KEY": settings.signer_key,
           "CN_SIGNER_CERT": settings.signer_cert, "CN_OWNER_PASSWORD": settings.owner_password}
    commands = {"status": ["status", run_id], "rerun": ["rerun", run_id, "--failed"],
                "reconcile": ["reconcile", run_id, "--relay-log", str(tmp_path / "relay.log")]}
    return {name: subprocess.run([sys.executable, "-m", "pipeline", *c], capture_output=True, text=True, env=env,
                                 timeout=300) for name, c in commands.items()}


@pytest.mark.parametrize("tamper,db,readers", [("truncated report", 11, ("status", "rerun", "reconcile")),
                                               ("report trade_date", 12, ("status", "rerun", "reconcile")),
                                               ("delivery-log line", 13, ("rerun", "reconcile"))])
def test_tampered_storage_is_named_in_one_line_by_status_rerun_and_reconcile(
        stored_run, ray_session, tmp_path, tamper, db, readers):
    import json
    import shutil
    from pathlib import Path

    from pipeline.record import keys

    settings, summary = stored_run
    run_id, store = summary["run_id"], tmp_path / "store"
    shutil.copytree(settings.store_url, store)
    report = store / keys.report_keys(run_id)[0]
    if tamper == "truncated report":
        report.write_bytes(report.read_bytes()[:-40])
        named = keys.report_keys(run_id)[0]
    elif tamper == "report trade_date":
        report.write_text(json.dumps({**json.loads(report.read_text()), "trade_date": "../../x"}))
        named = keys.report_keys(run_id)[0]
    else:
        log = next(p for p in sorted(store.glob(f"*-delivery-log/{run_id}/*/*.jsonl")) if p.stat().st_size)
        log.write_text(log.read_text() + "this is not JSON\n")
        named = log.relative_to(store).as_posix()
    answers = _commands(settings, run_id, str(store), db, tmp_path, ray_session)
    for name, done in answers.items():
        if name not in readers:
            assert done.returncode == 0, (name, done.stderr)
            continue
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and "Traceback" not in done.stderr, (name, done.stderr[-2000:])
        assert lines[-1].startswith(f"error: {store}: object {named!r}"), (name, lines[-1])
    assert not (tmp_path / "x").exists() and not Path(store).parent.parent.joinpath("x").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["relay.log", "store"], "nothing written outside the store"


def test_reconcile_streams_a_60_mb_delivery_log_its_memory_does_not_follow_the_log(stored_run, ray_session, tmp_path):
    import json
    import shutil

    from pipeline.record import keys

    settings, summary = stored_run
    run_id, peaks = summary["run_id"], {}
    uccs = [c["ucc"] for c in INNOCENTS] + ["OK9"]
    for entries, db in ((10, 14), (550_000, 15)):
        store = tmp_path / f"store-{entries}"
        shutil.copytree(settings.store_url, store)
        shard = keys.shard_of(uccs[0], 10)
        log = store / keys.delivery_log_prefix(run_id, shard) / "00000000000000000001-padding.jsonl"
        with log.open("w") as f:  # the shard's account once, then strangers: none is the run's
            for i in range(entries):
                f.write(json.dumps({"ucc": uccs[0] if i == 0 else f"Z{i}", "status": "sending", "at": 1.0,
                                    "message_id": f"<{'x' * 40}.{i}@contract-notes.invalid>", "reply": "",
                                    "reason": "padding " * 4}) + "\n")
        (tmp_path / "relay.log").write_text("")
        env = {**os.environ, "REDIS_URL": settings.redis_url.rsplit("/", 1)[0] + f"/{db}", "CN_STORE": str(store)}
        measured = subprocess.run(
            [sys.executable, "-c", "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
             "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)",
             sys.executable, "-m", "pipeline", "reconcile", run_id, "--relay-log", str(tmp_path / "relay.log")],
            capture_output=True, text=True, env=env, timeout=600)
        code, peak_kb = measured.stdout.strip().splitlines()[-1].split()
        peaks[entries] = (code, int(peak_kb) / 1024, measured.stderr[-2000:])
    assert log.stat().st_size > 60e6
    assert peaks[550_000][1] - peaks[10][1] < 30, peaks
    assert peaks[10][0] == peaks[550_000][0] == "0", "a stranger in the log is not an account of the run"


def test_a_mailing_whose_claims_are_refused_logs_them_not_sent_so_a_resumed_run_mails_them(
        settings, smtp_sink, tmp_path):
    """The delivery log's "sending" for a mail whose claim was refused (here: another driver
    took the run) is settled as not sent: rebuilt from the log, the account is neither
    unconfirmed nor guarded, and nothing reached the relay."""
    import asyncio

    from pipeline.record import delivery_log, keys
    from pipeline.record.lease import LeaseLostError
    from pipeline.stages import Batch, mail_context, mail_stage, restore_from_log

    run_id = f"refused-{os.urandom(3).hex()}"
    state, store = RunState(settings.redis_url, run_id), open_store(settings.store_url)
    state.start({})
    stale = state.take_lease(1).token
    state.r.delete(keys.run_lease(run_id))
    state.take_lease(60)  # another driver holds the run now
    store.put(keys.signed_pdf_key(DATE, "A1"), b"%PDF-1.7 archived")
    item = {"ucc": "A1", "name": "Client", "email": "a1@example.com", "pan": "ABCDE1234F", "ecn": True, "pdf": None}

    async def mail() -> dict:
        return await mail_stage(Batch(run_id, DATE, 0, [item], lease=stale), mail_context(settings, state, store))

    with pytest.raises(LeaseLostError):
        asyncio.run(mail())
    *_, last = delivery_log.entries(store, run_id, 0)
    assert (last["ucc"], last["status"]) == ("A1", "not_sent") and "lease" in last["reason"]
    assert delivery_log.latest(delivery_log.entries(store, run_id, 0)) == {}  # its mailing settled: nothing stands
    assert list(smtp_sink.outbox.glob("*.eml")) == []
    state.r.delete(*state.r.keys(f"cn:run:{run_id}:*"))  # Redis loses the run; the log rebuilds it
    state.start({})
    assert restore_from_log(store, state, run_id, 0, {"A1"}) == 0
    assert state.accounts(["A1"]) == {} and state.claimed(["A1"]) == set()


def test_a_driver_taken_over_never_frees_an_unconfirmed_account_for_the_new_driver_to_mail_again(
        settings, smtp_sink, tmp_path):
    """`rerun --unconfirmed` lets go of an account's earlier claim to mail it again. Its driver
    was taken over meanwhile: its mailer, still at work, must not let go of the guard, or the new
    driver's own mailing would send the account once more, unmarked."""
    import asyncio

    from pipeline.record import delivery_log, keys
    from pipeline.record.lease import LeaseLostError
    from pipeline.record.records import Outcome
    from pipeline.stages import Batch, mail_context, mail_stage

    run_id = f"taken-{os.urandom(3).hex()}"
    state, store = RunState(settings.redis_url, run_id), open_store(settings.store_url)
    state.start({})
    stale = state.take_lease(1).token
    state.record([Outcome("U1", "archived"), Outcome("U1", "delivered", "unconfirmed", reason="no reply")])
    state.restore_claims(["U1"])  # the first mail may have left
    state.r.delete(keys.run_lease(run_id))
    fresh = state.take_lease(60).token  # another driver holds the run now
    store.put(keys.signed_pdf_key(DATE, "U1"), b"%PDF-1.7 archived")
    item = {"ucc": "U1", "name": "Client", "email": "u1@example.com", "pan": "ABCDE1234F", "ecn": True, "pdf": None}

    async def mail() -> dict:
        ctx = mail_context(settings, state, store, resend_unconfirmed=True)
        return await mail_stage(Batch(run_id, DATE, 0, [item], lease=stale), ctx)

    with pytest.raises(LeaseLostError):
        asyncio.run(mail())
    assert state.claimed(["U1"]) == {"U1"} and list(smtp_sink.outbox.glob("*.eml")) == []
    assert not state.claim_mail("U1", "<U1>", state.epoch(), fresh), "the new driver finds it guarded"
    assert delivery_log.latest(delivery_log.entries(store, run_id, 0)) == {}


@pytest.mark.parametrize("date, said", [
    ("2026-11-22", "error: --date 2026-11-22: no exchange traded that day (2026-11-22 is not a NSE trading day "
                   "(weekend)"),
    ("2026-11-19", "error: trades.csv: no trade in its first and last rows is dated 2026-11-19 (they are dated "
                   f"{DATE}): is the run's date right?"),
])
def test_a_run_date_without_a_session_or_without_a_trade_is_refused_before_anything_starts(date, said, tmp_path,
                                                                                          redis_url):
    """Before: `run --date` a Sunday, on a Friday's dumps, started Ray and rejected every account
    one by one (exit 1). Now one line, exit 2, before Ray: nothing is written for the run."""
    folder = write_day(tmp_path / "in")
    env = {**os.environ, "REDIS_URL": redis_url, "CN_STORE": str(tmp_path / "store"), "RAY_ADDRESS": "",
           "CN_OWNER_PASSWORD": "an-owner-secret"}
    done = subprocess.run([sys.executable, "-m", "pipeline", "run", "--date", date, "--input", str(folder)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(said), errors
    assert "Traceback" not in done.stderr and "Ray" not in done.stderr
