"""A wrong input is one line of error on stderr, nothing before it at the default log level, and
never a success (before: an INFO line from the record's locator came first, `status` said the
error again as JSON on stdout, and a bad argument printed argparse's usage block)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipeline.settings import ROOT


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "CN_", "REDIS_", "SMTP_"))}
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**base, **env})


@pytest.mark.parametrize("args", [
    ("status", "no-such-run"), ("verify", "no-such-run"), ("bounces", "no-such-run", "--maildir", "/nonexistent"),
    ("plan", "--accounts", "-5"), ("status", "bad id!"), ("rerun", "x", "--accounts", ""),
    ("runs", "--store", "/nonexistent"), ("runs",),
])
def test_a_wrong_input_is_one_line_on_stderr_and_nothing_else(args, tmp_path):
    done = cli(*args, REDIS_URL="redis://127.0.0.1:1/0", CN_STORE=str(tmp_path / "store"))
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1 and done.stderr.startswith("error: "), done.stderr


def test_verbose_brings_the_info_lines_back(tmp_path):
    done = cli("status", "no-such-run", "--verbose", REDIS_URL="redis://127.0.0.1:1/0", CN_STORE=str(tmp_path))
    assert done.returncode == 2 and " INFO " in done.stderr and done.stderr.splitlines()[-1].startswith("error: ")


def test_help_still_shows_the_usage(tmp_path):
    done = cli("status", "--help")
    assert done.returncode == 0 and (done.stdout + done.stderr).startswith("usage: ")


@pytest.mark.parametrize("name, value", [("REDIS_URL", "redis//x"), ("CN_STORE", "s3:/x"), ("SMTP_URL", "smtpx://a")])
def test_a_malformed_url_setting_is_one_line_naming_it(name, value, tmp_path):
    done = cli("status", "some-run", **{"REDIS_URL": "redis://127.0.0.1:1/0", "CN_STORE": str(tmp_path), name: value})
    assert done.returncode == 2 and done.stderr.startswith(f"error: {name}: ") and len(done.stderr.splitlines()) == 1, \
        done.stderr


def test_a_new_run_told_to_take_a_setting_it_cannot_is_refused_as_a_rerun_is(tmp_path):
    """CN_SHELL_SETTINGS names the settings a later command takes from its shell, not the run's;
    a new run's are all its shell's, but a name mistyped is said now, as its rerun would say it.
    Before, a new run took any name without a word, and the rerun it was set for refused it."""
    done = cli("run", "--date", "2026-11-20", "--input", str(tmp_path / "dumps"), "--test-keys",
               CN_SHELL_SETTINGS="CN_MAIL_REPLYTO", REDIS_URL="redis://127.0.0.1:1/0", CN_STORE=str(tmp_path / "store"))
    assert done.returncode == 2 and done.stderr.splitlines()[-1].startswith(
        "error: CN_SHELL_SETTINGS names CN_MAIL_REPLYTO: it takes only"), done.stderr
