"""What the day waits for, told by the driver: the signers and mailers note an outage of their
HSM or relays, and the driver, signers and mailers one of the store, in the run's meta
(record/waiting.py); the driver reads it each second and says it at WARNING once an outage,
and when it ends. Once an outage is past the later of its patience and the run's deadline, the
day stops waiting: the chains not yet started are failed in one stroke (their accounts ready
for one `rerun --failed`), and said in one line.
"""

from __future__ import annotations

import logging
import time

from pipeline.record.waiting import NAMES, said, waits
from pipeline.settings import Settings, clock, gives_up_at

log = logging.getLogger("pipeline.cluster.driver")


class DayWaits:
    def __init__(self, run_id: str, settings: Settings):
        self.run_id, self.deadline_at = run_id, settings.deadline_at
        self.floors = {"hsm": settings.hsm_patience_s, "relay": settings.smtp_patience_s,
                       "store": settings.store_patience_s}
        self.now: dict[str, float] = {}  # what the day waits for now, since when (epoch)
        self.ended = False  # the day stopped waiting: said once

    def look(self, meta: dict) -> dict[str, float]:
        """Reads the run's meta; says each outage that began or ended since the last look."""
        seen = waits(meta)
        for what, since in seen.items():
            if what not in self.now:
                log.warning("run %s: %s: %s", self.run_id, said(what, since), self._until(what, since))
        for what in set(self.now) - set(seen):
            log.warning("run %s: %s is back after %.0f s", self.run_id, NAMES.get(what, what),
                        time.time() - self.now[what])
        self.now = seen
        return seen

    def given_up(self) -> bool:
        """Whether an outage is waited for no more: past the later of its patience and the deadline.
        Not the store's: failing a chain reads its shard from the store; its requests give up
        themselves (storage.S3Store), and the run stops there (exit 2: run it again), its shard's
        accounts not known to fail them."""
        return any(time.time() > self._gives_up(what, since) for what, since in self.now.items() if what != "store")

    def reason(self) -> str:
        """What a chain not started is failed for."""
        return f"not started: {self._gone()} at {clock(time.time())}, past the wait it was given"

    def ending(self, left: int, force: bool = False) -> str:
        """The day's one line when it stops waiting (`force`: a forced rerun's, whose delivered
        accounts are mailed again only with --force)."""
        self.ended = True
        past = f"its deadline {clock(self.deadline_at)}" if self.deadline_at else "its patience (no run deadline)"
        return (f"run {self.run_id}: past {past}, still {self._gone()}: {left} accounts not started are failed, "
                f"and those in flight fail as they reach it; `rerun {self.run_id} --failed"
                f"{' --force' if force else ''}` sends them")

    def _gone(self) -> str:
        return "; ".join(said(what, since) for what, since in sorted(self.now.items(), key=lambda w: w[1]))

    def _gives_up(self, what: str, since: float) -> float:
        return gives_up_at(since, self.floors.get(what, 0.0), self.deadline_at)

    def _until(self, what: str, since: float) -> str:
        ends = f"until {clock(self._gives_up(what, since))}"
        return f"nothing fails for it {ends}, the run's deadline" if self.deadline_at and \
            self._gives_up(what, since) == self.deadline_at else f"nothing fails for it {ends} (its patience)"
