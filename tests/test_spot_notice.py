"""The spot-notice watcher keeps its node protected (issue 69): metadata that does not answer at
boot is asked again with backoff, a node it cannot protect is said at WARNING, and cluster.yaml's
restart loop starts it again whenever it ends but cleanly. Its drain against the session's real
GCS (a node id no alive node has: the GCS accepts it, as it does a node already gone, and the
session's own node keeps working); the drain of a live node is tests/test_node_loss.py's."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.node_loss import Metadata
from pipeline.cluster import spot_notice
from pipeline.embedded import free_port
from pipeline.settings import ROOT

NOBODY = "ab" * 28  # a node id (28 bytes, hex) that no node of the session has


def test_metadata_that_answers_only_after_its_first_probes_is_waited_for_and_the_notice_drains(ray_session, tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    watcher = subprocess.Popen([sys.executable, "-m", "pipeline.cluster.spot_notice", "--address",
                                ray_session.address_info["gcs_address"], "--metadata", f"http://127.0.0.1:{port}",
                                "--node-id", NOBODY, "--poll-s", "0.2"], cwd=tmp_path, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(2.5)  # the first probes are refused: nothing listens yet
    assert watcher.poll() is None, "one refused probe at boot ended the watcher: " + watcher.stdout.read()
    stand_in = Metadata(port)
    try:
        time.sleep(3)  # answered by the third probe (1 s, then 2 s after the first)
        stand_in.notice(time.time() + 90)
        out, _ = watcher.communicate(timeout=90)
    finally:
        stand_in.stop()
        if watcher.poll() is None:
            watcher.kill()
    assert watcher.returncode == 0 and "spot interruption: node drained" in out, out[-3000:]


def test_metadata_that_never_answers_is_said_at_warning_and_the_watcher_exits_to_be_started_again(caplog):
    nowhere = spot_notice.Metadata(f"http://127.0.0.1:{free_port()}", timeout_s=0.5)
    with caplog.at_level(logging.INFO, logger="pipeline.cluster.spot_notice"):
        assert spot_notice.watch(nowhere, lambda n: False, probes=3, first_s=0.01) is None
    tries = [r for r in caplog.records if "instance metadata" in r.getMessage()]
    assert [r.levelno for r in tries] == [logging.INFO, logging.INFO, logging.WARNING], caplog.text
    assert "not protected" in tries[-1].getMessage() and "after 3 tries" in tries[-1].getMessage()


def test_a_machine_that_is_not_ec2_is_said_at_warning(monkeypatch, caplog):
    monkeypatch.delenv("CN_IMDS_URL", raising=False)
    monkeypatch.setattr(spot_notice, "on_ec2", lambda: False)
    with caplog.at_level(logging.INFO, logger="pipeline.cluster.spot_notice"):
        assert spot_notice.main(["--address", "127.0.0.1:1"]) == 0
    [said] = caplog.records
    assert said.levelno == logging.WARNING and "not protected" in said.getMessage()


def test_an_unreadable_drain_list_is_said_at_warning_once(ray_session, monkeypatch, caplog):
    import ray._private.state

    from pipeline.cluster import fleet as nodes

    def broken():
        raise AttributeError("get_draining_nodes")  # as a Ray that renamed it would

    monkeypatch.setattr(ray._private.state.state, "get_draining_nodes", broken)
    monkeypatch.setitem(nodes._said, "unreadable", False)
    with caplog.at_level(logging.DEBUG, logger="pipeline.cluster.fleet"):
        views = [nodes.look() for _ in range(3)]
    assert all(v.draining == frozenset() and v.alive for v in views)
    said = [r for r in caplog.records if "draining" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING], caplog.text


def _loop_command() -> str:
    commands = yaml.safe_load((Path(ROOT) / "cluster.yaml").read_text())["worker_start_ray_commands"]
    [line] = [c for c in commands if "pipeline.cluster.spot_notice" in c]
    return line


def _home(tmp_path: Path, exits: list[int]) -> tuple[Path, dict]:
    """A worker's home whose ~/venv/bin/python plays the watcher: it notes each start, then exits
    with the next of `exits` (the last one for good)."""
    home = tmp_path / "home"
    (home / "contract_notes" / "scripts").mkdir(parents=True)
    (home / "contract_notes" / "scripts" / "cluster.env").write_text("")
    (home / "venv" / "bin").mkdir(parents=True)
    codes = " ".join(map(str, exits))
    fake = home / "venv" / "bin" / "python"
    fake.write_text(f'#!/bin/sh\necho "$*" >> "$HOME/starts"\nn=$(wc -l < "$HOME/starts")\n'
                    f'set -- {codes}\nshift $(( n > $# ? $# - 1 : n - 1 ))\n'
                    'echo "watcher run $n"\n[ "$1" = hang ] && exec sleep 600\nexit "$1"\n')
    fake.chmod(0o755)
    return home, {"HOME": str(home), "PATH": "/usr/bin:/bin", "RAY_HEAD_IP": "10.0.0.1"}


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_cluster_yamls_loop_starts_the_watcher_again_until_it_exits_cleanly(tmp_path):
    home, env = _home(tmp_path, [1, 137, 0])  # a failed probe's exit, a SIGKILL's (the OOM killer), a drained node
    subprocess.run(["bash", "-c", _loop_command()], env=env, cwd=home, check=True, timeout=30)
    starts = home / "starts"
    assert _wait_for(lambda: starts.exists() and len(starts.read_text().splitlines()) == 3, 30)
    pid = int((home / ".cn-spot-notice.pid").read_text())
    assert _wait_for(lambda: not _alive(pid), 10), "the loop ends once the watcher exits 0"
    assert starts.read_text().splitlines()[0] == "-m pipeline.cluster.spot_notice --address 10.0.0.1:6379"
    log = (home / "spot_notice.log").read_text()
    assert "spot_notice exited 1: started again" in log and "spot_notice exited 137: started again" in log, log


def test_a_second_ray_up_ends_the_previous_loop_and_its_watcher(tmp_path):
    home, env = _home(tmp_path, ["hang"])
    subprocess.run(["bash", "-c", _loop_command()], env=env, cwd=home, check=True, timeout=30)
    assert _wait_for(lambda: (home / ".cn-spot-notice.pid").exists() and (home / "starts").exists(), 10)
    first = int((home / ".cn-spot-notice.pid").read_text())
    subprocess.run(["bash", "-c", _loop_command()], env=env, cwd=home, check=True, timeout=30)
    try:
        assert _wait_for(lambda: not _alive(first), 30), "the first loop still runs"
        # a watcher's start is a Python process's: 10 s was once too few beside the suite's other sessions
        assert _wait_for(lambda: len((home / "starts").read_text().splitlines()) == 2, 30)
    finally:
        second = int((home / ".cn-spot-notice.pid").read_text())
        if second != first and _alive(second):
            os.killpg(second, 9)  # the loop this test started, by its own group


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
