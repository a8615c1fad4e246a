"""Capacity that arrives: spot first, on-demand when spot does not come, a clear end when
nothing does.

Ray's autoscaler (v2) keeps retrying a spot type that the cloud refuses and only demotes it
after its own timeout, while the day waits with no node. So the driver watches: once spot
render capacity has neither arrived nor started booting for `spot_wait_s`, it asks for the
render resource with `ondemand` (a resource only the on-demand render type offers), which the
autoscaler can satisfy only by launching that type. If any role the day needs (render, signer,
smtp) is still absent after `capacity_wait_s`, with no node of it booting, the run stops and
names the node types that failed to launch, instead of waiting for the dead-man switch. On a
Ray started by hand and joined by its address (`by_hand`), no autoscaler launches anything: a
role no node offers is said at once and waited for as long, then the run stops the same way.
Once every role has a node, the watch looks again every LOOK_AGAIN_S: a role whose last node
is lost mid-day, while the day's tasks or actors wait for it, is waited for in the same way,
from when it was seen gone (its tasks would otherwise wait for ever where nothing replaces the
node).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from pipeline.errors import CannotRun

log = logging.getLogger("pipeline.cluster.capacity")
ROLES = ("render", "signer", "smtp")
ONDEMAND = "ondemand"  # cluster.yaml: only render_ondemand offers it
LOOK_AGAIN_S = 10.0  # every role seen: a look at the cluster (7-23 ms of the driver's CPU) this often


class CapacityError(CannotRun, RuntimeError):
    """No node for a role the day needs came up in time."""


@dataclass(frozen=True)
class ClusterView:
    """What the watch needs to know about the cluster, read once per check."""

    resources: dict[str, float]  # of the live nodes
    booting: set[str]  # node types launched and not yet joined
    failures: list[tuple[float, str]]  # the autoscaler's failed launches, (when, on the watch's clock; what)
    demanded: set[str] | None = None  # the roles tasks and actors wait for; None: not known


@dataclass
class CapacityWatch:
    request: Callable[[list[dict]], None]
    look: Callable[[], ClusterView]
    node_types: dict[str, dict]  # available_node_types of the cluster config
    spot_wait_s: float
    capacity_wait_s: float
    clock: Callable[[], float] = time.monotonic
    started: float = -1.0
    bundles: list[dict] = field(default_factory=list)
    ondemand: bool = False
    arrived: bool = False
    looked: float = 0.0  # when the cluster was last looked at
    gone: dict[str, float] = field(default_factory=dict)  # after arrival: a role without a node, waited for since
    idle: set[str] = field(default_factory=set)  # of those, the ones nothing waited for at the last look
    lost: dict[str, float] = field(default_factory=dict)  # after arrival: when each gone role was last seen with a node

    def ask(self, bundles: list[dict]) -> None:
        """Request the day's bundles; render bundles go on-demand once the watch fell back."""
        self.bundles = bundles
        self.request([self._placed(b) for b in bundles] if self.ondemand else bundles)

    def check(self) -> None:
        """Called about once a second by the driver while it waits on the cluster."""
        now = self.clock()
        if self.arrived and now - self.looked < LOOK_AGAIN_S:
            return
        first, seen, self.looked = self.started < 0, self.looked, now
        if first:
            self.started = now
        view = self.look()
        missing = [r for r in ROLES if view.resources.get(r, 0) <= 0]
        if self.arrived:
            waits = self._lost(now, seen, view, missing)
        elif not missing:
            self.arrived = True
            if not first:
                log.info("capacity: every role has a node after %.0f s", now - self.started)
            return
        else:  # the day's start: every role is needed, each waited for from the first look
            if first and not self.node_types:
                log.warning("capacity: no node of this Ray offers %s yet; waiting %.0f s (CN_CAPACITY_WAIT_S) for "
                            "one: %s", "/".join(missing), self.capacity_wait_s, _offered(missing))
            waits = {r: now - self.started for r in missing}
        if "render" in waits:
            self._fall_back(waits["render"], view)
        self._stop(waits, view)

    def _lost(self, now: float, seen: float, view: ClusterView, missing: list[str]) -> dict[str, float]:
        """Once every role has had a node: each role whose nodes are all gone is said, and waited
        for from when it was seen gone or, if nothing waited for it then, from when something
        does (Ray's demand; every role where that cannot be read): a render node lost in a
        mail-bound tail, its work done, stops nothing. `seen`: the look before this one, when every
        role not yet said gone still had a node: a failed launch since then is the loss's."""
        needed = set(ROLES) if view.demanded is None else view.demanded
        for role in [r for r in self.gone if r not in missing]:
            log.info("capacity: %s has a node again, after %.0f s waited for", role, now - self.gone.pop(role))
            self.idle.discard(role)
            self.lost.pop(role, None)
        for role in missing:
            if role not in self.gone:
                self.gone[role], self.lost[role] = now, seen
                if role in needed:
                    self._say_gone(role)
        for role in self.gone.keys() - needed:
            self.gone[role] = now  # nothing waits for it: its wait starts when something does
            if role not in self.idle:
                self.idle.add(role)
                log.info("capacity: no node offers %s any more, but no task waits for %s now: the run goes on "
                         "without it", role, role)
        for role in self.idle & needed:
            self.idle.discard(role)
            self._say_gone(role)
        return {r: now - since for r, since in self.gone.items() if r in needed}

    def _say_gone(self, role: str) -> None:
        if self.node_types:
            log.warning("capacity: no node offers %s any more; the autoscaler has %.0f s (CN_CAPACITY_WAIT_S) to "
                        "replace it", role, self.capacity_wait_s)
        else:
            log.warning("capacity: no node of this Ray offers %s any more; waiting %.0f s (CN_CAPACITY_WAIT_S) for "
                        "one: %s", role, self.capacity_wait_s, _offered([role]))

    def _fall_back(self, waited: float, view: ClusterView) -> None:
        if (not self.ondemand and waited >= self.spot_wait_s and not view.booting & self._types_with("render")
                and self._types_with(ONDEMAND)):
            self.ondemand = True
            log.warning("capacity: no spot render node after %.0f s (%s); asking for on-demand render nodes",
                        waited, _last(view.failures, self._types_with("render"), self.lost.get("render", -math.inf)))
            self.ask(self.bundles or [{"CPU": 1, "render": 1}])

    def _stop(self, waits: dict[str, float], view: ClusterView) -> None:
        over = [r for r in ROLES if r in waits and waits[r] >= self.capacity_wait_s]
        if self.node_types:
            stalled = [r for r in over if not view.booting & self._types_with(r)]  # a booting node is coming
        else:  # its node types unknown here: any node booting (an autoscaler of its own) may bring the role
            stalled = [] if view.booting else over
        if not stalled:
            return
        waited = min(waits[r] for r in stalled)
        if not self.node_types:
            raise CapacityError(
                f"no node of this Ray offers {'/'.join(stalled)} after {waited:.0f} s (CN_CAPACITY_WAIT_S), and none "
                f"is booting: {_offered(stalled)}; what was mailed is recorded: run the same run id again once it has "
                "one")
        types = set().union(*map(self._types_with, stalled))
        since = min(self.lost.get(r, -math.inf) for r in stalled)  # before arrival: any (the cluster's start too)
        raise CapacityError(
            f"no {'/'.join(stalled)} node came up in {waited:.0f} s (CN_CAPACITY_WAIT_S); the autoscaler says: "
            f"{_last(view.failures, types, since)}; what was mailed is recorded: run the same run id again when the account "
            "has capacity (or raise its EC2 quota)")

    def _placed(self, bundle: dict) -> dict:
        return {**bundle, ONDEMAND: 1} if "render" in bundle else bundle

    def _types_with(self, resource: str) -> set[str]:
        return {name for name, t in self.node_types.items() if t.get("resources", {}).get(resource)}


def by_hand(capacity_wait_s: float) -> CapacityWatch:
    """The watch of a run not on a `ray up` head: without it, a day on a Ray joined by its address
    none of whose nodes offered `render` waited for ever in its split. It asks for nothing and
    knows no node types (so no spot fallback: its spot wait means nothing); a local Ray, started
    with every role, is seen whole at the first look."""
    return CapacityWatch(lambda bundles: None, look_at_ray, {}, capacity_wait_s, capacity_wait_s)


def _offered(roles: list[str]) -> str:
    resources = ", ".join(f'"{r}": N' for r in roles)
    return f"start a node with `ray start --address=... --resources='{{{resources}}}'`, as cluster.yaml's node types declare"


def _last(failures: list[tuple[float, str]], types: set[str], since: float) -> str:
    """The newest failed launch of these node types since `since` (when the lost role was last
    seen with a node): a role lost in the evening does not quote the morning's refusal."""
    mine = sorted((when, f) for when, f in failures if when >= since and f.split(" ", 1)[0] in types)
    return mine[-1][1] if mine else "no failed launch reported"


def look_at_ray() -> ClusterView:
    """The live nodes' resources from Ray; booting nodes and failed launches from the
    autoscaler v2 status (empty if it cannot be read: the timeouts still hold)."""
    import ray

    booting, failures, demanded = set(), [], None
    try:
        from ray.autoscaler.v2.sdk import get_cluster_status

        status = get_cluster_status(ray.get_runtime_context().gcs_address)
        booting = {n.ray_node_type_name for n in status.pending_nodes}  # launched: an instance exists
        offset = time.time() - time.monotonic()  # epoch seconds to the watch's clock (CapacityWatch.clock)
        failures = [((f.failed_ts_s or f.request_ts_s) + 1 - offset,  # the end of its second: whole seconds given
                     f"{f.ray_node_type_name} launch failed" + (f" ({f.details})" if f.details else ""))
                    for f in status.failed_launches]
        demanded = {r for d in status.resource_demands.ray_task_actor_demand for b in d.bundles_by_count
                    for r in b.bundle if r in ROLES}  # not the day's request: what waits for a node now
    except Exception as e:  # a status the SDK cannot read must not stop the run
        log.debug("capacity: no autoscaler status (%s)", e)
    return ClusterView(dict(ray.cluster_resources()), booting, failures, demanded)
