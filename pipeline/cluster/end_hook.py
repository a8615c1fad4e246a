"""The end of a run, told to whoever must act on it: CN_ON_END is a webhook URL (the summary
JSON POSTed to it) or a command (the summary JSON on its standard input), called once a run
ends however it ends: delivered, with failures, or unable to start. A failed or late day then
pages someone instead of waiting to be noticed. The hook's own failure is logged, never the
run's: its exit status stays the run's."""

from __future__ import annotations

import json
import logging
import shlex
import subprocess
import urllib.request
from urllib.parse import urlsplit

log = logging.getLogger("pipeline.cluster.end_hook")
TIMEOUT_S = 30.0


def notify(hook: str, event: dict) -> bool:
    """Calls the hook with `event`; True if it took it (a 2xx, or exit status 0)."""
    if not hook:
        return False
    data = json.dumps(event, default=str).encode()
    try:
        if hook.startswith(("http://", "https://")):
            request = urllib.request.Request(hook, data=data, method="POST",
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
                answer.read()
        else:
            subprocess.run(shlex.split(hook), input=data, timeout=TIMEOUT_S, check=True, capture_output=True)
        return True
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        log.warning("the end-of-run hook (%s) failed: %s", _named(hook), e)
        return False


def _named(hook: str) -> str:
    """The hook as a log may show it: a URL without its credentials or query, a command's name."""
    if hook.startswith(("http://", "https://")):
        parts = urlsplit(hook)
        return f"{parts.scheme}://{parts.hostname}{parts.path}"
    return (shlex.split(hook) or [""])[0]
