"""What may be committed of one partition, whatever kind of state keeps it, and the
small vocabulary of partitions the member's modules share (no Kafka calls, no threads)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

from kafka_idem.consume.outcome import Deferred

TP = tuple[str, int]


class Message(Protocol):
    """What the bookkeeping needs of a fetched message (a delivered one, not an error)."""

    def topic(self) -> str: ...

    def partition(self) -> int: ...

    def offset(self) -> int: ...


class Committable:
    """What may be committed of one partition: the offset after its finished prefix
    not acknowledged yet, and the asynchronous commit in flight. Both kinds of
    partition state (the prefix one of :mod:`~kafka_idem.consume.partitions`, the
    key-ordered one of :mod:`~kafka_idem.consume.concurrency.keyed_state`) keep it the
    same way, for :mod:`~kafka_idem.consume.offsets`."""

    def __init__(self, *, jitter: Callable[[float, float], float] = random.uniform) -> None:
        self.to_commit: int | None = None  # next offset to commit, not yet acknowledged
        self.committing: int | None = None  # the offset of an asynchronous commit in flight
        self.paused = False
        self.framework_failures = 0  # consecutive deferrals that were our own fault
        self._jitter = jitter

    def commit_sent(self, offset: int) -> None:
        self.committing = offset

    def commit_not_sent(self) -> None:
        self.committing = None

    def committed(self, offset: int) -> None:
        """A synchronous commit of ``offset`` succeeded."""
        if self.to_commit == offset:
            self.to_commit = None

    def acknowledged(self, offset: int, *, failed: bool) -> None:
        """The broker answered an asynchronous commit of ``offset``."""
        if self.committing == offset:
            self.committing = None  # the next round sends the newest offset, if any
        if not failed and self.to_commit == offset:
            self.to_commit = None

    def delay(self, res: Deferred) -> float:
        """How long a deferred message waits: its own delay, or when our surroundings
        failed, a jittered growing wait (never charged to the message)."""
        if res.reason == "config":
            # Waiting will not fix it (consume/config_hold.py): 1 s, 2 s, 4 s ... up to a minute.
            self.framework_failures += 1
            return float(min(60, 2 ** min(self.framework_failures - 1, 6)))
        if res.reason in ("framework", "dlq"):
            self.framework_failures += 1
            return self._jitter(0.1, min(10.0, 0.2 * 2 ** min(self.framework_failures, 6)))
        return res.delay

    # What the loop asks of every kind of state.

    def add(self, msg: Message, now: float) -> None:
        raise NotImplementedError

    def first_offset(self) -> int | None:
        raise NotImplementedError

    def deadline(self, linger: float) -> float | None:
        """When the loop must look at this partition again (None: nothing to wait for)."""
        raise NotImplementedError

    def pause_if(self, now: float, full: int) -> bool:
        raise NotImplementedError

    def resume_if(self, now: float, low: int) -> bool:
        raise NotImplementedError


class Assigned(Protocol):
    """A partition as the rebalance callbacks give it (a ``TopicPartition``)."""

    @property
    def topic(self) -> str: ...

    @property
    def partition(self) -> int: ...


def tps(partitions: Sequence[Assigned]) -> list[TP]:
    return [(p.topic, p.partition) for p in partitions]


def names(partitions: Sequence[Assigned]) -> str:
    return ",".join(f"{p.topic}[{p.partition}]" for p in partitions)
