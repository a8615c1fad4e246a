"""A fresh run's first notes, made by the driver before the split: the same accounts and note
numbers the split makes, mailed first and once, and a run that died after them resumed."""

from __future__ import annotations

import email
import json
import subprocess
from email import policy
from pathlib import Path

import pytest
import yaml

from pipeline import credentials
from pipeline.cluster import driver, first_notes
from pipeline.cluster.driver import Chain, RunRequest, _fail_chain, _first_notes_done, run_day
from pipeline.day.split import first_accounts, make_plan, split_day
from pipeline.note.content import ROWS_PER_PAGE
from pipeline.record import keys
from pipeline.record.lease import held
from pipeline.record.manifest import load_first_notes, load_manifest
from pipeline.record.state import RunState
from pipeline.record.storage import open_store
from tests.conftest import TRADE_DATE
from tests.helpers import client_rows, outbox_messages


def _ucc(msg) -> str:
    return msg["Subject"].split("(")[-1].rstrip(")")


def _shard_file(settings, run_id: str, shard: int) -> dict[str, dict]:
    text = (Path(settings.store_url) / keys.shard_key(run_id, shard)).read_text()
    return {a["ucc"]: a for a in map(json.loads, text.splitlines())}


def test_the_first_notes_are_the_accounts_the_split_makes_bad_rows_and_stray_quotes_included(settings, day):
    inputs = open_store(str(day))
    plan = make_plan(inputs, TRADE_DATE, settings.shard_size, parts=1)
    shard, chosen = first_accounts(inputs, plan, TRADE_DATE, 4)
    assert len(chosen) >= 2, "the sample should give the lead shard a few accounts"
    bad_price, twice = chosen[0][0], chosen[1][0]
    trades = (day / "trades.csv").read_text().splitlines()
    header = trades[0].split(",")
    at = next(i for i, t in enumerate(trades) if t.split(",")[header.index("ucc")] == bad_price)
    row = trades[at].split(",")
    row[header.index("price")] = "12.3x"
    trades[at] = ",".join(row)
    trades.insert(len(trades) // 2, 'x,"an open quote,' + ",".join(["1"] * (len(header) - 2)))  # swallows rows after it
    (day / "trades.csv").write_text("\n".join(trades) + "\n")
    clients = (day / "clients.csv").read_text().splitlines()
    clients.append(next(c for c in clients if c.split(",")[0] == twice))  # a duplicate client
    (day / "clients.csv").write_text("\n".join(clients) + "\n")

    shard_again, found = first_accounts(inputs, plan, TRADE_DATE, 4)
    state = RunState(settings.redis_url, "first-split")
    split_day(inputs, open_store(settings.store_url), state, "first-split", TRADE_DATE, settings.shard_size, "CNT")

    assert shard_again == shard
    made = _shard_file(settings, "first-split", shard)
    assert {u for u, _, _ in found} <= {u for u, _, _ in chosen} - {bad_price, twice}
    for ucc, client, trades in found:  # the very client block and trades the shard file holds
        assert json.loads(client) == made[ucc]["client"] and [json.loads(t) for t in trades] == made[ucc]["trades"]
    records = state.accounts([bad_price, twice])
    assert records[bad_price]["status"] == records[twice]["status"] == "rejected"
    lost = {u for u, _, _ in chosen} - {bad_price, twice} - {u for u, _, _ in found}
    assert all(u not in made for u in lost), "an account the first notes dropped must be one the split drops"


@pytest.mark.parametrize("joined", [False, True], ids=["local", "running-ray"])
def test_a_fresh_run_mails_its_first_notes_before_any_chain_once_each(settings, day, smtp_sink, ray_session, joined,
                                                                    monkeypatch):
    """On one machine the driver signs and mails them itself; joining a running Ray (a cluster's
    head, which neither signs nor mails) it renders them and the pools' first actors take them
    as they start, and the split waits for them: its workers' boots would take the cores they
    start on."""
    monkeypatch.setattr(driver, "SPLIT_HOLD_S", 120.0)
    summary = run_day(settings, RunRequest(TRADE_DATE, str(day)),
                      address=ray_session.address_info["address"] if joined else None)

    run_id = summary["run_id"]
    store = open_store(settings.store_url)
    made = load_first_notes(store, run_id)
    assert made is not None and len(made["numbers"]) >= 2
    numbers = made["numbers"]
    mailed = [_ucc(m) for m in outbox_messages(smtp_sink.outbox)]
    assert len(mailed) == len(set(mailed)) == summary["delivered"] == summary["accounts"]
    arrived = [_ucc(email.message_from_bytes(p.read_bytes(), policy=policy.default))
               for p in sorted(smtp_sink.outbox.glob("*.eml"), key=lambda p: p.stat().st_mtime_ns)]
    if joined:  # the split waited for them (SPLIT_HOLD_S, long here: a suite's load may hold the actors' start)
        assert set(arrived[:len(numbers)]) == set(numbers), "the relay's first messages are the driver's notes"
        first_mail = min(p.stat().st_mtime for p in smtp_sink.outbox.glob("*.eml"))
        shards = [Path(settings.store_url) / keys.shard_key(run_id, s) for s in load_manifest(store, run_id).shards]
        assert first_mail <= min(p.stat().st_mtime for p in shards), "no shard was split before the first mail"
    else:  # the driver mails them before any chain starts
        assert set(arrived[:len(numbers)]) == set(numbers), "the relay's first messages are the driver's notes"
    shard = _shard_file(settings, run_id, made["shard"])
    pans = {u: c["pan"] for u, c in client_rows(day).items()}
    for ucc, number in numbers.items():
        assert shard[ucc]["note_no"] == number  # the split kept the number the note was mailed with
        pdf = Path(settings.store_url) / keys.signed_pdf_key(TRADE_DATE, ucc)
        text = subprocess.run(["pdftotext", "-upw", pans[ucc], str(pdf), "-"], capture_output=True, text=True).stdout
        assert number in text
    assert summary["delivered_now"] == summary["accounts"]


def test_the_split_waits_for_the_first_notes_only_where_it_would_start_beside_the_pools():
    """One machine (the session's Ray, a laptop's) renders, signs and mails on one node: the
    split's workers would take the cores the first actors start on. cluster.yaml's node types
    render apart from signing and mailing: there the split does not wait."""
    types = yaml.safe_load((Path(driver.ROOT) / "cluster.yaml").read_text())["available_node_types"]
    cluster = [{"Alive": True, "Resources": t["resources"]} for t in types.values()]
    assert not driver.split_beside_pools(cluster)
    one = {"Alive": True, "Resources": {"CPU": 2, "render": 2, "signer": 1, "smtp": 1}}
    assert driver.split_beside_pools(cluster + [one])
    assert not driver.split_beside_pools(cluster + [{**one, "Alive": False}])


@pytest.mark.usefixtures("ray_session")
def test_a_run_whose_driver_died_after_its_first_notes_resumes_with_their_numbers_and_mails_none_twice(
        settings, day, smtp_sink):
    run_id = "died-after-first-notes"
    store, state = open_store(settings.store_url), RunState(settings.redis_url, run_id)
    resolved, signer = credentials.read(settings)
    state.start({"date": TRADE_DATE, "input": str(day)})
    with held(state, settings.lease_s) as lease:  # the driver, up to its death
        early = first_notes.start(settings, resolved, signer, run_id, TRADE_DATE, open_store(str(day)), store, state,
                                  lease.token, 2)
        early.join()
    assert early.error is None and early.result["tally"] == {"ok": len(early.numbers.result())}
    before = len(outbox_messages(smtp_sink.outbox))

    summary = run_day(settings, RunRequest(TRADE_DATE, str(day), run_id=run_id))

    mailed = [_ucc(m) for m in outbox_messages(smtp_sink.outbox)]
    assert before == len(early.numbers.result())
    assert len(mailed) == len(set(mailed)) == summary["accounts"] == summary["delivered"]
    shard = _shard_file(settings, run_id, early.shard)
    assert {u: shard[u]["note_no"] for u in early.numbers.result()} == early.numbers.result()
    numbers = [a["note_no"] for s in load_manifest(store, run_id).shards for a in _shard_file(settings, run_id, s).values()]
    assert len(numbers) == len(set(numbers)) == summary["accounts"]


def test_a_heavy_account_among_the_first_is_left_to_its_shard_s_chain_and_mailed_once(settings, day, smtp_sink,
                                                                                        ray_session):
    """The first notes are rendered whole in the driver: a client with pages of trades among
    them (a 60,000-trade client is often the first of clients.csv) would hold them back and
    cost the driver the note's memory. It goes to its shard's chain, rendered in page ranges."""
    inputs = open_store(str(day))
    _, chosen = first_accounts(inputs, make_plan(inputs, TRADE_DATE, settings.shard_size, parts=2), TRADE_DATE, 4)
    heavy = chosen[0][0]
    lines = (day / "trades.csv").read_text().splitlines()
    header = lines[0].split(",")
    ucc_at, trade_at = header.index("ucc"), header.index("trade_no")
    own = [line.split(",") for line in lines[1:] if line.split(",")[ucc_at] == heavy]
    more = []
    for i in range(5 * ROWS_PER_PAGE // len(own) + 1):  # five pages of trades
        for cols in own:
            cols = list(cols)
            cols[trade_at] = f"{8 * 10**15 + i * 1000 + len(more):016d}"
            more.append(",".join(cols))
    (day / "trades.csv").write_text("\n".join(lines + more) + "\n")

    summary = run_day(settings, RunRequest(TRADE_DATE, str(day)))

    numbers = load_first_notes(open_store(settings.store_url), summary["run_id"])["numbers"]
    assert heavy not in numbers and set(numbers) == {u for u, _, _ in chosen[1:]}
    mailed = [_ucc(m) for m in outbox_messages(smtp_sink.outbox)]
    assert len(mailed) == len(set(mailed)) == summary["delivered"] == summary["accounts"] and heavy in mailed


def test_first_notes_whose_thread_failed_leave_each_account_failed_or_unconfirmed_never_pending(settings):
    run_id = "first-notes-failed"
    state = RunState(settings.redis_url, run_id)
    epoch = state.start({})
    lease = state.take_lease(60).token
    early = first_notes.FirstNotes()
    early.shard, early.error = 3, OSError("the store went away\nwith a traceback")
    early.numbers.set_result({"A1": "CNT-26/27-0000001", "A2": "CNT-26/27-0000002"})
    assert state.claim_mail("A2", "<a2@x>", epoch, lease)  # its mail may have left before the failure

    result = _first_notes_done(early, settings, run_id)

    records = state.accounts(["A1", "A2"])
    assert records["A1"]["status"] == "failed" and "first notes: OSError: the store went away" in records["A1"]["reason"]
    assert records["A2"]["status"] == "unconfirmed"
    assert set(state.failed()) == {"A1"} and set(state.unconfirmed()) == {"A2"}
    assert result["tally"] == {"failed": 1, "unconfirmed": 1}


def test_the_first_notes_chain_on_a_running_ray_that_fails_fails_its_accounts_not_their_shard(settings):
    """Handed to the pools, the first notes are a chain of their own: a failure past its resends
    fails (or leaves unconfirmed) those accounts, never the shard their own chain mails."""
    run_id = "first-chain-failed"
    state = RunState(settings.redis_url, run_id)
    epoch = state.start({})
    lease = state.take_lease(60).token
    early = first_notes.FirstNotes(send=lambda batch: None)
    early.numbers.set_result({"A1": "CNT-26/27-0000001", "A2": "CNT-26/27-0000002"})
    assert state.claim_mail("A2", "<a2@x>", epoch, lease)
    chain = Chain(7, None, first=early)

    result = _fail_chain(settings, run_id, chain, "RayActorError: the signer died", frozenset({"A1", "A2"}))

    records = state.accounts(["A1", "A2", "B1"])
    assert records["A1"]["status"] == "failed" and "first notes: RayActorError" in records["A1"]["reason"]
    assert records["A2"]["status"] == "unconfirmed" and "B1" not in records
    assert result["tally"] == {"failed": 1, "unconfirmed": 1}


def test_a_day_too_big_to_read_in_the_driver_makes_no_first_notes(
        settings, day, monkeypatch):
    monkeypatch.setattr(first_notes, "MAX_INPUT_BYTES", (day / "trades.csv").stat().st_size)  # clients.csv tips it
    state = RunState(settings.redis_url, "too-big")
    resolved, signer = credentials.read(settings)
    early = first_notes.start(settings, resolved, signer, "too-big", TRADE_DATE, open_store(str(day)),
                              open_store(settings.store_url), state, "", 2)
    assert early.thread is None and early.plan.result() is None and early.numbers.result() == {}
    assert early.skipped(0) == frozenset() and load_first_notes(open_store(settings.store_url), "too-big") is None


class _Counted:
    """A store that counts the reads that would be requests on S3."""

    def __init__(self, store):
        self.store, self.reads = store, []

    def stream_range(self, key, start, end, chunk):
        self.reads.append(key)
        yield from self.store.stream_range(key, start, end, chunk)

    def read_range(self, key, start, end):
        self.reads.append(key)
        return self.store.read_range(key, start, end)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_the_first_notes_read_each_dump_in_one_request_and_find_what_a_read_a_range_finds(settings, day, monkeypatch):
    """The first notes' read of the day's ranges goes through one GET a dump (split.OneRead), where
    it was a GET a range (bench/scale.py --s3-only): the accounts found are the same, lines that
    run past their range and all."""
    from pipeline.day import split

    monkeypatch.setattr(split, "RANGE_BYTES_MIN", 4096)  # many ranges, each line on a boundary read on past it
    inputs = _Counted(open_store(str(day)))
    plan = make_plan(inputs, TRADE_DATE, settings.shard_size, parts=2)
    assert sum(r.file == "trades.csv" for r in plan.ranges) > 5
    inputs.reads.clear()
    found = first_accounts(inputs, plan, TRADE_DATE, 4)
    assert inputs.reads.count("trades.csv") == 1 and inputs.reads.count("clients.csv") <= 2, inputs.reads

    monkeypatch.setattr(split, "OneRead", lambda store, ends: _Closing(store))  # a GET a range, as before
    assert first_accounts(inputs, plan, TRADE_DATE, 4) == found and found[1]


class _Closing(_Counted):
    def close(self):
        pass
