"""Start and stop the local services of the embedded default: redis-server and an SMTP sink.

Each runs as a child process on a free loopback port and is stopped by its own PID, never
by name: other Redis or SMTP servers on the machine are not ours to touch.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.settings import tls_files, with_tls_files


class EmbeddedError(RuntimeError):
    pass


@dataclass
class Service:
    name: str
    process: subprocess.Popen
    url: str

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, name: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise EmbeddedError(f"{name} exited with code {process.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    process.kill()
    raise EmbeddedError(f"{name} did not listen on port {port} within {timeout_s} s")


def start_redis(workdir: Path, aof: bool = True, port: int | None = None, tls_dir: Path | None = None) -> Service:
    """AOF on (fsync every second): a restart keeps the run's state, at no cost worth measuring.
    With `tls_dir` (ca.crt, node.crt, node.key), TLS only and client certificates required, as
    on a cluster's head (cluster.yaml)."""
    binary = shutil.which("redis-server")
    if not binary:
        raise EmbeddedError("redis-server is not on PATH (apt-get install redis-server)")
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    if tls_dir is None:
        listen = ["--port", str(port)]
    else:
        ca, cert, key = tls_files(tls_dir)
        listen = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", cert, "--tls-key-file", key,
                  "--tls-ca-cert-file", ca, "--tls-auth-clients", "yes"]
    process = subprocess.Popen(
        [binary, *listen, "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes" if aof else "no",
         "--dir", str(workdir), "--logfile", str(workdir / "redis.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(port, process, "redis-server")
    if tls_dir is None:
        return Service("redis", process, f"redis://127.0.0.1:{port}/0")
    return Service("redis", process, with_tls_files(f"rediss://127.0.0.1:{port}/0", str(tls_dir)))


def start_smtp_sink(outbox: Path, log: Path, extra_args: list[str] = (), port: int | None = None) -> Service:
    """Waits for the sink's "listening" line rather than probing the port: a probe would be
    a connection, and the sink may be told to refuse its first ones."""
    port = port or free_port()
    with log.open("ab") as out:
        start = out.tell()
        process = subprocess.Popen(
            [sys.executable, "-m", "pipeline.mail.smtp_sink", "--port", str(port), "--outbox", str(outbox), *extra_args],
            stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parent.parent)
    deadline = time.monotonic() + 20
    while b"listening on" not in log.read_bytes()[start:]:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise EmbeddedError(f"smtp sink did not start on port {port}: see {log}")
        time.sleep(0.02)
    return Service("smtp", process, f"smtp://127.0.0.1:{port}")
