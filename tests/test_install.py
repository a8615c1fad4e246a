"""The README's first command on a Debian without Go: scripts/install.sh installs what the job
needs and never calls go (versitygw, an S3 server only the tests use, is built by the test
command). Before, it ran `go install` under `set -e` and a machine without Go stopped there."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from pipeline.settings import ROOT


def test_install_never_calls_go_and_the_demo_runs_after_it(tmp_path):
    shims = tmp_path / "bin"
    shims.mkdir()
    called = tmp_path / "go-was-called"
    (shims / "go").write_text(f"#!/bin/sh\ntouch {called}\nexit 127\n")  # a machine without Go: any call fails
    (shims / "go").chmod(0o755)
    path = os.pathsep.join([str(shims)] + [p for p in os.environ["PATH"].split(os.pathsep) if "/go" not in p])
    env = {**os.environ, "PATH": path, "CN_TOOLS_DIR": str(tmp_path / "tools")}  # no versitygw built here
    done = subprocess.run(["bash", "scripts/install.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0 and not called.exists(), done.stderr[-2000:]
    demo = subprocess.run([f"{ROOT}/.venv/bin/python", "-m", "pipeline", "demo", "--accounts", "12", "--workdir",
                           str(tmp_path / "demo")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stderr[-2000:]
    summary = json.loads(demo.stdout.splitlines()[-1])
    assert summary["delivered"] + summary["physical"] == summary["accounts"] > 0, summary
    assert len(list(Path(tmp_path / "demo" / "outbox").glob("*.eml"))) == summary["delivered"]
