"""Producing a dead letter again: where it goes, the lineage headers it carries,
and the pace (a token bucket for ``--rate``).

Used by a replay run and by ``kafka-idem rerun``. Key and value bytes go out
unchanged; the ``idem.*`` failure headers are replaced by ``idem.replay.*``
lineage (when, by whom, from which DLQ record).

``flush()`` returning 0 only says nothing is queued any more, not that the broker
took the records: :class:`Deliveries` latches every delivery report, and
:func:`republish_acknowledged` raises unless the one record was acknowledged.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Producer

from kafka_idem.deadletters import headers as h
from kafka_idem.deadletters.dead_letter import PREFIX
from kafka_idem.errors import BrokerError, ConfigError
from kafka_idem.observe import tracing
from kafka_idem.replay.reading import kafka_errors
from kafka_idem.replay.records import REPLAY_GROUP, DlqRecord, Header


def replay_headers(
    record: DlqRecord, *, actor: str, at: dt.datetime | None = None, group: str | None = None
) -> list[Header]:
    """The record's original headers (no ``idem.*``) plus the ``idem.replay.*`` lineage;
    ``group``: the replay that sends it (its re-dead-letter, kept with the lineage, is
    then one that replay never sends again)."""
    kept = [(k, v) for k, v in record.headers if not k.startswith(PREFIX)]
    lineage = {
        h.REPLAY_AT.name: (at or dt.datetime.now(dt.UTC)).astimezone(dt.UTC).isoformat(),
        h.REPLAY_BY.name: actor,
        h.REPLAY_SOURCE_TOPIC.name: record.dlq_topic,
        h.REPLAY_SOURCE_PARTITION.name: str(record.partition),
        h.REPLAY_SOURCE_OFFSET.name: str(record.offset),
    }
    if group is not None:
        lineage[REPLAY_GROUP] = group
    return kept + [(k, v.encode("utf-8")) for k, v in lineage.items()]


def target_of(record: DlqRecord, to_topic: str | None) -> str:
    target = to_topic or record.original_topic
    if not target:
        raise ConfigError(
            f"{record.dlq_topic}[{record.partition}]@{record.offset} has no "
            "idem.original.topic header; choose a target with --to",
            setting="to_topic",
        )
    return target


def republish(
    producer: Producer,
    record: DlqRecord,
    *,
    to_topic: str | None = None,
    actor: str,
    on_delivery: Callable[[Any, Any], None] | None = None,
    group: str | None = None,
) -> None:
    """Produce ``record`` again: key and value bytes unchanged, lineage headers added.

    Back to the original topic it goes to its original partition, so it stays in
    order with the other messages of its key whatever partitioner their producer
    used; to another topic (``to_topic``) the producer's partitioner decides. The
    caller flushes (or commits its transaction).
    """
    target = target_of(record, to_topic)
    with tracing.replaying(record, target) as trace_headers:  # a span when tracing is on
        kwargs: dict[str, Any] = {
            "key": record.key,
            "value": record.value,
            "headers": tracing.with_trace(replay_headers(record, actor=actor, group=group),
                                          trace_headers),
        }
        if to_topic is None and record.original_partition is not None:
            kwargs["partition"] = record.original_partition
        if on_delivery is not None:
            kwargs["on_delivery"] = on_delivery
        producer.produce(target, **kwargs)


class Deliveries:
    """An ``on_delivery`` callback that latches each delivery report."""

    def __init__(self) -> None:
        self.acked = 0
        self.errors: list[str] = []

    def __call__(self, err: Any, msg: Any) -> None:
        if err is None:
            self.acked += 1
            return
        where = f"{msg.topic()}[{msg.partition()}]" if msg is not None else "a record"
        reason = err.str() if hasattr(err, "str") else str(err)
        self.errors.append(f"{where}: {reason}")

    def check(self, sent: int, what: str, **context: Any) -> None:
        """Raise :class:`BrokerError` unless all ``sent`` records were acknowledged."""
        if self.errors:
            raise BrokerError(
                f"{what}: the broker refused {len(self.errors)} of {sent} record(s): "
                f"{self.errors[0]}", **context,
            )
        if self.acked < sent:
            raise BrokerError(
                f"{what}: {sent - self.acked} of {sent} record(s) not acknowledged in time",
                **context,
            )


def delivery_wait(producer_config: dict[str, Any]) -> float:
    """Seconds within which librdkafka reports every delivery (``message.timeout.ms``,
    or its alias ``delivery.timeout.ms``), plus a margin."""
    ms = producer_config.get("message.timeout.ms", producer_config.get("delivery.timeout.ms",
                                                                        300_000))
    return float(ms) / 1000 + 10


def republish_acknowledged(
    producer: Producer, record: DlqRecord, *, actor: str, timeout: float,
    to_topic: str | None = None,
) -> str:
    """:func:`republish` one record and wait for its delivery report; return the target.

    Raises :class:`BrokerError` when the broker refused the record or did not
    acknowledge it within ``timeout`` seconds (see :func:`delivery_wait`).
    """
    target = target_of(record, to_topic)
    what = (f"republishing {record.dlq_topic}[{record.partition}]@{record.offset} "
            f"to {target}")
    deliveries = Deliveries()
    with kafka_errors(what):
        republish(producer, record, to_topic=to_topic, actor=actor, on_delivery=deliveries)
        producer.flush(timeout)
    deliveries.check(1, what)
    return target


class TokenBucket:
    """At most ``rate`` acquisitions per second on average, bursts up to ``burst``.

    Tokens refill continuously at ``rate``/s up to ``burst`` (default: one second's
    worth, at least 1); :meth:`acquire` sleeps until a token is there. With
    ``rate=10``: 10 records go at once, then one every 0.1 s.
    """

    def __init__(
        self,
        rate: float,
        *,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rate <= 0:
            raise ConfigError("rate must be > 0 records per second", setting="rate")
        self.rate = rate
        self.burst = max(1.0, burst if burst is not None else rate)
        self.tokens = 1.0  # the first record goes at once, no burst at start-up
        self.clock = clock
        self.sleep = sleep
        self.last = clock()

    def acquire(self) -> None:
        while True:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                return
            self.sleep((1.0 - self.tokens) / self.rate)
