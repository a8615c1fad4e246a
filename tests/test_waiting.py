"""Redis waited for by time (pipeline/record/waiting.py): a real redis-server stopped and started
again. Its patience (CN_REDIS_PATIENCE_S) is the floor, the run's deadline the reach; the
process says once that it waits, and when Redis is back."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from pipeline.embedded import start_redis
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
