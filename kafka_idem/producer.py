"""Producing messages the way a handler reads them: :meth:`kafka_idem.App.producer`.

    with app.producer() as producer:
        producer.send("inventory.reserve", Reserve(shop="s1", order_id="o-1", sku="k", qty=2))
        producer.send("inventory.reserve", {"shop": "s1", "order_id": "o-2", "sku": "k", "qty": 1})
    # leaving the block flushes: DeliveryFailed if Kafka did not acknowledge a record

Each payload (a model instance, or a mapping the model accepts) is encoded with the
topic's handler's codec (JSON, Avro single-object, registry, or the handler's own),
then decoded back the way the consumer will decode it, so a payload the handler
could never read (a missing field, a key field left blank, a key over
``key_max_bytes``) fails here, in the producer, and is never sent.

**The Kafka key is the message's idempotency key** (UTF-8), unless ``key=`` says
otherwise. Every delivery of one business intent — a producer retry, a resend with a
new request id, a replay — then lands in one partition, in order, behind the first:
its duplicate is answered by the stored result on the member that owns the partition
instead of racing another member for the same record (which would wait, ``busy``, and
retry). Pass ``key=`` (bytes or str) to partition by something else, e.g. by order id
when different operations on one order must stay in order, or ``key=None`` for no key.

The producer is idempotent with ``acks=all`` (the settings' ``producer_config``, with
``KAFKA_IDEM_KAFKA`` options such as SASL/TLS): a broker-side retry never doubles a
record. A topic the cluster lacks is refused by the first :meth:`Producer.send` to it
at once, saying so (librdkafka would hold its records until they time out).
:meth:`Producer.flush` waits for every acknowledgement and raises
:class:`~kafka_idem.errors.DeliveryFailed` naming the records that failed.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka import Producer as KafkaProducer

from kafka_idem.codecs.base import validate
from kafka_idem.errors import ConfigError, DeliveryFailed
from kafka_idem.keys import check_key

if TYPE_CHECKING:
    from kafka_idem.handler import Handler
    from kafka_idem.settings import Settings


class _Key:
    """The default of ``send(key=...)``: the idempotency key."""


IDEMPOTENCY_KEY: Any = _Key()


class Producer:
    """Sends payloads to handlers' topics, encoded with their codecs and keyed by their
    idempotency keys (module docs). Not thread-safe; one per thread.

    ``handlers``: an app's handlers by topic (read at each :meth:`send`); ``settings``:
    its settings (``producer_config()``, ``key_max_bytes``); ``app``: its name, for
    errors; ``config``: librdkafka options over ``producer_config()``."""

    def __init__(self, handlers: Mapping[str, Handler[Any]], settings: Settings, *, app: str,
                 config: Mapping[str, Any] | None = None, timeout: float = 30.0) -> None:
        self.handlers = handlers
        self.settings = settings
        self.app_name = app
        self.timeout = timeout
        conf = {**settings.producer_config(), **(config or {})}
        self._producer = KafkaProducer(conf)
        self._failures: list[tuple[str, bytes | None, str]] = []
        self._existing: set[str] = set()  # topics the cluster was seen to have
        self.sent = 0  # acknowledged since the producer was made

    def send(
        self, topic: str, payload: Any, *, key: bytes | str | None = IDEMPOTENCY_KEY,
        headers: Mapping[str, bytes | str] | None = None, partition: int | None = None,
    ) -> str:
        """Queue ``payload`` for ``topic`` (whose handler's codec encodes it); return its
        idempotency key. The record is sent in the background: :meth:`flush` (or leaving
        the ``with`` block) waits for its acknowledgement."""
        handler = self.handlers.get(topic)
        if handler is None:
            raise ConfigError(
                f"no handler of app {self.app_name!r} reads topic {topic!r}: the producer "
                f"encodes with the topic's handler (topics: {', '.join(self.handlers)})",
                setting="topic")
        if isinstance(payload, Mapping) and isinstance(handler.format, str | None):
            # a built-in codec: the mapping becomes the model first, as the consumer will
            # see it (InvalidPayload names the fields, never their values)
            payload = validate(handler.adapter, payload, fmt=handler.codec.name)
        value = handler.encode(payload)
        # What the consumer will make of these bytes: a payload it could not read fails
        # here (InvalidPayload, MissingKeyField, InvalidKey), before it is sent.
        model = handler.decode(value)
        idem_key = check_key(handler.key.build(model), self.settings.key_max_bytes,
                             escaped=handler.key.escapes)
        kafka_key = idem_key.encode() if key is IDEMPOTENCY_KEY else key
        self._check_topic(topic, kafka_key)
        kwargs: dict[str, Any] = {"key": kafka_key, "value": value, "on_delivery": self._report}
        if headers:
            kwargs["headers"] = list(headers.items())
        if partition is not None:
            kwargs["partition"] = partition
        while True:
            try:
                self._producer.produce(topic, **kwargs)
                break
            except BufferError:  # the local queue is full: let deliveries drain first
                self._producer.poll(0.5)
            except KafkaException as exc:  # e.g. over message.max.bytes, checked locally
                raise DeliveryFailed(f"cannot send to {topic!r}: {exc.args[0]}",
                                     failures=[(topic, kafka_key if isinstance(kafka_key, bytes)
                                                else None, str(exc.args[0]))]) from exc
        self._producer.poll(0)
        return idem_key

    def _check_topic(self, topic: str, key: Any) -> None:
        """Refuse at once a topic the cluster does not have (once seen, a topic is not
        asked about again): librdkafka would hold its records until they time out and
        then say only that. A broker not answering leaves it to the delivery."""
        if topic in self._existing:
            return
        try:
            meta = self._producer.list_topics(topic, timeout=self.timeout)
        except KafkaException:
            return
        found = meta.topics.get(topic)
        if found is None or found.error is None:
            self._existing.add(topic)
            return
        if found.error.code() in _ABSENT:
            raise DeliveryFailed(_absent(topic), failures=[
                (topic, key if isinstance(key, bytes) else None, found.error.str())])

    def _report(self, err: KafkaError | None, msg: Any) -> None:
        if err is None:
            self.sent += 1
        elif err.code() in _ABSENT:
            self._failures.append((msg.topic(), msg.key(), _absent(msg.topic())))
        else:
            self._failures.append((msg.topic(), msg.key(), err.str()))

    def flush(self, timeout: float | None = None) -> int:
        """Wait until every queued record is acknowledged; return how many records were
        acknowledged so far. Raise :class:`DeliveryFailed` if any was not (the failures
        are reported once)."""
        wait = self.timeout if timeout is None else timeout
        left = self._producer.flush(wait)
        failures, self._failures = self._failures, []
        if failures:
            topic, _key, error = failures[0]
            raise DeliveryFailed(
                f"{len(failures)} record(s) not delivered (first: topic {topic!r}: {error})"
                + (f"; {left} more still unacknowledged" if left else ""), failures=failures)
        if left:
            raise DeliveryFailed(f"{left} record(s) not acknowledged within {wait:g} s")
        return self.sent

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.flush()


_ABSENT = (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC)


def _absent(topic: str) -> str:
    return (f"topic {topic!r} does not exist: create it first (`kafka-idem topics create "
            "MODULE:APP` creates an app's topics)")


__all__ = ["IDEMPOTENCY_KEY", "Producer"]
