"""The transactional outbox (docs/OUTBOX.md), ctx.emit in every mode: an event for
each effect that committed, exactly once for read_committed readers, with the
intent's headers; none for a rolled-back effect, a lost lease, a conflict or a
replay; the batch path's fallback emits once."""

from __future__ import annotations

import gc
import json
import logging
import warnings
from decimal import Decimal
from typing import Any

import pytest
from confluent_kafka import Producer
from pydantic import BaseModel

from consumers import payments
from consumers.payments import encode_charge
from kafka_idem import Context, Permanent, RetryPolicy
from kafka_idem.handler import AsyncContext
from kafka_idem.store import Delivery, Store, connect
from tests.conftest import BOOTSTRAP, DB, InProcess, Topics, caught_up, headers, produce, wait_for
from tests.integration.outbox_support import (
    RelayThread,
    emitting,
    event_of,
    events_by_key,
    outbox_app,
    wait_published,
)
from tests.integration.support import dlq_records


def charges(*orders: tuple[str, str]) -> list[tuple[bytes, bytes]]:
    return [(o.encode(), encode_charge("t1", o, a)) for o, a in orders]


def processed(app: Any, group: str) -> None:
    wait_for(lambda: caught_up(group, app.topics[0]), what="the charges")


def test_local_mode_emit_is_published_once_with_the_intent_headers(
    db: DB, topics: Topics, group: str
) -> None:
    app, events = outbox_app(db, topics, group, batch_path=False)
    source = app.topics[0]
    produce(source, charges(("o1", "1.00"), ("o2", "2.00"), ("o1", "1.00")))  # o1 again: replay
    with InProcess(app), RelayThread(app):
        processed(app, group)
        got = wait_published(db, events, 2)
    assert sorted(m.key() for m in got) == [b"o1", b"o2"]
    first = next(m for m in got if m.key() == b"o1")
    h = headers(first)
    assert json.loads(first.value()) == {"order_id": "o1", "amount": "1.00", "attempt": 1}
    assert h["idem.key"] == "t1:charge:o1"
    assert h["idem.namespace"] == app.namespace
    assert h["idem.source.topic"] == source
    assert (h["idem.source.partition"], h["idem.source.offset"]) == ("0", "0")
    assert h["x-test"] == "yes" and int(h["idem.outbox.id"]) > 0


@pytest.mark.parametrize("batch_path", [True, False], ids=["batch", "per-message"])
def test_no_event_for_a_failure_a_conflict_or_a_replay(
    db: DB, topics: Topics, group: str, batch_path: bool
) -> None:
    app, events = outbox_app(db, topics, group, batch_path=batch_path)
    # o2: a negative amount fails after its emit (Permanent: dead-lettered); o1 again with
    # another amount: a conflict; o1 again as it was: a replay.
    produce(app.topics[0], charges(("o1", "1.00"), ("o2", "-1.00"), ("o1", "9.00"),
                                   ("o1", "1.00"), ("o3", "3.00")))
    with InProcess(app), RelayThread(app):
        processed(app, group)
        wait_published(db, events, 2)
    by_key = events_by_key(events)
    assert {k: len(v) for k, v in by_key.items()} == {"o1": 1, "o3": 1}
    assert db.ledger_counts() == {"t1:charge:o1": 1, "t1:charge:o3": 1}


def test_bulk_handler_items_emit_and_a_batch_fallback_emits_each_once(
    db: DB, topics: Topics, group: str
) -> None:
    app, events = outbox_app(db, topics, group)
    failed_once: list[str] = []

    def bulk(batch: list[tuple[payments.ChargeRequested, Context]], tx: Any) -> list[Any]:
        for msg, ctx in batch:
            ctx.emit(events, event_of(msg, ctx), key=msg.order_id)
        if any(m.order_id == "o3" for m, _ in batch) and not failed_once:
            failed_once.append("o3")
            raise RuntimeError("the whole batch falls back once")
        return payments.charge_many(batch, tx)

    app.handlers[app.topics[0]].bulk_handler(bulk)
    produce(app.topics[0], charges(*[(f"o{i}", "1.00") for i in range(6)], ("o9", "-1.00")))
    with InProcess(app), RelayThread(app):
        processed(app, group)
        wait_published(db, events, 6)
    assert failed_once == ["o3"]  # the fallback ran: its per-message re-run emitted again
    by_key = events_by_key(events)
    assert {k: len(v) for k, v in by_key.items()} == {f"o{i}": 1 for i in range(6)}
    assert sum(db.ledger_counts().values()) == 6


def test_leased_mode_an_emit_of_an_attempt_whose_lease_was_lost_does_not_survive(
    db: DB, topics: Topics, group: str
) -> None:
    events = topics(partitions=1, dlq=False, prefix="ev")

    def steal_then_charge(msg: payments.ChargeRequested, ctx: Context) -> Any:
        if ctx.attempt == 1:  # another owner takes the key over while this attempt runs
            store = Store(schema="kafka_idem", table="task_idempotency", namespace="failures")
            with connect(db.dsn) as other:
                store.expire_leases(other, key=ctx.idempotency_key)
                store.claim(other, key=ctx.idempotency_key, request_hash=ctx.request_hash,
                            delivery=Delivery(ctx.topic, ctx.partition, ctx.offset, "thief"),
                            lease_seconds=1.0, max_attempts=5, max_elapsed_seconds=3600)
                other.commit()
        return payments.charge(msg, ctx)

    app, _ = outbox_app(db, topics, group, emitting(events, steal_then_charge), events=events,
                        mode="leased", lease_seconds=1.0, busy_retry_seconds=0.2)
    produce(app.topics[0], charges(("o1", "1.00")))
    with InProcess(app), RelayThread(app):
        processed(app, group)
        got = wait_published(db, events, 1)
    assert [json.loads(m.value())["attempt"] for m in got] == [3]  # not the first attempt's
    assert db.ledger_counts() == {"t1:charge:o1": 1}


def test_async_handler_await_emit(db: DB, topics: Topics, group: str) -> None:
    events = topics(partitions=1, dlq=False, prefix="ev")

    async def charge(msg: payments.ChargeRequested, ctx: AsyncContext) -> Any:
        await ctx.emit(events, event_of(msg, ctx), key=msg.order_id)
        return await payments.charge_async(msg, ctx)

    app, _ = outbox_app(db, topics, group, charge, events=events, mode="leased")
    produce(app.topics[0], charges(("o1", "1.00"), ("o2", "-5.00"), ("o3", "3.00")))
    with InProcess(app), RelayThread(app):
        processed(app, group)
        wait_published(db, events, 2)
    assert sorted(events_by_key(events)) == ["o1", "o3"]
    assert db.balances() == {("t1", "EUR"): Decimal("4.00")}


def test_async_handler_that_forgets_await_on_emit_still_emits_once_with_its_effect(
    db: DB, topics: Topics, group: str
) -> None:
    """``ctx.emit(...)`` without ``await`` registers the event at the call: it is
    published once with the charge; an attempt that raises after emitting (a Permanent
    rejection, a retried error) takes its event back with its transaction; no
    "never awaited" warning."""
    events = topics(partitions=1, dlq=False, prefix="ev")

    async def charge(msg: payments.ChargeRequested, ctx: AsyncContext) -> Any:
        ctx.emit(events, event_of(msg, ctx), key=msg.order_id)  # no await: the user's slip
        if msg.order_id == "o4" and ctx.attempt == 1:
            raise RuntimeError("the downstream failed after the emit: retried")
        return await payments.charge_async(msg, ctx)  # o2's negative amount: Permanent

    app, _ = outbox_app(db, topics, group, charge, events=events, mode="leased",
                        retry=RetryPolicy(base=0.05, cap=0.05, max_attempts=3))
    produce(app.topics[0], charges(("o1", "1.00"), ("o2", "-5.00"), ("o3", "3.00"),
                                   ("o4", "4.00")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with InProcess(app), RelayThread(app):
            processed(app, group)
            got = wait_published(db, events, 3)
        gc.collect()
    assert sorted((m.key(), json.loads(m.value())["attempt"]) for m in got) == [
        (b"o1", 1), (b"o3", 1), (b"o4", 2)]
    assert {k: len(v) for k, v in events_by_key(events).items()} == {"o1": 1, "o3": 1, "o4": 1}
    assert db.ledger_counts() == {"t1:charge:o1": 1, "t1:charge:o3": 1, "t1:charge:o4": 1}
    record = db.record("t1:charge:o2")
    assert record is not None and record["status"] == "failed"
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_emit_to_an_undeclared_topic_is_a_configuration_error_that_holds_the_message(
    db: DB, topics: Topics, group: str
) -> None:
    def bad(msg: payments.ChargeRequested, ctx: Context) -> Any:
        ctx.emit("not.declared", {"x": 1})
        return payments.charge(msg, ctx)

    app, _ = outbox_app(db, topics, group, bad)
    produce(app.topics[0], charges(("o1", "1.00")))
    with InProcess(app) as r:
        wait_for(lambda: r.runner.metrics.config_errors.labels(
            app.topics[0], "charge")._value.get() > 0, what="the configuration error")
    assert db.ledger_counts() == {} and db.record("t1:charge:o1") is None  # held, not charged


def test_permanent_rejection_from_a_bulk_handler_drops_that_items_events(
    db: DB, topics: Topics, group: str
) -> None:
    app, events = outbox_app(db, topics, group)

    def bulk(batch: list[tuple[payments.ChargeRequested, Context]], tx: Any) -> list[Any]:
        for msg, ctx in batch:
            ctx.emit(events, event_of(msg, ctx), key=msg.order_id)
        out = payments.charge_many(batch, tx)  # o1's negative amount: a Permanent result
        assert isinstance(out[0], Permanent)
        return out

    app.handlers[app.topics[0]].bulk_handler(bulk)
    produce(app.topics[0], charges(("o1", "-1.00"), ("o2", "2.00"), ("o3", "3.00")))
    with InProcess(app) as r, RelayThread(app):
        processed(app, group)
        wait_published(db, events, 2)
        fallbacks = r.runner.metrics.messages.labels(app.topics[0], "charge", "succeeded")
    assert sorted(events_by_key(events)) == ["o2", "o3"]
    assert fallbacks._value.get() == 2


def test_an_event_carries_the_source_messages_trace_context_without_a_tracer(
    db: DB, topics: Topics, group: str
) -> None:
    app, events = outbox_app(db, topics, group)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    producer = Producer({"bootstrap.servers": BOOTSTRAP})
    producer.produce(app.topics[0], key=b"o1", value=encode_charge("t1", "o1", "1.00"),
                     headers=[("traceparent", parent.encode())])
    producer.flush(30)
    with InProcess(app), RelayThread(app):
        processed(app, group)
        (event,) = wait_published(db, events, 1)
    assert headers(event)["traceparent"] == parent


class Receipt(BaseModel):
    order_id: str
    amount: Decimal


SECRET = "card-4111-1111-1111-1111"  # a value the handler's event must never show


def one_dead_letter(app: Any) -> dict[str, str]:
    """One charge through ``app``: the headers of its one dead letter."""
    source = app.topics[0]
    produce(source, charges(("o1", "1.00")))
    with InProcess(app):
        wait_for(lambda: dlq_records(source), what="the dead letter")
    [letter] = dlq_records(source)
    return headers(letter)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_event_its_model_rejects_dead_letters_the_message_by_field_paths_never_values(
    db: DB, topics: Topics, group: str, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    caplog.set_level(logging.INFO, logger="kafka_idem")
    events = topics(partitions=1, dlq=False, prefix="ev")

    def bad(msg: payments.ChargeRequested, ctx: Context) -> Any:
        ctx.emit(events, {"order_id": msg.order_id, "amount": SECRET}, key=msg.order_id)
        return payments.charge(msg, ctx)

    async def bad_async(msg: payments.ChargeRequested, ctx: AsyncContext) -> Any:
        await ctx.emit(events, {"order_id": msg.order_id, "amount": SECRET}, key=msg.order_id)
        return await payments.charge_async(msg, ctx)

    fn, mode = (bad, "local") if kind == "sync" else (bad_async, "leased")
    app, _ = outbox_app(db, topics, group, fn, events=events, mode=mode)
    app.event_topic(events, model=Receipt)
    h = one_dead_letter(app)
    assert h["idem.error.kind"] == "permanent" and h["idem.error.class"] == "InvalidEvent"
    assert h["idem.error.message"] == (
        f"ctx.emit({events!r}): the event does not validate against Receipt: "
        "amount: Input should be a valid decimal")
    record = db.record("t1:charge:o1")
    assert record is not None and record["status"] == "failed"
    assert record["error_class"] == "InvalidEvent" and SECRET not in record["error_message"]
    assert db.ledger_counts() == {}  # the charge rolled back with the event
    assert db.rows(f"SELECT count(*) AS n FROM {app.settings.schema_name}.outbox")[0]["n"] == 0
    assert not any(SECRET in r.getMessage() or SECRET in str(r.__dict__) for r in caplog.records)


def test_a_handlers_own_validation_error_is_recorded_by_field_paths_never_values(
    db: DB, topics: Topics, group: str
) -> None:
    def bad(msg: payments.ChargeRequested, ctx: Context) -> Any:
        Receipt(order_id=msg.order_id, amount=SECRET)  # type: ignore[arg-type]
        return payments.charge(msg, ctx)

    app, _ = outbox_app(db, topics, group, bad)
    h = one_dead_letter(app)
    assert h["idem.error.class"] == "ValidationError"
    assert h["idem.error.message"] == (
        "1 validation error(s) for Receipt: amount: Input should be a valid decimal")
