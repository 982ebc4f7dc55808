"""What the member measures besides its outcomes: consumer lag and the store's gauges."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from kafka_idem.consume.partitions import TP, Partitions
from kafka_idem.metrics import Metrics
from kafka_idem.settings import Settings
from kafka_idem.store import Store, connect

LAG_EVERY_SECONDS = 5.0


class Lag:
    """The per-partition lag gauge, refreshed at most every few seconds."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._last = 0.0

    def observe(self, consumer: Consumer, parts: Partitions) -> None:
        now = time.monotonic()
        if now - self._last < LAG_EVERY_SECONDS:
            return
        self._last = now
        for (topic, part), st in parts.items():
            try:
                _low, high = consumer.get_watermark_offsets(
                    TopicPartition(topic, part), cached=True
                )
                # Lag counts what is not finished: messages waiting in our queue
                # (fetched but pending) as much as those not fetched yet.
                first = st.first_offset()
                done = (
                    first if first is not None
                    else consumer.position([TopicPartition(topic, part)])[0].offset
                )
            except KafkaException:
                continue
            if high >= 0 and done >= 0:
                self.metrics.lag.labels(topic, str(part)).set(max(high - done, 0))

    def forget(self, tps: Iterable[TP]) -> None:
        """Drop the series of partitions this member no longer has."""
        for topic, part in tps:
            with contextlib.suppress(KeyError):
                self.metrics.lag.remove(topic, str(part))


def sample_store(settings: Settings, store: Store) -> dict[str, Any]:
    """Database gauges for the sampler thread (its own short-lived connection)."""
    from kafka_idem import admin

    conn = connect(settings.dsn, application_name="kafka_idem:metrics")
    try:
        st = admin.status(conn, store, long_running_seconds=settings.long_running_seconds,
                          namespace=store.namespace)  # this app's records only
    finally:
        conn.close()
    return {
        "by_status": st.by_status,
        "expired_leases": st.processing_expired,
        "long_running": st.long_running,
    }
