"""Prometheus metrics for `GET /metrics` (text exposition format).

Two sources: what this process counted (admissions by outcome and code, admission latency),
and what the job store says at scrape time (jobs by state, queue depth, runner up and
heartbeat age, each tracked job's newest validation loss and token accuracy) — the latter is read fresh on every scrape so every gunicorn worker reports the
same truth. Under `kiln serve` the process counters are shared across workers through
prometheus_client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, set before any import).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ADMISSION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class Metrics:
    """This process's counters; `render` adds the store's gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.admissions = Counter(
            "kiln_admissions",
            "SFT submissions by outcome (admitted, replayed, rejected) and error code.",
            ["outcome", "code"],
            registry=self.registry,
        )
        self.admission_seconds = Histogram(
            "kiln_admission_seconds",
            "Wall time of POST /v1/train/sft from body read to response, every outcome.",
            buckets=ADMISSION_BUCKETS,
            registry=self.registry,
        )

    def observe_admission(self, outcome: str, code: str, seconds: float) -> None:
        self.admissions.labels(outcome=outcome, code=code).inc()
        self.admission_seconds.observe(seconds)

    def render(self, store_snapshot: Callable[[], dict]) -> bytes:
        """The exposition text: process (or all workers') counters, then the store gauges."""
        if os.environ.get(MULTIPROC_ENV):
            shared = CollectorRegistry()
            MultiProcessCollector(shared)
            counters = generate_latest(shared)
        else:
            counters = generate_latest(self.registry)
        store = CollectorRegistry(auto_describe=False)
        store.register(_StoreCollector(store_snapshot))
        return counters + generate_latest(store)


class _StoreCollector:
    """Gauges read from the job store at scrape time."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self._snapshot = snapshot

    def collect(self):
        snap = self._snapshot()
        jobs = GaugeMetricFamily("kiln_jobs", "Tracked (not deleted) jobs by state.", labels=["state"])
        for state, count in sorted(snap["jobs_by_state"].items()):
            jobs.add_metric([state], count)
        yield jobs
        yield GaugeMetricFamily("kiln_queue_depth", "Jobs waiting in the queue.", value=snap["queue_depth"])
        yield GaugeMetricFamily(
            "kiln_jobs_unpublished",
            "Queued jobs whose broker message has not gone out yet (the reconciler republishes them).",
            value=snap["unpublished"],
        )
        yield GaugeMetricFamily(
            "kiln_runner_up", "1 when a live runner can take jobs, else 0.", value=1 if snap["runner"] else 0
        )
        age = GaugeMetricFamily(
            "kiln_runner_heartbeat_age_seconds",
            "Seconds since the newest runner heartbeat (any state); absent when no runner ever registered.",
        )
        if snap["heartbeat_age_s"] is not None:
            age.add_metric([], snap["heartbeat_age_s"])
        yield age
        yield from _validation_gauges(snap.get("validation", []))


def _validation_gauges(latest: list[dict]):
    """The newest evaluation of each tracked job with held-out validation (docs/validation.md)."""
    labels = ["job_id", "adapter_name"]
    loss = GaugeMetricFamily(
        "kiln_validation_loss",
        "Validation loss (token-weighted mean cross-entropy) of the job's newest evaluation.",
        labels=labels,
    )
    accuracy = GaugeMetricFamily(
        "kiln_validation_token_accuracy",
        "Validation token accuracy (arg-max equals the target) of the job's newest evaluation.",
        labels=labels,
    )
    step = GaugeMetricFamily(
        "kiln_validation_global_step",
        "Global step of the job's newest validation evaluation (0: the baseline).",
        labels=labels,
    )
    for entry in latest:
        key = [entry["job_id"], entry["adapter_name"]]
        loss.add_metric(key, entry["loss"])
        accuracy.add_metric(key, entry["token_accuracy"])
        step.add_metric(key, entry["global_step"])
    yield loss
    yield accuracy
    yield step
