"""The Redis state model against a real redis-server."""

import uuid

import pytest

from pipeline.state import Outcome, RunState, StateLostError, final_status


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
    epoch = state.start({})
    assert state.claim_mail("A", "<m1>", epoch) is True
    assert state.claim_mail("A", "<m1>", epoch) is False
    state.release_mail("A")
    assert state.claim_mail("A", "<m1>", epoch) is True
    assert state.start({}) == epoch, "a rerun of the run keeps its epoch"


def test_a_redis_that_lost_the_run_refuses_claims_instead_of_forgetting_them(state):
    epoch = state.start({})
    assert state.claim_mail("A", "<m1>", epoch)
    state.r.delete(*state.r.keys(f"cn:run:{state.run_id}:*"))  # what FLUSHALL or a restart without AOF does
    with pytest.raises(StateLostError, match="run the same run id again"):
        state.claim_mail("A", "<m1>", epoch)
    with pytest.raises(StateLostError):
        state.claim_mail("B", "<m2>", epoch)
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
    a, b = state.next_note_numbers(fy, 5), state.next_note_numbers(fy, 3)
    assert (a, b) == (1, 6)


def test_batched_writes_flush_by_size_and_a_trickle_by_time(state):
    import time

    from pipeline.state import StateWriter

    writer = StateWriter(state, size=3, max_age_s=0.2)
    for ucc in ("A", "B"):
        writer.add(Outcome(ucc, "validated"))
    assert state.counts()["validated"] == 0  # buffered
    writer.add(Outcome("C", "validated"))
    assert state.counts()["validated"] == 3  # size reached
    writer.add(Outcome("D", "validated"))
    time.sleep(0.4)
    assert state.counts()["validated"] == 4  # a trickle is flushed by the timer
