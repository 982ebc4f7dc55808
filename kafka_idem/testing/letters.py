"""Dead letters captured in memory, written by the framework's own DLQ code.

The runner hands a unit's results to :func:`~kafka_idem.consume.send_letters.send_letters`,
which produces each dead letter through a
:class:`~kafka_idem.deadletters.dead_letter.DeadLetterer` and waits for its
acknowledgement. The kit does the same with a producer that keeps the records instead
of sending them, so a captured letter has exactly the key, value and ``idem.*`` headers
a consumer would write to the DLQ topic.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from kafka_idem.consume.outcome import Result
from kafka_idem.consume.partitions import TP
from kafka_idem.consume.send_letters import send_letters
from kafka_idem.deadletters.dead_letter import PREFIX, DeadLetterer
from kafka_idem.observe.metrics import Metrics
from kafka_idem.testing.message import FakeMessage


class CapturedLetter(FakeMessage):
    """One record a consumer would have produced to a dead-letter topic, read like a
    ``confluent_kafka.Message`` (``topic()``, ``key()``, ``value()``, ``headers()``;
    ``offset()`` counts the records of its topic from 0)."""

    __slots__ = ()

    def header(self, name: str) -> str | None:
        """The (last) value of header ``name`` as text, or ``None`` when absent."""
        found = [v for k, v in self.headers() or () if k == name]
        return None if not found else (found[-1] or b"").decode("utf-8", "replace")

    @property
    def idem(self) -> dict[str, str]:
        """The ``idem.*`` headers as text, e.g. ``letter.idem["idem.error.kind"]``."""
        return {k: (v or b"").decode("utf-8", "replace") for k, v in self.headers() or ()
                if k.startswith(PREFIX)}

    @property
    def kind(self) -> str | None:
        """``idem.error.kind``: permanent, exhausted, payload_conflict or undecodable."""
        return self.header("idem.error.kind")


class MemoryProducer:
    """The two calls :class:`~kafka_idem.deadletters.dead_letter.DeadLetterer` makes of a
    ``confluent_kafka.Producer``, acknowledging every record on ``flush()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[CapturedLetter, Callable[[Any, Any], None] | None]] = []
        self._offsets: dict[str, int] = {}
        self.records: list[CapturedLetter] = []

    def produce(self, topic: str, *, key: bytes | None = None, value: bytes | None = None,
                headers: Sequence[tuple[str, str | bytes | None]] = (),
                on_delivery: Callable[[Any, Any], None] | None = None) -> None:
        with self._lock:
            offset = self._offsets.get(topic, 0)
            self._offsets[topic] = offset + 1
            letter = CapturedLetter(topic, offset=offset, key=key, value=value,
                                    headers=list(headers))
            self._pending.append((letter, on_delivery))

    def flush(self, _timeout: float | None = None) -> int:
        with self._lock:
            pending, self._pending = self._pending, []
            self.records.extend(letter for letter, _ in pending)
        for letter, callback in pending:
            if callback is not None:
                callback(None, letter)
        return 0


class LetterBox:
    """Where a harness's dead letters go: produced with the runner's own code."""

    def __init__(self, *, header_limit: int, signing_keys: tuple[bytes, ...] = ()) -> None:
        self.producer = MemoryProducer()
        # DeadLetterer calls only produce() and flush(), which MemoryProducer has.
        self.dlq = DeadLetterer(self.producer,  # type: ignore[arg-type]
                                header_limit=header_limit, signing_keys=signing_keys)
        self.metrics = Metrics()

    def send(self, results: dict[TP, list[Result]]) -> list[CapturedLetter]:
        """Produce the dead letters among ``results`` (as the runner does before it moves
        an offset); return the records written."""
        before = len(self.producer.records)
        send_letters(self.dlq, self.metrics, results)
        return self.producer.records[before:]

    @property
    def letters(self) -> list[CapturedLetter]:
        return list(self.producer.records)
