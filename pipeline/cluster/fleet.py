"""The fleet: the signer and mailer pools against the cluster's nodes, and the one recovery
path for a dead actor. driver.py keeps the day's schedule; what happens when an actor dies is
decided here alone, whatever killed it (its node lost, drained, its process crashed or killed).

Ray neither restarts a pool actor nor re-runs its calls (RECOVERY): an actor found dead is
dropped from its pool, the chains it held are sent again to the living (`take_back`, at most
RESENDS times), and the pool is sized back up from the slots of the nodes that stay. With Ray's
own task retries on as well, a call that was running when its actor died was run again by Ray
on the restarted actor while the driver resent the same batch: two attempts at once (Ray's own
guidance: max_task_retries=0 where the application resends). Signing is write-once and mailing
goes through the exactly-once guard, so a resent batch archives nothing twice and mails no one
twice.

The nodes, as the driver sees them about once a second: which are alive, which are draining
(a spot notice, `ray drain-node`), and the role slots of those that will stay. A node lost
without grace (a reclaimed spot instance, a dead host) takes its raylet, object store and every
actor on it at once; Ray notices within its health check (about 15 s), then lists the node
dead. A draining node is still alive, and what runs there may finish, but nothing new should go
there: the pools choose its actors no more.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

from actors import metrics
from actors.mailer import MailerActor
from actors.signer import SignerActor
from pipeline.cluster import ray_private
from pipeline.cluster.capacity import CapacityError
from pipeline.cluster.pools import Pool
from pipeline.settings import ConfigError, Settings

log = logging.getLogger("pipeline.cluster.fleet")
RECOVERY = {"max_restarts": 0, "max_task_retries": 0}  # every pool actor's: the fleet recovers, Ray does not


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


_said: dict[str, bool] = {"unreadable": False}  # said once a process: look() runs every second


def _draining() -> set[str]:
    """The nodes the GCS is draining; none if this Ray cannot say, and the pools then learn of
    a noticed node's loss only when it comes (said at WARNING: the spot notice no longer helps)."""
    try:
        return ray_private.draining_nodes()
    except Exception as e:  # a Ray whose private call changed (tests/test_ray_private.py), or a GCS blip
        if not _said["unreadable"]:
            log.warning("the nodes Ray is draining are not readable (%s): a spot-noticed node's actors are "
                        "still chosen until it is lost", e)
        _said["unreadable"] = True
        return set()


RESENDS = 3  # a chain is sent again at most this often: a batch that kills its actor each time fails, named
LOSSES = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError, ray.exceptions.NodeDiedError,
          ray.exceptions.WorkerCrashedError)


@dataclass
class Fleet:
    """The pools against the nodes: an actor whose node died is dropped at once (its chains then
    fail fast and are sent to the living), an actor found dead on its own likewise when its chain
    fails (`take_back`), a draining node's actors are chosen no more, and a role left with no
    actor for `capacity_wait_s` stops the run, naming it. `pools`: (signers, mailers) in a run."""

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
        if newly := drained - self.drained:  # the laptop's `watch` shows it: a node going, the day not failing
            log.warning("node(s) %s drained (a spot notice): no new work goes there",
                        ", ".join(sorted(n[:12] for n in newly)))
        metrics.nodes("drained", len(newly))
        self.drained |= drained
        lost = (gone | {n for n, why in ended.items() if why not in ENDED_WELL}) - self.drained
        metrics.nodes("lost", len(lost - self.lost_nodes))
        self.lost_nodes |= lost

    def take_back(self, error: BaseException, chain) -> bool:
        """Takes a failed chain back to be sent again, if its actor (or the object it handed on)
        was lost and it has resends left; the actor the error names is dropped from its pool.
        False: the chain failed for good, and its accounts are failed with the cause."""
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

    @property
    def signers(self) -> Pool:
        return self.pools[0]

    @property
    def mailers(self) -> Pool:
        return self.pools[1]

    def ready(self) -> bool:
        """Whether a chain can be handed out now: an actor of every pool is ready."""
        return all(pool.ready() for pool in self.pools)

    def take(self, starting: bool = False) -> tuple:
        """The least-loaded living actor of each pool (signer, mailer), busy until given back."""
        return tuple(pool.take(starting) for pool in self.pools)

    def give_back(self, *actors: Any) -> None:
        for pool, actor in zip(self.pools, actors):
            pool.give_back(actor)

    def size(self, settings: Settings, view: NodeView) -> None:
        """The pools follow the signer and smtp slots of the nodes that stay (unless fixed): not
        a draining node's."""
        self.signers.size_to(settings.signers or int(view.slots.get("signer", 0)))
        self.mailers.size_to(settings.mailers or int(view.slots.get("smtp", 0)))

    def place(self, timeout: float = 0.0) -> None:
        """The actors that said which node they run on become choosable; one that died starting
        (its node lost) is dropped, and one whose own start failed stops the run."""
        starting = {probe: (pool, actor) for pool in self.pools for probe, actor in pool.starting().items()}
        if not starting:
            time.sleep(timeout)
            return
        done, _ = ray.wait(list(starting), num_returns=len(starting), timeout=timeout)
        for ref in done:
            pool, actor = starting[ref]
            try:
                pool.placed(actor, ray.get(ref))
            except ray.exceptions.RayActorError as e:
                if e.actor_init_failed:
                    raise cannot_start(e) from None
                log.warning("a %s actor was lost while it started: %s", pool.role, why(e))
                pool.lose(actor)

    def started(self, watch: Callable[[], None]) -> None:
        """The first signer and mailer are up (the key, the secret, the region read where they
        run) and have said which node they are on, or the run stops here with the cause in one
        line (exit status 2), before an account is rendered: an actor that cannot start would
        otherwise fail every account it was given."""
        while not self.ready():
            self.place(timeout=1.0)
            watch()

    def close(self) -> None:
        for pool in self.pools:
            pool.close()

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


def start(settings: Settings, run_id: str, force: bool, resend_unconfirmed: bool, relays: str) -> Fleet:
    """The run's pools, their first actors booting (while the split runs), with RECOVERY's
    options: a dead one is the fleet's to replace and its batches the fleet's to resend."""
    own = settings.for_actors()  # each reads the secret itself
    signers = Pool("signer", lambda i: SignerActor.options(name=f"signer-{i}-{run_id}", **RECOVERY).remote(
        own, run_id), ray.kill, _where)
    mailers = Pool("mailer", lambda i: MailerActor.options(name=f"mailer-{i}-{run_id}", **RECOVERY).remote(
        own, run_id, force, resend_unconfirmed, relays), ray.kill, _where)
    fleet = Fleet((signers, mailers), settings.capacity_wait_s)
    fleet.size(settings, look())
    return fleet


def cannot_start(e: ray.exceptions.RayActorError) -> ConfigError:
    """The creation error's last line ("SignerSetupError: ..."), not Ray's traceback."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return ConfigError(f"an actor could not start: {lines[-1] if lines else type(e).__name__}")


def why(e: BaseException) -> str:
    """An error in one line, for an account's reason (an empty message has no first line)."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


def _where(actor) -> ray.ObjectRef:
    return actor.node.remote()


def _actor_id(actor) -> str | None:
    try:
        return actor._actor_id.hex()
    except AttributeError:  # not a Ray actor handle
        return None
