"""cluster.yaml's setup commands, run as written in bash, with the installs made to fail: the
step must fail and leave no stamp (a stamp makes every later `ray up` skip the install). An
install the day can do without (Prometheus) may let `ray up` go on, and says so, but writes no
stamp either."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from pipeline.settings import ROOT

COMMANDS = yaml.safe_load((Path(ROOT) / "cluster.yaml").read_text())
ENTRIES = [(section, i, c) for section in ("setup_commands", "head_setup_commands")
           for i, c in enumerate(COMMANDS[section]) if "apt-get" in c or "pip install" in c]
OPTIONAL = "the day runs without it"  # what such an entry echoes when its install failed
FAILING = ["sudo", "pip", "apt-get"]


def home_for(tmp_path: Path, failing: str) -> tuple[Path, dict]:
    """A home with the project's files, and a PATH where `failing` exits 100 and the rest succeed."""
    home, bin_ = tmp_path / "home", tmp_path / "bin"
    (home / "contract_notes" / "scripts").mkdir(parents=True)
    (home / "contract_notes" / "requirements-runtime.txt").write_text("ray==2.60.0\n")
    (home / ".bashrc").write_text("")
    bin_.mkdir()
    for name in ("sudo", "apt-get", "systemctl", "sed"):
        (bin_ / name).write_text('#!/bin/sh\nexec env "$@"\n' if name == "sudo" else "#!/bin/sh\nexit 0\n")
    (bin_ / "python3").write_text("#!/bin/sh\nmkdir -p \"$HOME/venv/bin\"\n"
                                  "printf '#!/bin/sh\\nexit 0\\n' > \"$HOME/venv/bin/pip\"\n"
                                  "chmod +x \"$HOME/venv/bin/pip\"\n")
    (bin_ / failing).write_text("#!/bin/sh\nexit 100\n")
    for p in bin_.iterdir():
        p.chmod(0o755)
    env = {"HOME": str(home), "PATH": f"{bin_}:/usr/bin:/bin"}
    return home, env


@pytest.mark.parametrize("section, index, command", ENTRIES, ids=[f"{s}[{i}]" for s, i, _ in ENTRIES])
@pytest.mark.parametrize("failing", FAILING)
def test_a_failed_install_fails_the_step_and_writes_no_stamp(tmp_path, section, index, command, failing):
    if failing == "pip" and "pip install" not in command:
        pytest.skip("this entry installs nothing with pip")
    home, env = home_for(tmp_path, failing)
    if failing == "pip":  # the venv's own pip is the one that runs
        (tmp_path / "bin" / "python3").write_text("#!/bin/sh\nmkdir -p \"$HOME/venv/bin\"\n"
                                                  "printf '#!/bin/sh\\nexit 100\\n' > \"$HOME/venv/bin/pip\"\n"
                                                  "chmod +x \"$HOME/venv/bin/pip\"\n")
    done = subprocess.run(["bash", "-c", command], env=env, cwd=home, capture_output=True, text=True, timeout=60)
    if OPTIONAL in command:
        assert done.returncode == 0 and OPTIONAL in done.stdout, done.stderr
    else:
        assert done.returncode != 0, f"{section}[{index}] hid a failed {failing}"
    assert not [p.name for p in home.iterdir() if p.name.startswith(".cn-")], "a stamp was written"


@pytest.mark.parametrize("section, index, command", ENTRIES, ids=[f"{s}[{i}]" for s, i, _ in ENTRIES])
def test_a_good_install_writes_its_stamp_once(tmp_path, section, index, command):
    home, env = home_for(tmp_path, "false-command-nobody-calls")
    done = subprocess.run(["bash", "-c", command], env=env, cwd=home, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in home.iterdir() if p.name.startswith(".cn-")], "no stamp"
    if section == "setup_commands":
        assert (home / ".bashrc").read_text().count("cluster.env") == 1
        assert os.path.exists(home / "venv" / "bin" / "pip")


@pytest.mark.parametrize("failures, calls, ok", [(0, ["start"], True), (1, ["start", "stop", "start"], True),
                                                 (2, ["start", "stop", "start"], False)])
def test_the_head_s_ray_start_that_fails_is_stopped_and_started_once_more(tmp_path, failures, calls, ok):
    """`ray start` gives up when its raylet has not registered within a fixed 30 s (a head busy
    with its own start, as on the suite's saturated minutes); the head's `ray` here fails its
    first `failures` starts. Once more, not forever: a start that fails twice fails `ray up`."""
    home = tmp_path / "home"
    (home / "contract_notes" / "scripts").mkdir(parents=True)
    (home / "contract_notes" / "scripts" / "cluster.env").write_text(
        (Path(ROOT) / "scripts" / "cluster.env").read_text())
    (home / "venv" / "bin").mkdir(parents=True)
    ray = home / "venv" / "bin" / "ray"
    ray.write_text('#!/bin/sh\necho "$1" >> "$HOME/ray.calls"\n'
                   'n=$(cat "$HOME/failures")\n'
                   'if [ "$1" = start ] && [ "$n" -gt 0 ]; then echo $((n - 1)) > "$HOME/failures"; exit 1; fi\n')
    ray.chmod(0o755)
    (home / "failures").write_text(str(failures))
    command = next(c for c in COMMANDS["head_start_ray_commands"] if "ray start" in c)
    done = subprocess.run(["bash", "-c", command], env={"HOME": str(home), "PATH": "/usr/bin:/bin",
                                                        "RAY_HEAD_IP": "10.0.0.1"},
                          cwd=home, capture_output=True, text=True, timeout=60)
    assert (home / "ray.calls").read_text().split() == calls
    assert (done.returncode == 0) == ok, done.stderr
    assert ("RETRIED" in done.stderr) == (failures > 0)
