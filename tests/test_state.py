"""The Redis state model against a real redis-server."""

import asyncio
import json
import os
import signal
import socket
import threading
import time
import uuid

import pytest

from pipeline.embedded import start_redis
from pipeline.mail.message import message_id
from pipeline.record import keys
from pipeline.record.guard import StateLostError, claim_token
from pipeline.record.lease import LeaseHeldError, LeaseLostError, held
from pipeline.record.records import STAGES, Outcome, final_status, history
from pipeline.record.state import RunState

KEY = b"the run's HMAC key: Message-IDs are keyed, as a run writes them"


@pytest.fixture
def state(redis_url):
    return RunState(redis_url, f"test-{uuid.uuid4().hex[:8]}", ttl_s=600)


def test_counters_move_once_per_account_and_stage_however_often_recorded(state):
    for _ in range(3):
        state.record([Outcome("A", "validated"), Outcome("A", "rendered"), Outcome("B", "validated")])
    c = state.counts()
    assert (c["validated"], c["rendered"], c["signed"]) == (2, 1, 0)


def test_a_failure_keeps_the_furthest_stage_and_enters_the_failed_registry(state):
    state.record([Outcome("A", "validated"), Outcome("A", "rendered"), Outcome("A", "signed"),
                  Outcome("A", "archived")])
    state.record([Outcome("A", "delivered", "failed", reason="smtp permanent: 550 no such user")])
    rec = state.accounts(["A"])["A"]
    assert (rec["stage"], rec["status"], rec["failed_at"]) == ("archived", "failed", "delivered")
    assert state.failed() == ["A"] and state.counts()["failed"] == 1

    state.record([Outcome("A", "delivered", message_id="<m>")])
    assert state.failed() == [] and state.counts()["delivered"] == 1


def test_the_mail_guard_admits_exactly_one_claim(state):
    epoch, lease = state.start({}), state.take_lease(30).token
    token = claim_token(lease)
    assert state.claim_mail("A", "<m1>", epoch, lease, token=token) is True
    assert state.claim_mail("A", "<m1>", epoch, lease) is False
    state.release_mail("A", token)
    assert state.claim_mail("A", "<m1>", epoch, lease) is True
    assert state.start({}) == epoch, "a rerun of the run keeps its epoch"


def test_a_resend_takes_over_an_earlier_driver_s_claim_once_and_only_under_the_lease(state):
    """`rerun --unconfirmed`: the new driver's resend takes over the first run's claim in the
    claim's own step (a driver taken over meanwhile is refused, the guard kept); the same batch
    resent to another mailer finds the claim its own driver's and does not mail again; and the
    first run's mailing, giving up on its relay later, never frees the claim it lost."""
    epoch = state.start({})
    first = state.take_lease(30).token
    old = claim_token(first)
    assert state.claim_mail("A", "<m>", epoch, first, token=old)
    state.r.delete(keys.run_lease(state.run_id))
    rerun = state.take_lease(30).token
    with pytest.raises(LeaseLostError):
        state.claim_mail("A", "<m>", epoch, first, resend=True)
    assert not state.claim_mail("A", "<m>", epoch, rerun), "a plain claim never takes over"
    assert state.claim_mail("A", "<m>", epoch, rerun, resend=True)
    assert not state.claim_mail("A", "<m>", epoch, rerun, resend=True), "once a driver: the batch resent elsewhere"
    state.release_mail("A", old)
    assert state.claimed(["A"]) == {"A"}


def test_a_claim_says_when_it_was_taken(state):
    """A forced rerun tells its own attempt's outcome (recorded after its claim) from the run's
    earlier delivery by the claim's time (stages._already_claimed); a guard that does not say
    (restored from storage, or a token made before the time was in it) reads as never."""
    epoch, lease = state.start({}), state.take_lease(30).token
    before = time.time()
    assert state.claim_mail("A", "<m>", epoch, lease)
    assert before - 0.001 <= state.claim_time("A") <= time.time() + 0.001  # in whole milliseconds
    assert claim_token(lease)[:8] == lease[:8]
    state.restore_claims(["B"])
    state.r.hset(keys.run_mailguard(state.run_id), "C", lease[:8] + os.urandom(4).hex())
    assert (state.claim_time("B"), state.claim_time("C"), state.claim_time("D")) == (0.0, 0.0, 0.0)


def test_a_claim_whose_kept_connection_redis_cut_claims_once_through_the_client(state):
    """Claims go on a connection of their own (guard._evalsha); when Redis cuts it (a restart,
    CLIENT KILL), the claim falls back to the client and its retries, and the guard still
    admits exactly one claim an account."""
    epoch, lease = state.start({}), state.take_lease(30).token
    assert state.claim_mail("A", "<a>", epoch, lease)
    killed = state.r.client_kill_filter(_type="normal", skipme=True)
    assert killed >= 1, "the claims' connection was open to be cut"
    assert state.claim_mail("B", "<b>", epoch, lease)
    assert not state.claim_mail("A", "<a>", epoch, lease)
    assert state.claim_mail("C", "<c>", epoch, lease), "the connection is usable again"
    assert state.claimed(["A", "B", "C"]) == {"A", "B", "C"}


def test_a_mailer_s_claim_to_a_redis_frozen_mid_claim_gives_up_in_its_timeout_and_never_reads_that_reply(tmp_path):
    """A mailer's claims (claim_mail_async) go on its loop's own kept connection. Redis stops
    answering (SIGSTOP: a frozen server, or a half-open link) after a claim was sent on it: the
    claim gives up within the URL's socket timeout and hands the same call to the client's
    patient retries, which claim once Redis is back (the same token: its own claim). The kept
    connection, whose reply was never read, is never used again: a claim after it that must be
    refused is refused, not answered with the frozen claim's reply."""
    server = start_redis(tmp_path / "redis", aof=False)
    try:
        state = RunState(server.url + "?socket_timeout=0.5", f"test-{uuid.uuid4().hex[:8]}")
        epoch, lease = state.start({}), state.take_lease(60).token
        handed = []

        async def patient(fn, args):
            handed.append(time.monotonic())
            return await asyncio.to_thread(fn, args)

        async def claims() -> tuple[bool, bool, bool, float]:
            first = await state.claim_mail_async("A", "<a>", epoch, lease, [], patient, claim_token(lease))
            server.process.send_signal(signal.SIGSTOP)
            threading.Timer(1.5, server.process.send_signal, (signal.SIGCONT,)).start()
            started = time.monotonic()
            frozen = await state.claim_mail_async("B", "<b>", epoch, lease, [], patient, claim_token(lease))
            again = await state.claim_mail_async("A", "<a>", epoch, lease, [], patient, claim_token(lease))
            return first, frozen, again, started

        first, frozen, again, started = asyncio.run(claims())
    finally:
        server.process.send_signal(signal.SIGCONT)
        server.stop()
    assert first and frozen and not again
    waited = [t - started for t in handed if t >= started]  # the first claim's too, had its script to be loaded
    assert len(waited) == 1 and 0.5 <= waited[0] < 1.4, "the frozen claim waited its timeout, no more"


def test_replies_ride_to_redis_with_the_next_claim_even_after_redis_lost_its_scripts(state):
    """A mailer records a relay's reply in its next claim's round trip (stages._record): the
    reply must land whether or not Redis still has the scripts cached (a restart drops them),
    exactly once (a second write would add an event), and the claim must still hold."""
    epoch, lease = state.start({}), state.take_lease(30).token
    for ucc in "ABC":
        state.record([Outcome(ucc, "archived")])
    assert state.claim_mail("B", "<b>", epoch, lease, [Outcome("A", "delivered", message_id="<a>", reply="250 ok")])
    state.r.script_flush()
    assert state.claim_mail("C", "<c>", epoch, lease, [Outcome("B", "delivered", message_id="<b>", reply="250 ok")])
    assert not state.claim_mail("C", "<c>", epoch, lease)
    records = state.accounts(["A", "B"])
    assert [(r["stage"], r["reply"], r["events"]) for r in records.values()] == [("delivered", "250 ok", [])] * 2
    assert state.counts()["delivered"] == 2 and state.claimed(["B", "C"]) == {"B", "C"}


def test_a_redis_that_lost_the_run_refuses_claims_instead_of_forgetting_them(state):
    epoch, lease = state.start({}), state.take_lease(30).token
    assert state.claim_mail("A", "<m1>", epoch, lease)
    state.r.delete(*state.r.keys(f"cn:run:{state.run_id}:*"))  # what FLUSHALL or a restart without AOF does
    with pytest.raises(StateLostError, match="run the same run id again"):
        state.claim_mail("A", "<m1>", epoch, lease)
    with pytest.raises(StateLostError):
        state.claim_mail("B", "<m2>", epoch, lease)
    assert not state.claimed(["A", "B"]), "nothing was claimed against the lost run"


def test_unconfirmed_accounts_have_their_own_registry_and_leave_it_when_settled(state):
    state.record([Outcome("A", "archived"), Outcome("B", "archived")])
    state.record([Outcome("A", "delivered", "unconfirmed", message_id="<a>", reason="connection lost")])
    state.record([Outcome("B", "delivered", "failed", reason="smtp permanent: 550")])
    rec = state.accounts(["A"])["A"]
    assert (final_status(rec), rec["stage"], rec["message_id"]) == ("unconfirmed", "archived", "<a>")
    assert state.unconfirmed() == ["A"] and state.failed() == ["B"]
    assert (state.counts()["unconfirmed"], state.counts()["failed"]) == (1, 1)
    state.record([Outcome("A", "delivered", message_id="<a>", reply="reconciled")])
    assert state.unconfirmed() == [] and state.counts()["delivered"] == 1


def test_note_numbers_are_reserved_in_disjoint_blocks(state):
    fy = f"test-{uuid.uuid4().hex[:6]}"
    sequence = keys.note_sequence(fy, "a-store")
    a, b = state.next_note_numbers(sequence, 5), state.next_note_numbers(sequence, 3)
    assert (a, b) == (1, 6)


def test_batched_writes_flush_by_size_and_a_trickle_by_time(state):
    import time

    from pipeline.record.records import StateWriter

    writer = StateWriter(state, size=3, max_age_s=0.2)
    for ucc in ("A", "B"):
        writer.add(Outcome(ucc, "validated"))
    assert state.counts()["validated"] == 0  # buffered
    writer.add(Outcome("C", "validated"))
    assert state.counts()["validated"] == 3  # size reached
    writer.add(Outcome("D", "validated"))
    time.sleep(0.4)
    assert state.counts()["validated"] == 4  # a trickle is flushed by the timer


def test_an_account_costs_redis_at_most_400_bytes_at_the_end_of_a_run(state):
    """Issue 11's budget, measured with MEMORY USAGE on a run's keys: every stage recorded, the
    mail guard taken, the relay's reply kept. 2,000 accounts make both hashes the large kind
    (hashtable, not listpack), as at 1.5M."""
    epoch, uccs = state.start({"date": "2026-11-20"}), [f"C{i:07d}" for i in range(2000)]
    lease = state.take_lease(30).token
    for stage in STAGES[:-1]:
        state.record(Outcome(u, stage) for u in uccs)
    for u in uccs:
        assert state.claim_mail(u, message_id(state.run_id, u, KEY), epoch, lease)
    state.record(Outcome(u, "delivered", message_id=message_id(state.run_id, u, KEY),
                         reply=f"OK queued as {uuid.uuid4().hex}", extra={"attempts": 1}) for u in uccs)
    state.snapshot()
    names = [keys.run_meta(state.run_id), keys.run_counts(state.run_id), keys.run_accounts(state.run_id),
             keys.run_failed(state.run_id), keys.run_unconfirmed(state.run_id), keys.run_mailguard(state.run_id),
             keys.run_timeline(state.run_id)]
    per_account = sum(state.r.memory_usage(k, samples=0) or 0 for k in names) / len(uccs)
    print(f"redis bytes per account: {per_account:.0f}")
    assert per_account <= 400, per_account
    rec = state.accounts([uccs[7]])[uccs[7]]
    assert (rec["stage"], rec["message_id"], rec["attempts"]) == ("delivered", message_id(state.run_id, uccs[7], KEY), 1)
    assert rec["reply"].startswith("OK queued as ")


def test_the_history_keeps_the_order_of_failures_reruns_and_stages_reached(state):
    state.record([Outcome("A", "validated"), Outcome("A", "rendered")])
    state.record([Outcome("A", "signed", "failed", reason="signer down")])
    state.record([Outcome("A", "signed"), Outcome("A", "archived")])
    state.record([Outcome("A", "delivered", "failed", reason="smtp permanent: 550")])
    state.record([Outcome("A", "archived"), Outcome("A", "delivered", reply="250 ok", message_id="<x@y>")])
    events = [(e["stage"], e["status"]) for e in history(state.accounts(["A"])["A"])]
    assert events == [("validated", "ok"), ("rendered", "ok"), ("signed", "failed"), ("signed", "ok"),
                      ("archived", "ok"), ("delivered", "failed"), ("archived", "ok"), ("delivered", "ok")]
    rec = state.accounts(["A"])["A"]
    assert (rec["message_id"], rec["reply"], rec["failed_at"], final_status(rec)) == ("<x@y>", "250 ok", "", "delivered")
    assert history(rec)[-1]["reply"] == "250 ok" and history(rec)[2]["reason"] == "signer down"


def test_one_driver_holds_a_run_and_a_second_is_told_who(state):
    first = state.take_lease(30)
    with pytest.raises(LeaseHeldError, match=rf"held by a driver on {socket.gethostname()} \(pid {os.getpid()}\) since"):
        state.take_lease(30)
    epoch = state.start({})
    with pytest.raises(LeaseLostError):
        state.claim_mail("A", "<m1>", epoch, "not-the-lease")
    assert state.claim_mail("A", "<m1>", epoch, first.token)
    state.release_lease(first.token)
    assert state.take_lease(30).taken_over_from is None, "a released run is free"


def test_a_driver_that_stopped_renewing_is_taken_over_and_the_takeover_recorded(state):
    dead = state.take_lease(0.3)
    time.sleep(0.5)
    heir = state.take_lease(0.3)
    assert heir.taken_over_from["token"] == dead.token and heir.taken_over_from["pid"] == os.getpid()
    assert json.loads(state.meta()["lease_takeover"])["token"] == dead.token
    assert not state.renew_lease(dead.token) and state.renew_lease(heir.token)
    assert not state.holds_lease(dead.token) and state.holds_lease(heir.token)


def test_a_held_lease_is_renewed_while_its_driver_works_and_released_after(state):
    with held(state, 0.6) as lease:
        time.sleep(1.5)  # more than twice the lease: only renewals keep it
        with pytest.raises(LeaseHeldError):
            state.take_lease(0.6)
        assert not lease.lost
    assert state.lease_holder() is None


def test_a_later_outcome_keeps_the_recorded_message_id_reply_and_duplicate_mark(state):
    state.record([Outcome("A", "delivered", message_id="<m>", reply="250 queued as X",
                          extra={"possible_duplicate": True})])
    state.record([Outcome("A", "delivered", "skipped", reason="already delivered")])
    state.record([Outcome("A", "delivered", "unconfirmed", reason="a resend's reply was lost")])
    rec = state.accounts(["A"])["A"]
    assert (rec["message_id"], rec["reply"]) == ("<m>", "250 queued as X")
    assert rec["extra"]["possible_duplicate"] is True


def test_a_record_is_never_stamped_before_the_moment_it_was_made(state):
    """A rerun counts the records made since its start. One made 0.3 ms after that start was
    rounded to the nearest millisecond, below it, and counted as the run's before (CI met it: a
    forced rerun's failed chain answered for an account the rerun had delivered). The real
    clock, forty times: rounded, about half the records made within half a millisecond of
    their moment would read as before it."""
    moments = {}
    for i in range(40):
        moments[f"A{i}"] = time.time()
        state.record([Outcome(f"A{i}", "rendered")])
    recorded = state.accounts(list(moments))
    for ucc, since in moments.items():
        assert recorded[ucc]["updated"] >= since
