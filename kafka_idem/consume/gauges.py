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
        self._end: dict[TP, int] = {}  # idle partitions' end reached, since assigned

    def observe(self, consumer: Consumer, parts: Partitions, assigned: Iterable[TP] = (),
                every: float = LAG_EVERY_SECONDS) -> dict[TP, int | None] | None:
        """Refresh the gauge of every partition assigned or queued (at most every
        ``every`` seconds); return each one's lag (``None``: not known yet, nothing
        fetched since it was assigned), or ``None`` when it was too early to look."""
        now = time.monotonic()
        if now - self._last < every:
            return None
        self._last = now
        lags: dict[TP, int | None] = {}
        for topic, part in sorted(set(assigned) | {tp for tp, _ in parts.items()}):
            st = parts.get((topic, part))
            lags[(topic, part)] = None
            try:
                low, high = consumer.get_watermark_offsets(
                    TopicPartition(topic, part), cached=True
                )
                # Lag counts what is not finished: messages waiting in our queue
                # (fetched but pending) as much as those not fetched yet.
                first = st.first_offset() if st is not None else None
                done = (
                    first if first is not None
                    else consumer.position([TopicPartition(topic, part)])[0].offset
                )
                if done < 0 and high >= 0:
                    # Nothing handed to us since the assignment (an idle partition): the
                    # fetcher started at the committed offset; once it reached the end
                    # (librdkafka's end-of-partition event) that is what is finished.
                    done = high if low == high else self._end.get((topic, part), -1)
            except KafkaException:
                continue
            if high >= 0 and done >= 0:
                lags[(topic, part)] = max(high - done, 0)
                self.metrics.lag.labels(topic, str(part)).set(max(high - done, 0))
        return lags

    def reached_end(self, tp: TP, offset: int) -> None:
        """librdkafka's end-of-partition event: the fetcher of ``tp`` is at ``offset``,
        the end (no blocking call to ask for the committed offset in the loop)."""
        self._end[tp] = offset

    def forget(self, tps: Iterable[TP]) -> None:
        """Drop the series of partitions this member no longer has."""
        tps = list(tps)
        for tp in tps:
            self._end.pop(tp, None)
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
