"""Per-stage counters and latency histograms with ray.util.metrics (Ray glue, not a
building block): exported by the node where the work ran, on its metrics export port, and
shown by the dashboard's Metrics view when Prometheus scrapes it. Prometheus names them
ray_cn_notes_total, ray_cn_batch_seconds_{bucket,sum,count}, ray_cn_relay_rate{relay} (messages
a second a relay or paced domain is sent at now, cluster-wide, as each mailer last heard it),
ray_cn_relay_throttles_total{relay}, ray_cn_day_accounts_total, ray_cn_bounces_total{kind},
ray_cn_nodes_total{event} (lost, drained) and ray_cn_waited_seconds_total{on} (the HSM); the last
four are the day's totals, added up on the head by one detached actor (Totals) for the life of the
cluster and shown there as gauges that carry the whole total each export (see Totals: a counter's
lost export would leave them short for good), so the day's totals outlive the workers and drivers."""

from __future__ import annotations

import logging
import re
import time
import urllib.request
from functools import lru_cache

from ray.util.metrics import Counter, Gauge, Histogram

log = logging.getLogger("actors.metrics")


# The day's totals: (metric as Prometheus names it, its label) -> description.
DAY, BOUNCES = ("ray_cn_day_accounts_total", "status"), ("ray_cn_bounces_total", "kind")
NODES, WAITED = ("ray_cn_nodes_total", "event"), ("ray_cn_waited_seconds_total", "on")
TOTALS = {DAY: "Accounts of the day by final status, counted by the driver.",
          BOUNCES: "Bounces recorded after delivery, by kind (bounced, deferred).",
          NODES: "Nodes lost or drained mid-run, counted by the driver.",
          WAITED: "Seconds the run's batches were held waiting on a dependency (each outage once), counted by the "
                  "driver."}
KEEPER, NAMESPACE = "cn_day_totals", "contract_notes"
REFRESH_S = 1.0  # well inside Ray's export interval (metrics_report_interval_ms, 10 s; 1 s at the least)
_counted: dict[tuple, float] = {}  # what this process has added to the head's totals: (metric, label) -> n
_last = None  # the keeper's answer to this process's last addition: (its totals then, its worker id, its port)
_keeper_of: dict = {}  # Ray job id -> the keeper's handle


class Totals:
    """The day's totals, kept by one detached actor on the head for the life of the cluster, and
    shown there as gauges set to the whole total again every REFRESH_S.

    Not counters: Ray (2.60, OpenTelemetry) exports a counter from each process as the increase
    since its last export, and the node's metrics agent adds each one it receives. An export the
    agent does not take within the deadline (10 s: a busy node, a stalled agent) is not sent again,
    so that increase never shows; and one the agent took but answered late is added all the same,
    so adding the difference again could count it twice. A gauge's export carries the total: the
    next export after a missed one shows the same number, whatever became of the one before. The
    agent keeps a gauge two export intervals after its last report (the value of a process gone
    goes with it): the keeper outlives the drivers, and says its totals again every REFRESH_S."""

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self._totals: dict[tuple, float] = {}
        self._gauges = {metric: Gauge(metric[0].removeprefix("ray_"), description=TOTALS[metric],
                                      tag_keys=(metric[1],)) for metric in TOTALS}
        import ray

        self._url, self._worker = node_metrics_url(), ray.get_runtime_context().get_worker_id()
        threading.Thread(target=self._say_again, name="cn-totals", daemon=True).start()

    def add(self, counts: dict[tuple, float]) -> tuple[dict, str, str]:
        """`counts`: (metric, label) -> n. Returns the totals then, the worker id their series are
        shown under, and the metrics port that shows them."""
        with self._lock:
            for key, n in counts.items():
                self._totals[key] = self._totals.get(key, 0) + n
            self._set()
            return dict(self._totals), self._worker, self._url

    def _say_again(self) -> None:
        while True:
            time.sleep(REFRESH_S)
            with self._lock:
                self._set()

    def _set(self) -> None:
        for (metric, value), total in self._totals.items():
            self._gauges[metric].set(total, tags={metric[1]: value})


def _keeper():
    """The head's keeper of the day's totals: made by the first process that counts, then found by
    name (in one namespace whatever the job's own)."""
    import ray

    job = ray.get_runtime_context().get_job_id()
    if job not in _keeper_of:
        _keeper_of.clear()
        _keeper_of[job] = ray.remote(Totals).options(
            name=KEEPER, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0, max_restarts=-1,
            resources={"node:__internal_head__": 0.001}).remote()
    return _keeper_of[job]


def _add(counts: dict[tuple, float]) -> None:
    """Counted where Ray runs: a run's driver and actors, `bounces` joined to the head. A process
    without Ray counts nothing: Ray's own first call would start a Ray of its own for it, with
    none of the role resources, and a run in that process then waited for ever on its split."""
    global _last
    import ray

    counts = {key: n for key, n in counts.items() if n > 0}
    if counts and ray.is_initialized():
        _last = _keeper().add.remote(counts)  # one caller's calls run in order: the last answer has them all
        for key, n in counts.items():
            _counted[key] = _counted.get(key, 0) + n


def nodes(event: str, n: int) -> None:
    _add({(NODES, event): n})


def waited(on: str, seconds: float) -> None:
    _add({(WAITED, on): seconds})


def day(tally: dict[str, int]) -> None:
    counts: dict[tuple, int] = {}
    for status, n in tally.items():
        key = (DAY, "delivered" if status == "ok" else status)
        counts[key] = counts.get(key, 0) + n
    _add(counts)


def bounces(kind: str, n: int) -> None:
    _add({(BOUNCES, kind): n})


def wait_exported(timeout_s: float = 30.0) -> bool:
    """Waits until the head's metrics port shows the day's totals with every count this process
    made in them (the keeper's totals as of its last addition). The keeper tells its node's
    agent every REFRESH_S; the agent takes it at its next export (about every 10 s)."""
    import ray

    if _last is None:
        return True
    deadline = time.monotonic() + timeout_s
    try:
        totals, worker, url = ray.get(_last, timeout=timeout_s)
    except Exception as e:  # the keeper lost (its node with it): the totals it had are gone
        log.warning("the keeper of the day's totals did not answer: %r; counted %s", e, _counted)
        return False
    worker = f'WorkerId="{worker}"'
    while True:
        try:
            text = urllib.request.urlopen(url, timeout=2).read().decode()
            shown = {(m, label): v for m in TOTALS for label, v in _shown(text, worker, *m).items()}
        except OSError:
            shown = {}
        if all(shown.get(key, 0) >= n * (1 - 1e-12) for key, n in totals.items()):
            return True
        if time.monotonic() > deadline:
            log.warning("the day's totals did not reach %s within %.0f s: shown %s, the keeper's %s (counted here %s)",
                        url, timeout_s, shown, totals, _counted)
            return False
        time.sleep(1)


def shown_totals() -> dict[tuple, float]:
    """The day's totals the head's metrics port shows now, as the keeper exports them."""
    import ray

    totals, worker, url = ray.get(_keeper().add.remote({}))
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {(m, label): v for m in TOTALS for label, v in _shown(text, f'WorkerId="{worker}"', *m).items()}


def node_metrics_url() -> str:
    """This node's metrics export port, where Prometheus scrapes it."""
    import ray

    node = next(n for n in ray.nodes() if n["NodeID"] == ray.get_runtime_context().get_node_id())
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


def _shown(text: str, worker: str, metric: str = DAY[0], label: str = DAY[1]) -> dict[str, float]:
    shown = {}
    for line in text.splitlines():
        if line.startswith(metric + "{") and worker in line:
            labels, value = line.rsplit(" ", 1)
            named = dict(_LABEL.findall(labels[len(metric) + 1:-1]))
            if label in named:
                shown[named[label]] = float(value)
    return shown


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@lru_cache(maxsize=1)
def _metrics() -> tuple[Counter, Histogram]:
    notes = Counter("cn_notes", description="Accounts through a stage, by outcome.", tag_keys=("stage", "status"))
    seconds = Histogram("cn_batch_seconds", description="Wall seconds per shard batch and stage.",
                        boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300], tag_keys=("stage",))
    return notes, seconds


def observe(stage: str, tally: dict[str, int], seconds: float) -> None:
    notes, histogram = _metrics()
    for status, n in tally.items():
        if n:
            notes.inc(n, tags={"stage": stage, "status": status})
    histogram.observe(seconds, tags={"stage": stage})


@lru_cache(maxsize=1)
def _relay_metrics() -> tuple[Gauge, Counter]:
    rate = Gauge("cn_relay_rate", description="Messages a second the cluster sends through a relay (or to a paced "
                 "domain) now; 0: no rate set.", tag_keys=("relay",))
    throttles = Counter("cn_relay_throttles", description="Throttle and daily-quota replies, by relay.",
                        tag_keys=("relay",))
    return rate, throttles


_throttles_seen: dict[str, int] = {}


def relays(rates: dict[str, dict]) -> None:
    """`rates` is SmtpPool.rates(): this mailer's view, exported after every batch."""
    gauge, counter = _relay_metrics()
    for name, r in rates.items():
        gauge.set(r["rate"], tags={"relay": name})
        new = r["throttles"] - _throttles_seen.get(name, 0)
        if new > 0:
            counter.inc(new, tags={"relay": name})
            _throttles_seen[name] = r["throttles"]
