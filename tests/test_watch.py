"""`watch` on the laptop: a day's log followed, its end as the job's, a silent head said in one
line. The job API here is a stand-in answering as Ray's does (GET /api/jobs/ID and its /logs);
the cloud test (test_ray_up.py) watches a real head die."""

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pipeline.cluster.watch import LOST, watch


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
