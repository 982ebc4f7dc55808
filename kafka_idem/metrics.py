"""Prometheus metrics (README, "Metrics"). One registry and one /metrics endpoint per process.

Counters are updated on the message path; database gauges (records by status,
expired leases, long-running records) are *sampled* by a background thread at
an interval, never queried on a scrape.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from kafka_idem import health
from kafka_idem.store import describe

log = logging.getLogger(__name__)

OUTCOMES = ("succeeded", "replayed", "busy", "conflict", "retried", "dead_lettered")
DECIDED = ("succeeded", "replayed", "conflict", "dead_lettered")  # the offset may move


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.messages = Counter(
            "kafka_idem_messages_total",
            "Messages processed, by outcome.",
            ["topic", "handler", "outcome"],
            registry=r,
        )
        self.dead_lettered = Counter(
            "kafka_idem_dead_lettered_total",
            "Messages dead-lettered, by error kind.",
            ["topic", "handler", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "kafka_idem_retries_total",
            "Handler failures scheduled for a retry.",
            ["topic", "handler"],
            registry=r,
        )
        self.exhausted = Counter(
            "kafka_idem_exhausted_total",
            "Keys that used up their retries (alert on this).",
            ["topic", "handler"],
            registry=r,
        )
        self.dlq_failures = Counter(
            "kafka_idem_dlq_produce_failures_total",
            "Dead-letter produces that were not acknowledged.",
            ["topic"],
            registry=r,
        )
        self.framework_errors = Counter(
            "kafka_idem_framework_errors_total",
            "Store or broker errors that made a partition wait (never charged to a message).",
            ["kind"],
            registry=r,
        )
        self.config_errors = Counter(
            "kafka_idem_config_errors_total",
            "Configuration errors met while processing: the partition is held, the message "
            "not charged (alert on any increase).",
            ["topic", "handler"],
            registry=r,
        )
        self.handler_seconds = Histogram(
            "kafka_idem_handler_duration_seconds",
            "Handler run time.",
            ["topic", "handler"],
            registry=r,
        )
        self.deliveries = Counter(
            "kafka_idem_deliveries_total",
            "Deliveries decided (succeeded, replayed, conflict, dead-lettered): each one "
            "lets its offset move. Sum over members; duplicates_total / deliveries_total "
            "is the group's duplicate ratio.",
            ["topic", "handler"],
            registry=r,
        )
        self.duplicates = Counter(
            "kafka_idem_duplicates_total",
            "Deliveries of a key that had already succeeded, answered with its stored "
            "result (the handler did not run).",
            ["topic", "handler"],
            registry=r,
        )
        # Deprecated, kept for one release: a per-process ratio cannot be summed across
        # members (use the two counters above); removed in the next release.
        self.duplicate_ratio = Gauge(
            "kafka_idem_duplicate_ratio",
            "DEPRECATED (removed in the next release): replayed / decided messages since "
            "this process started; use kafka_idem_duplicates_total / "
            "kafka_idem_deliveries_total.",
            registry=r,
        )
        self.handler_calls = Gauge(
            "kafka_idem_handler_calls",
            "Key-ordered handlers: calls running now (at most the handler's concurrency), "
            "and claimed messages waiting for a call's slot (read on each scrape).",
            ["topic", "handler", "state"],
            registry=r,
        )
        self.lag = Gauge(
            "kafka_idem_consumer_lag_messages",
            "Messages not finished yet (high watermark minus the first unfinished offset), "
            "per assigned partition.",
            ["topic", "partition"],
            registry=r,
        )
        self.records = Gauge(
            "kafka_idem_records",
            "Idempotency records by status (sampled).",
            ["status"],
            registry=r,
        )
        self.expired_leases = Gauge(
            "kafka_idem_expired_leases",
            "Records processing with an expired lease (sampled).",
            registry=r,
        )
        self.long_running = Gauge(
            "kafka_idem_long_running_records",
            "Records processing for longer than the threshold (sampled).",
            registry=r,
        )
        self.outbox_pending = Gauge(
            "kafka_idem_outbox_pending",
            "Outbox rows not published yet (sampled by the relay).",
            registry=r,
        )
        self.outbox_oldest_age = Gauge(
            "kafka_idem_outbox_oldest_age_seconds",
            "Age of the oldest unpublished outbox row, 0 when none (sampled by the relay; "
            "alert when it grows: relay or broker down).",
            registry=r,
        )
        self.outbox_published = Counter(
            "kafka_idem_outbox_published_total",
            "Outbox rows published (their Kafka transaction committed).",
            registry=r,
        )
        self.outbox_relay_errors = Counter(
            "kafka_idem_outbox_relay_errors_total",
            "Relay rounds or shard takeovers that failed (retried with backoff), by kind.",
            ["kind"],
            registry=r,
        )
        self.outbox_shards = Gauge(
            "kafka_idem_outbox_shards_owned",
            "Outbox shards this process publishes now.",
            registry=r,
        )
        self.health: health.Health | None = None  # set by the Runner: /livez, /readyz
        self._decided = 0
        self._replayed = 0
        self._lock = threading.Lock()

    def outcome(self, topic: str, handler: str, outcome: str, n: int = 1) -> None:
        self.messages.labels(topic, handler, outcome).inc(n)
        if outcome in DECIDED:
            self.deliveries.labels(topic, handler).inc(n)
            if outcome == "replayed":
                self.duplicates.labels(topic, handler).inc(n)
            with self._lock:
                self._decided += n
                if outcome == "replayed":
                    self._replayed += n
                self.duplicate_ratio.set(self._replayed / self._decided)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` (and ``/livez``, ``/readyz`` when a runner set
        :attr:`health`) on ``addr:port``; return the port bound."""
        server = health.serve(self.registry, self.health, port, addr)
        bound = int(server.server_address[1])
        log.info("metrics endpoint started on %s:%d", addr, bound,
                 extra={"action": "metrics", "port": bound})
        return bound


class Sampler(threading.Thread):
    """Samples the database gauges every ``interval`` seconds."""

    def __init__(self, metrics: Metrics, sample: Any, interval: float = 15.0) -> None:
        super().__init__(name="kafka-idem-sampler", daemon=True)
        self.metrics = metrics
        self.sample = sample
        self.interval = interval
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                figures = self.sample()
                for status, count in figures["by_status"].items():
                    self.metrics.records.labels(status).set(count)
                self.metrics.expired_leases.set(figures["expired_leases"])
                self.metrics.long_running.set(figures["long_running"])
            except Exception as exc:  # a sampling failure must never stop the consumer
                # One line: during a database outage this repeats every interval.
                log.warning("metrics sampling failed (%s)", describe(exc),
                            extra={"action": "sample"})
            self.stopped.wait(self.interval)
