"""The test kit's parts that need no database: the stub message, the fake remote
service, dead letters captured by the framework's own DLQ code, the payloads the
scenario matrix derives (a conflict, other keys), and how emitted events are compared."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, Field

from consumers import payments
from kafka_idem import App
from kafka_idem.consume.outcome import Finished
from kafka_idem.consume.paths.processor import Processor
from kafka_idem.deadletters.dead_letter import REQUIRED_HEADERS, DeadLetter
from kafka_idem.observe.metrics import Metrics
from kafka_idem.store import Store
from kafka_idem.testing import FakeMessage, FakeService
from kafka_idem.testing.events import Compared, EmittedEvent, compare_events, made_fields
from kafka_idem.testing.letters import LetterBox
from kafka_idem.testing.plugin import _frozen
from kafka_idem.testing.values import conflicting, other_keys


def test_a_fake_message_reads_like_a_kafka_message() -> None:
    msg = FakeMessage("orders", partition=2, offset=7, key="o-1", value='{"a": 1}',
                      headers={"trace": "abc", "empty": None}, timestamp=1_700_000_000_000)
    assert (msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value()) == (
        "orders", 2, 7, b"o-1", b'{"a": 1}')
    assert msg.headers() == [("trace", b"abc"), ("empty", None)]
    assert msg.timestamp() == (1, 1_700_000_000_000) and msg.error() is None
    assert FakeMessage("orders").timestamp() == (0, -1) and FakeMessage("orders").headers() \
        is None
    moved = msg.moved(offset=8)
    assert (moved.offset(), moved.value(), moved.headers(), moved.timestamp()) == (
        8, msg.value(), msg.headers(), msg.timestamp())
    assert msg == FakeMessage("orders", partition=2, offset=7, key=b"o-1", value=b'{"a": 1}',
                              headers=[("trace", "abc"), ("empty", None)],
                              timestamp=1_700_000_000_000)


def test_the_fake_service_applies_an_operation_once_per_key() -> None:
    bank = FakeService("bank")
    first = bank.call("charge", key="k1", amount="10")
    again = bank.call("charge", key="k1", amount="10")
    assert first == again == {"id": "bank-1", "operation": "charge", "key": "k1",
                              "amount": "10"}
    bank.call("charge", amount="10")
    bank.call("charge", amount="10")
    assert bank.effects() == [("charge", "k1", (("amount", "10"),)),
                              ("charge", None, (("amount", "10"),)),
                              ("charge", None, (("amount", "10"),))]
    assert [c.applied for c in bank.calls] == [True, False, True, True]
    assert bank.find("k1") == first and bank.find("k2") is None
    bank.reset()
    assert bank.effects() == [] and bank.calls == []
    assert bank.call("charge", key="k2")["id"] == "bank-1"  # numbered from 1 again


def test_dead_letters_are_captured_by_the_framework_s_own_dlq_code() -> None:
    source = FakeMessage("orders", offset=3, key=b"o-1", value=b"\x00bytes",
                         headers=[("trace", b"t")], timestamp=5)
    letter = DeadLetter(dlq_topic="orders.dlq", source=source, kind="permanent",
                        error_class="Permanent", error_message="no", attempts=1,
                        consumer_group="g", handler="h", idempotency_key="t:o-1",
                        namespace="ns", first_failure_at=dt.datetime(2025, 1, 1, tzinfo=dt.UTC),
                        last_failure_at=dt.datetime(2025, 1, 2, tzinfo=dt.UTC))
    box = LetterBox(header_limit=1024)
    [kept] = box.send({("orders", 0): [Finished("dead_lettered", letter, key="t:o-1")]})
    assert (kept.topic(), kept.offset(), kept.key(), kept.value()) == (
        "orders.dlq", 0, b"o-1", b"\x00bytes")
    assert kept.headers() == letter.headers(1024)
    assert set(REQUIRED_HEADERS) <= set(kept.idem)
    assert (kept.kind, kept.header("idem.key"), kept.header("trace")) == (
        "permanent", "t:o-1", "t")
    assert box.letters == [kept]


class Order(BaseModel):
    tenant_id: str
    order_id: str = Field(min_length=2)
    currency: str = Field(pattern=r"^[A-Z]{3}$")
    amount: Decimal = Field(gt=0)
    at: dt.datetime


def prepared(app: App, topic: str) -> Any:
    proc = Processor(app, store=Store(schema="kafka_idem", table="t", namespace="n"),
                     metrics=Metrics())
    handler = app.handlers[topic]
    return handler, lambda data: proc.prepare(handler, FakeMessage(topic, value=data))


def test_a_conflict_keeps_the_key_and_changes_a_hashed_field_the_model_accepts() -> None:
    app = App("derive")
    app.handler(topic="orders", model=Order, key="{tenant_id}:o:{order_id}",
                hash_fields=("currency",), format="json")(lambda m, c: None)
    handler, prepare = prepared(app, "orders")
    data = handler.encode({"tenant_id": "t1", "order_id": "o1", "currency": "EUR",
                           "amount": "5", "at": dt.datetime(2025, 1, 1, tzinfo=dt.UTC)})
    other = conflicting(handler, data, prepare)
    assert other is not None
    first, second = prepare(data), prepare(other)
    assert second.key == first.key and second.request_hash != first.request_hash
    assert second.model.currency == "EUS"  # "EUR2" does not match the pattern
    keys = [prepare(d).key for d in other_keys(handler, data, prepare, 2)]
    assert keys == ["t1:o:o12", "t1:o:o2"]  # the business id changes, not the tenant


def test_payloads_are_derived_for_avro_too() -> None:
    handler, prepare = prepared(payments.app, payments.TOPIC)
    data = payments.encode_charge("t1", "o-1", "10.00")
    other = conflicting(handler, data, prepare)
    assert other is not None and prepare(other).model.amount == Decimal("11.00")
    assert len(other_keys(handler, data, prepare, 2)) == 2


def test_options_are_keyed_by_value_and_objects_by_identity() -> None:
    marker = object()
    assert _frozen({"b": [1, 2], "a": {"x"}}) == _frozen({"a": {"x"}, "b": [1, 2]})
    assert _frozen({"setup": marker}) == (("setup", ("id", id(marker))),)


def _event(decoded: Any, *, key: bytes | None = b"o-1",
           headers: tuple[tuple[str, bytes], ...] = ()) -> EmittedEvent:
    return EmittedEvent(topic="shop.placed", key=key, value=b"...", headers=headers,
                        decoded=decoded, idem_key="t1:o-1", source=("shop.orders", 0, 0))


def test_an_event_is_compared_field_by_field_without_its_trace_context() -> None:
    at = dt.datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=dt.UTC)
    event = _event({"order": {"id": 1, "at": at}, "items": [{"sku": "a"}]},
                   headers=(("traceparent", b"00-aa"), ("tenant", b"t1")))
    assert event.fields() == {"order.id": 1, "order.at": at, "items[0].sku": "a"}
    assert event.header("tenant") == b"t1"
    again = _event(event.decoded, headers=(("traceparent", b"00-bb"), ("tenant", b"t1")))
    how = Compared()
    assert compare_events([event], [again], how, what="the reference") == []
    [problem] = compare_events([event], [again, again], how, what="the reference")
    assert problem.splitlines() == [
        "events to shop.placed: 2 event(s), the reference has 1",
        "  extra   key 'o-1': {order.id: 1, order.at: 2026-01-02T03:04:05.123456+00:00, "
        "items[0].sku: 'a'}; headers {tenant: 't1'}"]
    other = _event({"order": {"id": 2, "at": at}, "items": [{"sku": "a"}]},
                   headers=(("tenant", b"t1"),))
    assert compare_events([event], [other], Compared({"shop.placed": frozenset(
        {"order.id"})}), what="x") == []


def test_a_field_is_the_databases_only_when_both_values_are_one_columns() -> None:
    t1 = dt.datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=dt.UTC)
    t2 = t1 + dt.timedelta(seconds=1)
    first = [_event({"row": 1, "at": t1.replace(microsecond=123000), "n": 7, "id": "x1"})]
    second = [_event({"row": 1001, "at": t2, "n": 8, "id": "x2"})]
    made = {"shop.orders.id": [1], "shop.orders.created_at": [t1]}
    moved = {"shop.orders.id": [1001], "shop.orders.created_at": [t2]}
    # n and id differ but come from no column: a counter, a random id, compared
    assert made_fields(first, made, second, moved) == {
        "shop.placed": {"row": ("shop.orders.id",), "at": ("shop.orders.created_at",)}}
    # two columns with the value in both deliveries (two now() in one transaction): both
    made |= {"shop.lines.created_at": [t1]}
    moved |= {"shop.lines.created_at": [t2]}
    assert made_fields(first, made, second, moved)["shop.placed"]["at"] == (
        "shop.lines.created_at", "shop.orders.created_at")
    # one of them in the reference only (its sequence moved elsewhere): not that one
    moved["shop.lines.created_at"] = [t1]
    assert made_fields(first, made, second, moved)["shop.placed"]["at"] == (
        "shop.orders.created_at",)
    swapped = {"shop.orders.id": [t2], "shop.orders.created_at": [1001]}
    assert made_fields(first, made, second, swapped) == {}  # not the same column
    assert made_fields(first, made, second + second, moved) == {}  # not the same events


def test_the_concurrent_scenario_sees_waiters_queued_behind_another_waiter() -> None:
    """On a row that exists the second waiter queues on the first one's tuple lock:
    ``pg_blocking_pids`` names that waiter, not the holder (100). Both wait on the
    holder; a backend blocked by someone else entirely (7) does not."""
    from kafka_idem.testing.scenarios import _waiting_on

    edges = [(201, 100), (202, 201), (203, 202), (300, 7), (301, 300)]
    assert _waiting_on(100, edges) == {201, 202, 203}
    assert _waiting_on(100, list(reversed(edges))) == {201, 202, 203}
    assert _waiting_on(100, []) == set()
