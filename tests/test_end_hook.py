"""CN_ON_END: a run's end told to a webhook or a command, however it ends (issue 57)."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading

from pipeline.settings import ROOT
from tests.conftest import TRADE_DATE


def cli(env: dict, cwd, *argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_a_day_that_ends_posts_its_summary_and_one_that_cannot_start_runs_the_command(
        ray_session, redis_url, day, smtp_sink, tmp_path):
    got: list[dict] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CN_", "SMTP_URL"))}
    env.update(REDIS_URL=redis_url, RAY_ADDRESS=ray_session.address_info["address"], PYTHONPATH=ROOT,
               CN_ON_END=f"http://127.0.0.1:{server.server_address[1]}/hooks/T0/secret-path")
    try:
        done = cli(env, tmp_path, "run", "--date", TRADE_DATE, "--input", str(day), "--store", "rec", "--smtp",
                   smtp_sink.url, "--test-keys")
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.splitlines()[-1])
    [told] = got
    assert told["run_id"] == summary["run_id"] and told["exit_status"] == 0 and told["late"] is False
    assert told["delivered"] == summary["delivered"] and told["command"] == "run"

    heard = tmp_path / "heard.json"
    env["CN_ON_END"] = f"{sys.executable} -c \"import sys; open({str(heard)!r}, 'wb').write(sys.stdin.buffer.read())\""
    refused = cli(env, tmp_path, "run", "--date", TRADE_DATE, "--input", str(tmp_path / "no-such-input"), "--store",
                  "rec", "--test-keys")
    assert refused.returncode == 2
    told = json.loads(heard.read_text())
    assert told["exit_status"] == 2 and "no-such-input" in told["error"] and told["date"] == TRADE_DATE
