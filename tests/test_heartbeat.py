"""CN_HEARTBEAT_URL (issue 69): the page that must come comes. A real `run` pings a monitor on
this machine (healthchecks.io's ping API: URL/start, URL, URL/fail) while the day runs; a driver
SIGKILLed stops the pings, which is what the monitor pages on; a monitor that is down costs the
day nothing."""

from __future__ import annotations

import http.server
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pipeline.cluster.heartbeat import Heartbeat
from pipeline.embedded import free_port
from pipeline.settings import ROOT, ConfigError, Settings
from tests.conftest import TRADE_DATE


class Monitor:
    """A dead man's switch on loopback: records each ping's path, body and time."""

    def __init__(self):
        got = self.got = []

        class Ping(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
                got.append((self.path, body, time.monotonic()))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"OK")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ping)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/ping/c0ffee"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        return [p.removeprefix("/ping/c0ffee") or "/" for p, _, _ in self.got]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def monitor():
    m = Monitor()
    yield m
    m.stop()


def _env(ray_session, redis_url, monitor_url: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CN_", "SMTP_URL"))}
    env.update(REDIS_URL=redis_url, RAY_ADDRESS=ray_session.address_info["address"], PYTHONPATH=ROOT,
               CN_HEARTBEAT_URL=monitor_url, CN_HEARTBEAT_S="0.5")
    return env


def _run(env, cwd, *argv) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline", "run", "--date", TRADE_DATE, "--store", "rec",
                             "--test-keys", *argv], cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


@pytest.mark.waits
def test_a_day_pings_start_then_every_period_then_its_finish_and_one_that_cannot_run_pings_fail(
        ray_session, redis_url, day, smtp_sink, tmp_path, monitor):
    env = _env(ray_session, redis_url, monitor.url)
    done = _run(env, tmp_path, "--input", str(day), "--smtp", smtp_sink.url)
    out, err = done.communicate(timeout=300)
    assert done.returncode == 0, err[-3000:]
    paths = monitor.paths()
    assert paths[0] == "/start" and paths[-1] == "/" and "/fail" not in paths, paths
    beats = [t for p, _, t in monitor.got if p.endswith("/start")]
    assert len(beats) >= 3, f"a beat every 0.5 s while the day ran: {paths}"
    assert max(b - a for a, b in zip(beats, beats[1:])) < 3, "no long silence while the driver lived"
    assert "exit status 0" in monitor.got[-1][1]

    monitor.got.clear()
    refused = _run(env, tmp_path, "--input", str(tmp_path / "no-such-input"))
    _, err = refused.communicate(timeout=300)
    assert refused.returncode == 2, err[-3000:]
    assert monitor.paths()[0] == "/start" and monitor.paths()[-1] == "/fail", monitor.paths()
    assert "no-such-input" in monitor.got[-1][1]


def test_a_driver_sigkilled_mid_day_stops_the_pings(ray_session, redis_url, day, smtp_sink, tmp_path, monitor):
    env = _env(ray_session, redis_url, monitor.url)
    driver = _run(env, tmp_path, "--input", str(day), "--smtp", smtp_sink.url)
    try:
        deadline = time.monotonic() + 60
        while len(monitor.got) < 3 and time.monotonic() < deadline:  # started, and beating
            time.sleep(0.05)
        assert len(monitor.got) >= 3 and driver.poll() is None, (monitor.paths(), driver.poll())
        driver.send_signal(signal.SIGKILL)  # as the OOM killer ends it: no exit path runs
        driver.wait(timeout=30)
        killed_at = time.monotonic()
    finally:
        if driver.poll() is None:
            driver.kill()
    time.sleep(3)  # six periods
    after = [p for p, _, t in monitor.got if t > killed_at + 0.2]
    assert after == [], f"pings after the driver died: {after}"
    assert "/fail" not in monitor.paths() and monitor.paths()[-1] == "/start", "no last word from a killed driver"


def test_a_monitor_that_is_down_is_said_once_and_costs_nothing(caplog):
    beat = Heartbeat(f"http://127.0.0.1:{free_port()}/ping/x", period_s=0.1)
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="pipeline.cluster.heartbeat"):
        beat.start()
        time.sleep(0.5)
        beat.end(True, "done")
    assert time.monotonic() - started < 3, "each ping is bounded"
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "the day goes on" in warned[0].getMessage(), caplog.text
    assert "/ping/x" not in caplog.text, "the check's secret path is never logged"


def test_a_heartbeat_url_that_is_not_http_is_refused_before_the_day():
    with pytest.raises(ConfigError, match="CN_HEARTBEAT_URL"):
        Settings.from_env({"CN_HEARTBEAT_URL": "hc-ping.com/abc"})
