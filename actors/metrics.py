"""Per-stage counters and latency histograms with ray.util.metrics (Ray glue, not a
building block): exported by the node where the work ran, on its metrics export port, and
shown by the dashboard's Metrics view when Prometheus scrapes it. Prometheus names them
ray_cn_notes_total, ray_cn_batch_seconds_{bucket,sum,count}, ray_cn_relay_rate{relay} (messages
a second a relay or paced domain is sent at now, cluster-wide, as each mailer last heard it),
ray_cn_relay_throttles_total{relay}, ray_cn_day_accounts_total, ray_cn_bounces_total{kind},
ray_cn_nodes_total{event} (lost, drained) and ray_cn_waited_seconds_total{on} (the HSM); the last
four are counted on the head (by the driver, and by `bounces` on a cluster), so the day's totals
outlive the workers."""

from __future__ import annotations

import logging
import time
import urllib.request
from functools import lru_cache

from ray.util.metrics import Counter, Gauge, Histogram

log = logging.getLogger("actors.metrics")


@lru_cache(maxsize=1)
def _day() -> Counter:
    return Counter("cn_day_accounts", description="Accounts of the day by final status, counted by the driver.",
                   tag_keys=("status",))


@lru_cache(maxsize=1)
def _bounces() -> Counter:
    return Counter("cn_bounces", description="Bounces recorded after delivery, by kind (bounced, deferred).",
                   tag_keys=("kind",))


@lru_cache(maxsize=1)
def _fleet() -> tuple[Counter, Counter]:
    return (Counter("cn_nodes", description="Nodes lost or drained mid-run, counted by the driver.",
                    tag_keys=("event",)),
            Counter("cn_waited_seconds", description="Seconds the run's batches were held waiting on a dependency "
                    "(each outage once), counted by the driver.", tag_keys=("on",)))


def nodes(event: str, n: int) -> None:
    if n > 0:
        _fleet()[0].inc(n, tags={"event": event})


def waited(on: str, seconds: float) -> None:
    if seconds > 0:
        _fleet()[1].inc(seconds, tags={"on": on})


DAY, BOUNCES = ("ray_cn_day_accounts_total", "status"), ("ray_cn_bounces_total", "kind")
_counted: dict[tuple, int] = {}  # what this process has added to the head's counters: (metric, label) -> n


def day(tally: dict[str, int]) -> None:
    for status, n in tally.items():
        if n:
            status = "delivered" if status == "ok" else status
            _day().inc(n, tags={"status": status})
            _counted[(DAY, status)] = _counted.get((DAY, status), 0) + n


def bounces(kind: str, n: int) -> None:
    _bounces().inc(n, tags={"kind": kind})
    _counted[(BOUNCES, kind)] = _counted.get((BOUNCES, kind), 0) + n


def wait_exported(timeout_s: float = 30.0) -> bool:
    """Waits until this node's metrics port shows every count this process made. Ray hands a
    process's metrics to its node about every 10 s, and what is not handed over dies with the
    process: a driver that exits right after its last chains would leave the day's totals short."""
    import ray

    url, worker = node_metrics_url(), f'WorkerId="{ray.get_runtime_context().get_worker_id()}"'
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            text = urllib.request.urlopen(url, timeout=2).read().decode()
            shown = {(m, label): v for m in (DAY, BOUNCES) for label, v in _shown(text, worker, *m).items()}
        except OSError:
            shown = {}
        if all(shown.get(key, 0) >= n for key, n in _counted.items()):
            return True
        if time.monotonic() > deadline:
            log.warning("the day's counters did not reach %s within %.0f s: shown %s, counted %s", url, timeout_s,
                        shown, _counted)
            return False
        time.sleep(1)


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
            shown[labels.split(f'{label}="', 1)[1].split('"', 1)[0]] = float(value)
    return shown


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
