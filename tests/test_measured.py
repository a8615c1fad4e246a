"""What the benchmarks save for `plan` (bench/measured.py): a median of several runs, with its spread."""

from __future__ import annotations

import json
import subprocess
import sys

from bench import measured
from pipeline.settings import ROOT


def test_the_saved_figures_are_the_runs_medians_with_each_one_s_lowest_and_highest(tmp_path, monkeypatch):
    monkeypatch.setattr(measured, "MEASURED", tmp_path / "measured.json")
    (tmp_path / "measured.json").write_text(json.dumps({"mail": {"ours_mails_per_s": 500}}))
    runs = [{"notes_per_s_large": v, "cores": 2, "cpu_ms_per_note_large": {"render": r}, "label": "x"}
            for v, r in ((62.0, 14.8), (48.5, 16.0), (60.1, 15.1))]
    measured.save("scale", runs)
    saved = json.loads((tmp_path / "measured.json").read_text())
    assert saved["mail"] == {"ours_mails_per_s": 500}, "the other benchmark's figures are kept"
    assert saved["scale"]["notes_per_s_large"] == 60.1 and saved["scale"]["cpu_ms_per_note_large"] == {"render": 15.1}
    assert saved["scale"]["runs"] == 3 and saved["scale"]["label"] == "x"
    assert saved["scale"]["spread"]["notes_per_s_large"] == [48.5, 62.0]
    assert saved["scale"]["spread"]["cpu_ms_per_note_large.render"] == [14.8, 16.0]


def test_one_run_is_never_saved():
    done = subprocess.run([sys.executable, "bench/mail.py", "--save"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--save needs --runs 3 or more" in done.stderr
