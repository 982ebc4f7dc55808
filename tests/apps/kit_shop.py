"""A shop app written as a user would write one (outside consumers/), for the test
kit's own tests, with the mistakes the kit must catch switched on by name.

Two handlers: ``shop.orders`` (local mode, with a bulk form) records an order, counts
it, numbers its invoice and emits ``shop.order-placed`` with the order row's id;
``shop.payments`` (leased mode, with a reconciler) charges the fake ``bank``, records
the charge and emits ``shop.order-paid``. ``MISTAKE`` (set by a test, reset to
"none") makes one of them wrong:

* ``own_connection``: the order row is written through a second connection;
* ``counter_own_connection``: the order counter is incremented on a second
  connection, not keyed by anything;
* ``sequence_counter``: the invoice number is drawn from a sequence (not rolled back);
* ``remote_without_key``: the bank is called without the idempotency key;
* ``bulk_skips_counter``: the bulk form forgets the counter;
* ``reconcile_forgets_row``: the reconciler finds the charge but records nothing;
* ``event_counter``: the order event carries a number the process counts up, not
  the key's (not a mistake of exactly-once: the check leaves that field out, as it
  would a column that differs between two deliveries);
* ``event_random_id``: the order event carries a random id made for each emit (left
  out likewise);
* ``reconcile_emits_twice``: the reconciler emits the paid event again, after the
  recording it shares with the handler emitted it;
* ``event_own_connection``: the order event is written into the outbox through a
  second connection (as a handler does that reports a failure on a connection the
  rollback does not undo).
"""

from __future__ import annotations

import itertools
import json
import uuid
from decimal import Decimal
from typing import Any

import psycopg
from pydantic import BaseModel

from kafka_idem import App, Context, Done
from kafka_idem.testing import FakeService

ORDERS = "shop.orders"
PAYMENTS = "shop.payments"
PLACED = "shop.order-placed"
PAID = "shop.order-paid"
MISTAKE = {"now": "none"}
bank = FakeService("bank")
COUNTER = itertools.count(1)


class Order(BaseModel):
    tenant_id: str
    order_id: str
    amount: Decimal
    note: str = ""  # per-send, not hashed


app = App("shop")
app.event_topic(PLACED, format="json")
app.event_topic(PAID, format="json")


@app.migration
def tables(conn: Any) -> None:
    conn.execute("CREATE SCHEMA IF NOT EXISTS shop")
    conn.execute("CREATE TABLE IF NOT EXISTS shop.orders (id bigserial PRIMARY KEY,"
                 " key text NOT NULL, order_id text NOT NULL, amount numeric NOT NULL,"
                 " invoice bigint, created_at timestamptz NOT NULL DEFAULT now())")
    conn.execute("CREATE TABLE IF NOT EXISTS shop.counters (name text PRIMARY KEY,"
                 " n bigint NOT NULL)")
    conn.execute("INSERT INTO shop.counters VALUES ('orders', 0) ON CONFLICT DO NOTHING")
    conn.execute("CREATE SEQUENCE IF NOT EXISTS shop.invoice_no")
    conn.execute("CREATE TABLE IF NOT EXISTS shop.charges (id bigserial PRIMARY KEY,"
                 " key text NOT NULL, charge_id text NOT NULL, amount numeric NOT NULL)")


def _order(tx: psycopg.Connection[Any], ctx: Context, msg: Order, *,
           count: bool = True) -> None:
    """An order's effects (the handler's and, item by item, its bulk form's)."""
    key = ctx.idempotency_key
    insert = ("INSERT INTO shop.orders (key, order_id, amount) VALUES (%s, %s, %s)"
              " RETURNING id")
    if MISTAKE["now"] == "own_connection":
        with psycopg.connect(tx.info.dsn, autocommit=True) as conn:
            conn.execute(insert, (key, msg.order_id, msg.amount))
        row_id = None
    else:
        row = tx.execute(insert, (key, msg.order_id, msg.amount)).fetchone()
        row_id = None if row is None else int(row[0])
    _placed(tx, ctx, msg, row_id)
    counter = "UPDATE shop.counters SET n = n + 1 WHERE name = 'orders'"
    if not count:
        pass
    elif MISTAKE["now"] == "counter_own_connection":
        with psycopg.connect(tx.info.dsn, autocommit=True) as conn:
            conn.execute(counter)
    else:
        tx.execute(counter)
    if MISTAKE["now"] == "sequence_counter":
        tx.execute("UPDATE shop.orders SET invoice = nextval('shop.invoice_no')"
                   " WHERE key = %s", (key,))
    # tells the bank an order is coming (a remote call from local mode: harmless only
    # because the bank deduplicates by the key)
    bank.call("notify", key=None if MISTAKE["now"] == "remote_without_key" else key,
              order_id=msg.order_id)


def _placed(tx: psycopg.Connection[Any], ctx: Context, msg: Order, row_id: int | None) -> None:
    """The order event: the order and its row's id (a number the database made)."""
    event: dict[str, Any] = {"order_id": msg.order_id, "amount": str(msg.amount),
                             "row": row_id}
    if MISTAKE["now"] == "event_counter":
        event["n"] = next(COUNTER)
    if MISTAKE["now"] == "event_random_id":
        event["event_id"] = uuid.uuid4().hex
    if MISTAKE["now"] != "event_own_connection":
        ctx.emit(PLACED, event, key=msg.order_id)
        return
    s = app.settings
    with psycopg.connect(tx.info.dsn, autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL("INSERT INTO {} (namespace, shard, topic, key, value, idem_key)"
                            " VALUES (%s, 0, %s, %s, %s, %s)").format(
                psycopg.sql.Identifier(s.schema_name, "outbox")),
            (app.namespace, PLACED, msg.order_id.encode(), json.dumps(event).encode(),
             ctx.idempotency_key))


@app.handler(topic=ORDERS, model=Order, key="{tenant_id}:order:{order_id}",
             hash_fields=("amount",))
def place(msg: Order, ctx: Context) -> dict[str, Any]:
    _order(ctx.tx, ctx, msg)
    return {"order_id": msg.order_id}


@place.bulk_handler
def place_many(batch: list[tuple[Order, Context]], tx: Any) -> list[Any]:
    for msg, ctx in batch:
        _order(tx, ctx, msg, count=MISTAKE["now"] != "bulk_skips_counter")
    return [{"order_id": m.order_id} for m, _ in batch]


def _record(ctx: Context, charge: dict[str, Any], amount: Decimal) -> dict[str, Any]:
    ctx.tx.execute("INSERT INTO shop.charges (key, charge_id, amount) VALUES (%s, %s, %s)",
                   (ctx.idempotency_key, charge["id"], amount))
    ctx.emit(PAID, {"key": ctx.idempotency_key, "amount": str(amount)})
    return {"charge_id": charge["id"]}


@app.handler(topic=PAYMENTS, model=Order, key="{tenant_id}:pay:{order_id}",
             hash_fields=("amount",), mode="leased")
def pay(msg: Order, ctx: Context) -> dict[str, Any]:
    key = None if MISTAKE["now"] == "remote_without_key" else ctx.idempotency_key
    return _record(ctx, bank.call("charge", key=key, amount=str(msg.amount)), msg.amount)


@pay.reconciler
def find_charge(msg: Order, ctx: Context) -> Done | None:
    found = bank.find(ctx.idempotency_key)
    if found is None:
        return None
    if MISTAKE["now"] == "reconcile_forgets_row":
        return Done({"charge_id": found["id"]})
    done = Done(_record(ctx, found, msg.amount))
    if MISTAKE["now"] == "reconcile_emits_twice":
        ctx.emit(PAID, {"key": ctx.idempotency_key, "amount": str(msg.amount)})
    return done
