"""What the commands after the demo need: its settings in DIR/env.sh, and its services again.

The demo stops its Redis and SMTP sink when it ends, and its token lives in DIR/hsm: a
`status`, `rerun`, `bounces`, `close` or `verify` typed afterwards would find no run, no relay
and no key. So the demo writes DIR/env.sh (the run id, the demo's store, Redis, token and
owner password), and `demo --services` starts the same Redis (its append-only file keeps the
run's state) and SMTP sink again, in the background, on the ports the run recorded. Everything else
(the relay, the keys) the commands take from the run's own record.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from pipeline.embedded import EmbeddedError, start_redis, start_smtp_sink


def sink_args(work: Path, bounce_rate: float) -> list[str]:
    """The demo's relay returns DSNs for a share of its mail to DIR/bounces, as to the bounce
    domain's mailbox; without --bounce-rate the folder is there and stays empty."""
    (work / "bounces").mkdir(parents=True, exist_ok=True)
    return ["--bounce-rate", str(bounce_rate), "--bounces", str(work / "bounces")] if bounce_rate else []


def write_env(work: Path, run_id: str, redis_url: str, smtp_url: str, bounce_rate: float,
              owner_password: str | None) -> None:
    """DIR/env.sh for `source`, and DIR/services.json for `demo --services`. A generated owner
    password is kept beside the demo's other keys (0600), never in env.sh's text."""
    lines = [f"# the demo's settings for the commands after it (README, 'After the demo'): source {work / 'env.sh'}",
             f"export RUN_ID={shlex.quote(run_id)}", f"export CN_STORE={shlex.quote(str(work / 'store'))}",
             f"export REDIS_URL={shlex.quote(redis_url)}"]
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


def serve_again(work: Path) -> int:
    """`demo --services`: the demo's Redis and SMTP sink on the ports its run recorded, left
    running in the background once they listen; their PIDs in DIR/services.pid for `kill`."""
    recorded = work / "services.json"
    if not recorded.exists():
        raise SystemExit(f"error: {recorded} is missing: run the demo with --workdir {work} first")
    urls = json.loads(recorded.read_text())
    port = lambda url: int(url.rsplit(":", 1)[1].split("/")[0])  # noqa: E731
    started = []
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
