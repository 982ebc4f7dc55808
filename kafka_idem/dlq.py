"""Dead-letter records (DESIGN §6).

A DLQ record keeps the original Kafka key and value bytes unchanged and adds
headers prefixed ``idem.`` (see :data:`REQUIRED_HEADERS`). Error text is bounded
(no stack traces: PITFALLS 7). The produce is acknowledged (idempotent producer,
``acks=all``) before the source offset may be committed; :class:`DeadLetterer`
raises :class:`DeadLetterError` when it is not.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from kafka_idem.errors import DeadLetterError

log = logging.getLogger(__name__)

PREFIX = "idem."
ERROR_KINDS = ("permanent", "exhausted", "payload_conflict", "undecodable")
REQUIRED_HEADERS = (
    "idem.original.topic",
    "idem.original.partition",
    "idem.original.offset",
    "idem.original.timestamp",
    "idem.error.kind",
    "idem.error.class",
    "idem.error.message",
    "idem.attempts",
    "idem.first_failure_at",
    "idem.last_failure_at",
    "idem.consumer_group",
    "idem.handler",
)
# Also set when a key could be built: "idem.key".


def bounded(text: str, limit: int) -> str:
    """At most ``limit`` UTF-8 bytes, cut on a character boundary, marked when cut."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    return data[: max(limit - 3, 0)].decode("utf-8", "ignore") + "..."


def _iso(value: dt.datetime | None) -> str:
    return (value or dt.datetime.now(dt.UTC)).astimezone(dt.UTC).isoformat()


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One record to dead-letter, with everything its headers need."""

    dlq_topic: str
    source: Any  # confluent_kafka.Message (or a fake with the same methods)
    kind: str
    error_class: str
    error_message: str
    attempts: int
    consumer_group: str
    handler: str
    idempotency_key: str | None = None
    first_failure_at: dt.datetime | None = None
    last_failure_at: dt.datetime | None = None

    def headers(self, limit: int) -> list[tuple[str, str | bytes | None]]:
        ts_type, ts = self.source.timestamp()
        pairs: list[tuple[str, str]] = [
            ("idem.original.topic", self.source.topic()),
            ("idem.original.partition", str(self.source.partition())),
            ("idem.original.offset", str(self.source.offset())),
            ("idem.original.timestamp", str(ts if ts_type else -1)),
            ("idem.error.kind", self.kind),
            ("idem.error.class", bounded(self.error_class, 200)),
            ("idem.error.message", bounded(self.error_message, limit)),
            ("idem.attempts", str(self.attempts)),
            ("idem.first_failure_at", _iso(self.first_failure_at)),
            ("idem.last_failure_at", _iso(self.last_failure_at)),
            ("idem.consumer_group", self.consumer_group),
            ("idem.handler", self.handler),
        ]
        if self.idempotency_key is not None:
            pairs.append(("idem.key", bounded(self.idempotency_key, 1024)))
        # The original headers travel along, except our own from an earlier DLQ trip.
        original: list[tuple[str, str | bytes | None]] = [
            # replay lineage stays: a replayed message that fails again says so
            (k, v or b"")
            for k, v in (self.source.headers() or [])
            if not k.startswith(PREFIX) or k.startswith("idem.replay.")
        ]
        return original + [(k, v.encode("utf-8")) for k, v in pairs]


class DeadLetterer:
    """Produces DLQ records and waits for their acknowledgements."""

    def __init__(self, producer: Producer, *, header_limit: int, timeout: float = 30.0) -> None:
        self.producer = producer
        self.header_limit = header_limit
        self.timeout = timeout

    def send(self, letters: Sequence[DeadLetter]) -> list[BaseException | None]:
        """Produce all, flush, and return per letter ``None`` (acknowledged) or the error."""
        outcome: list[BaseException | None] = [None] * len(letters)
        pending = set(range(len(letters)))

        def report(index: int) -> Any:
            def on_delivery(err: KafkaError | None, _msg: Message) -> None:
                pending.discard(index)
                if err is not None:
                    outcome[index] = DeadLetterError(str(err), dlq_topic=letters[index].dlq_topic)

            return on_delivery

        for i, letter in enumerate(letters):
            try:
                self.producer.produce(
                    letter.dlq_topic,
                    key=letter.source.key(),
                    value=letter.source.value(),
                    headers=letter.headers(self.header_limit),
                    on_delivery=report(i),
                )
            except (BufferError, Exception) as exc:  # KafkaException, BufferError
                pending.discard(i)
                outcome[i] = DeadLetterError(str(exc), dlq_topic=letter.dlq_topic)
        self.producer.flush(self.timeout)
        for i in pending:
            outcome[i] = DeadLetterError("not acknowledged in time", dlq_topic=letters[i].dlq_topic)
        return outcome
