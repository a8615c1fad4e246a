"""The day's heartbeat (CN_HEARTBEAT_URL): a dead man's switch that an outside monitor holds.

The end-of-run hook (end_hook.py) fires from the driver's own exit path, so it is silent exactly
when someone must be paged: the head's instance ended, the driver SIGKILLed or OOM-killed. A
monitor that pages when pings *stop* needs nothing from a dead process. The pings follow
healthchecks.io's ping API, which self-hosted monitors and most dead man's switches share:

- `URL/start` when the day starts, and again every CN_HEARTBEAT_S while it runs: each says "still
  running, expect the end within the check's grace time". A check whose grace is a few periods
  goes down (and pages) that long after the last ping of a driver that died.
- `URL` once the day ends with exit status 0: the run is over, the monitor expects the next day.
- `URL/fail` when it ends otherwise (failed accounts, or the day could not run), with one line why.

A monitor that is down never costs the day: each ping has a short timeout, and a failing
monitor is logged at WARNING once until it answers again (docs/operations.md, "The heartbeat").
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from contextlib import contextmanager
from typing import Iterator
from urllib.parse import urlsplit

from pipeline.record.redact import mask_text

log = logging.getLogger("pipeline.cluster.heartbeat")
TIMEOUT_S = 5.0


class Heartbeat:
    """Pings `url` from a daemon thread every `period_s` between start() and end()."""

    def __init__(self, url: str, period_s: float):
        self.url, self.period_s = url.rstrip("/"), period_s
        self.timeout_s = min(TIMEOUT_S, period_s)
        self.stopped = threading.Event()
        self.failing = False
        self.thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)

    def start(self) -> None:
        self.ping("/start", "started")
        self.thread.start()

    def end(self, ok: bool, said: str = "") -> None:
        """Stops the beat, then the last ping: the finish, or the failure with `said`."""
        self.stopped.set()
        self.thread.join(timeout=self.timeout_s + 1)
        self.ping("" if ok else "/fail", said)

    def _beat(self) -> None:
        while not self.stopped.wait(self.period_s):
            self.ping("/start", "running")

    def ping(self, suffix: str, body: str = "") -> bool:
        """One ping; False (said once a failing spell, at WARNING) if the monitor did not take it."""
        body = mask_text(body)  # the monitor may be a service outside the broker: no PAN or address goes there
        request = urllib.request.Request(self.url + suffix, data=body.encode()[:10_000], method="POST",
                                         headers={"Content-Type": "text/plain", "User-Agent": "contract-notes"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                answer.read()
        except (OSError, ValueError) as e:
            if not self.failing:
                log.warning("the heartbeat monitor (%s) did not take a ping: %s; the day goes on, and this is "
                            "said again only after it answers", _named(self.url), e)
            self.failing = True
            return False
        if self.failing:
            log.info("the heartbeat monitor (%s) answers again", _named(self.url))
        self.failing = False
        return True


@contextmanager
def beating(url: str, period_s: float) -> Iterator[Heartbeat | None]:
    """Around the day: the beat while it runs; `/fail` if it raises (the caller ends it
    otherwise, with the day's exit status). Nothing at all without a URL."""
    if not url:
        yield None
        return
    beat = Heartbeat(url, period_s)
    beat.start()
    try:
        yield beat
    except BaseException as e:
        beat.end(False, f"{type(e).__name__}: {str(e).splitlines()[0][:500] if str(e) else ''}")
        raise
    if not beat.stopped.is_set():  # the caller did not end it: ended well
        beat.end(True, "ended")


def _named(url: str) -> str:
    """The monitor as a log may show it: scheme and host, not the check's secret path."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}"
