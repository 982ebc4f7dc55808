"""The one committer of offsets, against a stub consumer: which offsets are committed
after which results, what an acknowledgement or a failure changes, what a revoke
commits and forgets. No Kafka, no PostgreSQL."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from kafka_idem.consume.offsets import Offsets
from kafka_idem.consume.outcome import Deferred, Finished
from kafka_idem.consume.partitions import Partitions
from kafka_idem.testing import FakeMessage

T = "orders"


def msg(partition: int, offset: int) -> FakeMessage:
    return FakeMessage(T, partition=partition, offset=offset)


@dataclass
class Ack:
    """A partition in a commit acknowledgement (a TopicPartition with its error)."""

    topic: str
    partition: int
    offset: int
    error: KafkaError | None = None


@dataclass
class StubConsumer:
    calls: list[tuple[bool, dict[int, int]]] = field(default_factory=list)
    fail_with: KafkaError | None = None

    def commit(self, *, offsets: list[TopicPartition], asynchronous: bool = True) -> Any:
        if self.fail_with is not None:
            raise KafkaException(self.fail_with)
        self.calls.append((asynchronous, {tp.partition: tp.offset for tp in offsets}))
        return None if asynchronous else offsets


def setup(*partitions: int, offsets: int = 5) -> tuple[Partitions, StubConsumer, Offsets]:
    parts = Partitions()
    for p in partitions:
        for o in range(offsets):
            parts.add(msg(p, o), 0.0)
    consumer = StubConsumer()
    return parts, consumer, Offsets(parts)


def finish(parts: Partitions, p: int, n: int, then: Deferred | None = None) -> None:
    results: list[Any] = [Finished("succeeded")] * n + ([then] if then else [])
    parts.apply({(T, p): results}, now=1.0)


def test_nothing_finished_commits_nothing() -> None:
    parts, consumer, offsets = setup(0)
    finish(parts, 0, 0, then=Deferred(1.0, "busy"))
    offsets.commit(consumer)
    offsets.commit(consumer, sync=True)
    assert consumer.calls == []


def test_the_offset_after_each_finished_prefix_is_committed_asynchronously() -> None:
    parts, consumer, offsets = setup(0, 1)
    finish(parts, 0, 3, then=Deferred(1.0, "busy"))
    finish(parts, 1, 1)
    offsets.commit(consumer)
    assert consumer.calls == [(True, {0: 3, 1: 1})]


def test_one_commit_in_flight_per_partition_until_it_is_acknowledged() -> None:
    parts, consumer, offsets = setup(0)
    finish(parts, 0, 1)
    offsets.commit(consumer)
    finish(parts, 0, 1)
    offsets.commit(consumer)  # the first is not acknowledged yet: nothing sent
    assert consumer.calls == [(True, {0: 1})]
    offsets.acknowledged(None, [Ack(T, 0, 1)])  # type: ignore[list-item]
    offsets.commit(consumer)  # the newest finished offset goes now
    assert consumer.calls == [(True, {0: 1}), (True, {0: 2})]
    offsets.acknowledged(None, [Ack(T, 0, 2)])  # type: ignore[list-item]
    offsets.commit(consumer)
    assert len(consumer.calls) == 2  # all acknowledged: nothing pending


def test_a_failed_acknowledgement_sends_the_offset_again() -> None:
    parts, consumer, offsets = setup(0, 1)
    finish(parts, 0, 2)
    finish(parts, 1, 2)
    offsets.commit(consumer)
    offsets.acknowledged(None, [Ack(T, 0, 2, KafkaError(KafkaError.REQUEST_TIMED_OUT)),
                                Ack(T, 1, 2)])  # type: ignore[list-item]
    offsets.commit(consumer)
    assert consumer.calls == [(True, {0: 2, 1: 2}), (True, {0: 2})]


def test_a_whole_failed_commit_is_logged_and_retried(caplog: pytest.LogCaptureFixture) -> None:
    parts, consumer, offsets = setup(0)
    finish(parts, 0, 2)
    offsets.commit(consumer)
    with caplog.at_level(logging.WARNING, logger="kafka_idem.consume"):
        offsets.acknowledged(KafkaError(KafkaError.REBALANCE_IN_PROGRESS),
                             [Ack(T, 0, 2)])  # type: ignore[list-item]
    assert "commit failed, will retry" in caplog.text
    offsets.commit(consumer)
    assert consumer.calls == [(True, {0: 2}), (True, {0: 2})]


def test_an_acknowledgement_of_an_older_offset_keeps_the_newer_one_pending() -> None:
    parts, consumer, offsets = setup(0)
    finish(parts, 0, 1)
    offsets.commit(consumer)
    finish(parts, 0, 2)  # offset 3 finished while the commit of 1 was in flight
    offsets.acknowledged(None, [Ack(T, 0, 1)])  # type: ignore[list-item]
    offsets.commit(consumer)
    assert consumer.calls == [(True, {0: 1}), (True, {0: 3})]


def test_an_async_commit_that_raises_is_not_in_flight_and_goes_again() -> None:
    parts, consumer, offsets = setup(0)
    finish(parts, 0, 1)
    consumer.fail_with = KafkaError(KafkaError._NO_OFFSET)
    offsets.commit(consumer)
    consumer.fail_with = None
    offsets.commit(consumer)
    assert consumer.calls == [(True, {0: 1})]


def test_a_sync_commit_includes_offsets_in_flight_and_settles_them() -> None:
    parts, consumer, offsets = setup(0, 1)
    finish(parts, 0, 1)
    offsets.commit(consumer)  # in flight, never acknowledged (the member is closing)
    finish(parts, 1, 4)
    offsets.commit(consumer, sync=True)
    assert consumer.calls[-1] == (False, {0: 1, 1: 4})
    offsets.commit(consumer, sync=True)
    assert len(consumer.calls) == 2  # nothing left to commit


def test_a_sync_commit_refused_for_lost_ownership_keeps_its_offsets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    parts, consumer, offsets = setup(0)
    finish(parts, 0, 2)
    consumer.fail_with = KafkaError(KafkaError.ILLEGAL_GENERATION)
    with caplog.at_level(logging.WARNING, logger="kafka_idem.consume"):
        offsets.commit(consumer, sync=True)
    assert "commit refused, ownership lost" in caplog.text
    consumer.fail_with = None
    offsets.commit(consumer, sync=True)
    assert consumer.calls == [(False, {0: 2})]


def test_a_revoke_commits_the_leaving_partitions_and_forgets_them() -> None:
    parts, consumer, offsets = setup(0, 1, 2)
    finish(parts, 0, 2, then=Deferred(5.0, "retry"))
    finish(parts, 1, 3)
    finish(parts, 2, 4)
    offsets.commit(consumer)  # partition 2's commit is in flight: a revoke commits it anyway
    offsets.commit_leaving(consumer, [(T, 2), (T, 0)])
    assert consumer.calls == [(True, {0: 2, 1: 3, 2: 4}), (False, {2: 4, 0: 2})]
    assert parts.get((T, 0)) is None and parts.get((T, 2)) is None
    st = parts.get((T, 1))
    assert st is not None and st.to_commit == 3  # the staying partition is untouched


def test_a_revoke_with_nothing_finished_commits_nothing_and_still_forgets() -> None:
    parts, consumer, offsets = setup(0)
    offsets.commit_leaving(consumer, [(T, 0), (T, 9)])
    assert consumer.calls == []
    assert parts.get((T, 0)) is None


def test_a_failed_commit_on_revoke_still_hands_the_partition_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    parts, consumer, offsets = setup(0)
    finish(parts, 0, 1)
    consumer.fail_with = KafkaError(KafkaError.UNKNOWN_MEMBER_ID)
    with caplog.at_level(logging.WARNING, logger="kafka_idem.consume"):
        offsets.commit_leaving(consumer, [(T, 0)])
    assert "commit on revoke failed" in caplog.text
    assert parts.get((T, 0)) is None


def test_an_acknowledgement_for_a_forgotten_partition_is_ignored() -> None:
    parts, consumer, offsets = setup(0)
    finish(parts, 0, 1)
    offsets.commit(consumer)
    parts.forget([(T, 0)])
    offsets.acknowledged(None, [Ack(T, 0, 1)])  # type: ignore[list-item]
    parts.add(msg(0, 1), 2.0)  # assigned again
    offsets.commit(consumer)
    assert consumer.calls == [(True, {0: 1})]
