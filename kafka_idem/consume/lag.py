"""What the member measures besides its outcomes: consumer lag and the store's gauges."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaException, TopicPartition

from kafka_idem.consume.partitions import TP, Partitions
from kafka_idem.observe.metrics import Metrics
from kafka_idem.settings import Settings
from kafka_idem.store import Store, connect, describe

log = logging.getLogger(__name__)

LAG_EVERY_SECONDS = 5.0
ASK_SECONDS = 1.0  # the longest the loop waits for the broker's answer about lag


class Lag:
    """The per-partition lag gauge, refreshed at most every few seconds."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._last = 0.0
        self._end: dict[TP, int] = {}  # idle partitions' end reached, since assigned
        self._committed: dict[TP, int] = {}  # where the fetchers of untouched partitions began

    def observe(self, consumer: Consumer, parts: Partitions, assigned: Iterable[TP] = (),
                every: float = LAG_EVERY_SECONDS) -> dict[TP, int | None] | None:
        """Refresh the gauge of every partition assigned or queued (at most every
        ``every`` seconds); return each one's lag (``None``: not known yet: the broker
        did not answer), or ``None`` when it was too early to look."""
        now = time.monotonic()
        if now - self._last < every:
            return None
        self._last = now
        tps = sorted(set(assigned) | {tp for tp, _ in parts.items()})
        marks: dict[TP, tuple[int, int]] = {}
        done: dict[TP, int] = {}
        for tp in tps:
            try:
                marks[tp], done[tp] = self._measure(consumer, parts, tp)
            except KafkaException:
                continue
        self._untouched(consumer, [tp for tp in marks if done[tp] < 0])
        lags: dict[TP, int | None] = {}
        for tp in tps:
            low, high = marks.get(tp, (-1, -1))
            first = done.get(tp, -1)
            if first < 0 and high >= 0:
                # Nothing handed to us since the assignment, the end not reached: the
                # fetcher began at the committed offset (none: the earliest one).
                first = self._committed.get(tp, -1)
                first = low if first == OFFSET_INVALID else first
            lags[tp] = None
            if high >= 0 and first >= 0:
                lags[tp] = max(high - first, 0)
                self.metrics.lag.labels(tp[0], str(tp[1])).set(lags[tp] or 0)
        return lags

    def _measure(self, consumer: Consumer, parts: Partitions,
                 tp: TP) -> tuple[tuple[int, int], int]:
        """The watermarks of ``tp`` and its first unfinished offset as far as the
        member knows it without asking the broker (-1: not known)."""
        topic, part = tp
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, part), cached=True)
        if high < 0:  # no fetch response yet: ask the broker
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, part),
                                                       timeout=ASK_SECONDS, cached=False)
        # Lag counts what is not finished: messages waiting in our queue (fetched but
        # pending) as much as those not fetched yet.
        st = parts.get(tp)
        first = st.first_offset() if st is not None else None
        done: int = (first if first is not None
                     else consumer.position([TopicPartition(topic, part)])[0].offset)
        if done < 0 and high >= 0:
            # an idle partition: the fetcher is at its end (librdkafka's end event)
            done = high if low == high else self._end.get(tp, -1)
        return (low, high), done

    def _untouched(self, consumer: Consumer, tps: list[TP]) -> None:
        """The committed offsets of the partitions nothing was fetched of yet, asked for
        once per assignment (no other member commits them while this one owns them)."""
        ask = [TopicPartition(t, p) for t, p in tps if (t, p) not in self._committed]
        if not ask:
            return
        try:
            found = consumer.committed(ask, timeout=ASK_SECONDS)
        except KafkaException:
            return  # asked again at the next observation
        for tp in found:
            if tp.error is None:
                self._committed[(tp.topic, tp.partition)] = tp.offset

    def reached_end(self, tp: TP, offset: int) -> None:
        """librdkafka's end-of-partition event: the fetcher of ``tp`` is at ``offset``,
        the end (no blocking call to ask for the committed offset in the loop)."""
        self._end[tp] = offset

    def forget(self, tps: Iterable[TP]) -> None:
        """Drop the series of partitions this member no longer has."""
        tps = list(tps)
        for tp in tps:
            self._end.pop(tp, None)
            self._committed.pop(tp, None)
        for topic, part in tps:
            with contextlib.suppress(KeyError):
                self.metrics.lag.remove(topic, str(part))


def sample_store(settings: Settings, store: Store) -> dict[str, Any]:
    """Database gauges for the sampler thread (its own short-lived connection)."""
    from kafka_idem.admin import operations as admin

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
