"""Reading a relay's own log: which Message-IDs it accepted (pure parsing; the lines follow
Postfix's and Haraka's formats as those programs write them)."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from pipeline.mail.relay_log import accepted_ids
from pipeline.followup.restore import from_storage
from pipeline.record import delivery_log, keys, report
from pipeline.record.manifest import SplitResult, save_manifest
from pipeline.record.records import Outcome, final_status
from pipeline.record.state import RunState
from pipeline.record.storage import StorageError, open_store
from pipeline.stages import restore_from_log

POSTFIX = """\
Nov 22 18:04:11 relay postfix/smtpd[2211]: 4B3C1200A4: client=app-1.internal[10.0.1.15]
Nov 22 18:04:11 relay postfix/cleanup[2214]: 4B3C1200A4: message-id=<aaa@contract-notes.invalid>
Nov 22 18:04:11 relay postfix/qmgr[1043]: 4B3C1200A4: from=<notes@broker.example.com>, size=48213, nrcpt=1 (queue active)
Nov 22 18:04:12 relay postfix/smtp[2230]: 4B3C1200A4: to=<c1@example.com>, relay=mx.example.com[203.0.113.5]:25, \
delay=0.9, delays=0.1/0/0.3/0.5, dsn=2.0.0, status=sent (250 2.0.0 Ok: queued as 9F1E2)
Nov 22 18:04:13 relay postfix/cleanup[2214]: 5C4D2300B5: message-id=<bbb@contract-notes.invalid>
Nov 22 18:04:13 relay postfix/smtpd[2211]: lost connection after DATA (48213 bytes) from app-1.internal[10.0.1.15]
2026-11-22T18:04:14.120301+05:30 relay postfix-out/cleanup[77]: 6D5E3400C6: message-id=<ccc@contract-notes.invalid>
2026-11-22T18:04:14.130301+05:30 relay postfix-out/qmgr[78]: 6D5E3400C6: from=<notes@broker.example.com>, \
size=48000, nrcpt=1 (queue active)
"""

TXN = "7F1C820F-1D6A-4C3B-9E54-6A2D41C7B0E1"
HARAKA = f"""\
[NOTICE] [{TXN}] [core] connect ip=10.0.1.15 port=40022 local_ip=10.0.2.4 local_port=25
[NOTICE] [{TXN}.1] [core] message mid=<ddd@contract-notes.invalid> size=48213 rcpts=1/0/0 delay=0.004 code=CONT msg=""
[NOTICE] [{TXN}.1] [core] queue code=OK msg=""
[NOTICE] [{TXN}.2] [core] message mid=<eee@contract-notes.invalid> size=48213 rcpts=1/0/0 delay=0.003 code=CONT msg=""
[NOTICE] [{TXN}.2] [core] queue code=DENYSOFT msg="Message denied temporarily ({TXN}.2)"
2026-11-22T12:34:56.789Z [NOTICE] [{TXN}.3] [core] message mid=<fff@contract-notes.invalid> size=1 rcpts=1/0/0 \
delay=0 code=CONT msg=""
2026-11-22T12:34:56.799Z [NOTICE] [{TXN}.3] [core] queue code=OK msg="Message Queued ({TXN}.3)"
level=NOTICE uuid={TXN}.4 source=core message=message mid=<ggg@contract-notes.invalid> size=9 rcpts=1/0/0 code=CONT
level=NOTICE uuid={TXN}.4 source=core message=queue code=OK msg=""
""" + "\n".join(json.dumps(r) for r in [
    {"level": "NOTICE", "uuid": f"{TXN}.5", "origin": "core", "message": "message", "mid": "<hhh@contract-notes.invalid>"},
    {"level": "NOTICE", "uuid": f"{TXN}.5", "origin": "core", "message": "queue", "code": "OK", "msg": ""},
    {"level": "NOTICE", "uuid": f"{TXN}.6", "origin": "core", "message": "message", "mid": "<iii@contract-notes.invalid>"},
]) + "\n"

PLAIN = "jjj@contract-notes.invalid\n<kkk@contract-notes.invalid>\n\n"


def test_only_messages_the_relay_committed_count_as_accepted(tmp_path):
    (tmp_path / "maillog").write_text(POSTFIX)
    (tmp_path / "haraka.log").write_text(HARAKA)
    (tmp_path / "ids.txt").write_text(PLAIN)

    found = accepted_ids([tmp_path / "maillog", tmp_path / "haraka.log", tmp_path / "ids.txt"])

    accepted = {f"<{x}@contract-notes.invalid>" for x in ("aaa", "ccc", "ddd", "fff", "ggg", "hhh", "jjj", "kkk")}
    assert found == accepted
    # bbb: cleanup saw it, the client vanished before the dot; eee: deferred; iii: no queue line


def test_a_lost_redis_is_rebuilt_from_the_delivery_log_guard_first(redis_url, tmp_path):
    store = open_store(str(tmp_path / "store"))
    run_id = f"restore-{uuid.uuid4().hex[:6]}"
    delivery_log.append(store, run_id, 3, [delivery_log.sending(u, f"<{u}>") for u in ("A", "B", "C", "D")])
    delivery_log.append(store, run_id, 3, [
        {"ucc": "A", "status": "delivered", "message_id": "<A>", "reply": "OK queued", "at": time.time(), "attempts": 1},
        {"ucc": "C", "status": "failed", "message_id": "<C>", "reason": "smtp permanent: 550", "at": time.time()}])
    state = RunState(redis_url, run_id, ttl_s=600)
    epoch = state.start({})

    assert restore_from_log(store, state, run_id, 3, {"A", "B", "C", "D"}) == 4
    assert restore_from_log(store, state, run_id, 3, {"A", "B", "C", "D"}) == 0, "restoring twice changes nothing"

    records = state.accounts(["A", "B", "C", "D"])
    assert {u: final_status(r) for u, r in records.items()} == {
        "A": "delivered", "B": "unconfirmed", "C": "failed", "D": "unconfirmed"}
    assert state.claimed(["A", "B", "C", "D"]) == {"A", "B", "D"}, "a failed mail may be sent again"
    assert not state.claim_mail("B", "<B>", epoch, state.take_lease(30).token)


def test_a_record_redis_made_anew_after_losing_the_run_does_not_hide_the_log_s_mail(redis_url, tmp_path):
    """Redis lost the run after A was mailed and B's mail began; a split task run again then
    validated both anew, later than the log's entries. Restored, each is still guarded: neither
    is mailed a second time."""
    store = open_store(str(tmp_path / "store"))
    run_id = f"anew-{uuid.uuid4().hex[:6]}"
    delivery_log.append(store, run_id, 3, [delivery_log.sending(u, f"<{u}>") for u in ("A", "B")])
    delivery_log.append(store, run_id, 3, [{"ucc": "A", "status": "delivered", "message_id": "<A>", "reply": "OK",
                                            "at": time.time(), "attempts": 1}])
    state = RunState(redis_url, run_id, ttl_s=600)
    epoch = state.start({})
    time.sleep(0.01)
    state.record([Outcome("A", "validated"), Outcome("B", "validated")])

    assert restore_from_log(store, state, run_id, 3, {"A", "B"}) == 2
    assert {u: final_status(r) for u, r in state.accounts(["A", "B"]).items()} == {"A": "delivered", "B": "unconfirmed"}
    lease = state.take_lease(30).token
    assert not state.claim_mail("A", "<A>", epoch, lease) and not state.claim_mail("B", "<B>", epoch, lease)


def test_a_report_brought_back_into_redis_does_not_hide_a_mail_logged_after_it(redis_url, tmp_path):
    """The report says X's mail failed. A rerun then mailed X (the log says delivered) and ended
    before it wrote the report again, and Redis went with its cluster. Brought back from storage,
    the report's records are rebuilt now, later than the log's entry, yet X is delivered and
    guarded: the next `rerun --failed` does not mail it a second time."""
    store, run_id = open_store(str(tmp_path / "store")), f"report-{uuid.uuid4().hex[:6]}"
    save_manifest(store, run_id, SplitResult(shards=[3], shard_count=10, accounts=1))
    store.put(keys.shard_key(run_id, 3), b'{"ucc": "X1"}\n')
    state = RunState(redis_url, run_id, ttl_s=600)
    state.start({"date": "2026-11-20"})
    delivery_log.append(store, run_id, 3, [delivery_log.sending("X1", "<X1>")])
    delivery_log.append(store, run_id, 3, [{"ucc": "X1", "status": "failed", "message_id": "<X1>", "at": time.time(),
                                            "reason": "smtp permanent: 550"}])
    state.record([Outcome("X1", "archived"), Outcome("X1", "delivered", "failed", reason="smtp permanent: 550")])
    report.write(store, state, run_id, {"trade_date": "2026-11-20", "accounts": 1}, [])
    delivery_log.append(store, run_id, 3, [delivery_log.sending("X1", "<X1>")])  # the rerun
    delivery_log.append(store, run_id, 3, [{"ucc": "X1", "status": "delivered", "message_id": "<X1>", "reply": "250 OK",
                                            "at": time.time(), "attempts": 2}])
    state.r.delete(*state.r.keys(f"cn:run:{run_id}:*"))
    time.sleep(0.01)

    from_storage(store, state, run_id)
    assert final_status(state.accounts(["X1"])["X1"]) == "delivered" and state.claimed(["X1"]) == {"X1"}


def test_a_mailing_refused_at_its_claim_leaves_what_the_log_said_before_it(redis_url, tmp_path):
    """A's note was delivered, then a `rerun --force` lost the run's lease before its claim: the
    log's last word on A is that mailing's "not_sent". B's only mailing was refused the same way.
    Redis then lost the run: restored, A is still delivered and guarded, and B is left to be
    mailed."""
    store, run_id = open_store(str(tmp_path / "store")), f"notsent-{uuid.uuid4().hex[:6]}"
    delivery_log.append(store, run_id, 3, [delivery_log.sending("A", "<A>")])
    delivery_log.append(store, run_id, 3, [{"ucc": "A", "status": "delivered", "message_id": "<A>", "reply": "250 OK",
                                            "at": time.time(), "attempts": 1}])
    delivery_log.append(store, run_id, 3, [delivery_log.sending(u, f"<{u}>") for u in ("A", "B")])
    delivery_log.append(store, run_id, 3, [delivery_log.not_sent(u, "the run's lease was lost") for u in ("A", "B")])
    state = RunState(redis_url, run_id, ttl_s=600)
    state.start({})

    assert restore_from_log(store, state, run_id, 3, {"A", "B"}) == 1
    assert final_status(state.accounts(["A"])["A"]) == "delivered" and state.claimed(["A", "B"]) == {"A"}


def _entry(ucc: str, status: str, at: float, **more) -> dict:
    return {"ucc": ucc, "status": status, "at": at, "message_id": f"<{ucc}>"} | more


@pytest.mark.parametrize("named", [True, False], ids=["not_sent naming its sending", "not_sent as written before"])
def test_a_mailing_refused_at_its_claim_counts_for_nothing_whatever_came_between(named):
    """Each account's latest mailing, and its final status when the run is sealed: a not_sent
    settles its own sending only, never an outcome. A: a driver's mailing waited while another
    driver took the run, mailed and delivered it, then was refused. B: a forced rerun and a
    resent batch beside it both refused after B's delivery. C: only ever refused. D: a mailing
    that died, then one refused (a not_sent that cannot say which of the two open sendings was
    its own settles neither: D reads as unconfirmed either way, guarded)."""
    def refused(ucc, sending_at, at):
        return _entry(ucc, "not_sent", at, **({"sending_at": sending_at} if named else {}))

    log = [_entry("A", "sending", 1), _entry("A", "sending", 2), _entry("A", "delivered", 3), refused("A", 1, 4),
           _entry("B", "sending", 1), _entry("B", "delivered", 2), _entry("B", "sending", 3), _entry("B", "sending", 4),
           refused("B", 3, 5), refused("B", 4, 6),
           _entry("C", "sending", 1), refused("C", 1, 2),
           _entry("D", "sending", 1), _entry("D", "sending", 2), refused("D", 2, 3)]
    found = delivery_log.latest(log)
    d = ("sending", 1) if named else ("sending", 2)
    assert {u: (e["status"], e["at"]) for u, e in found.items()} == {
        "A": ("delivered", 3), "B": ("delivered", 2), "D": d}
    assert delivery_log.final_statuses(iter(log), closed=False) == {
        "A": "delivered", "B": "delivered", "D": "unconfirmed"}


def test_a_delivered_record_rebuilt_from_the_report_is_not_undone_by_a_sending_logged_after_it(redis_url, tmp_path):
    """The report read A delivered; its mailing's outcome never reached the log (the mailer ended
    first), and the log's "sending" is stamped after the record and the report's reading. Brought
    back, A stays delivered and guarded, out of the unconfirmed list, and the log gets the
    delivery it missed, once however often the run is restored."""
    store, run_id = open_store(str(tmp_path / "store")), f"caught-{uuid.uuid4().hex[:6]}"
    state = RunState(redis_url, run_id, ttl_s=600)
    state.start({})
    state.record([Outcome("A", "archived"), Outcome("A", "delivered", message_id="<A>", reply="250 OK")])
    read_at = time.time()
    time.sleep(0.01)
    delivery_log.append(store, run_id, 3, [delivery_log.sending("A", "<A>")])

    assert [restore_from_log(store, state, run_id, 3, {"A"}, as_of=read_at) for _ in range(2)] == [0, 0]
    assert final_status(state.accounts(["A"])["A"]) == "delivered" and state.unconfirmed() == []
    assert state.claimed(["A"]) == {"A"}
    log = list(delivery_log.entries(store, run_id, 3))
    assert [e["status"] for e in log] == ["sending", "delivered"] and delivery_log.latest(log)["A"] == log[-1]


def test_a_run_logged_before_the_chain_is_appended_to_and_read_whole(tmp_path):
    """Objects named by time (a run of the previous version, still within the retention) stay
    readable; the chain starts beside them."""
    store = open_store(str(tmp_path / "store"))
    run_id = f"legacy-{uuid.uuid4().hex[:6]}"
    legacy = f"{keys.delivery_log_prefix(run_id, 2)}01795540000000000000-abcd1234.jsonl"
    store.put(legacy, json.dumps({"ucc": "A", "status": "delivered", "message_id": "<A>", "at": time.time(),
                                  "attempts": 1}).encode() + b"\n")
    link = delivery_log.append(store, run_id, 2, [delivery_log.sending("B", "<B>")])
    assert link.seq == 1 and delivery_log.head(store, run_id, 2) == link
    assert {e["ucc"] for e in delivery_log.entries(store, run_id, 2)} == {"A", "B"}


def test_a_log_line_is_one_entry_exactly_as_json_loads_reads_it(tmp_path):
    """The log's lines are parsed by the JSON scanner for speed: whatever it accepts must be what
    json.loads accepts. Padding is read, as json.loads reads it; two entries on one line, or
    one cut short, are named by line."""
    store = open_store(str(tmp_path / "store"))
    entry = json.dumps({"ucc": "A", "status": "delivered", "at": 1.5}, separators=(",", ":"))
    assert [e["ucc"] for e in delivery_log.parse(store, "k", [entry, f"  {entry} ", ""])] == ["A", "A"]
    for bad in (f"{entry},{entry}", f"{entry} x", entry[:-1], '{"ucc":"A","status":"sent","at":1}', "[]"):
        with pytest.raises(StorageError, match="'k' line 2: not a delivery-log entry"):
            list(delivery_log.parse(store, "k", [entry, bad]))
