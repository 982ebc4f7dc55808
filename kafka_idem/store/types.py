"""What the store's protocol answers: a claim's outcome, a delivery, a failure."""

from __future__ import annotations

import datetime as dt
import enum
import os
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg

Conn = psycopg.Connection[Any]
AsyncConn = psycopg.AsyncConnection[Any]


class Outcome(enum.StrEnum):
    CLAIMED = "claimed"
    REPLAY = "replay"
    BUSY = "busy"
    CONFLICT = "conflict"
    DEAD = "dead"
    EXHAUSTED = "exhausted"


@dataclass(frozen=True, slots=True)
class Delivery:
    """Where the message being processed came from (stored as the last delivery)."""

    topic: str
    partition: int
    offset: int
    handler: str


@dataclass(frozen=True, slots=True)
class Claim:
    outcome: Outcome
    key: str
    token: uuid.UUID | None = None
    attempts: int = 0
    budget_used: int = 1  # attempts counted against the retry limit (since the last re-run)
    result: Any = None
    retry_in: float = 0.0
    backoff: bool = False  # busy because a retry is not due yet (not someone's live lease)
    failing_for: float = 0.0  # seconds since the first failure, by the database clock
    took_over: bool = False
    last_chance: bool = False  # limit reached: reconcile, then succeed or be exhausted
    charged: bool = True  # this claim counted an attempt (not a re-entry, nor a last chance)
    previous_error_kind: str | None = None
    error_kind: str | None = None
    error_class: str | None = None
    error_message: str | None = None
    first_failure_at: dt.datetime | None = None
    last_failure_at: dt.datetime | None = None

    @property
    def withdrawable(self) -> bool:
        """Ours, and charged: a claim whose call never started may be withdrawn
        (:meth:`Store.withdraw_claim`); a re-entry or a last chance was not charged."""
        return self.outcome is Outcome.CLAIMED and self.token is not None and self.charged

    @classmethod
    def new_key(cls, key: str, token: uuid.UUID) -> Claim:
        """A key that a batch or round claim inserted: ours, at its first attempt."""
        return cls(Outcome.CLAIMED, key, token=token, attempts=1)


class Token(bytes):
    """An owner token the batch path made: the 16 bytes of a version 4 UUID, as
    :func:`uuid.uuid4` makes them, kept as bytes (a :class:`uuid.UUID` object costs
    more to make than the rest of a message's claim). ``uuid.UUID(bytes=token)`` is
    the UUID; the records' ``COPY`` sends the bytes as they are."""

    __slots__ = ()


def new_tokens(n: int) -> list[Token]:
    """``n`` random owner tokens (version 4 UUIDs, RFC 4122 variant) from one read of the
    system's randomness: ``uuid4()`` reads it once per token, a system call each, which
    was a tenth of a batch's time in its loop thread."""
    raw = bytearray(os.urandom(16 * n))
    for i in range(0, 16 * n, 16):
        raw[i + 6] = (raw[i + 6] & 0x0F) | 0x40  # version 4
        raw[i + 8] = (raw[i + 8] & 0x3F) | 0x80  # the RFC 4122 variant
    data = bytes(raw)
    return [Token(data[i:i + 16]) for i in range(0, 16 * n, 16)]


@dataclass(frozen=True, slots=True)
class Failure:
    """What :meth:`Store.fail` recorded."""

    attempts: int
    next_attempt_at: dt.datetime | None
    first_failure_at: dt.datetime
    last_failure_at: dt.datetime


@dataclass(frozen=True, slots=True)
class Event:
    """One event a handler emitted (``ctx.emit``), encoded, as the outbox stores it.

    ``slot`` (of the event key, else the idempotency key) decides the shard and is
    the lock that orders two transactions emitting the same key."""

    topic: str
    key: bytes | None
    value: bytes | None  # None: a tombstone
    headers: tuple[tuple[str, bytes], ...]
    idem_key: str
    slot: int
    shard: int
    source: Delivery | None = None
    shard_key: str | None = None  # the emitting message's (a distributed store's placement)


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """A row of the outbox as the relay reads it."""

    id: int
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    idem_key: str
    source_topic: str | None
    source_partition: int | None
    source_offset: int | None
    created_at: dt.datetime
