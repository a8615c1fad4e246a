"""Signer and mailer actors, as many as the cluster has slots for, each call to the least loaded.

On a cluster the pool follows the `signer` / `smtp` resources of the live nodes: it grows as
the autoscaler adds signer/SMTP nodes, without restarting the run, and gives back actors with
nothing in flight when nodes go (a busy actor is left to finish: killing it would fail its
batch). CN_SIGNERS / CN_MAILERS fix the sizes instead. One actor always exists: its pending
creation is the demand that makes the autoscaler start the first node. No Ray import here:
the driver hands in how to make and kill an actor, so the sizing is tested without a cluster.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("pipeline.cluster.pools")


@dataclass
class Pool:
    role: str
    make: Callable[[int], Any]  # index -> a new actor handle
    kill: Callable[[Any], None]
    actors: list = field(default_factory=list)
    busy: list[int] = field(default_factory=list)  # calls in flight, per actor
    made: int = 0  # how many were ever made: names stay unique
    peak: int = 0

    def size_to(self, target: int) -> None:
        target = max(1, target)
        while len(self.actors) < target:
            self.actors.append(self.make(self.made))
            self.busy.append(0)
            self.made += 1
        for i in reversed(range(len(self.actors))):  # the idle ones beyond the target go
            if len(self.actors) <= target:
                break
            if self.busy[i] == 0:
                self.kill(self.actors.pop(i))
                self.busy.pop(i)
        if len(self.actors) > self.peak:
            log.info("%s pool: %d actors", self.role, len(self.actors))
            self.peak = len(self.actors)

    def take(self) -> Any:
        """The least-loaded actor, counted as busy until `give_back`."""
        i = min(range(len(self.actors)), key=self.busy.__getitem__)
        self.busy[i] += 1
        return self.actors[i]

    def give_back(self, actor: Any) -> None:
        for i, a in enumerate(self.actors):
            if a is actor:
                self.busy[i] -= 1
                return

    def close(self) -> None:
        for actor in self.actors:
            self.kill(actor)
        self.actors, self.busy = [], []
