"""What Kafka holds durably, read without joining or disturbing the group.

:func:`read_topic` reads every record of a topic from its low watermark to the
end offset captured at the start (the source topic, the DLQ topic and the outbox's
event topic), as :class:`KafkaRecord` values, with ``isolation.level=read_committed``
(a transactional topic is read as its downstream consumers see it: records of
aborted transactions never, the end reached at the last stable offset), under a
throw-away group id that commits nothing;
:func:`committed_offsets` asks the group's committed offsets without joining it.
:func:`patiently` repeats a read after a pause when Kafka does not answer, so a
broker restart is never taken for a verdict. :class:`CheckerError`: the state
could not be read.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

T = TypeVar("T")


class CheckerError(Exception):
    """The checker could not read the durable state it needs."""


@dataclass(frozen=True, slots=True)
class KafkaRecord:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]

    def header_map(self) -> dict[str, str]:
        return {k: v.decode("utf-8", "replace") for k, v in self.headers}


def _client_conf(bootstrap: str, kafka: Mapping[str, Any] | None) -> dict[str, Any]:
    conf = {k: v for k, v in (kafka or {}).items() if not k.startswith(("group.", "fetch."))}
    conf.update({
        "bootstrap.servers": bootstrap,
        "group.id": f"kafka-idem-checker-{uuid.uuid4().hex[:12]}",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        # the end of a transactional topic is a commit marker, never a record: EOF says it
        "enable.partition.eof": True,
        "isolation.level": "read_committed",
        "auto.offset.reset": "earliest",
        "log_level": 2,  # connection errors during a broker restart are retried, not news
    })
    return conf


def read_topic(
    bootstrap: str, topic: str, *, kafka: Mapping[str, Any] | None = None,
    timeout: float = 300.0,
) -> tuple[list[KafkaRecord], dict[int, tuple[int, int]]]:
    """Every record of ``topic`` (low watermark to end) and ``{partition: (low, high)}``."""
    consumer = Consumer(_client_conf(bootstrap, kafka))
    try:
        meta = consumer.list_topics(topic, timeout=30).topics.get(topic)
        if meta is None or meta.error is not None:
            raise CheckerError(f"topic {topic!r} not found: {meta.error if meta else 'absent'}")
        marks = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
                 for p in sorted(meta.partitions)}
        left = {p: high for p, (low, high) in marks.items() if high > low}
        consumer.assign([TopicPartition(topic, p, marks[p][0]) for p in left])
        out: list[KafkaRecord] = []
        deadline = time.monotonic() + timeout
        while left:
            if time.monotonic() > deadline:
                raise CheckerError(f"could not read {topic!r} to its end in {timeout:.0f}s: "
                                   f"partitions {sorted(left)} unfinished")
            for m in consumer.consume(2000, timeout=0.1):
                p, off = int(m.partition() or 0), int(m.offset() or 0)
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF and p in left:
                        del left[p]  # the last stable offset: nothing more to read there
                    continue
                if p not in left or off >= left[p]:
                    continue
                out.append(KafkaRecord(p, off, m.key(), m.value(), _headers(m.headers())))
                if off + 1 >= left[p]:
                    del left[p]
        return out, marks
    finally:
        consumer.close()


def _headers(raw: Any) -> tuple[tuple[str, bytes], ...]:
    out = []
    for k, v in raw or []:
        out.append((str(k), v.encode() if isinstance(v, str) else bytes(v or b"")))
    return tuple(out)


def patiently(read: Callable[[], T], attempts: int = 6, pause: float = 5.0) -> T:
    """``read()``, again after a pause when Kafka does not answer (e.g. a broker restart
    by someone else): an unreadable state is an error, never a verdict."""
    for attempt in range(attempts):
        try:
            return read()
        except (KafkaException, CheckerError):
            if attempt == attempts - 1:
                raise
            time.sleep(pause)
    raise AssertionError("unreachable")


def committed_offsets(
    bootstrap: str, group: str, topic: str, partitions: Iterable[int], *,
    kafka: Mapping[str, Any] | None = None,
) -> dict[int, int]:
    """The group's committed offset per partition (negative: none), without joining it."""
    conf = _client_conf(bootstrap, kafka)
    conf["group.id"] = group
    consumer = Consumer(conf)
    try:
        tps = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=30)
        return {tp.partition: tp.offset for tp in tps}
    finally:
        consumer.close()
