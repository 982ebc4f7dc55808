"""What became of a message: the vocabulary every path returns and the runner reads.

:class:`Finished` means the offset may advance (after the dead letter, if there is
one, is acknowledged); :class:`Deferred` means the partition waits and the message
runs again. Both name *why* with a :class:`enum.StrEnum`, so a value still equals its
string (``Ended.REPLAYED == "replayed"``): log fields, metric labels and callers that
compare with strings keep working.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kafka_idem.deadletters.dead_letter import DeadLetter
from kafka_idem.errors import MessageError

TP = tuple[str, int]


class Message(Protocol):
    """What the path reads of a delivered Kafka message (``confluent_kafka.Message``,
    or a test's fake with the same methods).

    confluent_kafka types ``topic()``, ``partition()`` and ``offset()`` as optional
    because the same class carries error events; a delivered message always has them.
    """

    def topic(self) -> str: ...

    def partition(self) -> int: ...

    def offset(self) -> int: ...

    def key(self) -> bytes | None: ...

    def value(self) -> bytes | None: ...

    def headers(self) -> Sequence[tuple[str, bytes | None]] | None: ...

    def timestamp(self) -> tuple[int, int]: ...


Parts = Sequence[tuple[TP, Sequence[Message]]]
"""A unit of local work: each partition with its messages, in offset order."""


class Ended(enum.StrEnum):
    """How a finished message ended."""

    SUCCEEDED = "succeeded"
    REPLAYED = "replayed"  # an earlier success answered it; the handler did not run
    CONFLICT = "conflict"  # its key was first used with another payload: dead-lettered
    DEAD_LETTERED = "dead_lettered"


class Reason(enum.StrEnum):
    """Why a message waits."""

    BUSY = "busy"  # another owner's live lease, or a retry not due yet
    RETRY = "retry"  # it failed and is due again after a backoff
    FRAMEWORK = "framework"  # our surroundings failed (database, registry): not charged
    CONFIG = "config"  # a configuration error (consume/config_hold.py): not charged, held
    DLQ = "dlq"  # its dead letter was not acknowledged


@dataclass(frozen=True, slots=True, init=False)
class Finished:
    outcome: Ended
    letter: DeadLetter | None
    key: str | None

    def __init__(
        self, outcome: Ended | str, letter: DeadLetter | None = None, key: str | None = None
    ) -> None:
        # A string is accepted (and checked: a misspelt outcome fails here, not as a
        # silently wrong metric label) so callers written before the enums still work.
        object.__setattr__(self, "outcome", Ended(outcome))
        object.__setattr__(self, "letter", letter)
        object.__setattr__(self, "key", key)


@dataclass(frozen=True, slots=True, init=False)
class Deferred:
    delay: float
    reason: Reason
    token: uuid.UUID | None  # our still-live claim, re-entered on the next try

    def __init__(
        self, delay: float, reason: Reason | str, token: uuid.UUID | None = None
    ) -> None:
        object.__setattr__(self, "delay", delay)
        object.__setattr__(self, "reason", Reason(reason))  # checked, as in Finished
        object.__setattr__(self, "token", token)


Result = Finished | Deferred
Results = dict[TP, list[Result]]


@dataclass(frozen=True, slots=True)
class Prepared:
    """A decoded message: its validated model, idempotency key and request hash."""

    model: Any  # the handler's pydantic model
    key: str
    request_hash: str
    shard: str | None = None  # the handler's shard_key (None: the store's default)


Ahead = Mapping[TP, Mapping[int, Prepared | MessageError]]
"""Messages the loop thread decoded as it queued them (``local_workers > 0``): per
partition, by offset, the prepared form or why the message cannot be decoded. A
message missing here is decoded where it runs."""
