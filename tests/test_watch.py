"""`watch` on the laptop: a day's log followed, its end as the job's, a silent head said in one
line. The job API here is a stand-in answering as Ray's does (GET /api/jobs/ID and its /logs);
the cloud test (test_ray_up.py) watches a real head die."""

import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pipeline.__main__ import main
from pipeline.cluster.watch import LOST, NEVER, watch
from pipeline.embedded import free_port
from pipeline.settings import ROOT
from tests.local_cloud import variant


class _Jobs(BaseHTTPRequestHandler):
    job = {"status": "RUNNING"}
    logs = "run 2026-11-20-abc123: dumps read after 1.0 s, 4 shards being assembled\n"

    def do_GET(self):
        body = {"/api/jobs/day": self.job, "/api/jobs/day/logs": {"logs": self.logs}}.get(self.path)
        self.send_response(200 if body else 404)
        self.end_headers()
        self.wfile.write(json.dumps(body or {}).encode())

    def log_message(self, *_):
        pass


def _serve():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Jobs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_a_head_that_stops_answering_is_said_once_with_the_run_id_that_resumes_it(capsys):
    server, address = _serve()
    out = io.StringIO()
    threading.Timer(1.0, lambda: (server.shutdown(), server.server_close())).start()  # the head's instance ends

    assert watch(address, "day", silence_s=2, poll_s=0.2, out=out) == LOST

    assert "dumps read" in out.getvalue()
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("error: the head") and "--run-id 2026-11-20-abc123" in said[0]


def test_a_day_that_ends_ends_the_watch_with_its_status(capsys):
    server, address = _serve()
    _Jobs.job = {"status": "FAILED"}
    try:
        assert watch(address, "day", silence_s=2, poll_s=0.2, out=io.StringIO()) == 1
        assert watch(address, "other", silence_s=2, poll_s=0.2, out=io.StringIO()) == 2
    finally:
        _Jobs.job = {"status": "RUNNING"}
        server.shutdown()
        server.server_close()
    assert "job day: FAILED" in capsys.readouterr().err


# Issue 69: a silent address is not yet a lost head. The cloud is asked through Ray's node provider
# for cluster.yaml (its local-cloud variant, tests/local_cloud.py's LocalCloudProvider, whose API is
# played here by a stand-in listing one head instance in the state the test gives it).

class _Cloud(BaseHTTPRequestHandler):
    head = "running"
    asked = 0

    def do_GET(self):
        _Cloud.asked += 1
        body = json.dumps([{"id": "i-0head", "ip": "10.0.0.2", "type": "c6a.xlarge", "state": self.head,
                            "tags": {"ray-cluster-name": "contract-notes", "ray-node-type": "head"}}]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass


@pytest.fixture
def cloud(tmp_path, monkeypatch):
    """The cluster config (cluster.yaml's local-cloud variant) whose provider asks the stand-in."""
    monkeypatch.syspath_prepend(str(Path(ROOT) / "tests"))  # the provider's module, as `ray up` finds it
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Cloud)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = tmp_path / "cluster-local.yaml"
    config.write_text(variant((Path(ROOT) / "cluster.yaml").read_text(), f"http://127.0.0.1:{server.server_address[1]}"))
    _Cloud.head, _Cloud.asked = "running", 0
    yield config
    server.shutdown()
    server.server_close()


def _watch(address: str, config: Path, silence_s: float = 2) -> int:
    return main(["watch", "day", "--address", address, "--silence-s", str(silence_s), "--cluster-config", str(config)],
                stdout=io.StringIO())


def test_a_mistyped_address_that_never_answered_is_said_as_such_never_as_a_lost_head(cloud, capsys):
    assert _watch(f"http://127.0.0.1:{free_port()}", cloud, silence_s=1) == NEVER

    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and said[0].startswith("error: nothing ever answered at http://127.0.0.1:"), said
    assert said[0].endswith("is the address right? `ray dashboard cluster.yaml` opens it") and "ray down" not in said[0]


def test_a_tunnel_that_dropped_while_the_cloud_runs_the_head_is_said_and_the_watch_goes_on(cloud, capsys):
    server, address = _serve()
    port = server.server_address[1]
    reopened = []

    def drop_then_reopen():
        server.shutdown()
        server.server_close()  # the tunnel drops: nothing listens on the laptop's port
        time.sleep(6)  # silent for 2 s, then the cloud is asked, and asked again 2 s later
        _Jobs.job = {"status": "SUCCEEDED"}
        again = ThreadingHTTPServer(("127.0.0.1", port), _Jobs)  # `ray dashboard cluster.yaml` again
        threading.Thread(target=again.serve_forever, daemon=True).start()
        reopened.append(again)

    threading.Timer(1.0, drop_then_reopen).start()
    try:
        assert _watch(address, cloud) == 0  # the day's own end, once the tunnel is back
    finally:
        _Jobs.job = {"status": "RUNNING"}
        for again in reopened:
            again.shutdown()
            again.server_close()

    said = capsys.readouterr().err
    tunnel = [line for line in said.splitlines() if "tunnel" in line]
    assert len(tunnel) == 1 and tunnel[0].startswith("warning: the head is running but its address does not answer")
    assert "`ray dashboard cluster.yaml`" in tunnel[0] and "ray down" not in said and "lost" not in said, said
    assert _Cloud.asked >= 2 and "job day: SUCCEEDED" in said


def test_a_head_the_cloud_no_longer_runs_is_lost_with_the_run_id_that_resumes_it(cloud, capsys):
    server, address = _serve()
    _Cloud.head = "terminated"
    threading.Timer(1.0, lambda: (server.shutdown(), server.server_close())).start()

    assert _watch(address, cloud) == LOST

    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and "the cloud no longer runs it" in said[0], said
    assert "ray down, ray up, then submit the day again with --run-id 2026-11-20-abc123" in said[0]
    assert _Cloud.asked >= 1
