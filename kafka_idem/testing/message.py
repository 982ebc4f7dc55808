"""A delivered Kafka message without Kafka: what the message path reads of one.

The path reads a message through the :class:`~kafka_idem.consume.outcome.Message`
protocol (``topic()``, ``partition()``, ``offset()``, ``key()``, ``value()``,
``headers()``, ``timestamp()``), so a :class:`FakeMessage` goes wherever a
``confluent_kafka.Message`` does: the processor, the dead-letter headers, the
partition bookkeeping.

    >>> msg = FakeMessage("orders", offset=7, key="o-1", value=b'{"id": 1}')
    >>> (msg.topic(), msg.partition(), msg.offset(), msg.key())
    ('orders', 0, 7, b'o-1')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# confluent_kafka's timestamp types: (TIMESTAMP_NOT_AVAILABLE, -1) when there is none
TIMESTAMP_NOT_AVAILABLE = 0
TIMESTAMP_CREATE_TIME = 1

Headers = Mapping[str, str | bytes | None] | Sequence[tuple[str, str | bytes | None]]


def _bytes(value: str | bytes | None) -> bytes | None:
    return value.encode("utf-8") if isinstance(value, str) else value


@dataclass(frozen=True, slots=True, init=False)
class FakeMessage:
    """A message as a consumer receives it. ``key``, ``value`` and header values may be
    given as text (UTF-8 encoded here); ``headers`` as a mapping or as pairs (Kafka
    allows a name twice); ``timestamp`` in epoch milliseconds (a create time), or
    ``None`` for a message without one."""

    _topic: str
    _partition: int
    _offset: int
    _key: bytes | None
    _value: bytes | None
    _headers: tuple[tuple[str, bytes | None], ...] | None
    _timestamp: tuple[int, int]

    def __init__(
        self,
        topic: str,
        *,
        partition: int = 0,
        offset: int = 0,
        key: str | bytes | None = None,
        value: str | bytes | None = None,
        headers: Headers | None = None,
        timestamp: int | None = None,
    ) -> None:
        pairs = None
        if headers is not None:
            items = headers.items() if isinstance(headers, Mapping) else headers
            pairs = tuple((str(name), _bytes(v)) for name, v in items)
        stamp = ((TIMESTAMP_NOT_AVAILABLE, -1) if timestamp is None
                 else (TIMESTAMP_CREATE_TIME, int(timestamp)))
        for name, value_ in (("_topic", topic), ("_partition", partition), ("_offset", offset),
                             ("_key", _bytes(key)), ("_value", _bytes(value)),
                             ("_headers", pairs), ("_timestamp", stamp)):
            object.__setattr__(self, name, value_)

    def topic(self) -> str:
        """The topic it was read from."""
        return self._topic

    def partition(self) -> int:
        """Its partition."""
        return self._partition

    def offset(self) -> int:
        """Its offset."""
        return self._offset

    def key(self) -> bytes | None:
        """The Kafka key bytes (``None``: no key)."""
        return self._key

    def value(self) -> bytes | None:
        """The value bytes (``None``: a tombstone)."""
        return self._value

    def headers(self) -> list[tuple[str, bytes | None]] | None:
        """A copy of its headers (``None``: it has none)."""
        return None if self._headers is None else list(self._headers)

    def timestamp(self) -> tuple[int, int]:
        """``(timestamp type, milliseconds since the epoch)``, as confluent_kafka's."""
        return self._timestamp

    def error(self) -> None:
        """A delivered message carries no error (the consumer loop asks)."""
        return None

    def moved(self, *, partition: int | None = None, offset: int | None = None) -> FakeMessage:
        """The same bytes at another position (a producer's retry is a new record)."""
        ts_type, ts = self._timestamp
        return FakeMessage(
            self._topic,
            partition=self._partition if partition is None else partition,
            offset=self._offset if offset is None else offset,
            key=self._key, value=self._value, headers=self._headers,
            timestamp=ts if ts_type != TIMESTAMP_NOT_AVAILABLE else None,
        )
