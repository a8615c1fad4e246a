"""Every benchmark runs at its smoke size (`--smoke`), so a refactor cannot break one unseen
(issue 58: bench/proof.py had stopped running at HEAD and nothing said so). The figures of a
smoke run mean nothing; that it runs to its JSON line does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pipeline.settings import ROOT

pytestmark = pytest.mark.bench

# bench/node_loss.py is tests/test_node_loss.py's harness: it runs there at its real sizes; measured.py,
# processes.py, range_times.py, s3_native.py and slow_store.py are parts of the others; mail.py runs below
# with --dkim, which mails unsigned first (a run of its own cost the suite another Ray and ~15 CPU-s), and
# fullday.py keeping its record, which is then closed and verified again (as two tests, its days ran twice:
# ~50 CPU-s more)
BENCHES = sorted(p.name for p in (Path(ROOT) / "bench").glob("*.py")
                 if p.name not in ("fullday.py", "mail.py", "measured.py", "node_loss.py", "processes.py",
                                  "range_times.py", "s3_native.py", "slow_store.py"))


@pytest.mark.parametrize("bench", BENCHES)
def test_the_bench_runs_at_its_smoke_size_to_a_json_line(bench):
    result = smoke(bench)[-1]
    assert isinstance(result, dict)
    if bench == "render.py":  # its huge note in page ranges, and their times projected on a render node
        from pipeline.cluster.page_ranges import RANGE_PAGES

        assert result["pages_2000_range_tasks"] == -(-result["pages_2000_pages"] // RANGE_PAGES) >= 2, result
        assert 0 < result["pages_2000_ranges_here"] <= result["pages_2000_range_tasks"], result  # the render task's own
        # the projection is made of this run's parts: the serial ones, then the ranges on the node's vCPUs (at
        # least the slowest range, at most all of them one after the other); each figure is rounded to 0.01 s.
        # Below the wall time here only at a real size: at the smoke size's few ranges the two can tie
        serial = result["pages_2000_build_s"] + result["pages_2000_submit_s"] + result["pages_2000_merge_s"]
        slowest, together = result["pages_2000_range_task_s"][1], result["pages_2000_range_tasks_sum_s"]
        assert serial + slowest - 0.03 <= result["pages_2000_on_render_node_s"] <= serial + together + 0.03, result
    if bench == "scale.py":  # the cores' busy time by whose it was: each of the run's own processes spent some
        spent = result["all_cpu_ms_per_note_by_process_large"]
        groups = ("task workers (split, render)", "signer", "mailer", "driver", "relay")  # Redis: a few 10-ms ticks
        assert all(spent.get(g, 0) > 0 for g in groups), spent


def test_the_full_day_bench_keeps_its_record_then_closes_and_verifies_it_again_each_run(tmp_path):
    """bench/fullday.py at its smoke size, its record kept as the day left it (--keep), then
    --record: close and verify at 1.5M measured again without the day's 35 minutes."""
    day = smoke("fullday.py", "--keep", str(tmp_path))[-1]
    assert day["each_once_at_relay"] and day["at_400"]["close_s3"]["log_objects"] > 0, day
    runs = smoke("fullday.py", "--record", str(tmp_path / "400"), "--runs", "2")
    logged = day["at_400"]["close_s3"]["log_objects"]  # the kept record is the one the day's close read
    assert len(runs) == 2 and all(r[f"{n}_s3"]["log_objects"] == logged for r in runs for n in ("close", "verify")), runs


def smoke(bench: str, *more: str) -> list[dict]:
    """The bench's JSON lines at its smoke size. Its temporary folders (TMPDIR) must be gone when
    it ends: a bench that leaves them fills a runner's /tmp a run at a time (the proof bench's
    two days were 0.4 GB a run)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "CN_", "REDIS_URL", "SMTP_URL"))}
    with tempfile.TemporaryDirectory(prefix="cnb", dir="/tmp") as tmp:  # short: Ray's socket paths
        own = Path(tmp, "t")
        own.mkdir()
        done = subprocess.run([sys.executable, f"bench/{bench}", "--smoke", *more], cwd=ROOT, capture_output=True,
                              text=True, timeout=600, env={**env, "RAY_TMPDIR": tmp, "TMPDIR": str(own), "PYTHONPATH": ROOT})
        left = sorted(p.name for p in own.iterdir())
    assert done.returncode == 0, done.stderr[-3000:]
    assert not left, f"bench/{bench} left its temporary folders: {left}"
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stdout[-2000:]
    return lines


def test_the_mail_bench_measures_unsigned_mail_against_smtplib_then_dkim_signing_with_dkim():
    result = smoke("mail.py", "--dkim")[-1]
    assert result["dkim_sign_cpu_ms_per_mail"] > 0 and result["dkim_client_cpu_ms_per_mail"] > 0
    assert result["speedup"] > 0 and result["ours_client_cpu_ms_per_mail"] > 0, result
    assert result["relay_sink_cpu_ms_per_mail"] > 0 and result["redis_cpu_ms_per_mail"] >= 0, result


def test_the_first_note_bench_times_a_run_joining_a_running_ray_beside_a_baseline_tree():
    """`scale.py --first-note-only --running --baseline TREE` (issue 73's first note on a running
    Ray): both sides reach the relay; this tree stands in as its own baseline."""
    result = smoke("scale.py", "--first-note-only", "--running", "--baseline", ROOT)[-1]
    assert 0 < result["first_note_s_running_large"] and 0 < result["first_note_s_baseline"]
