"""Bounded reads of a DLQ topic: ``dlq list``, ``dlq show`` and ``rerun`` read here,
and a replay reads its batches with the same helpers.

The end offsets are captured when a read starts, so a read never waits for
records that arrive later; a read that sees neither a record nor the end of a
partition for :data:`STALL_SECONDS` fails with :class:`BrokerError`. Reads are
``read_committed`` and never join or commit a group (``assign()`` only).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from kafka_idem.errors import BrokerError, ConfigError
from kafka_idem.replay.records import DlqRecord, Selection
from kafka_idem.settings import Settings

READER_GROUP = "kafka-idem-dlq-reader"  # never joined, never committed: assign() only
TIMEOUT = 30.0
STALL_SECONDS = 30.0  # no record and no end-of-partition for this long: the broker is gone
BATCH_SIZE = 500


def reader_config(settings: Settings, group: str) -> dict[str, Any]:
    conf = settings.consumer_config(group)
    # A bounded read needs to know when a partition has no more records.
    conf.update({"enable.partition.eof": True, "isolation.level": "read_committed"})
    return conf


@contextmanager
def kafka_errors(what: str, **context: Any) -> Iterator[None]:
    """Turn a confluent-kafka exception into :class:`BrokerError` (``__cause__`` kept)."""
    try:
        yield
    except KafkaException as exc:
        raise BrokerError(f"{what}: {exc}", **context) from exc


def partitions_of(consumer: Consumer, topic: str, selection: Selection) -> list[int]:
    with kafka_errors("reading topic metadata", topic=topic):
        md = consumer.list_topics(topic, timeout=TIMEOUT)
    meta = md.topics.get(topic)
    if meta is None or meta.error is not None or not meta.partitions:
        raise ConfigError(f"topic {topic!r} does not exist", setting="dlq_topic")
    parts = sorted(meta.partitions)
    if selection.partition is not None:
        if selection.partition not in parts:
            raise ConfigError(
                f"topic {topic!r} has no partition {selection.partition} "
                f"(partitions 0..{parts[-1]})",
                setting="partition",
            )
        parts = [selection.partition]
    return parts


def bounds(
    consumer: Consumer,
    topic: str,
    selection: Selection,
    resume: dict[int, int] | None = None,
) -> tuple[dict[int, int], dict[int, int]]:
    """Start and end (exclusive) offset per partition, the ends captured now."""
    starts: dict[int, int] = {}
    ends: dict[int, int] = {}
    for p in partitions_of(consumer, topic, selection):
        with kafka_errors("reading offsets", topic=topic, partition=p):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=TIMEOUT)
        start = max(low, selection.from_offset or 0, (resume or {}).get(p, -1))
        end = high if selection.to_offset is None else min(high, selection.to_offset + 1)
        starts[p], ends[p] = start, max(end, start)
    return starts, ends


def batches(
    consumer: Consumer, topic: str, starts: dict[int, int], ends: dict[int, int], size: int
) -> Iterator[list[Any]]:
    """Messages of ``[start, end)`` per partition, in batches of at most ``size``."""
    active = {p for p in starts if starts[p] < ends[p]}
    if not active:
        return
    with kafka_errors("assigning partitions", topic=topic):
        consumer.assign([TopicPartition(topic, p, starts[p]) for p in sorted(active)])
    last_progress = time.monotonic()
    while active:
        with kafka_errors("reading", topic=topic):
            msgs = consumer.consume(size, timeout=0.25)
        batch = []
        for m in msgs:
            p = m.partition()
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    active.discard(p)
                    continue
                if err.fatal() or not err.retriable():
                    raise BrokerError(f"reading: {err}", topic=topic, partition=p)
                continue
            offset = m.offset()
            if offset is None or p not in active:
                continue
            if offset >= ends[p]:
                active.discard(p)
                continue
            batch.append(m)
            if offset >= ends[p] - 1:
                active.discard(p)
        if msgs:
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > STALL_SECONDS:
            raise BrokerError("no progress reading the topic", topic=topic)
        if batch:
            yield batch


def scan(
    settings: Settings, dlq_topic: str, selection: Selection
) -> Generator[DlqRecord, None, None]:
    """The records of ``dlq_topic`` matching ``selection``, from the beginning to the end
    offsets captured when the scan starts (partition by partition in offset order)."""
    consumer = Consumer(reader_config(settings, f"{settings.name_prefix}{READER_GROUP}"))
    try:
        starts, ends = bounds(consumer, dlq_topic, selection)
        for batch in batches(consumer, dlq_topic, starts, ends, BATCH_SIZE):
            for m in batch:
                rec = DlqRecord.from_message(m)
                if selection.matches(rec):
                    yield rec
    finally:
        consumer.close()


def read_one(settings: Settings, dlq_topic: str, partition: int, offset: int) -> DlqRecord | None:
    """The record at ``partition``/``offset`` of ``dlq_topic``, or ``None``."""
    sel = Selection(partition=partition, from_offset=offset, to_offset=offset)
    found = scan(settings, dlq_topic, sel)
    try:
        return next(found, None)
    finally:
        found.close()


class Reader:
    """Reads single records by position with one consumer kept open (the console's
    record pages: no new consumer and metadata round trip per read). Not thread-safe:
    callers hold :attr:`lock`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.lock = threading.Lock()
        self._consumer: Consumer | None = None

    def read(self, topic: str, partition: int, offset: int,
             timeout: float = 10.0) -> DlqRecord | None:
        """The record at ``topic[partition]@offset``, or ``None`` when there is none
        (never written, compacted or deleted by retention, or an aborted one)."""
        if self._consumer is None:
            self._consumer = Consumer(reader_config(
                self.settings, f"{self.settings.name_prefix}{READER_GROUP}"))
        consumer = self._consumer
        try:
            with kafka_errors("reading a record", topic=topic, partition=partition):
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition),
                                                           timeout=timeout)
                if not low <= offset < high:
                    return None
                consumer.assign([TopicPartition(topic, partition, offset)])
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    m = consumer.poll(0.2)
                    if m is None:
                        continue
                    err = m.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            return None
                        if err.fatal() or not err.retriable():
                            raise BrokerError(f"reading: {err}", topic=topic,
                                              partition=partition)
                        continue
                    got = m.offset()
                    if got is None or got < offset:
                        continue
                    return DlqRecord.from_message(m) if got == offset else None
            raise BrokerError("no answer reading the record", topic=topic, partition=partition)
        except BaseException:
            self.close()  # a consumer in an unknown state is not reused
            raise

    def close(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with contextlib.suppress(Exception):
                consumer.close()


def latest_for_key(settings: Settings, dlq_topic: str, key: str,
                   namespace: str | None = None,
                   accept: Callable[[DlqRecord], bool] | None = None) -> DlqRecord | None:
    """The most recently dead-lettered record of idempotency key ``key`` (in
    ``namespace``: a record from before namespaces matches any) that ``accept``
    takes (e.g. one whose signature holds), or ``None``."""
    found = [r for r in scan(settings, dlq_topic, Selection(key=key, namespace=namespace))
             if accept is None or accept(r)]
    if not found:
        return None
    epoch = dt.datetime.min.replace(tzinfo=dt.UTC)
    return max(found, key=lambda r: (r.last_failure_at or epoch, r.timestamp or epoch, r.offset))
