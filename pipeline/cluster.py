"""Capacity up front, and teardown when the refs resolve: the cluster's life around a run.

The plan turns the day's accounts, the deadline and the measured per-stage rates into node
counts of the cluster.yaml types; the driver asks the autoscaler for exactly that
(request_resources) so nodes start together instead of trickling in behind the queue.
When the run ends, however it ends, the session releases the request, terminates the
workers, then the head (through the node provider, as `ray down` does).
`ray submit --stop` is not used: it leaks workers (see ../shared/RAY_NOTES.md).
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from pipeline.capacity import CapacityWatch, look_at_ray

log = logging.getLogger("pipeline.cluster")
BOOTSTRAP_CONFIG = Path("~/ray_bootstrap_config.yaml").expanduser()  # written on the head by `ray up`


@dataclass(frozen=True)
class NodeType:
    name: str
    instance: str
    vcpus: int
    usd_per_hour: float  # on-demand, ap-south-1 (2026); spot is typically 60-70% less


RENDER = NodeType("render_spot", "c6a.8xlarge", 32, 1.152)
SIGNER_SMTP = NodeType("signer_smtp", "c6a.2xlarge", 8, 0.288)


@dataclass(frozen=True)
class Rates:
    """Per-note costs measured by bench/ on a 2-core c6a-class machine (see README)."""

    render_cpu_ms: float = 11.0  # bench/e2e.py pipeline render stage (charges + Typst)
    sign_cpu_ms: float = 8.0  # bench/e2e.py sign stage (AES-256 + PAdES + archive)
    mails_per_s_per_node: float = 1000.0  # bench/mail.py: ~270/s per mailer on 1 core, 4 mailers
    efficiency: float = 0.8  # pipeline rate over cores x sequential rate (bench/e2e.py, 0.76-0.91)
    startup_s: float = 240.0  # nodes booting and installing before the first note
    margin: float = 0.25  # share of the deadline held back for retries, reruns and slow relays


@dataclass(frozen=True)
class Plan:
    accounts: int
    deadline_s: float
    render_nodes: int
    signer_smtp_nodes: int
    expected_s: float
    usd: float
    bundles: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"accounts": self.accounts, "deadline_min": round(self.deadline_s / 60, 1),
                "render_nodes": self.render_nodes, "render_instance": RENDER.instance,
                "signer_smtp_nodes": self.signer_smtp_nodes, "signer_smtp_instance": SIGNER_SMTP.instance,
                "expected_min": round(self.expected_s / 60, 1), "fits_deadline": self.expected_s <= self.deadline_s,
                "est_cost_usd_on_demand": round(self.usd, 2)}


def plan(accounts: int, deadline_min: float, rates: Rates = Rates()) -> Plan:
    """The fewest nodes that finish inside the deadline less its margin, given the rates;
    stages overlap (a pipeline), so the run lasts as long as its slowest stage, after
    start-up."""
    budget = max(60.0, deadline_min * 60 * (1 - rates.margin) - rates.startup_s)
    render_core_s = accounts * rates.render_cpu_ms / 1000 / rates.efficiency
    sign_core_s = accounts * rates.sign_cpu_ms / 1000 / rates.efficiency
    render_nodes = max(1, math.ceil(render_core_s / (budget * RENDER.vcpus)))
    signer_nodes = max(1, math.ceil(sign_core_s / (budget * SIGNER_SMTP.vcpus)),
                       math.ceil(accounts / (budget * rates.mails_per_s_per_node)))
    stage_s = max(render_core_s / (render_nodes * RENDER.vcpus), sign_core_s / (signer_nodes * SIGNER_SMTP.vcpus),
                  accounts / (signer_nodes * rates.mails_per_s_per_node))
    expected = rates.startup_s + stage_s
    hours = expected / 3600
    usd = hours * (render_nodes * RENDER.usd_per_hour + signer_nodes * SIGNER_SMTP.usd_per_hour)
    bundles = ([{"CPU": RENDER.vcpus, "render": RENDER.vcpus}] * render_nodes
               + [{"CPU": SIGNER_SMTP.vcpus, "signer": 8, "smtp": 4}] * signer_nodes)
    return Plan(accounts, deadline_min * 60, render_nodes, signer_nodes, expected, usd, bundles)


def request_capacity(bundles: list[dict]) -> None:
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)


def release_capacity() -> None:
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=[])


def teardown_workers(config: str | dict) -> None:
    from ray.autoscaler.sdk import teardown_cluster

    teardown_cluster(config, workers_only=True, keep_min_workers=False)


def terminate_head(config: str | dict) -> None:
    """The head ends itself through its node provider, as `ray down` would; if that fails,
    by the OS (its InstanceInitiatedShutdownBehavior is terminate)."""
    import yaml
    from ray.autoscaler._private.commands import _bootstrap_config
    from ray.autoscaler._private.providers import _get_node_provider
    from ray.autoscaler.tags import NODE_KIND_HEAD, TAG_RAY_NODE_KIND

    try:
        cfg = yaml.safe_load(open(config)) if isinstance(config, str) else config
        cfg = _bootstrap_config(cfg, no_config_cache=True)
        provider = _get_node_provider(cfg["provider"], cfg["cluster_name"])
        provider.terminate_nodes(provider.non_terminated_nodes({TAG_RAY_NODE_KIND: NODE_KIND_HEAD}))
    except Exception:
        if not on_cluster():
            raise
        log.exception("cluster: the provider could not terminate the head; shutting it down instead")
        subprocess.run(["sudo", "shutdown", "-h", "now"], check=False)


def terminate_head_after_driver(config: str | dict, grace_s: float | None = None) -> None:
    """The head ends a minute (CN_HEAD_GRACE_S) after the driver exits: its exit status reaches
    `ray job` (a failed day is a FAILED job), and the logs flush. A detached process waits for it."""
    from pipeline.settings import Settings

    grace_s = Settings.from_env().head_grace_s if grace_s is None else grace_s
    code = ("import sys, time, psutil; from pipeline.cluster import terminate_head; "
            "psutil.wait_procs([psutil.Process(int(sys.argv[1]))]); time.sleep(float(sys.argv[2])); "
            "terminate_head(sys.argv[3])")
    subprocess.Popen([sys.executable, "-c", code, str(os.getpid()), str(grace_s), str(config)],
                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=open(Path("~/end-head.log").expanduser(), "ab"),
                     env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})


@dataclass
class ClusterSession:
    deadline_min: float | None
    request: Callable[[list[dict]], None] = request_capacity
    capacity: CapacityWatch | None = None

    def size_for(self, accounts: int) -> None:
        """Called by the driver once the split has counted the day's accounts."""
        if self.deadline_min is None:
            return
        p = plan(accounts, self.deadline_min)
        log.info("capacity for %d accounts in %s min: %s", accounts, self.deadline_min, p.as_dict())
        (self.capacity.ask if self.capacity else self.request)(p.bundles)

    def watch(self) -> None:
        """Called by the driver about once a second while it waits on the cluster."""
        if self.capacity is not None:
            self.capacity.check()


def capacity_watch(config: str | dict, request: Callable[[list[dict]], None]) -> CapacityWatch:
    import yaml

    from pipeline.settings import Settings

    cfg = yaml.safe_load(open(config)) if isinstance(config, str) else config
    settings = Settings.from_env()
    return CapacityWatch(request, look_at_ray, cfg.get("available_node_types", {}), settings.spot_wait_s,
                         settings.capacity_wait_s)


@contextmanager
def session(on_cluster: bool, deadline_min: float | None = None, keep: bool = False,
            config: str | dict = str(BOOTSTRAP_CONFIG), release: Callable[[], None] = release_capacity,
            teardown: Callable[[str | dict], None] = teardown_workers,
            shutdown: Callable[[str | dict], None] = terminate_head_after_driver,
            request: Callable[[list[dict]], None] = request_capacity,
            watch: CapacityWatch | None = None) -> Iterator[ClusterSession]:
    """Around a run on a cluster: watch that capacity arrives, then whatever happens inside
    (a crash included), release the request, terminate the workers and the head, unless `keep`."""
    if on_cluster and watch is None:
        watch = capacity_watch(config, request)
    current = ClusterSession(deadline_min if on_cluster else None, request=request,
                             capacity=watch if on_cluster else None)
    try:
        yield current
    finally:
        if on_cluster:
            _end(current, keep, config, release, teardown, shutdown)


def _end(current: ClusterSession, keep: bool, config, release, teardown, shutdown) -> None:
    steps = [("release the resource request", release)]
    if not keep:
        steps += [("terminate the workers", lambda: teardown(config)), ("terminate the head", lambda: shutdown(config))]
    for what, step in steps:
        try:
            log.info("cluster: %s", what)
            step()
        except Exception:  # keep going: a failed release must not keep the workers alive
            log.exception("cluster: could not %s", what)


def on_cluster() -> bool:
    """The driver runs on a head that `ray up` made (its bootstrap config is there)."""
    return BOOTSTRAP_CONFIG.exists() and os.environ.get("CN_NOT_ON_CLUSTER") != "1"
