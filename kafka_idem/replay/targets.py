"""Whether a replay's target can take a record, asked before the record's key is re-run.

A record the broker refuses would abort the replay's Kafka transaction, and with it
every other record of the batch, run after run. So each record's target is checked
against the cluster's metadata when the batch is decided (:meth:`Targets.unsendable`:
the topic exists, the partition a record goes back to exists, the record is not
larger than the topic takes); what only the broker can say (not authorised, a topic
deleted meanwhile) is found when the batch is produced, and :func:`fault_of` says
whether a delivery error is the record's or its target's own (set that record
aside) or the broker's (stop the run).
"""

from __future__ import annotations

import logging
from typing import Any

from confluent_kafka import Consumer, KafkaError
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
)

from kafka_idem.replay.reading import TIMEOUT, kafka_errors
from kafka_idem.replay.records import DlqRecord
from kafka_idem.replay.republishing import replay_headers

log = logging.getLogger(__name__)

# Refusals that name the record's target: every record for it fails alike.
TARGET_FAULTS = frozenset({
    KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION,
    KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.TOPIC_EXCEPTION,
    KafkaError.POLICY_VIOLATION,
})
# Refusals of one record (or of the request it shared with others: see run._produce).
RECORD_FAULTS = frozenset({
    KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE, KafkaError.INVALID_RECORD,
    KafkaError._INVALID_ARG, KafkaError.UNSUPPORTED_COMPRESSION_TYPE,
})
# A record batch's fixed header, and a record's own framing and per-header framing
# at their largest (varints): what a record costs the topic's max.message.bytes
# beyond its bytes, sent alone. Tracing replaces the record's traceparent with the
# replay span's (as long) and may add a short tracestate. An estimate a little high
# refuses only records within these bytes of the limit; one too low is found by the
# broker at produce time.
BATCH_OVERHEAD = 61
RECORD_OVERHEAD = 40
HEADER_OVERHEAD = 10
TRACE_ALLOWANCE = 128


def fault_of(err: Any) -> str | None:
    """``"target"``, ``"record"``, or ``None`` (the broker's or the transaction's: the
    run stops) for a delivery error or a :class:`KafkaError` raised by ``produce()``."""
    if not isinstance(err, KafkaError):
        return "record" if isinstance(err, TypeError | ValueError) else None
    if err.code() in TARGET_FAULTS:
        return "target"
    if err.code() in RECORD_FAULTS:
        return "record"
    return None


def reason_of(err: Any) -> str:
    """A refusal as one short reason: the error's name and text."""
    if isinstance(err, KafkaError):
        return f"{err.name()}: {err.str()}"
    return f"{type(err).__name__}: {err}"


class Targets:
    """The cluster's view of a replay's targets, read once per topic."""

    def __init__(self, consumer: Consumer, admin_config: dict[str, Any], *,
                 compressed: bool, actor: str = "", group: str = "") -> None:
        self.consumer = consumer
        self.admin_config = admin_config
        # With compression the broker checks compressed sizes: only it can tell.
        self.compressed = compressed
        self.actor = actor
        self.group = group
        self._partitions: dict[str, int | None] = {}
        self._max_bytes: dict[str, int | None] = {}

    def partitions(self, topic: str) -> int | None:
        """How many partitions ``topic`` has; ``None`` when it does not exist."""
        if topic not in self._partitions:
            with kafka_errors("reading topic metadata", topic=topic):
                md = self.consumer.list_topics(topic, timeout=TIMEOUT)
            meta = md.topics.get(topic)
            ok = meta is not None and meta.error is None and bool(meta.partitions)
            self._partitions[topic] = len(meta.partitions) if ok and meta is not None else None
        return self._partitions[topic]

    def max_bytes(self, topic: str) -> int | None:
        """The topic's ``max.message.bytes``; ``None`` when it cannot be read (the
        broker then says so at produce time)."""
        if topic not in self._max_bytes:
            self._max_bytes[topic] = self._read_max_bytes(topic)
        return self._max_bytes[topic]

    def _read_max_bytes(self, topic: str) -> int | None:
        try:
            client = AdminClient(self.admin_config)
            resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
            config = client.describe_configs([resource], request_timeout=TIMEOUT)
            entry = next(iter(config.values())).result(timeout=TIMEOUT)["max.message.bytes"]
            return int(entry.value)
        except Exception as exc:  # no DescribeConfigs right: the produce finds out
            log.debug("could not read max.message.bytes of %s: %s", topic, exc)
            return None

    def size(self, rec: DlqRecord) -> int:
        """The bytes ``rec`` takes sent again alone (its lineage headers in place of its
        ``idem.*`` ones): what a topic's ``max.message.bytes`` is held against."""
        headers = replay_headers(rec, actor=self.actor, group=self.group or None)
        return (BATCH_OVERHEAD + RECORD_OVERHEAD + TRACE_ALLOWANCE + len(rec.key or b"")
                + len(rec.value or b"")
                + sum(HEADER_OVERHEAD + len(k.encode()) + len(v or b"") for k, v in headers))

    def unsendable(self, rec: DlqRecord, target: str, *, to_topic: str | None) -> str | None:
        """Why ``target`` cannot take ``rec``, or ``None``."""
        count = self.partitions(target)
        if count is None:
            return f"no_topic: topic {target!r} does not exist"
        part = rec.original_partition
        if to_topic is None and part is not None and not 0 <= part < count:
            return (f"no_partition: {target!r} has no partition {part} "
                    f"(partitions 0..{count - 1})")
        limit = None if self.compressed else self.max_bytes(target)
        if limit is not None and (size := self.size(rec)) > limit:
            return (f"too_large: about {size} bytes, over {target!r}'s max.message.bytes "
                    f"of {limit}")
        return None
