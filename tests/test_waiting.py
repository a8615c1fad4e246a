"""Redis waited for by time (pipeline/record/waiting.py): a real redis-server stopped and started
again. Its patience (CN_REDIS_PATIENCE_S) is the floor, the run's deadline the reach; the
process says once that it waits, and when Redis is back."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from pipeline.embedded import EmbeddedError, start_redis
from pipeline.record.state import RunState
from pipeline.record.waiting import RedisGone


def test_redis_down_past_its_patience_is_waited_for_until_the_deadline_and_said_once(tmp_path, caplog):
    """Patience 1 s: without a deadline a call fails after about that; with the run's deadline
    a minute off, the same call waits out a 4 s outage and is said once. Before, Redis had 40
    retries (about 30 s) whatever the run's deadline."""
    server = start_redis(tmp_path / "redis")
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    server.stop()
    hasty = RunState(server.url, "redis-wait", patience_s=1.0)
    started = time.monotonic()
    with pytest.raises(RedisGone, match=r"unreachable since .*, past CN_REDIS_PATIENCE_S \(1 s\)"):
        hasty.update_meta(tried=1)
    assert time.monotonic() - started < 5

    patient, back = RunState(server.url, "redis-wait", patience_s=1.0, deadline_at=time.time() + 60), []
    timer = threading.Timer(4, lambda: back.append(start_redis(tmp_path / "redis", port=port)))
    timer.start()
    caplog.set_level(logging.WARNING, logger="pipeline.record.waiting")
    caplog.clear()  # the hasty client's outage was said, by its own client
    started = time.monotonic()
    try:
        patient.update_meta(waited=1)
        took = time.monotonic() - started
        assert patient.meta().get("waited") == "1"
    finally:
        timer.join()
        for service in back:
            service.stop()
    assert took > 3.5, took
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if m.startswith("waiting for Redis")]) == 1, said
    assert len([m for m in said if "is back after" in m]) == 1, said


@pytest.mark.parametrize("rate", ["", "?rate=200"])
def test_a_mailer_s_event_loop_goes_on_while_redis_is_away(tmp_path, settings, smtp_sink, rate):
    """Redis stopped for 3 s in the middle of a batch, the run's deadline a minute off: the
    mails wait and all leave once (counted at the relay), and the mailer's event loop, which
    also reads the relays' replies and answers the driver, is never held more than a moment.
    Before, each claim waited for Redis on the loop itself: one stall as long as the outage.
    A paced relay too (its send times come from Redis) sends each once."""
    import asyncio
    import dataclasses
    from collections import Counter

    from pipeline.record.storage import open_store
    from pipeline.stages import Batch, mail_context, mail_stage
    from tests.conftest import TRADE_DATE
    from tests.helpers import outbox_messages

    server = start_redis(tmp_path / "redis")
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    mine = dataclasses.replace(settings, redis_url=server.url, smtp_url=smtp_sink.url + rate,
                               smtp_connections=2).with_deadline(1)
    run_id = "loop-free"
    state = RunState.of(mine, run_id)
    state.start({})
    lease = state.take_lease(120).token
    items = [{"ucc": f"L{i:03d}", "name": "Client", "email": f"l{i}@example.com", "pan": "ABCPD1234E", "ecn": True,
              "pdf": b"%PDF-1.7\n" + bytes([i]) * 2000} for i in range(60)]
    back, gaps = [], []

    def outage() -> None:
        while len(list(smtp_sink.outbox.glob("*.eml"))) < 10:
            time.sleep(0.01)
        server.stop()
        time.sleep(3)
        back.append(start_redis(tmp_path / "redis", port=port))

    async def ticking(done: asyncio.Event) -> None:
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.02)
            gaps.append(time.monotonic() - last)
            last = time.monotonic()

    async def mail() -> dict:
        ctx, done = mail_context(mine, state, open_store(mine.store_url)), asyncio.Event()
        ticker = asyncio.get_running_loop().create_task(ticking(done))
        stopping = asyncio.get_running_loop().run_in_executor(None, outage)
        try:
            return await mail_stage(Batch(run_id, TRADE_DATE, 0, items, lease=lease), ctx)
        finally:
            await stopping
            done.set()
            await ticker
            await ctx.pool.close()

    try:
        result = asyncio.new_event_loop().run_until_complete(mail())
    finally:
        for service in back:
            service.stop()
    assert back, "Redis was not stopped and started again"
    assert result["tally"] == {"ok": 60}, result
    counts = Counter(m["Message-ID"] for m in outbox_messages(smtp_sink.outbox))
    assert len(counts) == 60 and set(counts.values()) == {1}
    assert max(gaps) < 1.0, f"the event loop was held {max(gaps):.1f} s while Redis was away"


def test_a_paced_relay_s_send_times_are_asked_of_redis_off_the_event_loop(tmp_path):
    """A relay's pacer asking Redis for send times while Redis is away for 3 s: the send
    waits for the answer, the loop does not. Before, the ask ran on the loop: a 3 s stall."""
    import asyncio

    from pipeline.mail.pacing import Pacer
    from pipeline.record.rates import RedisBuckets

    server = start_redis(tmp_path / "redis")
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    pacer, back, gaps = Pacer("relay:paced", 50.0, RedisBuckets(server.url, 1.0, time.time() + 60)), [], []

    async def go() -> float:
        for _ in range(pacer.batch):  # the times Redis gave, used up: the next send asks again
            await pacer.slot(asyncio.sleep)
        server.stop()
        timer = threading.Timer(3, lambda: back.append(start_redis(tmp_path / "redis", port=port)))
        timer.start()
        started, last = time.monotonic(), time.monotonic()
        sending = asyncio.get_running_loop().create_task(pacer.slot(asyncio.sleep))
        while not sending.done():
            await asyncio.sleep(0.02)
            gaps.append(time.monotonic() - last)
            last = time.monotonic()
        await sending
        timer.join()
        return time.monotonic() - started

    try:
        waited = asyncio.new_event_loop().run_until_complete(go())
    finally:
        for service in back:
            service.stop()
    assert waited > 2.5, waited
    assert max(gaps) < 1.0, f"the event loop was held {max(gaps):.1f} s while Redis was away"


def test_a_redis_started_on_a_port_another_program_listens_on_fails_rather_than_pass_for_it(tmp_path):
    """The start waited for an answer on the port: anybody's. A listener already there (the Redis
    a `kill` is still taking down, or a program that took the port after free_port) answered, the
    new redis-server failed to bind, and the caller was handed a URL with nobody of ours behind it."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(EmbeddedError, match=rf"redis-server exited with code \d+ before listening on {port}"):
            start_redis(tmp_path / "redis", port=port).stop()
    server = start_redis(tmp_path / "redis", port=port)  # the port free again: ours, and it answers
    try:
        state = RunState(server.url, "ours")
        state.update_meta(up=1)
        assert state.meta().get("up") == "1"
    finally:
        server.stop()


def test_a_forced_rerun_stopped_at_its_deadline_names_the_rerun_that_mails_its_accounts_again():
    """Its failed accounts are delivered ones: `rerun --failed` alone would take them and mail
    none (a delivered account is mailed again only with --force)."""
    from pipeline.cluster.waits import DayWaits
    from pipeline.settings import Settings

    waits = DayWaits("r1", Settings(deadline_at=time.time()))
    assert waits.ending(3).endswith("`rerun r1 --failed` sends them")
    assert waits.ending(3, force=True).endswith("`rerun r1 --failed --force` sends them")
