"""Batches that close early (issue 17): a loop round takes what librdkafka holds and
waits only for the first message, so a batch starts when the input pauses, is full
under a backlog, and fills for ``batch_linger_seconds`` when asked to."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import Producer

from consumers import payments
from consumers.payments import encode_charge
from kafka_idem import App
from tests.conftest import (
    BOOTSTRAP,
    DB,
    InProcess,
    Topics,
    app_settings,
    caught_up,
    produce,
    wait_for,
)
from tests.integration.support import charge_app
from tests.integration.test_keyed import keyed_app


def bulk_app(db: DB, topic: str, group: str, sizes: list[int], **settings: Any) -> App:
    """The payments handler with a bulk handler that notes the size of every batch."""
    app = App("closing", **app_settings(db, group_id=group, schemas_dir=payments.SCHEMAS_DIR,
                                        **settings))
    app.migration(payments.create_tables)
    handler = app.handler(topic=topic, model=payments.ChargeRequested,
                          key="{tenant_id}:charge:{order_id}", hash_fields=("amount", "currency"),
                          schema=payments.SCHEMA)(payments.charge)

    def charge_many(batch: list[Any], tx: Any) -> list[Any]:
        sizes.append(len(batch))
        return payments.charge_many(batch, tx)

    handler.bulk_handler(charge_many)
    return app


def charged(db: DB, n: int) -> Callable[[], bool]:
    return lambda: len(db.ledger_counts()) == n


def charge(i: int) -> tuple[bytes, bytes]:
    return f"o{i}".encode(), encode_charge("t1", f"o{i}", "1.00")


class OneByOne:
    """One producer sending each message on its own (flushed before the next)."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.producer = Producer({"bootstrap.servers": BOOTSTRAP, "acks": "all",
                                  "enable.idempotence": True, "linger.ms": 0})

    def send(self, *records: tuple[bytes, bytes]) -> None:
        for key, value in records:
            self.producer.produce(self.topic, key=key, value=value, partition=0)
        assert self.producer.flush(30) == 0


def test_a_slow_input_gets_small_batches_that_do_not_wait_for_the_batch_wait(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=1)
    sizes: list[int] = []
    # A batch that waited to fill would take 10 s per message here: each message
    # below is sent only after the one before it committed, within 8 s.
    app = bulk_app(db, topic, group, sizes, batch_size=50, batch_max_wait_seconds=10.0)
    sent = 0
    with InProcess(app):
        producer = OneByOne(topic)
        for _ in range(5):
            producer.send(charge(sent))
            sent += 1
            wait_for(charged(db, sent), timeout=8.0,
                     what=f"message {sent} without waiting for a full batch")
        singles = list(sizes)
        for _ in range(3):  # bursts of 4: a batch takes what came, never waits for 50
            producer.send(*(charge(sent + i) for i in range(4)))
            sent += 4
            wait_for(charged(db, sent), timeout=8.0,
                     what=f"the burst up to message {sent}")
    assert singles == [1] * 5
    bursts = sizes[5:]
    assert sum(bursts) == 12 and len(bursts) >= 3 and max(bursts) <= 4, sizes


def test_a_backlog_gets_full_batches(db: DB, topics: Topics, group: str) -> None:
    topic = topics(partitions=1)
    produce(topic, [charge(i) for i in range(200)])
    sizes: list[int] = []
    with InProcess(bulk_app(db, topic, group, sizes, batch_size=50)):
        wait_for(lambda: caught_up(group, topic), what="the backlog")
    assert sizes == [50] * 4
    assert len(db.ledger_counts()) == 200


def test_a_linger_lets_batches_of_a_slow_input_fill(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=1)
    sizes: list[int] = []
    app = bulk_app(db, topic, group, sizes, batch_size=10, batch_max_wait_seconds=10.0,
                   batch_linger_seconds=10.0)
    with InProcess(app):
        producer = OneByOne(topic)
        for i in range(30):  # each on its own: without the linger, batches of 1 or 2
            producer.send(charge(i))
        wait_for(lambda: caught_up(group, topic), what="the 30 messages")
    assert sizes == [10, 10, 10]


class Counting:
    """The member's consumer, counting its consume() calls."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def consume(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner.consume(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("mode", ["local", "leased", "keyed"])
def test_an_idle_member_does_not_spin(db: DB, topics: Topics, group: str, mode: str) -> None:
    topic = topics(partitions=2)
    produce(topic, [charge(i) for i in range(6)])
    if mode == "keyed":
        app = keyed_app(db, topic, group, payments.charge, concurrency=4)
    else:
        app = charge_app(db, topic, group, mode=mode)
    runner_rounds = [0]
    with InProcess(app) as r:
        step = r.runner.step

        def counted() -> None:
            runner_rounds[0] += 1
            step()

        r.runner.step = counted  # type: ignore[method-assign]
        wait_for(lambda: r.runner.consumer is not None, what="the consumer")
        counting = Counting(r.runner.consumer)
        r.runner.consumer = counting  # type: ignore[assignment]
        wait_for(lambda: caught_up(group, topic), what="the messages")
        rounds, calls, start = runner_rounds[0], counting.calls, time.monotonic()
        time.sleep(2.0)  # the idle interval measured
        rounds, calls = runner_rounds[0] - rounds, counting.calls - calls
        elapsed = time.monotonic() - start
    # batch_max_wait_seconds is 0.05: about 20 rounds a second, two consume() calls each.
    bound = 3 * elapsed / 0.05 + 10
    assert 0 < rounds <= bound, (rounds, elapsed)
    assert calls <= 2 * rounds + 2, (calls, rounds)
