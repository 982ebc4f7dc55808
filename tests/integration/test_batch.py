"""The batch path's own edge cases (issue 6), each with the batch path on and off:
the observable outcome must be the same."""

from __future__ import annotations

import random
import signal
from decimal import Decimal
from typing import Any

import pytest

from consumers import payments
from consumers.payments import build_app, encode_charge
from kafka_idem import Context, Retryable, RetryPolicy
from tests.conftest import (
    DB,
    InProcess,
    Members,
    Topics,
    app_settings,
    caught_up,
    committed,
    headers,
    member_env,
    produce,
    read_topic,
    wait_for,
)
from tests.integration.support import charge_app, seeded

BATCH = pytest.mark.parametrize("batch_path", [True, False], ids=["batch", "per-message"])


def charges(*orders: tuple[str, str]) -> list[tuple[bytes, bytes]]:
    return [(o.encode(), encode_charge("t1", o, a)) for o, a in orders]


@BATCH
def test_a_failing_message_mid_batch_lets_the_others_commit_and_holds_the_offset(
    db: DB, topics: Topics, group: str, batch_path: bool
) -> None:
    topic = topics(partitions=1)
    produce(topic, charges(*[(f"o{i}", "1.00") for i in range(8)]))

    def flaky(msg: payments.ChargeRequested, ctx: Context) -> Any:
        if msg.order_id == "o3" and ctx.attempt == 1:
            raise Retryable("o3 fails once")
        return payments.charge(msg, ctx)

    seed = seeded(4.0, at_least=2.5)  # a first retry delay of 2.5 s or more
    retry = RetryPolicy(base=4.0, cap=4.0, max_attempts=3, rng=random.Random(seed))
    app = charge_app(db, topic, group, flaky, retry=retry, batch_path=batch_path)
    with InProcess(app):
        wait_for(lambda: (db.record("t1:charge:o3") or {}).get("status") == "retryable_failed",
                 what="o3 to fail once")
        wait_for(lambda: committed(group, topic)[0] == 3, what="the offsets before o3")
        # While o3 waits: the others are done (other keys do not wait for it), and the
        # committed offset stays at it.
        wait_for(lambda: len(db.ledger_counts()) == 7, what="the keys after o3")
        assert "t1:charge:o3" not in db.ledger_counts()
        assert committed(group, topic)[0] == 3
        wait_for(lambda: caught_up(group, topic), what="o3's retry")
    assert [r["order_id"] for r in db.ledger()] == [f"o{i}" for i in (0, 1, 2, 4, 5, 6, 7, 3)]
    assert db.record("t1:charge:o3")["attempts"] == 2  # type: ignore[index]


@BATCH
def test_the_same_key_twice_in_a_batch_replays_and_a_conflict_is_dead_lettered(
    db: DB, topics: Topics, group: str, batch_path: bool
) -> None:
    topic = topics(partitions=1)
    produce(topic, charges(("o1", "10.00"), ("o2", "2.00"), ("o1", "10.00"), ("o1", "11.00"),
                           ("o2", "2.0")))
    app = build_app(topic=topic, **app_settings(db, group_id=group, batch_path=batch_path))
    with InProcess(app) as r:
        wait_for(lambda: caught_up(group, topic), what="the batch")
        replayed = r.runner.metrics.messages.labels(topic, "charge", "replayed")._value.get()
    assert replayed == 2
    assert db.ledger_counts() == {"t1:charge:o1": 1, "t1:charge:o2": 1}
    assert db.balances() == {("t1", "EUR"): Decimal("12.00")}
    assert {r["attempts"] for r in db.records()} == {1}
    # the handler's shard key is stored on either path (a store distributed later on
    # Citus keeps each record where its handler looks for it)
    assert {r["shard_key"] for r in db.records()} == {"t1"}
    (letter,) = read_topic(f"{topic}.dlq")
    assert headers(letter)["idem.error.kind"] == "payload_conflict"
    assert headers(letter)["idem.original.offset"] == "3"


@BATCH
def test_sigkill_in_the_middle_of_a_batch_transaction_leaves_nothing_partial(
    db: DB, topics: Topics, members: Members, group: str, batch_path: bool
) -> None:
    """A crash in the middle of a unit: nothing of an uncommitted transaction stays.
    The batch path has one transaction for the batch (o0..o5, written in it, roll back
    with o6); the per-message path one per message (o0..o5 committed, each effect with
    its record; o6 rolled back). No offset was committed either way: the replacement
    answers what was committed by its record and runs the rest, each once."""
    topic = topics(partitions=1)
    produce(topic, charges(*[(f"o{i}", "1.00") for i in range(10)]))
    env = member_env(db, topic, KILL_AFTER_WRITE_ORDERS="o6",
                     KAFKA_IDEM_BATCH_PATH=str(batch_path).lower())
    victim = members.start("tests.apps.variants:app", env, group=group)
    assert victim.wait(timeout=60) == -signal.SIGKILL
    done = [] if batch_path else [f"t1:charge:o{i}" for i in range(6)]
    assert [r["idempotency_key"] for r in db.ledger()] == done
    assert sorted((r["idempotency_key"], r["status"]) for r in db.records()) == [
        (k, "succeeded") for k in done]
    assert committed(group, topic)[0] < 0

    members.start("tests.apps.variants:app", member_env(db, topic), group=group)
    wait_for(lambda: caught_up(group, topic), what="the replacement")
    assert db.ledger_counts() == {f"t1:charge:o{i}": 1 for i in range(10)}
    assert {r["attempts"] for r in db.records()} == {1}
