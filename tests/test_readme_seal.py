"""The README's instant seal, as printed: a demo that records no bounce window, then `close`
seals its run at once and `verify` finds it whole (before: CN_BOUNCE_WINDOW_H=0 was refused as
out of range, after a half-made demo, and no supported way showed a sealed run); then a test
send with the demo's env.sh alone."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.settings import ROOT
from tests.test_bounces import _typed


def instant_seal_block(work: Path) -> list[str]:
    text = (Path(ROOT) / "README.md").read_text().split("To see the seal at once", 1)[1]
    block = text.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split("  #", 1)[0].strip().replace("demo-sealed", str(work)) for line in block.splitlines()
            if line.strip()]


def test_the_readme_s_instant_seal_makes_a_demo_that_close_seals_at_once_and_verify_finds_whole(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "CN_", "REDIS_", "SMTP_"))}
    lines = instant_seal_block(tmp_path / "demo")
    assert any("--bounce-window-h 0" in line for line in lines)
    # and, with env.sh alone, a test send through the demo's relay, signed with its token (before: it asked for
    # a key file, and env.sh named neither the relay nor the token)
    lines.insert(-1, ".venv/bin/python -m pipeline test-send --to ops@broker.example.com")
    said = _typed(lines, env)
    assert [code for _, code, _ in said] == [0] * len(lines), "\n".join(f"{l} -> {c}\n{o[-1500:]}" for l, c, o in said)
    verified = next(out for line, _, out in said if " verify " in line)
    assert "sealed" in verified.lower() and "not sealed" not in verified.lower(), verified
    sent = next(out for line, _, out in said if " test-send " in line)
    assert '"status": "delivered"' in sent, sent
