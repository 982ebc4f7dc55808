"""The marker: a record on the shard's partition of the control topic, in the same
Kafka transaction as the events it lists, naming the outbox ids that transaction
published. A relay taking a shard over reads the last committed one
(``read_committed``) and deletes its ids before publishing anything: they are the
only rows that can have been published and not deleted (a relay deletes a round's
rows before it starts the next), so a crash between the Kafka commit and the
database delete never republishes.

The control topic is compacted and every marker has the same key, so a partition
keeps about one record however long the relay runs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

log = logging.getLogger(__name__)

KEY = b"kafka-idem-outbox-marker"


def ranges(ids: Sequence[int]) -> list[list[int]]:
    """``ids`` as inclusive ``[first, last]`` runs (a round's ids are mostly consecutive)."""
    out: list[list[int]] = []
    for i in sorted(ids):
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def encode(shard: int, ids: Sequence[int], *, outbox: str, owner: str) -> bytes:
    return json.dumps({"v": 1, "outbox": outbox, "shard": shard, "ids": ranges(ids),
                       "relay": owner}, separators=(",", ":")).encode()


def decode(data: bytes, outbox: str) -> list[int]:
    """The ids a marker lists, if it is a marker of ``outbox`` (else none: the ids of
    another database's outbox name other rows)."""
    doc = json.loads(data)
    if doc.get("outbox") != outbox:
        log.warning("the last outbox marker names outbox %r, not this one (%r): ignored",
                    doc.get("outbox"), outbox, extra={"action": "outbox_marker"})
        return []
    return [i for first, last in doc["ids"] for i in range(first, last + 1)]


def last_marker(consumer: Consumer, topic: str, shard: int, *, outbox: str,
                timeout: float) -> list[int]:
    """The ids of ``outbox``'s last committed marker on ``topic[shard]`` (``[]``: none).

    ``consumer`` reads ``read_committed`` with ``enable.partition.eof``: markers of
    aborted transactions (a fenced zombie's) are never seen. It reads the tail of
    the partition, a window growing until a marker is found or the start reached."""
    deadline = time.monotonic() + timeout
    low, high = consumer.get_watermark_offsets(TopicPartition(topic, shard), timeout=timeout,
                                               cached=False)
    if high <= low:
        return []
    window = 64
    while True:
        start = max(low, high - window)
        found = _scan(consumer, TopicPartition(topic, shard, start), deadline)
        if found is not None:
            return decode(found, outbox)
        if start == low:
            return []
        window *= 8


def _scan(consumer: Consumer, tp: TopicPartition, deadline: float) -> bytes | None:
    """The value of the last marker from ``tp``'s offset to the partition's end."""
    consumer.assign([tp])
    last: bytes | None = None
    try:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading the last outbox marker of {tp.topic}[{tp.partition}]")
            msg: Any = consumer.poll(0.2)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    return last
                raise KafkaException(err)
            if msg.key() == KEY:
                last = msg.value()
    finally:
        consumer.unassign()
