"""Harness.check on a handler whose own SQL makes values anew (a time, a random id)
and returns one: two correct deliveries differ in them, so the report leaves them
out and says so, instead of calling every scenario a failure."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel

from kafka_idem import App, Context
from kafka_idem.testing import Harness
from tests.conftest import ADMIN_DSN


class Order(BaseModel):
    tenant_id: str
    order_id: str
    amount: int


app = App("kit-drift")
DOUBLE = {"now": False}  # the mistake a check must still catch


@app.migration
def tables(conn: Any) -> None:
    conn.execute("CREATE SCHEMA IF NOT EXISTS drift")
    conn.execute("CREATE TABLE IF NOT EXISTS drift.orders (id serial PRIMARY KEY, key text,"
                 " amount int, created timestamptz NOT NULL DEFAULT now(), seen timestamptz,"
                 " ref uuid)")


@app.handler(topic="drift.orders", model=Order, key="{tenant_id}:o:{order_id}",
             hash_fields=("amount",), batch=True)
def order(msg: Order, ctx: Context) -> dict[str, Any]:
    insert = ("INSERT INTO drift.orders (key, amount, seen, ref) VALUES (%s, %s,"
              " clock_timestamp(), gen_random_uuid()) RETURNING id, seen")
    row = ctx.tx.execute(insert, (ctx.idempotency_key, msg.amount)).fetchone()
    if DOUBLE["now"]:
        with psycopg.connect(ctx.tx.info.dsn, autocommit=True) as own:  # not in the tx
            own.execute(insert, (ctx.idempotency_key, msg.amount))
    assert row is not None
    return {"id": row[0], "seen": row[1].isoformat(), "amount": msg.amount}


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    with Harness(app, database_url=ADMIN_DSN) as h:
        yield h


ORDER = {"tenant_id": "t1", "order_id": "o-1", "amount": 3}


def test_values_the_handler_makes_anew_are_left_out_and_said(harness: Harness) -> None:
    report = harness.check("drift.orders", ORDER)
    assert report.passed, str(report)
    why = ("differs between two deliveries of the reference: a value the handler makes "
           "anew, e.g. now() or a random id in its SQL")
    assert report.left_out == [
        "drift.orders.id (default nextval('drift.orders_id_seq'::regclass))",
        "drift.orders.created (default now())",
        f"drift.orders.seen ({why})", f"drift.orders.ref ({why})",
        f"the stored result['seen'] ({why})"]
    assert f"  left out: {'; '.join(report.left_out)}" in str(report)


def test_a_write_outside_the_transaction_is_still_caught(harness: Harness) -> None:
    DOUBLE["now"] = True
    try:
        with pytest.raises(AssertionError) as caught:
            harness.check("drift.orders", ORDER, scenarios=["crash_before_commit"])
    finally:
        DOUBLE["now"] = False
    assert "table drift.orders: 1 row(s) more than the reference" in str(caught.value)
