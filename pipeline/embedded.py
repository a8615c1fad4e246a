"""Start and stop the local services of the embedded default: redis-server and an SMTP sink.

Each runs as a child process on a free loopback port and is stopped by its own PID, never
by name: other Redis or SMTP servers on the machine are not ours to touch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
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


def wait_for_port(port: int, process: subprocess.Popen, name: str, timeout_s: float = 20, own: bool = False) -> None:
    """Until something answers on the port; with `own`, until `process` itself listens on it (as
    /proc tells, where there is one): another listener's answer (the Redis a `kill` is still
    taking down, or a program that took the port after free_port) would pass for ours, which
    then failed to bind and left nobody there."""
    deadline = time.monotonic() + timeout_s
    own = own and Path("/proc/net/tcp").exists()
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise EmbeddedError(f"{name} exited with code {process.returncode} before listening on {port}")
        if own:
            if _listening(process.pid, port):
                return
        else:  # anybody's answer (no /proc to tell whose)
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        time.sleep(0.05)
    process.kill()
    raise EmbeddedError(f"{name} did not listen on port {port} within {timeout_s} s")


def _listening(pid: int, port: int) -> bool:
    """Whether process `pid` holds a socket listening on TCP `port` (IPv4 or IPv6), from /proc:
    the listening sockets' inodes in /proc/net/tcp*, against the sockets among its descriptors."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            next(rows)  # the column names
            for row in rows:
                fields = row.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return False
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) in inodes:
                    return True
    return False


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
    wait_for_port(port, process, "redis-server", own=True)
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


# What the commands after the demo need (README, "After the demo"): its settings in DIR/env.sh, and its Redis
# (whose append-only file keeps the run) and SMTP sink again on the ports the run recorded.


def sink_args(work: Path, bounce_rate: float) -> list[str]:
    """The demo's relay returns DSNs for a share of its mail to DIR/bounces, as to the bounce
    domain's mailbox; without --bounce-rate it is an empty maildir, so the README's `bounces`
    after the demo reads none."""
    for sub in ("new", "cur", "tmp"):
        (work / "bounces" / sub).mkdir(parents=True, exist_ok=True)
    return ["--bounce-rate", str(bounce_rate), "--bounces", str(work / "bounces")] if bounce_rate else []


def write_env(work: Path, run_id: str, redis_url: str, smtp_url: str, bounce_rate: float,
              owner_password: str | None, signing: dict[str, str] | None = None) -> None:
    """DIR/env.sh for `source`, and DIR/services.json for `demo --services`. A generated owner
    password is kept beside the demo's other keys (0600), never in env.sh's text. `signing`: the
    variables that name the demo's key (its token's, or its files), so that a follow-up that signs
    (test-send, a rerun) signs as the demo did, with env.sh alone."""
    lines = [f"# the demo's settings for the commands after it (README, 'After the demo'): source {work / 'env.sh'}",
             f"export RUN_ID={shlex.quote(run_id)}", f"export CN_STORE={shlex.quote(str(work / 'store'))}",
             f"export REDIS_URL={shlex.quote(redis_url)}", f"export SMTP_URL={shlex.quote(smtp_url)}"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted((signing or {}).items())]
    if os.environ.get("SOFTHSM2_CONF"):  # the demo's token (made in DIR/hsm)
        lines.append(f"export SOFTHSM2_CONF={shlex.quote(os.environ['SOFTHSM2_CONF'])}")
    if owner_password:
        kept = work / "keys" / "owner-password"
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.touch(mode=0o600)
        kept.chmod(0o600)  # a file an earlier demo left keeps its mode otherwise
        kept.write_text(owner_password)
        lines.append(f'export CN_OWNER_PASSWORD="$(cat {shlex.quote(str(kept))})"')
    (work / "env.sh").write_text("\n".join(lines) + "\n")
    (work / "services.json").write_text(json.dumps({"redis": redis_url, "smtp": smtp_url, "bounce_rate": bounce_rate}))


def _wait_free(port: int, wait_s: float = 5.0) -> None:
    """Waits for the port to be free, as it is once services just killed have exited: a service
    started while the old one still listened would fail to bind. Still taken after `wait_s`: the
    start fails below, saying they may be running already."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the services bind: a listener refuses it,
            try:                                                     # a closed connection's TIME_WAIT does not
                s.bind(("127.0.0.1", port))
                return
            except OSError:
                time.sleep(0.05)


def serve_again(work: Path) -> int:
    """`demo --services`: the demo's Redis and SMTP sink on the ports its run recorded, left
    running in the background once they listen; their PIDs in DIR/services.pid for `kill`."""
    recorded = work / "services.json"
    if not recorded.exists():
        raise SystemExit(f"error: {recorded} is missing: run the demo with --workdir {work} first")
    urls = json.loads(recorded.read_text())
    port = lambda url: int(url.rsplit(":", 1)[1].split("/")[0])  # noqa: E731
    started = []
    for url in (urls["redis"], urls["smtp"]):
        _wait_free(port(url))
    try:
        started.append(start_redis(work / "redis", port=port(urls["redis"])))
        started.append(start_smtp_sink(work / "outbox", work / "smtp.log", sink_args(work, urls["bounce_rate"]),
                                       port=port(urls["smtp"])))
    except EmbeddedError as e:
        for service in started:
            service.stop()
        raise SystemExit(f"error: the demo's services did not start ({e}): are they running already "
                         f"(kill $(cat {work / 'services.pid'}))?") from None
    (work / "services.pid").write_text(" ".join(str(s.process.pid) for s in started) + "\n")
    print(f"the demo's Redis ({urls['redis']}) and SMTP sink ({urls['smtp']}) run in the background: "
          f"kill $(cat {work / 'services.pid'}) stops them", file=sys.stderr)
    return 0
