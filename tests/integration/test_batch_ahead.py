"""Decoding ahead (issue 17): with ``local_workers > 0`` the loop thread decodes a batch
handler's messages as it queues them and the worker's batch path uses that form. The
outcomes must be those of the inline batch path, and no message is decoded twice."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest

from consumers.payments import encode_charge
from tests.conftest import (
    DB,
    InProcess,
    Topics,
    caught_up,
    committed,
    end_offsets,
    headers,
    produce,
    wait_for,
)
from tests.integration.support import HANDLER, charge_app, dlq_records

WORKERS = pytest.mark.parametrize("local_workers", [0, 1], ids=["inline", "workers"])

UNDECODABLE = b"not avro at all"


def charge(order: str, amount: str) -> tuple[bytes, bytes]:
    return order.encode(), encode_charge("t1", order, amount)


def mixed() -> list[tuple[bytes, bytes]]:
    """Valid, duplicate, conflicting, undecodable and invalid (a key over
    ``key_max_bytes``) messages; a Kafka key per order keeps an order in one partition."""
    return [
        charge("o1", "10.00"), charge("o2", "2.00"), (b"u", UNDECODABLE),
        charge("o1", "10.00"), charge("o3", "3.00"), charge("o1", "11.00"),
        charge("o" * 1100, "1.00"), charge("o4", "4.00"), charge("o2", "2.00"),
        charge("o5", "5.00"), (b"u", UNDECODABLE), charge("o6", "6.00"),
    ]


@WORKERS
def test_decoding_ahead_has_the_outcomes_of_the_inline_batch_path(
    db: DB, topics: Topics, group: str, local_workers: int
) -> None:
    topic = topics(partitions=2)
    sent = mixed()
    acked = produce(topic, sent)
    app = charge_app(db, topic, group, local_workers=local_workers, batch_size=4)
    with InProcess(app) as r:
        wait_for(lambda: caught_up(group, topic), what="the topic to drain")
        wait_for(lambda: len(dlq_records(topic)) == 4, what="the dead letters")
        outcomes = r.runner.metrics.messages
        replayed = outcomes.labels(topic, HANDLER, "replayed")._value.get()
    assert replayed == 2
    orders = ["o1", "o2", "o3", "o4", "o5", "o6"]
    assert db.ledger_counts() == {f"t1:charge:{o}": 1 for o in orders}
    assert {(r["idempotency_key"], r["status"], r["attempts"]) for r in db.records()} == {
        (f"t1:charge:{o}", "succeeded", 1) for o in orders}
    got = Counter(
        (m.key(), m.value(), h["idem.error.kind"], h["idem.error.class"], h["idem.attempts"],
         h["idem.original.topic"], h["idem.consumer_group"])
        for m in dlq_records(topic) for h in [headers(m)])
    meta = (topic, group)
    assert got == Counter({
        (*sent[2], "undecodable", "Undecodable", "0", *meta): 2,
        (*sent[5], "payload_conflict", "PayloadConflict", "1", *meta): 1,
        (*sent[6], "permanent", "InvalidKey", "0", *meta): 1,
    })
    offsets = {(int(h["idem.original.partition"]), int(h["idem.original.offset"]))
               for h in map(headers, dlq_records(topic))}
    assert len(offsets) == 4 and offsets <= set(acked)
    assert committed(group, topic) == end_offsets(topic)


@WORKERS
def test_with_workers_the_loop_thread_decodes_each_message_once(
    db: DB, topics: Topics, group: str, local_workers: int
) -> None:
    topic = topics(partitions=2)
    sent = [charge(f"o{i}", "1.00") for i in range(40)] + [(b"u", UNDECODABLE)]
    produce(topic, sent)
    app = charge_app(db, topic, group, local_workers=local_workers, batch_size=8)
    proc = InProcess(app)  # binds the codecs
    codec = app.handlers[topic].codec
    calls: Counter[bytes] = Counter()
    threads: set[str] = set()
    decode = codec.decode

    def counted(data: bytes) -> Any:
        calls[data] += 1
        threads.add(threading.current_thread().name)
        return decode(data)

    codec.decode = counted  # type: ignore[method-assign]
    with proc:
        wait_for(lambda: caught_up(group, topic), what="the topic to drain")
    loop_thread = proc.thread.name
    assert calls == Counter(value for _key, value in sent)  # each value once, no more
    assert threads == {loop_thread}  # the workers never decoded (inline: the loop runs it)
    assert db.status_counts() == {"succeeded": 40}
    (letter,) = dlq_records(topic)
    assert headers(letter)["idem.error.kind"] == "undecodable"
