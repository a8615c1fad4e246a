"""Per-stage counters and latency histograms with ray.util.metrics (Ray glue, not a
building block): exported by the node where the work ran, on its metrics export port, and
shown by the dashboard's Metrics view when Prometheus scrapes it. Prometheus names them
ray_cn_notes_total, ray_cn_batch_seconds_{bucket,sum,count} and ray_cn_day_accounts_total;
the last is counted by the driver, on the head, so the day's totals outlive the workers."""

from __future__ import annotations

from functools import lru_cache

from ray.util.metrics import Counter, Histogram


@lru_cache(maxsize=1)
def _day() -> Counter:
    return Counter("cn_day_accounts", description="Accounts of the day by final status, counted by the driver.",
                   tag_keys=("status",))


def day(tally: dict[str, int]) -> None:
    for status, n in tally.items():
        if n:
            _day().inc(n, tags={"status": "delivered" if status == "ok" else status})


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
