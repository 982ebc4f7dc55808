"""A resumed partition is fetched at once (``Runner._pause_resume``), on a stub consumer.

librdkafka's broker thread does not wake for a resume: it fetches the partition when
it next wakes on its own, up to a second later, and a partition paused for holding
two batches ran dry meanwhile (seen in the key-ordered gateway benchmark: a second
with nothing in flight after each resume). A seek to the partition's own position
wakes it without changing where it reads.
"""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from consumers import payments
from kafka_idem import App
from kafka_idem.consume.partitions import PartitionState
from kafka_idem.consume.runner import Runner
from kafka_idem.testing import FakeMessage

TOPIC = "payments.charge-requested"


class StubConsumer:
    """What the runner asks of the consumer around a pause and a resume."""

    def __init__(self, positions: dict[tuple[str, int], int],
                 fail_position: bool = False) -> None:
        self.positions = positions
        self.fail_position = fail_position
        self.calls: list[tuple[Any, ...]] = []

    def pause(self, tps: list[TopicPartition]) -> None:
        self.calls.append(("pause", [(t.topic, t.partition) for t in tps]))

    def resume(self, tps: list[TopicPartition]) -> None:
        self.calls.append(("resume", [(t.topic, t.partition) for t in tps]))

    def position(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        if self.fail_position:
            raise KafkaException(KafkaError(KafkaError._STATE, "Erroneous state"))
        return [TopicPartition(t.topic, t.partition, self.positions[(t.topic, t.partition)])
                for t in tps]

    def seek(self, tp: TopicPartition) -> None:
        self.calls.append(("seek", (tp.topic, tp.partition), tp.offset))


def runner() -> Runner:
    app = App("resume", database_url="postgresql://x@127.0.0.1:1/x", batch_size=2)
    app.handler(topic=TOPIC, model=payments.ChargeRequested,
                key="{tenant_id}:charge:{order_id}", hash_fields=("amount", "currency"),
                schema=payments.SCHEMA)(payments.charge)
    return Runner(app)


def full_then_drained(r: Runner, partition: int) -> PartitionState:
    """A partition holding two batches (paused at the next round); the caller empties it."""
    for o in range(4):
        r.parts.add(FakeMessage(TOPIC, partition=partition, offset=o, value=b"{}"), 0.0)
    st = r.parts.get((TOPIC, partition))
    assert isinstance(st, PartitionState)
    return st


@pytest.mark.parametrize("position", [4, 17])
def test_a_resumed_partition_is_sought_to_its_own_position_so_it_is_fetched_now(
    position: int
) -> None:
    r = runner()
    r.consumer = stub = StubConsumer({(TOPIC, 0): position})
    st = full_then_drained(r, 0)
    r._pause_resume()
    assert stub.calls == [("pause", [(TOPIC, 0)])]
    st.queue.clear()
    r._pause_resume()
    assert stub.calls[1:] == [("resume", [(TOPIC, 0)]), ("seek", (TOPIC, 0), position)]


def test_a_partition_with_no_position_yet_is_resumed_without_a_seek() -> None:
    r = runner()
    r.consumer = stub = StubConsumer({(TOPIC, 0): -1001})  # OFFSET_INVALID
    st = full_then_drained(r, 0)
    r._pause_resume()
    st.queue.clear()
    r._pause_resume()
    assert stub.calls[1:] == [("resume", [(TOPIC, 0)])]


def test_a_resume_whose_seek_is_refused_still_resumes() -> None:
    r = runner()
    r.consumer = stub = StubConsumer({}, fail_position=True)  # e.g. revoked meanwhile
    st = full_then_drained(r, 0)
    r._pause_resume()
    st.queue.clear()
    r._pause_resume()
    assert stub.calls[1:] == [("resume", [(TOPIC, 0)])]

