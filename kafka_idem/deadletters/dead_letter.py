"""Dead-letter records (docs/how-to/dead-letters.md).

A DLQ record keeps the original Kafka key and value bytes unchanged and adds
headers prefixed ``idem.`` (:mod:`~kafka_idem.deadletters.headers`). Error text is
bounded (no stack traces: they leak internals and payloads). The produce is acknowledged
(idempotent producer, ``acks=all``) before the source offset may be committed;
:class:`DeadLetterer` raises :class:`DeadLetterError` when it is not.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from kafka_idem.deadletters import headers as h
from kafka_idem.deadletters.signing import Signer
from kafka_idem.errors import DeadLetterError

log = logging.getLogger(__name__)

PREFIX = h.PREFIX
ERROR_KINDS = ("permanent", "exhausted", "payload_conflict", "undecodable")
# The headers every dead letter carries (the conditional ones: headers.DEAD_LETTER).
REQUIRED_HEADERS = tuple(x.name for x in h.DEAD_LETTER if x.present == h.ALWAYS)


def bounded(text: str, limit: int) -> str:
    """At most ``limit`` UTF-8 bytes, cut on a character boundary, marked when cut."""
    # A lone surrogate (an exception text made from undecodable bytes) has no UTF-8 form:
    # it is written as its escape, never allowed to fail the dead-lettering.
    data = text.encode("utf-8", "backslashreplace")
    if len(data) <= limit:
        return data.decode("utf-8") if len(data) != len(text) else text
    return data[: max(limit - 3, 0)].decode("utf-8", "ignore") + "..."


def _iso(value: dt.datetime | None) -> str:
    return (value or dt.datetime.now(dt.UTC)).astimezone(dt.UTC).isoformat()


@dataclass(frozen=True, slots=True)
class Record:
    """What is produced to the DLQ."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, str | bytes | None]]


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
    namespace: str | None = None
    first_failure_at: dt.datetime | None = None
    last_failure_at: dt.datetime | None = None
    # The processing span's context (traceparent...), when tracing is on (tracing.py):
    # it replaces the original's, which is that span's parent.
    trace: tuple[tuple[str, bytes], ...] = ()

    def record(self, limit: int) -> Record:
        """The DLQ record: the original key and value bytes and headers, plus ours."""
        return Record(self.dlq_topic, self.source.key(), self.source.value(),
                      self.headers(limit))

    def slim(self, limit: int) -> Record:
        """The record without what made it too large for Kafka: the value, the original
        headers and a key over 1 KiB are left out; ``idem.truncated`` names what was
        left out and ``idem.original.value_bytes`` / ``idem.original.value_sha256``
        identify the value (still in the source topic at ``idem.original.*``)."""
        value = self.source.value() or b""
        key = self.source.key()
        dropped = ["value"]
        if key is not None and len(key) > 1024:
            key = None
            dropped.append("key")
        every = self.headers(limit)
        ours = [(k, v) for k, v in every if k.startswith(PREFIX)]
        if len(ours) < len(every):
            dropped.append("headers")
        extra: list[tuple[str, str | bytes | None]] = [
            (h.TRUNCATED.name, ",".join(dropped).encode()),
            (h.VALUE_BYTES.name, str(len(value)).encode()),
            (h.VALUE_SHA256.name, hashlib.sha256(value).hexdigest().encode()),
        ]
        return Record(self.dlq_topic, key, b"", ours + extra)

    def headers(self, limit: int) -> list[tuple[str, str | bytes | None]]:
        ts_type, ts = self.source.timestamp()
        pairs: list[tuple[str, str]] = [
            (h.ORIGINAL_TOPIC.name, self.source.topic()),
            (h.ORIGINAL_PARTITION.name, str(self.source.partition())),
            (h.ORIGINAL_OFFSET.name, str(self.source.offset())),
            (h.ORIGINAL_TIMESTAMP.name, str(ts if ts_type else -1)),
            (h.ERROR_KIND.name, self.kind),
            (h.ERROR_CLASS.name, bounded(self.error_class, 200)),
            (h.ERROR_MESSAGE.name, bounded(self.error_message, limit)),
            (h.ATTEMPTS.name, str(self.attempts)),
            (h.FIRST_FAILURE_AT.name, _iso(self.first_failure_at)),
            (h.LAST_FAILURE_AT.name, _iso(self.last_failure_at)),
            (h.CONSUMER_GROUP.name, self.consumer_group),
            (h.HANDLER.name, self.handler),
        ]
        if self.namespace is not None:
            pairs.append((h.NAMESPACE.name, self.namespace))
        if self.idempotency_key is not None:
            # Never cut: ``rerun`` and ``dlq list --key`` look keys up by their exact text
            # (their length is bounded by key_max_bytes before they exist).
            pairs.append((h.KEY.name, self.idempotency_key))
        # The original headers travel along, except our own from an earlier DLQ trip.
        original: list[tuple[str, str | bytes | None]] = [
            # replay lineage stays: a replayed message that fails again says so
            (k, v or b"")
            for k, v in (self.source.headers() or [])
            if (not k.startswith(PREFIX) or k.startswith("idem.replay."))
            and not (self.trace and k.lower() in ("traceparent", "tracestate"))
        ]
        original += list(self.trace)
        return original + [(k, v.encode("utf-8")) for k, v in pairs]


class DeadLetterer:
    """Produces DLQ records and waits for their acknowledgements."""

    def __init__(self, producer: Producer, *, header_limit: int, timeout: float = 30.0,
                 signing_keys: Sequence[bytes] = ()) -> None:
        """``signing_keys``: the ``dlq_signing_keys`` setting; the first signs each record."""
        self.producer = producer
        self.header_limit = header_limit
        self.timeout = timeout
        self.signer = Signer(signing_keys) if signing_keys else None

    def _signed(self, rec: Record) -> Record:
        if self.signer is None:
            return rec
        signature = self.signer.header(rec.headers, rec.key, rec.value)
        return Record(rec.topic, rec.key, rec.value, [*rec.headers, signature])

    def send(self, letters: Sequence[DeadLetter]) -> list[BaseException | None]:
        """Produce all, flush, and return per letter ``None`` (acknowledged) or the error.

        A letter too large for the producer or the broker (a value near the size
        limit plus our headers) is sent again without its payload: see
        :meth:`DeadLetter.slim`. Every message thus ends on the DLQ, and the
        record says what it lacks."""
        outcome = self._send([self._signed(letter.record(self.header_limit))
                              for letter in letters])
        too_big = [i for i, err in enumerate(outcome) if _too_large(err)]
        if too_big:
            again = self._send([self._signed(letters[i].slim(self.header_limit))
                                for i in too_big])
            for i, err in zip(too_big, again, strict=True):
                outcome[i] = err
        return [
            None if err is None else DeadLetterError(
                _reason(err), dlq_topic=letters[i].dlq_topic,
                offset=letters[i].source.offset())
            for i, err in enumerate(outcome)
        ]

    def _send(self, records: Sequence[Record]) -> list[KafkaError | BaseException | None]:
        outcome: list[KafkaError | BaseException | None] = [None] * len(records)
        pending = set(range(len(records)))

        def report(index: int) -> Any:
            def on_delivery(err: KafkaError | None, _msg: Message) -> None:
                pending.discard(index)
                outcome[index] = err

            return on_delivery

        for i, rec in enumerate(records):
            try:
                self.producer.produce(
                    rec.topic, key=rec.key, value=rec.value, headers=rec.headers,
                    on_delivery=report(i),
                )
            except KafkaException as exc:  # e.g. over message.max.bytes, checked locally
                pending.discard(i)
                outcome[i] = exc.args[0] if exc.args else exc
            except Exception as exc:  # BufferError (queue full), TypeError...
                pending.discard(i)
                outcome[i] = exc
        self.producer.flush(self.timeout)
        for i in pending:
            outcome[i] = TimeoutError("not acknowledged in time")
        return outcome


def _too_large(err: KafkaError | BaseException | None) -> bool:
    return isinstance(err, KafkaError) and err.code() == KafkaError.MSG_SIZE_TOO_LARGE


def _reason(err: KafkaError | BaseException) -> str:
    if isinstance(err, KafkaError):
        kind = "permanent" if not err.retriable() else "retriable"
        return f"{err.name()} ({kind}): {err.str()}"
    return f"{type(err).__name__}: {err}"
