"""Prometheus metrics (docs/how-to/operating.md, docs/reference/metrics.md). One registry
and one /metrics endpoint per process.

Counters are updated on the message path; database gauges (records by status,
expired leases, long-running records) are *sampled* by a background thread at
an interval, never queried on a scrape.
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from kafka_idem.observe import health

log = logging.getLogger(__name__)

OUTCOMES = ("succeeded", "replayed", "busy", "conflict", "retried", "dead_lettered")
DECIDED = ("succeeded", "replayed", "conflict", "dead_lettered")  # the offset may move


_Kind = type[Counter] | type[Gauge] | type[Histogram]
# (attribute, type, name, help, label names): registered in this order
METRICS: tuple[tuple[str, _Kind, str, str, tuple[str, ...]], ...] = (
    ("messages", Counter, "kafka_idem_messages_total",
     "Messages processed, by outcome.",
     ("topic", "handler", "outcome")),
    ("dead_lettered", Counter, "kafka_idem_dead_lettered_total",
     "Messages dead-lettered, by error kind.",
     ("topic", "handler", "kind")),
    ("retries", Counter, "kafka_idem_retries_total",
     "Handler failures scheduled for a retry.",
     ("topic", "handler")),
    ("exhausted", Counter, "kafka_idem_exhausted_total",
     "Keys that used up their retries (alert on this).",
     ("topic", "handler")),
    ("dlq_failures", Counter, "kafka_idem_dlq_produce_failures_total",
     "Dead-letter produces that were not acknowledged.",
     ("topic",)),
    ("framework_errors", Counter, "kafka_idem_framework_errors_total",
     "Store or broker errors that made a partition wait (never charged to a message).",
     ("kind",)),
    ("config_errors", Counter, "kafka_idem_config_errors_total",
     "Configuration errors met while processing: the partition is held, the message "
     "not charged (alert on any increase).",
     ("topic", "handler")),
    ("handler_seconds", Histogram, "kafka_idem_handler_duration_seconds",
     "Handler run time.",
     ("topic", "handler")),
    ("deliveries", Counter, "kafka_idem_deliveries_total",
     "Deliveries decided (succeeded, replayed, conflict, dead-lettered): each one "
     "lets its offset move. Sum over members; duplicates_total / deliveries_total "
     "is the group's duplicate ratio.",
     ("topic", "handler")),
    ("duplicates", Counter, "kafka_idem_duplicates_total",
     "Deliveries of a key that had already succeeded, answered with its stored "
     "result (the handler did not run).",
     ("topic", "handler")),
    # Deprecated in 0.2.0, removed in 0.3.0 (CHANGELOG.md): a per-process ratio cannot be
    # summed across members (use the two counters above).
    ("duplicate_ratio", Gauge, "kafka_idem_duplicate_ratio",
     "DEPRECATED (removed in 0.3.0): replayed / decided messages since "
     "this process started; use kafka_idem_duplicates_total / "
     "kafka_idem_deliveries_total.",
     ()),
    ("handler_calls", Gauge, "kafka_idem_handler_calls",
     "Key-ordered handlers: calls running now (at most the handler's concurrency), "
     "and claimed messages waiting for a call's slot (read on each scrape).",
     ("topic", "handler", "state")),
    ("max_rate", Gauge, "kafka_idem_handler_max_rate",
     "A handler's max_rate: the messages a second it may start in this member (set "
     "at start, for handlers with one).",
     ("topic", "handler")),
    ("throttled", Counter, "kafka_idem_handler_throttled_seconds_total",
     "Seconds a handler's messages waited for its max_rate in this member (while its "
     "bucket was empty and messages were queued for it).",
     ("topic", "handler")),
    ("lag", Gauge, "kafka_idem_consumer_lag_messages",
     "Messages not finished yet (high watermark minus the first unfinished offset), "
     "per assigned partition.",
     ("topic", "partition")),
    ("records", Gauge, "kafka_idem_records",
     "Idempotency records by status (sampled).",
     ("status",)),
    ("expired_leases", Gauge, "kafka_idem_expired_leases",
     "Records processing with an expired lease (sampled).",
     ()),
    ("long_running", Gauge, "kafka_idem_long_running_records",
     "Records processing for longer than the threshold (sampled).",
     ()),
    ("outbox_pending", Gauge, "kafka_idem_outbox_pending",
     "Outbox rows not published yet (sampled by the relay).",
     ()),
    ("outbox_oldest_age", Gauge, "kafka_idem_outbox_oldest_age_seconds",
     "Age of the oldest unpublished outbox row, 0 when none (sampled by the relay; "
     "alert when it grows: relay or broker down).",
     ()),
    ("outbox_published", Counter, "kafka_idem_outbox_published_total",
     "Outbox rows published (their Kafka transaction committed).",
     ()),
    ("outbox_relay_errors", Counter, "kafka_idem_outbox_relay_errors_total",
     "Relay rounds or shard takeovers that failed (retried with backoff), by kind.",
     ("kind",)),
    ("outbox_shards", Gauge, "kafka_idem_outbox_shards_owned",
     "Outbox shards this process publishes now.",
     ()),
    ("handler_paused", Gauge, "kafka_idem_handler_paused",
     "1 while the handler is paused (kafka-idem pause) and this member holds it: none "
     "of its calls runs or starts here; 0 otherwise.",
     ("handler",)),
    ("retention_purged", Counter, "kafka_idem_retention_purged_total",
     "Succeeded records older than the retention window removed by this member's "
     "background retention runs.",
     ()),
    ("retention_last_run", Gauge, "kafka_idem_retention_last_run_timestamp_seconds",
     "When this member last finished a background retention run that had the app's "
     "turn (Unix time; 0: none yet). Alert when no member's moves for several intervals.",
     ()),
    ("retention_errors", Counter, "kafka_idem_retention_errors_total",
     "Background retention runs that failed or were skipped, by kind (database, "
     "unchecked: a source topic's retention.ms could not be read, too_short).",
     ("kind",)),
    ("batch_fallbacks", Counter, "kafka_idem_batch_fallbacks_total",
     "Local-mode batches the batch path left to the per-message path (a handler "
     "raised, a key in another member's hands or due for a retry, a key written by "
     "another member meanwhile...), by topic: each such batch runs message by message, "
     "slower; the DEBUG log line batch_fallback says why.",
     ("topic",)),
)


class Metrics:
    """The process's metrics (:data:`METRICS`, each an attribute of its name) in one
    registry, and what the message path counts with them."""

    # made from METRICS in __init__; declared here so that their types are known
    messages: Counter
    dead_lettered: Counter
    retries: Counter
    exhausted: Counter
    dlq_failures: Counter
    framework_errors: Counter
    config_errors: Counter
    handler_seconds: Histogram
    deliveries: Counter
    duplicates: Counter
    duplicate_ratio: Gauge
    handler_calls: Gauge
    max_rate: Gauge
    throttled: Counter
    lag: Gauge
    records: Gauge
    expired_leases: Gauge
    long_running: Gauge
    outbox_pending: Gauge
    outbox_oldest_age: Gauge
    outbox_published: Counter
    outbox_relay_errors: Counter
    outbox_shards: Gauge
    handler_paused: Gauge
    retention_purged: Counter
    retention_last_run: Gauge
    retention_errors: Counter
    batch_fallbacks: Counter

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        for attr, kind, name, help_text, labels in METRICS:
            setattr(self, attr, kind(name, help_text, labels, registry=self.registry))
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
