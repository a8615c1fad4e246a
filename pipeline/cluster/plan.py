"""Capacity up front, and teardown when the refs resolve: the cluster's life around a run.

The plan turns the day's accounts, the deadline and the measured per-stage rates into node
counts of the cluster.yaml types; the driver asks the autoscaler for exactly that
(request_resources) so nodes start together instead of trickling in behind the queue.
When the run ends, however it ends, the session releases the request, terminates the
workers, then the head (through the node provider, as `ray down` does).
`ray submit --stop` is not used: it runs `ray stop` before its teardown, so the autoscaler is gone and the
workers leak.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import psutil

from pipeline.cluster.capacity import CapacityWatch, look_at_ray
from pipeline.settings import ROOT, Settings

log = logging.getLogger("pipeline.cluster.plan")
BOOTSTRAP_CONFIG = Path("~/ray_bootstrap_config.yaml").expanduser()  # written on the head by `ray up`


@dataclass(frozen=True)
class NodeType:
    name: str
    instance: str
    vcpus: int
    usd_per_hour: float  # on-demand, ap-south-1 (2026); spot is typically 60-70% less


RENDER = NodeType("render_spot", "c6a.8xlarge", 32, 1.152)
SIGNER_SMTP = NodeType("signer_smtp", "c6a.2xlarge", 8, 0.288)


HEADS = (NodeType("head", "c6a.xlarge", 4, 0.144), NodeType("head", "c6a.2xlarge", 8, 0.288),
         NodeType("head", "c6a.4xlarge", 16, 0.576), NodeType("head", "c6a.8xlarge", 32, 1.152))
HEAD_GIB_PER_VCPU = 2  # c6a: 2 GiB a vCPU
HEAD_BASE_GIB = 2.0  # GCS, dashboard, driver, API (the driver measured 170-250 MB)
REDIS_HEADROOM = 1.5  # allocator fragmentation and the AOF rewrite's copy-on-write
MEASURED = Path(__file__).resolve().parent / "measured.json"  # written by bench/scale.py, mail.py and fullday.py


@dataclass(frozen=True)
class Rates:
    """What a note costs, as bench/scale.py and bench/mail.py measured it on a 2-core c6a-class
    machine (pipeline/cluster/measured.json, written by them). Start-up and margin are not measured
    here: they are the nodes' boot and the share of the deadline held back."""

    render_cpu_ms: float  # a note's charges and Typst, in the pipeline
    sign_cpu_ms: float  # AES-256 + PAdES + archive
    mails_per_s_per_mailer: float  # one mailer actor against a relay 1 ms away
    efficiency: float  # pipeline rate over cores x the sequential loop's rate
    split_rows_per_s_per_core: float  # the Ray split on every core, per core
    rows_per_account: float  # clients' and trades' rows a day, per account
    report_s_per_100k: float
    redis_bytes_per_account: float
    mailers_per_node: int = 4  # the `smtp` resources of a signer/SMTP node (cluster.yaml)
    startup_s: float = 240.0  # nodes booting and installing before the first note
    margin: float = 0.25  # share of the deadline held back for retries, reruns and slow relays

    @classmethod
    def measured(cls, path: Path = MEASURED) -> "Rates":
        """The control plane's figures (the rows an account, the report, Redis) from the
        full-size day (bench/fullday.py) once it has run; before, bench/scale.py's smaller days."""
        m = json.loads(path.read_text())
        scale, mail = m["scale"], m["mail"]
        day = {"rows": scale["rows_large"], "accounts": scale["accounts_large"],
               "report_write_s": scale["report_s_per_100k"] * scale["accounts_large"] / 100_000,
               "redis_bytes_per_account": scale["redis_bytes_per_account"]}
        if "fullday" in m:
            day = m["fullday"][f"at_{max(m['fullday']['sizes'])}"]
        return cls(render_cpu_ms=scale["cpu_ms_per_note_large"]["render"],
                   sign_cpu_ms=scale["cpu_ms_per_note_large"]["sign"],
                   mails_per_s_per_mailer=mail["ours_mails_per_s"], efficiency=scale["efficiency_large"],
                   split_rows_per_s_per_core=scale["split_rows_per_s_all"] / scale["cores"],
                   rows_per_account=day["rows"] / day["accounts"],
                   report_s_per_100k=day["report_write_s"] * 100_000 / day["accounts"],
                   redis_bytes_per_account=day["redis_bytes_per_account"])


@dataclass(frozen=True)
class Plan:
    accounts: int
    rows: int
    deadline_s: float
    render_nodes: int
    signer_smtp_nodes: int
    split_s: float
    report_s: float
    expected_s: float
    usd: float
    head: NodeType  # the head of one run (cluster.yaml's: it ends with the run)
    head_redis_gib: float
    head_kept: NodeType  # a head kept (--keep-cluster) for the retention, one run a day
    head_kept_redis_gib: float
    bundles: list[dict] = field(default_factory=list)
    relay_rate: float = 0.0  # the relays' messages a second together (0: not known)
    mail_s: float = 0.0  # the accounts at that rate
    mail_bound: bool = False  # the relays, not the nodes, decide when the day ends: more nodes would not help
    hsm_rate: float = 0.0  # the HSM's signatures a second (CN_HSM_OPS_S; 0: not known)
    hsm_s: float = 0.0  # a signature an account at that rate
    hsm_bound: bool = False  # the HSM decides when the day ends

    def advice(self) -> str:
        if self.hsm_bound:
            need = self.accounts / max(1.0, self.deadline_s - (self.expected_s - self.hsm_s))
            return (f"HSM-bound: {_count(self.accounts)} signatures at {self.hsm_rate:g}/s = "
                    f"{self.hsm_s / 60:.3g} min; "
                    + (f"add HSMs to its cluster (CloudHSM spreads signatures over them) for {need:,.0f}/s to meet "
                       f"{self.deadline_s / 60:g} min" if self.expected_s > self.deadline_s else
                       f"it still meets {self.deadline_s / 60:g} min"))
        if not self.mail_bound:
            if self.expected_s <= self.deadline_s:
                return ""
            return (f"does not fit {self.deadline_s / 60:g} min: the nodes' start-up and the report "
                    f"({self.report_s / 60:.2g} min) leave too little for the day, whatever the nodes; "
                    f"give a deadline of at least {math.ceil(self.expected_s / 60)} min")
        need = self.accounts / max(1.0, self.deadline_s - (self.expected_s - self.mail_s))
        return (f"mail-bound: {_count(self.accounts)} at {self.relay_rate:g}/s = {self.mail_s / 60:.3g} min; "
                + (f"add a relay or raise the relay's rate (SES: its maximum send rate) to {need:,.0f}/s "
                   f"to meet {self.deadline_s / 60:g} min" if self.expected_s > self.deadline_s else
                   f"it still meets {self.deadline_s / 60:g} min"))

    def as_dict(self) -> dict:
        return {"accounts": self.accounts, "rows": self.rows, "deadline_min": round(self.deadline_s / 60, 1),
                "render_nodes": self.render_nodes, "render_instance": RENDER.instance,
                "signer_smtp_nodes": self.signer_smtp_nodes, "signer_smtp_instance": SIGNER_SMTP.instance,
                "split_min": round(self.split_s / 60, 2), "report_min": round(self.report_s / 60, 2),
                "expected_min": round(self.expected_s / 60, 1), "fits_deadline": self.expected_s <= self.deadline_s,
                "head_instance": self.head.instance, "head_redis_gib": round(self.head_redis_gib, 2),
                "head_kept_instance": self.head_kept.instance,
                "head_kept_redis_gib": round(self.head_kept_redis_gib, 1),
                "est_cost_usd_on_demand": round(self.usd, 2), "relay_rate": self.relay_rate,
                "mail_min": round(self.mail_s / 60, 1), "mail_bound": self.mail_bound, "hsm_rate": self.hsm_rate,
                "hsm_min": round(self.hsm_s / 60, 1), "hsm_bound": self.hsm_bound, "advice": self.advice()}


def plan(accounts: int, deadline_min: float, rates: Rates | None = None, rows: int | None = None,
         retention_days: float = 14, min_render_nodes: int = 1, relay_rate: float = 0.0, hsm_rate: float = 0.0) -> Plan:
    """The fewest nodes that finish inside the deadline less its margin. Stages overlap (a
    pipeline), so the run lasts as long as its slowest stage after start-up; the split runs
    on the render cores and no note can finish before it; the report follows the last note.
    The relays are a stage too: at `relay_rate` (their rates together), the mail takes
    accounts / relay_rate whatever the nodes; so is the HSM, at `hsm_rate` signatures a second
    (one a note: the proof's is one more). The head holds Redis: the run's accounts, or
    every run's of the retention if it is kept."""
    rates = rates or Rates.measured()
    rows = rows if rows is not None else round(accounts * rates.rows_per_account)
    report_s = accounts / 100_000 * rates.report_s_per_100k
    budget = max(60.0, deadline_min * 60 * (1 - rates.margin) - rates.startup_s - report_s)
    render_core_s = accounts * rates.render_cpu_ms / 1000 / rates.efficiency + rows / rates.split_rows_per_s_per_core
    sign_core_s = accounts * rates.sign_cpu_ms / 1000 / rates.efficiency
    node_mails_per_s = rates.mails_per_s_per_mailer * rates.mailers_per_node
    mail_need = min(relay_rate, accounts / budget) if relay_rate else accounts / budget  # mailers past the relays' rate would wait
    render_nodes = max(min_render_nodes, math.ceil(render_core_s / (budget * RENDER.vcpus)))
    signer_nodes = max(1, math.ceil(sign_core_s / (budget * SIGNER_SMTP.vcpus)), math.ceil(mail_need / node_mails_per_s))
    split_s = rows / (rates.split_rows_per_s_per_core * render_nodes * RENDER.vcpus)
    nodes_s = max(render_core_s / (render_nodes * RENDER.vcpus), sign_core_s / (signer_nodes * SIGNER_SMTP.vcpus),
                  accounts / (signer_nodes * node_mails_per_s))
    mail_s = accounts / relay_rate if relay_rate else 0.0
    hsm_s = accounts / hsm_rate if hsm_rate else 0.0
    stage_s = max(nodes_s, mail_s, hsm_s)
    expected = rates.startup_s + stage_s + report_s
    redis_gib = accounts * rates.redis_bytes_per_account / 2**30
    kept_gib = redis_gib * math.ceil(retention_days)
    usd = expected / 3600 * (render_nodes * RENDER.usd_per_hour + signer_nodes * SIGNER_SMTP.usd_per_hour)
    bundles = ([{"CPU": RENDER.vcpus, "render": RENDER.vcpus}] * render_nodes
               + [{"CPU": SIGNER_SMTP.vcpus, "signer": 8, "smtp": rates.mailers_per_node}] * signer_nodes)
    return Plan(accounts, rows, deadline_min * 60, render_nodes, signer_nodes, split_s, report_s, expected, usd,
                head_for(redis_gib), redis_gib, head_for(kept_gib), kept_gib, bundles, relay_rate, mail_s,
                mail_s > nodes_s and mail_s >= hsm_s, hsm_rate, hsm_s, hsm_s > max(nodes_s, mail_s))


def _count(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n:,}"


def head_for(redis_gib: float) -> NodeType:
    need = redis_gib * REDIS_HEADROOM + HEAD_BASE_GIB
    return next((h for h in HEADS if h.vcpus * HEAD_GIB_PER_VCPU >= need), HEADS[-1])


def capacity_table(deadline_min: float = 25, sizes=(100_000, 500_000, 1_500_000, 3_000_000, 5_000_000)) -> str:
    """docs/aws.md's capacity table (`plan --table`), so the docs can say what `plan` says."""
    lines = ["| accounts | client + trade rows | render c6a.8xlarge | signer/SMTP c6a.2xlarge | split | report "
             "| expected | cost | head (its Redis) | head kept 14 days |", "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    rates = Rates.measured()
    for n in sizes:
        p = plan(n, deadline_min, rates)
        lines.append(f"| {n:,} | {p.rows / 1e6:.1f}M | {p.render_nodes} | {p.signer_smtp_nodes} "
                     f"| {p.split_s / 60:.1f} min | {p.report_s / 60:.1f} min | {p.expected_s / 60:.1f} min "
                     f"| ${p.usd:.2f} | {p.head.instance} ({p.head_redis_gib:.2f} GiB) "
                     f"| {p.head_kept.instance} ({p.head_kept_redis_gib:.1f} GiB) |")
    return "\n".join(lines)


def request_capacity(bundles: list[dict]) -> None:
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)


def release_capacity() -> None:
    import ray
    from ray.autoscaler.sdk import request_resources

    if ray.is_initialized():  # a day stopped before Ray started asked for nothing
        request_resources(bundles=[])


def teardown_workers(config: str | dict) -> None:
    from ray.autoscaler.sdk import teardown_cluster

    teardown_cluster(config, workers_only=True, keep_min_workers=False)


def node_provider(config: str | dict):
    """The cluster's node provider, as `ray up` and the autoscaler use it."""
    import yaml

    from pipeline.cluster import ray_private

    return ray_private.node_provider(yaml.safe_load(open(config)) if isinstance(config, str) else config)


def node_ips(provider) -> set[str]:
    """The private IPs of the cluster's live nodes, by the cloud's own account."""
    return {provider.internal_ip(n) for n in provider.non_terminated_nodes({})}


def terminate_head(config: str | dict) -> None:
    """The head ends itself through its node provider, as `ray down` would; if that fails,
    by the OS (its InstanceInitiatedShutdownBehavior is terminate)."""
    from ray.autoscaler.tags import NODE_KIND_HEAD, TAG_RAY_NODE_KIND

    try:
        provider = node_provider(config)
        provider.terminate_nodes(provider.non_terminated_nodes({TAG_RAY_NODE_KIND: NODE_KIND_HEAD}))
    except Exception:
        if not on_cluster():
            raise
        log.exception("cluster: the provider could not terminate the head; shutting it down instead")
        subprocess.run(["sudo", "shutdown", "-h", "now"], check=False)


def terminate_head_after_driver(config: str | dict, grace_s: float | None = None) -> None:
    """The head ends a minute (CN_HEAD_GRACE_S) after the driver exits: its exit status reaches
    `ray job` (a failed day is a FAILED job), and the logs flush. A detached process waits for it."""
    grace_s = Settings.from_env().head_grace_s if grace_s is None else grace_s
    # The driver may be gone before the waiter looks (a day stopped at its first check exits at
    # once): a driver not found, or a process that took its PID since, has exited.
    code = ("import sys, time, psutil\n"
            "try:\n"
            "    driver = psutil.Process(int(sys.argv[1]))\n"
            "    if driver.create_time() == float(sys.argv[2]):\n"
            "        driver.wait()\n"
            "except psutil.NoSuchProcess:\n"
            "    pass\n"
            "time.sleep(float(sys.argv[3]))\n"
            "from pipeline.cluster.plan import terminate_head\n"
            "terminate_head(sys.argv[4])\n")
    driver = psutil.Process()
    subprocess.Popen([sys.executable, "-c", code, str(driver.pid), repr(driver.create_time()), str(grace_s), str(config)],
                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=open(Path("~/end-head.log").expanduser(), "ab"),
                     env={**os.environ, "PYTHONPATH": ROOT})


@dataclass
class ClusterSession:
    deadline_min: float | None
    request: Callable[[list[dict]], None] = request_capacity
    capacity: CapacityWatch | None = None
    relay_rate: float = 0.0  # the run's relays' rates together (settings.relay_rate()): the plan's mail stage
    hsm_rate: float = 0.0  # CN_HSM_OPS_S: the plan's signing stage when the key is on an HSM

    def size_for(self, accounts: int) -> None:
        """Called by the driver once the split has counted the day's accounts."""
        if self.deadline_min is None:
            return
        p = plan(accounts, self.deadline_min, relay_rate=self.relay_rate, hsm_rate=self.hsm_rate)
        log.info("capacity for %d accounts in %s min: %s", accounts, self.deadline_min, p.as_dict())
        if p.mail_bound:
            (log.warning if not p.expected_s <= p.deadline_s else log.info)("capacity: %s", p.advice())
        (self.capacity.ask if self.capacity else self.request)(p.bundles)

    def watch(self) -> None:
        """Called by the driver about once a second while it waits on the cluster."""
        if self.capacity is not None:
            self.capacity.check()


def capacity_watch(config: str | dict, request: Callable[[list[dict]], None]) -> CapacityWatch:
    import yaml

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


def end_cluster(config: str | dict = str(BOOTSTRAP_CONFIG)) -> None:
    """A day that cannot start ends its cluster too (the workers, then the head after the
    grace): nothing will run on it, and the dead-man switch is hours away."""
    _end(ClusterSession(None), False, config, lambda: None, teardown_workers, terminate_head_after_driver)


def on_cluster() -> bool:
    """The driver runs on a head that `ray up` made (its bootstrap config is there)."""
    return BOOTSTRAP_CONFIG.exists() and os.environ.get("CN_NOT_ON_CLUSTER") != "1"
