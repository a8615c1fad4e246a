"""Real servers for the tests, each a child process on a free loopback port, stopped by PID."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from pipeline.embedded import EmbeddedError, Service, free_port, wait_for_port

S3_ACCESS_KEY = "cn-test-access"
S3_SECRET_KEY = "cn-test-secret-0123456789"


def start_versitygw(root: Path) -> Service:
    """An S3-compatible server (versitygw, posix backend) speaking S3 over HTTP."""
    binary = shutil.which("versitygw", path=str(Path(__file__).resolve().parent.parent / ".venv" / "bin"))
    binary = binary or shutil.which("versitygw")
    if not binary:
        raise EmbeddedError("versitygw not found: run scripts/install.sh")
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = (root.parent / "versitygw.log").open("ab")
    process = subprocess.Popen(
        [binary, "--access", S3_ACCESS_KEY, "--secret", S3_SECRET_KEY, "--port", f"127.0.0.1:{port}",
         "posix", "--nometa", str(root)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    wait_for_port(port, process, "versitygw")
    return Service("s3", process, f"http://127.0.0.1:{port}")
