"""Harness.deliver: the real protocol on a throwaway database, what it returns (the
outcome, the record, the stored result, the dead letters with the headers a consumer
writes), the kit's clock, its clean slate and its databases."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any, Literal

import psycopg
import pytest
from pydantic import BaseModel

from consumers import payments
from kafka_idem import App, Context, IllegalTransition, Retryable, RetryPolicy
from kafka_idem.store import Delivery, Store
from kafka_idem.testing import Harness
from tests.apps import kit_shop
from tests.conftest import ADMIN_DSN, DB, InProcess, Topics, produce, wait_for
from tests.integration.support import assert_dead_letter, charge_app, dlq_records

Make = Callable[..., Harness]
KEY = "t1:charge:o-1"


def charge(amount: str = "10.00", order: str = "o-1") -> dict[str, Any]:
    return payments.charge_payload("t1", order, amount)


def test_a_delivery_succeeds_once_and_its_duplicates_replay_the_stored_result(
    kafka_idem_harness: Make,
) -> None:
    harness = kafka_idem_harness(payments.app)
    first = harness.deliver(payments.TOPIC, charge(), key="o-1")
    assert (first.outcome, first.steps, first.key, first.status) == (
        "succeeded", ("succeeded",), KEY, "succeeded")
    assert first.result == {"order_id": "o-1", "amount": "10.00", "currency": "EUR"}
    assert first.record is not None and first.record["namespace"] == "payments"
    assert first.message.key() == b"o-1" and first.message.offset() == 0
    again = harness.redeliver(first.message)  # the same record, after a restart
    resent = harness.deliver(payments.TOPIC, charge())  # a producer's retry: a new record
    assert (again.outcome, resent.outcome) == ("replayed", "replayed")
    assert again.result == resent.result == first.result
    assert resent.message.offset() == 1
    assert [(r["idempotency_key"], r["amount"]) for r in harness.rows("payments.ledger")] == [
        (KEY, Decimal("10.00"))]
    assert harness.dead_letters == []


def test_a_delivery_says_which_events_it_emitted(kafka_idem_harness: Make) -> None:
    harness = kafka_idem_harness(payments.app)
    first = harness.deliver(payments.TOPIC, charge(), headers={"traceparent": TRACE})
    [event] = first.events
    assert (event.topic, event.key, event.idem_key) == ("payments.charge-completed", b"o-1",
                                                        KEY)
    assert event.source == (payments.TOPIC, 0, first.message.offset())
    assert isinstance(event.decoded, payments.ChargeCompleted)
    assert (event.decoded.amount, event.decoded.ledger_entry.id) == (Decimal("10.00"), 1)
    assert event.fields() is not None and event.fields()["ledger_entry.id"] == 1
    assert event.header("traceparent") == TRACE.encode()  # the trace goes on
    assert harness.events("payments.charge-completed") == [event]
    again = harness.redeliver(first.message)
    conflict = harness.deliver(payments.TOPIC, charge("99.00"))
    rejected = harness.deliver(payments.TOPIC, charge("-1.00", order="o-2"))
    assert (again.outcome, conflict.outcome, rejected.outcome) == (
        "replayed", "conflict", "dead_lettered")
    assert again.events == conflict.events == rejected.events == ()
    assert harness.events() == [event]
    harness.reset()
    assert harness.events() == []


TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_payload_and_the_bytes_a_producer_sends_are_one_message(
    kafka_idem_harness: Make,
) -> None:
    harness = kafka_idem_harness(payments.app)
    payload = charge()
    assert harness.deliver(payments.TOPIC, payload).outcome == "succeeded"
    raw = payments.app.handlers[payments.TOPIC].encode(payload)
    assert harness.deliver(payments.TOPIC, raw).outcome == "replayed"


def test_dead_letters_carry_every_header_a_consumer_writes(kafka_idem_harness: Make) -> None:
    harness = kafka_idem_harness(payments.app)
    bad = harness.deliver(payments.TOPIC, charge("0"), key="o-1",
                          headers={"traceparent": "00-abc-01"})
    assert (bad.outcome, bad.status) == ("dead_lettered", "failed")
    [letter] = bad.dead_letters
    assert letter.topic() == f"{payments.TOPIC}.dlq"
    assert_dead_letter(letter, bad.message, kind="permanent", attempts=1, group="payments",
                       key=KEY, record=bad.record)
    assert letter.header("traceparent") == "00-abc-01"
    assert letter.idem["idem.namespace"] == "payments"
    harness.deliver(payments.TOPIC, charge(order="o-2"))
    conflict = harness.deliver(payments.TOPIC, charge("11.00", order="o-2"))
    assert conflict.outcome == "conflict" and conflict.dead_letters[0].kind == "payload_conflict"
    junk = harness.deliver(payments.TOPIC, b"not avro")
    assert (junk.outcome, junk.record, junk.key) == ("dead_lettered", None, None)
    assert junk.dead_letters[0].kind == "undecodable"
    assert junk.dead_letters[0].value() == b"not avro"
    assert "idem.key" not in junk.dead_letters[0].idem
    assert [d.kind for d in harness.dead_letters] == ["permanent", "payload_conflict",
                                                      "undecodable"]
    assert [d.offset() for d in harness.dead_letters] == [0, 1, 2]


def test_the_kit_writes_the_dead_letters_the_runner_writes(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=1)
    app = charge_app(db, topic, group)
    value = payments.encode_charge("t1", "o-1", "0")
    produce(topic, [(b"o-1", value)])
    with InProcess(app):
        [sent] = wait_for(lambda: dlq_records(topic), timeout=60, what="the dead letter")
    with Harness(app, database_url=ADMIN_DSN) as harness:
        [kept] = harness.redeliver(kit_message(topic, value)).dead_letters

    def comparable(msg: Any) -> list[tuple[str, bytes | None]]:
        moving = ("idem.original.timestamp", "idem.first_failure_at", "idem.last_failure_at")
        return [(k, v) for k, v in msg.headers() if k not in moving]

    assert (kept.topic(), kept.key(), kept.value()) == (sent.topic(), sent.key(), sent.value())
    assert comparable(kept) == comparable(sent)


def kit_message(topic: str, value: bytes) -> Any:
    from kafka_idem.testing import FakeMessage

    return FakeMessage(topic, partition=0, offset=0, key=b"o-1", value=value)


def test_retries_are_decided_and_counted_without_waiting_for_their_backoff(
    kafka_idem_harness: Make,
) -> None:
    app = App("flaky", schemas_dir=payments.SCHEMAS_DIR)
    app.migration(payments.create_tables)

    # a backoff of 10 minutes each time: the test would time out if it were waited for
    @app.handler(topic="flaky.charges", model=payments.ChargeRequested,
                 key="{tenant_id}:charge:{order_id}", hash_fields=("amount",),
                 retry=RetryPolicy(base=600, cap=600, max_attempts=3))
    def flaky(msg: payments.ChargeRequested, ctx: Context) -> None:
        payments.charge(msg, ctx)
        raise Retryable(f"not yet (attempt {ctx.attempt})")

    harness = kafka_idem_harness(app)
    d = harness.deliver("flaky.charges", charge())
    assert d.steps == ("retry", "retry", "dead_lettered")
    assert (d.status, d.attempts, d.dead_letters[0].kind) == ("failed", 3, "exhausted")
    assert "not yet (attempt 3)" in d.record["error_message"]  # type: ignore[index]
    assert harness.rows("payments.ledger") == []


def test_a_lease_held_by_another_owner_is_busy_until_the_kit_lets_it_expire(
    kafka_idem_harness: Make,
) -> None:
    harness = kafka_idem_harness(kit_shop.app, remotes={"bank": kit_shop.bank})
    order = {"tenant_id": "t1", "order_id": "o-1", "amount": "3.00"}
    key = "t1:pay:o-1"
    store = harness.current.store
    prep = harness.current.main.prepare(harness.handler(kit_shop.PAYMENTS),
                                        harness.message(kit_shop.PAYMENTS, order))
    claim = store.claim_new(harness.current.conn(), key=key, request_hash=prep.request_hash,
                            delivery=Delivery(kit_shop.PAYMENTS, 0, 0, "pay"),
                            lease_seconds=300)
    assert claim is not None  # another member holds it for five minutes
    busy = harness.deliver(kit_shop.PAYMENTS, order)
    assert (busy.outcome, busy.reason, busy.status) == ("deferred", "busy", "processing")
    assert harness.expire_leases() == [key]
    assert harness.expire_leases() == []  # no live lease left
    taken = harness.deliver(kit_shop.PAYMENTS, order)
    assert (taken.outcome, taken.attempts) == ("succeeded", 2)  # taken over, attempt 2
    assert kit_shop.bank.effects() == [("charge", key, (("amount", "3.00"),))]


def test_reset_gives_the_state_the_migrations_left(kafka_idem_harness: Make) -> None:
    harness = kafka_idem_harness(kit_shop.app, remotes={"bank": kit_shop.bank})
    order = {"tenant_id": "t1", "order_id": "o-1", "amount": "3.00"}
    d = harness.deliver(kit_shop.ORDERS, order)
    with psycopg.connect(harness.dsn) as conn:
        conn.execute("SELECT nextval('shop.invoice_no')")
        conn.execute("INSERT INTO shop.orders (key, order_id, amount) VALUES ('x', 'x', 1)")
    assert [r["n"] for r in harness.rows("shop.counters")] == [1]
    harness.reset()
    assert harness.rows("shop.orders") == [] and harness.dead_letters == []
    assert [(r["name"], r["n"]) for r in harness.rows("shop.counters")] == [("orders", 0)]
    assert harness.current.record(d.key) is None
    assert kit_shop.bank.effects() == []
    with psycopg.connect(harness.dsn) as conn:
        assert conn.execute("SELECT nextval('shop.invoice_no')").fetchone() == (1,)
        assert conn.execute("SELECT nextval('shop.orders_id_seq')").fetchone() == (1,)
    assert harness.deliver(kit_shop.ORDERS, order).outcome == "succeeded"


def test_the_store_is_wiped_only_in_a_database_of_the_kit(db: DB) -> None:
    store = Store(schema="kafka_idem", table="task_idempotency")
    with psycopg.connect(db.dsn) as conn, pytest.raises(IllegalTransition):
        store.wipe(conn)


def test_the_harness_drops_its_databases_when_it_closes() -> None:
    harness = Harness(kit_shop.app, database_url=ADMIN_DSN)
    prefix = harness.databases.base

    def made() -> list[str]:
        with psycopg.connect(ADMIN_DSN) as conn:
            rows = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE %s",
                                (prefix + "%",)).fetchall()
        return sorted(r[0] for r in rows)

    assert made() == [prefix, prefix + "_check"]
    harness.close()
    assert made() == []


class Tagged(BaseModel):
    tenant_id: str
    order_id: str
    currency: Literal["EUR"]  # no other value validates: no conflicting payload exists


def test_the_tables_and_the_columns_a_check_compares(kafka_idem_harness: Make) -> None:
    app = App(f"tables-{uuid.uuid4().hex[:6]}")

    @app.migration
    def tables(conn: Any) -> None:
        conn.execute("CREATE SCHEMA tagged")
        conn.execute("CREATE TABLE tagged.orders (id bigint GENERATED ALWAYS AS IDENTITY "
                     "PRIMARY KEY, ref uuid NOT NULL DEFAULT gen_random_uuid(), key text, "
                     "remote_id text, at timestamptz DEFAULT clock_timestamp())")
        conn.execute("CREATE TABLE tagged.lines (order_id bigint REFERENCES tagged.orders, "
                     "n integer)")

    @app.handler(topic="tagged", model=Tagged, key="{tenant_id}:tag:{order_id}",
                 hash_fields=("currency",), format="json")
    def tag(msg: Tagged, ctx: Context) -> None:
        row = ctx.tx.execute("INSERT INTO tagged.orders (key, remote_id) VALUES (%s, %s) "
                             "RETURNING id", (ctx.idempotency_key, uuid.uuid4().hex))
        ctx.tx.execute("INSERT INTO tagged.lines VALUES (%s, 1)", (row.fetchone()[0],))

    harness = kafka_idem_harness(app, ignore={"tagged.orders": ["remote_id"]})
    assert [(t.name, t.columns, dict(t.left_out)) for t in harness.tables] == [
        ("tagged.lines", ("n",), {"order_id": "references tagged.orders.id"}),
        ("tagged.orders", ("key",), {"id": "identity",
                                     "ref": "default gen_random_uuid()",
                                     "remote_id": "ignored",
                                     "at": "default clock_timestamp()"})]
    value = {"tenant_id": "t1", "order_id": "o-1", "currency": "EUR"}
    report = harness.check("tagged", value)
    assert report.passed
    assert report.result("conflict", "per-message").skipped == (
        "no payload with the same key and another request hash could be made from this "
        "one: pass conflict=")
    with pytest.raises(ValueError, match="lacks"):
        Harness(app, database_url=ADMIN_DSN, ignore={"tagged.orders": ["nope"]})


def test_a_check_with_nothing_to_compare_is_refused(kafka_idem_harness: Make) -> None:
    app = App(f"bare-{uuid.uuid4().hex[:6]}")
    app.handler(topic="bare", model=Tagged, key="{tenant_id}:tag:{order_id}",
                hash_fields=("currency",), format="json")(lambda msg, ctx: None)
    harness = kafka_idem_harness(app)
    with pytest.raises(Exception, match="nothing to compare"):
        harness.check("bare", {"tenant_id": "t1", "order_id": "o-1", "currency": "EUR"})


def test_a_store_beside_the_app_s_tables_in_one_schema_is_reset_with_them(
    kafka_idem_harness: Make,
) -> None:
    app = App(f"beside-{uuid.uuid4().hex[:6]}", schema_name="shared")

    @app.migration
    def tables(conn: Any) -> None:
        conn.execute("CREATE TABLE shared.things (id serial, key text)")

    @app.handler(topic="things", model=Tagged, key="{tenant_id}:tag:{order_id}",
                 hash_fields=("currency",), format="json")
    def thing(msg: Tagged, ctx: Context) -> None:
        ctx.tx.execute("INSERT INTO shared.things (key) VALUES (%s)", (ctx.idempotency_key,))

    harness = kafka_idem_harness(app)
    assert [t.name for t in harness.tables] == ["shared.things"]
    value = {"tenant_id": "t1", "order_id": "o-1", "currency": "EUR"}
    assert harness.deliver("things", value).outcome == "succeeded"
    harness.reset()
    assert harness.rows("shared.things") == []
    again = harness.deliver("things", value)
    assert (again.outcome, [r["id"] for r in harness.rows("shared.things")]) == (
        "succeeded", [1])


@pytest.mark.parametrize(("result", "why"), [
    ({"tags": {"c-1"}}, "Object of type set is not JSON serializable"),
    # what json.dumps writes but PostgreSQL's jsonb refuses: the result's fault, not the
    # message's data
    ({"ratio": float("nan")}, "Out of range float values are not JSON compliant"),
    ({"note": "a\x00b"}, "a string holds U+0000, which PostgreSQL's jsonb cannot store"),
], ids=["set", "nan", "nul"])
@pytest.mark.parametrize("mode", ["local", "leased"])
def test_a_result_that_is_not_json_is_dead_lettered_saying_what_to_return(
    kafka_idem_harness: Make, mode: Literal["local", "leased"], caplog: pytest.LogCaptureFixture,
    result: Any, why: str,
) -> None:
    class Loan(BaseModel):
        branch: str
        copy_id: str

    app = App(f"loans-{mode}", max_attempts=2)

    @app.migration
    def tables(conn: Any) -> None:
        conn.execute("CREATE SCHEMA IF NOT EXISTS library")
        conn.execute("CREATE TABLE IF NOT EXISTS library.loans (copy_id text)")

    @app.handler(topic="loans", model=Loan, key="{branch}:loan:{copy_id}",
                 hash_fields=("copy_id",), mode=mode)
    def checkout(msg: Loan, ctx: Context) -> Any:
        ctx.tx.execute("INSERT INTO library.loans VALUES (%s)", (msg.copy_id,))
        return result

    harness = kafka_idem_harness(app)
    done = harness.deliver("loans", {"branch": "north", "copy_id": "c-1"})
    # A code defect (ResultNotJSON is a TypeError): dead-lettered at the first attempt.
    assert (done.outcome, done.steps, done.status) == (
        "dead_lettered", ("dead_lettered",), "failed")
    [letter] = done.dead_letters
    assert (letter.kind, letter.idem["idem.attempts"]) == ("permanent", "1")
    assert letter.idem["idem.error.class"] == "ResultNotJSON"
    assert letter.idem["idem.error.message"] == (
        f"a code defect, not retried: the handler's result is not JSON-serialisable ({why}): "
        "return only dict, list, str, int, float, bool or None (it is stored in result_json "
        "and given back to every duplicate)")
    assert not [r for r in caplog.records if r.exc_info], "no stack trace in the log"
    assert harness.rows("library.loans") == []


@pytest.mark.parametrize(("emit", "why"), [
    ({"key": 5}, "ctx.emit('shop.events'): key= must be str, bytes or None, not int"),
    ({"headers": {"x-n": 1}},
     "ctx.emit('shop.events'): header 'x-n' must be str or bytes, not int"),
    ({"headers": {1: "v"}}, "ctx.emit('shop.events'): header names must be str, not int"),
    ({"headers": [("h", "v")]},
     "ctx.emit('shop.events'): headers= must be a mapping of str to str or bytes, not list"),
])
def test_an_emit_with_a_bad_key_or_header_names_ctx_emit_and_leaves_no_effect(
    kafka_idem_harness: Make, emit: dict[str, Any], why: str
) -> None:
    app = App("shop", namespace=f"shop-{uuid.uuid4().hex[:6]}")
    app.event_topic("shop.events", format="json")

    @app.handler(topic="shop.orders", key="{order_id}", hash_fields=("order_id",))
    def order(msg: dict[str, Any], ctx: Context) -> None:
        ctx.emit("shop.events", {"order_id": msg["order_id"]}, **emit)

    harness = kafka_idem_harness(app)
    got = harness.deliver("shop.orders", {"order_id": "o-1"})
    [letter] = got.dead_letters
    assert got.outcome == "dead_lettered" and got.status == "failed"
    assert letter.kind == "permanent" and got.events == ()
    assert letter.idem["idem.error.message"].endswith(why)


def test_without_a_model_a_number_in_a_key_field_is_dead_lettered_as_the_consumer_does(
    kafka_idem_harness: Make,
) -> None:
    """The kit builds keys with the member's code: without a model, ``{"order_id": 7}``
    is an InvalidKey (it would share "7" with ``{"order_id": "7"}``), not a duplicate."""
    app = App("shop", namespace=f"shop-{uuid.uuid4().hex[:6]}")

    @app.handler(topic="shop.orders", key="{order_id}", hash_fields=("order_id",))
    def order(msg: dict[str, Any], ctx: Context) -> dict[str, Any]:
        return {"order_id": msg["order_id"]}

    harness = kafka_idem_harness(app)
    number = harness.deliver("shop.orders", {"order_id": 7})
    [letter] = number.dead_letters
    assert (number.outcome, number.key, number.status) == ("dead_lettered", None, None)
    assert (letter.kind, letter.idem["idem.error.class"]) == ("permanent", "InvalidKey")
    assert letter.idem["idem.error.message"].startswith(
        "key field 'order_id' holds a JSON number, not a string")
    text = harness.deliver("shop.orders", {"order_id": "7"})
    assert (text.outcome, text.key, text.result) == ("succeeded", "7", {"order_id": "7"})


class Shelved(BaseModel):
    order_id: str
    shelves: list[str]


class Other(BaseModel):
    order_id: str


@pytest.mark.parametrize("value", [Other(order_id="o-1"), '{"order_id": "o-1"}'],
                         ids=["another-model", "a-str"])
def test_an_event_that_is_not_its_topics_model_is_refused_never_sent_as_something_else(
    kafka_idem_harness: Make, value: Any, recwarn: pytest.WarningsRecorder
) -> None:
    app = App("shop", namespace=f"shop-{uuid.uuid4().hex[:6]}")
    app.event_topic("shop.shelved", model=Shelved)

    @app.handler(topic="shop.orders", key="{order_id}", hash_fields=("order_id",))
    def order(msg: dict[str, Any], ctx: Context) -> None:
        ctx.emit("shop.shelved", value)

    got = kafka_idem_harness(app).deliver("shop.orders", {"order_id": "o-1"})
    [letter] = got.dead_letters
    assert (got.outcome, got.events, letter.idem["idem.error.class"]) == (
        "dead_lettered", (), "InvalidEvent")
    assert letter.idem["idem.error.message"].startswith(
        "ctx.emit('shop.shelved'): the event does not validate against Shelved: ")
    assert not [w for w in recwarn if "o-1" in str(w.message)]  # pydantic's, quoting it
