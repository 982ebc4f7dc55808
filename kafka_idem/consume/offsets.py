"""The member's only committer of Kafka offsets.

An offset is committed only after its message's outcome is durable (stored,
replayed or dead-lettered and acknowledged): :class:`Offsets` commits what
:class:`~kafka_idem.consume.partitions.Partitions` says is pending, in the loop
(asynchronously, acknowledged in :meth:`Offsets.acknowledged`), on a revoke and
on close (synchronously). It needs only ``commit`` of the consumer
(:class:`Committer`), passed on each call, so a stub stands in for Kafka in unit
tests. On a revoke it commits through the consumer the callback was given.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal, Protocol, overload

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from kafka_idem.consume.committable import TP, Committable
from kafka_idem.consume.partitions import Partitions

log = logging.getLogger(__name__)

# Commit errors that mean "this member no longer owns the partition" (a rebalance
# or an eviction).
OWNERSHIP_LOST = {
    KafkaError.ILLEGAL_GENERATION,
    KafkaError.UNKNOWN_MEMBER_ID,
    KafkaError.REBALANCE_IN_PROGRESS,
    KafkaError._STATE,
    KafkaError._ASSIGNMENT_LOST,
    KafkaError.FENCED_INSTANCE_ID,
}


class Committer(Protocol):
    """The part of ``confluent_kafka.Consumer`` that commits offsets."""

    @overload
    def commit(
        self, *, offsets: list[TopicPartition], asynchronous: Literal[True] = ...
    ) -> None: ...

    @overload
    def commit(
        self, *, offsets: list[TopicPartition], asynchronous: Literal[False]
    ) -> list[TopicPartition]: ...


def _positions(pending: Sequence[tuple[TP, int]]) -> list[TopicPartition]:
    return [TopicPartition(tp[0], tp[1], offset) for tp, offset in pending]


class Offsets:
    """Commits each partition's finished prefix, and nothing else commits."""

    def __init__(self, parts: Partitions) -> None:
        self.parts = parts

    def commit(self, consumer: Committer, *, sync: bool = False) -> None:
        """Asynchronous in the loop (acknowledged in :meth:`acknowledged`); synchronous
        when closing."""
        if sync:
            self._commit_sync(consumer)
        else:
            self._commit_async(consumer)

    def _commit_async(self, consumer: Committer) -> None:
        pending = self.parts.pending_commits(in_flight_too=False)
        if not pending:
            return
        for tp, offset in pending:
            self._state(tp).commit_sent(offset)
        try:
            consumer.commit(offsets=_positions(pending), asynchronous=True)
        except KafkaException as exc:
            log.warning("commit failed, will retry: %s", exc, extra={"action": "commit"})
            for tp, _offset in pending:
                self._state(tp).commit_not_sent()

    def _commit_sync(self, consumer: Committer) -> None:
        pending = self.parts.pending_commits(in_flight_too=True)
        if not pending:
            return
        try:
            consumer.commit(offsets=_positions(pending), asynchronous=False)
        except KafkaException as exc:
            err = exc.args[0]
            if err.code() in OWNERSHIP_LOST:
                log.warning("commit refused, ownership lost: %s", err, extra={"action": "commit"})
            else:
                log.warning("commit failed, will retry: %s", err, extra={"action": "commit"})
            return
        for tp, offset in pending:
            st = self.parts.get(tp)
            if st is not None:
                st.committed(offset)

    def acknowledged(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """The broker's answer to an asynchronous commit (runs inside consume())."""
        for tp_ in partitions:
            st = self.parts.get((tp_.topic, tp_.partition))
            if st is not None:
                st.acknowledged(tp_.offset, failed=err is not None or tp_.error is not None)
        if err is not None and err.code() != KafkaError._NO_OFFSET:
            log.warning("commit failed, will retry: %s", err, extra={"action": "commit"})

    def commit_leaving(self, consumer: Committer, tps: Sequence[TP]) -> None:
        """Commit what is finished of partitions being revoked, synchronously, and forget
        them: the next owner starts after their finished prefixes."""
        pending = self.parts.pending_commits(in_flight_too=True, of=tps)
        self.parts.forget(tps)
        if not pending:
            return
        try:
            consumer.commit(offsets=_positions(pending), asynchronous=False)
        except KafkaException as exc:
            # The records are durable; the new owner replays them from the store.
            log.warning("commit on revoke failed: %s", exc, extra={"action": "commit"})

    def _state(self, tp: TP) -> Committable:
        st = self.parts.get(tp)
        assert st is not None  # pending_commits named it in this call
        return st


def say_where_they_start(consumer: object, partitions: Sequence[TopicPartition], *,
                         group: str, reset: str, timeout: float = 2.0) -> None:
    """One INFO line for each newly assigned partition the group has never committed
    on: they start where ``auto.offset.reset`` says (a new ``group_id`` on an old topic
    reads it from the start; what another group already processed is answered from
    the store, never applied twice). Best effort: a broker that does not answer in
    ``timeout`` leaves it unsaid."""
    if not partitions:
        return
    try:
        found = consumer.committed(  # type: ignore[attr-defined]
            [TopicPartition(p.topic, p.partition) for p in partitions], timeout=timeout)
    except (KafkaException, RuntimeError):
        return
    where = {"earliest": "the earliest offset", "smallest": "the earliest offset",
             "beginning": "the earliest offset"}.get(reset, f"the {reset} offset")
    for tp in found:
        if tp.error is None and tp.offset < 0:  # one line per partition, with its fields
            log.info("group %s has no committed offset on %s[%d]: starting at %s "
                     "(auto.offset.reset=%s)", group, tp.topic, tp.partition, where, reset,
                     extra={"action": "start_offset", "topic": tp.topic,
                            "partition": tp.partition})
