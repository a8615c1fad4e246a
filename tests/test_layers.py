"""The import contracts of pipeline/ (pyproject.toml, [tool.importlinter]) hold, and a new
import that breaks one fails with the contract's name, as it would in CI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.settings import ROOT

LINT = str(Path(sys.executable).with_name("lint-imports"))


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([LINT, "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120)


def test_the_tree_keeps_every_contract():
    out = lint(Path(ROOT))
    assert out.returncode == 0, out.stdout[-3000:]
    assert "5 kept, 0 broken" in out.stdout


@pytest.mark.parametrize("module, line, contract", [
    ("pipeline/record/keys.py", "from pipeline.cluster import driver", "pipeline's layers"),
    ("pipeline/day/dumps.py", "import ray", "nothing below the cluster imports ray"),
    ("pipeline/note/charges.py", "from pipeline.record import state", "note, seal and mail never import redis"),
    ("pipeline/followup/verify.py", "import ray", "followup and tls import no Ray"),
    ("pipeline/followup/chains.py", "from pipeline.record import state", "verify loads only what it reads"),
    ("pipeline/tls/enroll.py", "from pipeline.cluster import plan", "pipeline's layers"),
])
def test_an_import_that_breaks_a_layer_fails_naming_the_contract(tmp_path, module, line, contract):
    for part in ("pipeline", "actors"):
        shutil.copytree(Path(ROOT) / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(Path(ROOT) / "pyproject.toml", tmp_path)
    with (tmp_path / module).open("a") as f:
        f.write(f"\n{line}  # noqa\n")
    out = lint(tmp_path)
    assert out.returncode != 0
    broken = out.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and module.removesuffix(".py").replace("/", ".") in broken, out.stdout[-3000:]


def test_the_processes_close_and_verify_spread_their_reads_over_load_no_redis_client():
    """record/spread.py's processes import chains.py alone; Redis's client (with what it
    imports) was 9 MB more in each of them, for a module they never call."""
    code = "import sys, pipeline.followup.chains; print(sorted(m for m in sys.modules if m.split('.')[0] == 'redis'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout[-500:] + out.stderr[-2000:]


HEAVY = ("redis", "pikepdf", "aiosmtplib", "ray", "pipeline.stages", "pipeline.note")


def _loaded(*modules: str) -> list[str]:
    code = (f"import json, sys, {', '.join(modules)}; "
            f"print(json.dumps(sorted(h for h in {HEAVY!r} if any(m == h or m.startswith(h + '.') for m in sys.modules))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_verify_loads_no_redis_client_pdf_library_renderer_or_mailer():
    """`verify` reads storage alone: before, it loaded Redis's client (through the run's state),
    pikepdf (through the signer), the renderer and the mailer (through `rerun`'s restore), 28 MB
    of a command held to 200 MB on a 1.5M-account record. The command finds the run's store in
    its Redis (located.py): that one client, and still no renderer or mailer."""
    assert _loaded("pipeline.followup.verify") == []
    assert _loaded("pipeline.followup.located", "pipeline.followup.verify") == ["redis"]


def test_close_loads_no_pdf_library_renderer_or_mailer():
    """`close` signs its proof with the notes' key and writes through Redis's client; it loaded
    pikepdf (through the HSM's module), the renderer and the mailer (through a restore it never
    asks for) as well: 76 -> 59 MB before its first read, on a command at 197 MB of its 200."""
    assert _loaded("pipeline.followup.close") == ["redis"]


def test_a_stage_workers_imports_load_neither_dkim_nor_pyhanko():
    """Every Ray worker imports the stages and the actors' modules as it starts: with them, dkim
    (loaded where a mailer signs) cost ~0.17 CPU-s of each start, and pyhanko's crypt package
    (SASLprep, for a password that is not printable ASCII) ~75 ms."""
    code = ("import sys, pipeline.stages, actors.signer, actors.mailer, pipeline.cluster.split_tasks; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'dkim', 'pyhanko'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
