"""The cluster's nodes as the driver sees them about once a second: which are alive, which are
draining (a spot notice, `ray drain-node`), and the role slots of those that will stay.

A node lost without grace (a reclaimed spot instance, a dead host) takes its raylet, object
store and every actor on it at once; Ray notices within its health check (about 15 s), then
lists the node dead. A draining node is still alive, and what runs there may finish, but
nothing new should go there: the pools choose its actors no more.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import ray

from actors import metrics
from pipeline.cluster import ray_private
from pipeline.cluster.capacity import CapacityError
from pipeline.cluster.pools import Pool

log = logging.getLogger("pipeline.cluster.nodes")


PREEMPTED = 3  # NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED: drained on a spot notice, then ended
ENDED_WELL = (1, 4)  # EXPECTED_TERMINATION, AUTOSCALER_DRAIN_IDLE: scaled down, not lost


@dataclass(frozen=True)
class NodeView:
    alive: frozenset[str]
    draining: frozenset[str]
    slots: dict[str, float]  # render, signer, smtp... of the alive nodes not draining
    dead: dict[str, int] = field(default_factory=dict)  # node -> why it ended (NodeDeathInfo.Reason)

    def gone(self, known: set[str]) -> set[str]:
        """Of the nodes the pools' actors run on, those no longer alive."""
        return known - self.alive


def look() -> NodeView:
    draining = frozenset(_draining())
    alive, slots, dead = set(), {}, {}
    for node in ray.nodes():
        if not node.get("Alive"):
            dead[node["NodeID"]] = node.get("DeathReason", 0)
            continue
        alive.add(node["NodeID"])
        if node["NodeID"] in draining:
            continue
        for name, amount in node.get("Resources", {}).items():
            slots[name] = slots.get(name, 0.0) + amount
    return NodeView(frozenset(alive), draining, slots, dead)


_unreadable: list[str] = []  # said once a process: look() runs every second


def _draining() -> set[str]:
    """The nodes the GCS is draining; none if this Ray cannot say, and the pools then learn of
    a noticed node's loss only when it comes (said at WARNING: the spot notice no longer helps)."""
    try:
        return ray_private.draining_nodes()
    except Exception as e:  # a Ray whose private call changed (tests/test_ray_private.py), or a GCS blip
        if not _unreadable:
            log.warning("the nodes Ray is draining are not readable (%s): a spot-noticed node's actors are "
                        "still chosen until it is lost", e)
        _unreadable.append(str(e))
        return set()


RESENDS = 3  # a chain is sent again at most this often: a batch that kills its actor each time fails, named
LOSSES = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError, ray.exceptions.NodeDiedError,
          ray.exceptions.WorkerCrashedError)


@dataclass
class Fleet:
    """The pools against the nodes: an actor whose node died is dropped at once (its chains then
    fail fast and are sent to the living), a draining node's actors are chosen no more, and a
    role left with no actor for `capacity_wait_s` stops the run, naming it."""

    pools: tuple[Pool, ...]
    capacity_wait_s: float
    clock: Callable[[], float] = time.monotonic
    seen: set[str] = field(default_factory=set)  # every node an actor of the pools ran on
    handled: set[str] = field(default_factory=set)  # of those, the ones gone whose actors were dropped
    lost_nodes: set[str] = field(default_factory=set)  # ended without grace during the run, any role
    drained: set[str] = field(default_factory=set)  # drained during the run (a spot notice)
    ended_before: set[str] | None = None  # nodes already dead when the run began
    empty_since: dict[str, float] = field(default_factory=dict)

    def check(self, view: NodeView) -> None:
        self.tally(view)
        self._capacity()

    def tally(self, view: NodeView) -> None:
        """The pools against the view: a draining node's actors passed over, a dead node's
        dropped, and the nodes drained and lost counted."""
        if self.ended_before is None:
            self.ended_before = set(view.dead)
        for pool in self.pools:
            if pool.drain(set(view.draining)):
                log.warning("%s actors on a draining node are chosen no more", pool.role)
        ended = {n: why for n, why in view.dead.items() if n not in self.ended_before}
        drained = view.draining | {n for n, why in ended.items() if why == PREEMPTED}
        self.seen |= set().union(*(p.nodes() for p in self.pools))
        gone = view.gone(self.seen) - self.handled
        self.handled |= gone
        if gone:
            log.warning("node(s) %s lost: their actors are dropped and their batches go to the living",
                        ", ".join(sorted(n[:12] for n in gone)))
            for pool in self.pools:
                pool.lose_nodes(gone)
        metrics.nodes("drained", len(drained - self.drained))
        self.drained |= drained
        lost = (gone | {n for n, why in ended.items() if why not in ENDED_WELL}) - self.drained
        metrics.nodes("lost", len(lost - self.lost_nodes))
        self.lost_nodes |= lost

    def lost(self, error: BaseException, chain) -> bool:
        """Whether a failed chain goes again: its actor (or the object it handed on) was lost,
        and it has resends left. The actor the error names is dropped from its pool."""
        if not isinstance(error, LOSSES) or chain.resends >= RESENDS:
            return False
        named = getattr(error, "actor_id", None)
        for pool in self.pools:
            for actor in pool.actors:
                if _actor_id(actor) == named:
                    pool.lose(actor)
        if not isinstance(error, ray.exceptions.RayActorError):  # the batch itself was lost: render it again
            chain.rendered = None
        chain.resends += 1
        return True

    def counts(self) -> dict[str, int]:
        return {"lost": len(self.lost_nodes), "drained": len(self.drained),
                "actors_lost": sum(p.lost for p in self.pools)}

    def _capacity(self) -> None:
        now = self.clock()
        for pool in self.pools:
            if pool.ready():
                self.empty_since.pop(pool.role, None)
                continue
            since = self.empty_since.setdefault(pool.role, now)
            if now - since >= self.capacity_wait_s:
                raise CapacityError(
                    f"no {pool.role} actor has been alive for {now - since:.0f} s (CN_CAPACITY_WAIT_S) after "
                    f"{len(self.lost_nodes)} node(s) were lost, and no replacement came up; what was mailed is "
                    "recorded: run the same run id again when the cluster has capacity (it resumes)")


def _actor_id(actor) -> str | None:
    try:
        return actor._actor_id.hex()
    except AttributeError:  # not a Ray actor handle
        return None
