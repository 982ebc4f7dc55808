"""A code defect in a handler (TypeError, AttributeError, NameError/UnboundLocalError,
NotImplementedError) is permanent by default: dead-lettered at the first attempt,
against the real broker and database (docs/how-to/handlers.md, "Errors and retries"). A mapping
restores retries; kafka_idem's own defects around the handler are never charged."""

from __future__ import annotations

import random
from typing import Any

import pytest

from consumers import payments
from consumers.payments import encode_charge
from kafka_idem import Context, RetryPolicy, UnknownOutcome
from kafka_idem.consume.paths.processor import Processor
from kafka_idem.observe.metrics import Metrics
from kafka_idem.store import Store
from kafka_idem.testing import FakeMessage
from tests.conftest import (
    DB,
    InProcess,
    Topics,
    caught_up,
    committed,
    produce,
    read_topic,
    wait_for,
)
from tests.integration.support import (
    HANDLER,
    assert_dead_letter,
    charge_app,
    claims,
    dlq_records,
    record_history,
)
from tests.integration.test_classification import run_until_finished

DEFECT = "a code defect, not retried: "


def _source(topic: str, offset: int) -> Any:
    (found,) = [m for m in read_topic(topic) if m.offset() == offset]
    return found


def _defective(msg: payments.ChargeRequested, ctx: Context) -> Any:
    """Business writes first (they must roll back), then a real defect per order."""
    result = payments.charge(msg, ctx)
    if msg.order_id == "o1":
        return len(msg.amount)  # type: ignore[arg-type]  # TypeError
    if msg.order_id == "o2":
        return msg.nickname  # type: ignore[attr-defined]  # AttributeError
    if msg.order_id == "o3":
        if msg.amount < 0:
            total = msg.amount
        return total  # UnboundLocalError
    if msg.order_id == "o4":
        raise NotImplementedError("refunds")
    return result


@pytest.mark.parametrize("mode", ["local", "leased"])
def test_a_code_defect_is_dead_lettered_at_the_first_attempt_and_the_offset_committed(
    db: DB, topics: Topics, group: str, mode: str
) -> None:
    topic = topics(partitions=1)
    record_history(db)
    orders = ["o1", "o2", "o3", "o4", "o5"]
    produce(topic, [(o.encode(), encode_charge("t1", o, "10.00")) for o in orders])
    app = charge_app(db, topic, group, _defective, mode=mode,
                     retry=RetryPolicy(base=0.1, cap=0.1, max_attempts=5))
    with InProcess(app) as r:
        wait_for(lambda: caught_up(group, topic), what="the partition to drain")
        permanent = r.runner.metrics.dead_lettered.labels(topic, HANDLER, "permanent")._value.get()
        retries = r.runner.metrics.retries.labels(topic, HANDLER)._value.get()

    expected = {"o1": "TypeError", "o2": "AttributeError", "o3": "UnboundLocalError",
                "o4": "NotImplementedError"}
    for offset, (order, error_class) in enumerate(expected.items()):
        key = f"t1:charge:{order}"
        rec = db.record(key)
        assert rec is not None
        assert (rec["status"], rec["error_kind"], rec["attempts"], rec["error_class"]) == (
            "failed", "permanent", 1, error_class), order
        assert rec["error_message"].startswith(DEFECT), rec["error_message"]
        assert [c["attempts"] for c in claims(db, key)] == [1], f"{order} was retried"
        (letter,) = dlq_records(topic, source_offset=offset)
        h = assert_dead_letter(letter, _source(topic, offset), kind="permanent", attempts=1,
                               group=group, key=key, record=rec)
        assert h["idem.error.class"] == error_class
        assert h["idem.error.message"].startswith(DEFECT)
    assert db.record("t1:charge:o3")["error_message"].endswith(  # type: ignore[index]
        "cannot access local variable 'total' where it is not associated with a value")
    assert db.record("t1:charge:o4")["error_message"] == DEFECT + "refunds"  # type: ignore[index]
    assert len(dlq_records(topic)) == 4
    assert db.ledger_counts() == {"t1:charge:o5": 1}  # the defects' writes rolled back
    assert committed(group, topic) == {0: 5}
    assert (permanent, retries) == (4, 0)


def test_an_async_handlers_code_defect_is_dead_lettered_at_the_first_attempt(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=1)
    record_history(db)

    async def defective(msg: payments.ChargeRequested, ctx: Any) -> Any:
        await ctx.tx.execute("SELECT 1")
        return msg.amount + "1"  # TypeError

    produce(topic, [(b"o1", encode_charge("t1", "o1", "10.00"))])
    app = charge_app(db, topic, group, defective, mode="leased",
                     retry=RetryPolicy(base=0.1, cap=0.1, max_attempts=5))
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), what="the partition to drain")
    key = "t1:charge:o1"
    rec = db.record(key)
    assert rec is not None
    assert (rec["status"], rec["error_kind"], rec["attempts"], rec["error_class"]) == (
        "failed", "permanent", 1, "TypeError")
    assert rec["error_message"].startswith(DEFECT)
    assert [c["attempts"] for c in claims(db, key)] == [1]
    (letter,) = dlq_records(topic)
    assert_dead_letter(letter, _source(topic, 0), kind="permanent", attempts=1, group=group,
                       key=key, record=rec)
    assert committed(group, topic) == {0: 1}


@pytest.mark.parametrize("mode", ["local", "leased"])
def test_a_mapping_to_retryable_restores_retries_for_type_errors(
    db: DB, topics: Topics, group: str, mode: str
) -> None:
    topic = topics(partitions=1)
    record_history(db)

    def defective(msg: payments.ChargeRequested, ctx: Context) -> Any:
        payments.charge(msg, ctx)
        raise TypeError(f"bad call on attempt {ctx.attempt}")

    produce(topic, [(b"o1", encode_charge("t1", "o1", "10.00"))])
    app = charge_app(db, topic, group, defective, mode=mode, errors={TypeError: "retryable"},
                     retry=RetryPolicy(base=0.1, cap=0.1, max_attempts=3,
                                       rng=random.Random(7)))
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), what="the key to be exhausted")

    key = "t1:charge:o1"
    rec = db.record(key)
    assert rec is not None
    assert (rec["status"], rec["error_kind"], rec["attempts"], rec["error_class"]) == (
        "failed", "exhausted", 3, "TypeError")
    assert rec["error_message"] == (
        "3 attempts reached the limit of 3; last error: bad call on attempt 3")
    assert [c["attempts"] for c in claims(db, key)] == [1, 2, 3]
    (letter,) = dlq_records(topic)
    assert_dead_letter(letter, _source(topic, 0), kind="exhausted", attempts=3, group=group,
                       key=key, record=rec)
    assert db.ledger() == []
    assert committed(group, topic) == {0: 1}


# --- through the processor (no broker): reconcilers, the framework's own code, bulk -------

TOPIC = "defects.charge-requested"
KEY = "t1:charge:o1"


def _message() -> FakeMessage:
    return FakeMessage(TOPIC, offset=5, key=b"o1", value=encode_charge("t1", "o1", "10.00"))


def _processor(db: DB, fn: Any, *, mode: str, **settings: Any) -> tuple[Processor, Store]:
    app = charge_app(db, TOPIC, "defects", fn, mode=mode,
                     retry=RetryPolicy(base=0.1, cap=0.1, max_attempts=5), **settings)
    store = Store(schema="kafka_idem", table="task_idempotency", namespace=app.namespace)
    return Processor(app, store=store, metrics=Metrics()), store


@pytest.mark.parametrize("mode", ["local", "leased"])
def test_a_reconciler_with_a_code_defect_is_permanent_too(db: DB, mode: str) -> None:
    calls: list[int] = []

    def timed_out(msg: payments.ChargeRequested, ctx: Context) -> Any:
        calls.append(ctx.attempt)
        raise UnknownOutcome("no answer from the bank")

    proc, _ = _processor(db, timed_out, mode=mode)

    @proc.app.handlers[TOPIC].reconciler
    def ask_bank(msg: payments.ChargeRequested, ctx: Context) -> None:
        return msg.bank_reference  # type: ignore[attr-defined, no-any-return]

    done, deferred = run_until_finished(proc, _message(), mode)
    proc.close()
    assert [d.reason for d in deferred] == ["retry"]  # the unknown outcome, once
    # The handler never ran at attempt 2: the reconciler's defect decided (the local
    # batch path may run attempt 1 twice, once before falling back).
    assert calls and set(calls) == {1}
    assert done.letter is not None
    assert (done.letter.kind, done.letter.attempts, done.letter.error_class) == (
        "permanent", 2, "AttributeError")
    rec = db.record(KEY)
    assert rec is not None
    assert (rec["status"], rec["error_kind"], rec["attempts"]) == ("failed", "permanent", 2)
    assert rec["error_message"].startswith(DEFECT)


@pytest.mark.parametrize("mode", ["local", "leased"])
def test_a_type_error_in_kafka_idems_own_completion_is_not_charged(db: DB, mode: str) -> None:
    proc, store = _processor(db, payments.charge, mode=mode, batch_path=False)
    real = store.complete
    broken: list[int] = []

    def complete(*args: Any, **kwargs: Any) -> Any:
        if not broken:
            broken.append(1)
            raise TypeError("a defect of kafka_idem's completion")
        return real(*args, **kwargs)

    store.complete = complete  # type: ignore[method-assign]
    done, deferred = run_until_finished(proc, _message(), mode)
    proc.close()
    assert broken == [1]
    assert [d.reason for d in deferred] == ["framework"]  # the partition waited: not charged
    assert done.outcome == "succeeded"
    rec = db.record(KEY)
    assert rec is not None
    assert (rec["status"], rec["attempts"], rec["error_kind"]) == ("succeeded", 1, None)
    assert db.ledger_counts() == {KEY: 1}


def test_a_bulk_handlers_type_error_falls_back_to_the_per_message_handler(db: DB) -> None:
    proc, _ = _processor(db, payments.charge, mode="local")
    bulk_calls: list[int] = []

    @proc.app.handlers[TOPIC].bulk_handler
    def charge_many(batch: list[tuple[Any, Context]], tx: Any) -> list[Any]:
        bulk_calls.append(len(batch))
        raise TypeError("a defect of the bulk form only")

    done, deferred = run_until_finished(proc, _message(), "local")
    proc.close()
    assert bulk_calls == [1]
    assert (done.outcome, deferred) == ("succeeded", [])
    rec = db.record(KEY)
    assert rec is not None and (rec["status"], rec["attempts"]) == ("succeeded", 1)
    assert db.ledger_counts() == {KEY: 1}


def test_a_type_error_in_kafka_idems_own_async_completion_is_not_charged(
    db: DB, topics: Topics, group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic = topics(partitions=1)
    real = Store.complete_async
    broken: list[str] = []

    async def complete_async(self: Store, *args: Any, **kwargs: Any) -> None:
        if not broken:
            broken.append(kwargs["key"])
            raise TypeError("a defect of kafka_idem's async completion")
        await real(self, *args, **kwargs)

    monkeypatch.setattr(Store, "complete_async", complete_async)

    async def handler(msg: payments.ChargeRequested, ctx: Any) -> Any:
        await ctx.tx.execute("SELECT 1")
        return {"order_id": msg.order_id}

    produce(topic, [(b"o1", encode_charge("t1", "o1", "10.00"))])
    app = charge_app(db, topic, group, handler, mode="leased",
                     retry=RetryPolicy(base=0.1, cap=0.1, max_attempts=5))
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), what="the partition to drain")
    assert broken == ["t1:charge:o1"]
    rec = db.record("t1:charge:o1")
    assert rec is not None
    assert (rec["status"], rec["attempts"], rec["error_kind"]) == ("succeeded", 1, None)
    assert dlq_records(topic) == []
