"""Signer and mailer actors, as many as the cluster has slots for, each call to the least loaded
living one.

On a cluster the pool follows the `signer` / `smtp` resources of the live nodes: it grows as
the autoscaler adds signer/SMTP nodes, without restarting the run, and gives back actors with
nothing in flight when nodes go (a busy actor is left to finish: killing it would fail its
batch). CN_SIGNERS / CN_MAILERS fix the sizes instead. One actor always exists: its pending
creation is the demand that makes the autoscaler start the first node.

An actor is chosen only once it has said which node it runs on (`locate`): a call handed to
one still starting would wait for its node. An actor whose node died is dropped at once (its
batches in flight go to the living: the fleet resends them, fleet.py); one whose node is draining (a
spot notice) is chosen no more and given back once idle. No Ray import here: the fleet hands
in how to make, kill and locate an actor, so the logic is tested without a cluster.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("pipeline.cluster.pools")
HERE = "here"  # the node of an actor made without `locate` (plain objects in the unit tests)


@dataclass
class Member:
    actor: Any
    probe: Any  # answers with the node the actor runs on; None once it has
    node: str = ""  # "" while the actor starts: never chosen then
    busy: int = 0  # calls in flight
    leaving: bool = False  # its node is draining: chosen no more, given back once idle


@dataclass
class Pool:
    role: str
    make: Callable[[int], Any]  # index -> a new actor handle
    kill: Callable[[Any], None]
    locate: Callable[[Any], Any] | None = None  # actor -> a ref that answers with its node's id
    members: list[Member] = field(default_factory=list)
    made: int = 0  # how many were ever made: names stay unique
    peak: int = 0
    lost: int = 0  # actors dropped with their node (or dead on their own)

    @property
    def actors(self) -> list:
        return [m.actor for m in self.members]

    @property
    def busy(self) -> list[int]:
        return [m.busy for m in self.members]

    def size_to(self, target: int) -> None:
        target = max(1, target)
        while len(self._staying()) < target:
            actor = self.make(self.made)
            probe = self.locate(actor) if self.locate else None
            self.members.append(Member(actor, probe, "" if self.locate else HERE))
            self.made += 1
        for m in list(self.members):  # a draining node's idle actors go, so the node can end
            if m.leaving and m.busy == 0:
                self._drop(m)
        for m in reversed(self._staying()):  # the idle ones beyond the target go, those still starting first
            if len(self._staying()) <= target:
                break
            if m.busy == 0 and not m.node:
                self._drop(m)
        for m in reversed(self._staying()):
            if len(self._staying()) <= target:
                break
            if m.busy == 0:
                self._drop(m)
        if len(self.members) > self.peak:
            log.info("%s pool: %d actors", self.role, len(self.members))
            self.peak = len(self.members)

    def starting(self) -> dict[Any, Any]:
        """probe -> actor, for the actors that have not yet said where they run."""
        return {m.probe: m.actor for m in self.members if not m.node and m.probe is not None}

    def placed(self, actor: Any, node: str) -> None:
        for m in self.members:
            if m.actor is actor:
                m.node, m.probe = node, None

    def ready(self) -> bool:
        """Whether an actor can be chosen now."""
        return any(m.node and not m.leaving for m in self.members)

    def take(self, starting: bool = False) -> Any:
        """The least-loaded living actor, counted as busy until `give_back`. `starting`: one still
        starting will do (the first notes on a running Ray: handed out as the actor boots)."""
        chosen = min((m for m in self.members if (m.node or starting) and not m.leaving), key=lambda m: m.busy,
                     default=None)
        if chosen is None:
            raise LookupError(f"no {self.role} actor is ready")
        chosen.busy += 1
        return chosen.actor

    def give_back(self, actor: Any) -> None:
        for m in self.members:
            if m.actor is actor:
                m.busy -= 1
                return

    def nodes(self) -> set[str]:
        return {m.node for m in self.members if m.node and m.node != HERE}

    def lose_nodes(self, gone: set[str]) -> list[Any]:
        """Drops the actors on nodes that are gone; returns them (their calls in flight are lost)."""
        dead = [m for m in self.members if m.node in gone]
        for m in dead:
            self._drop(m)
        self.lost += len(dead)
        return [m.actor for m in dead]

    def lose(self, actor: Any) -> bool:
        """Drops one actor found dead (its calls failed as the actor's); False if not this pool's."""
        for m in self.members:
            if m.actor is actor:
                self._drop(m)
                self.lost += 1
                return True
        return False

    def drain(self, nodes: set[str]) -> int:
        """The actors on draining nodes are chosen no more; returns how many were newly marked."""
        marked = [m for m in self.members if m.node in nodes and not m.leaving]
        for m in marked:
            m.leaving = True
        return len(marked)

    def close(self) -> None:
        for m in self.members:
            self.kill(m.actor)
        self.members = []

    def _staying(self) -> list[Member]:
        return [m for m in self.members if not m.leaving]

    def _drop(self, member: Member) -> None:
        self.members.remove(member)
        try:
            self.kill(member.actor)
        except Exception as e:  # an actor already gone with its node: nothing left to kill
            log.debug("%s pool: kill of a gone actor: %s", self.role, e)
