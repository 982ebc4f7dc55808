"""The shop the web console's end-to-end tests browse: ``pay`` refuses an amount below
one for good (``Permanent``, its message quoting the order's ``note``) unless the
order (or ``'*'``) is in ``console_shop.fixed``; a paid order is a row of
``console_shop.paid``.

A test produces orders with bad amounts, runs ``kafka-idem run
tests.apps.console_shop:app`` until they are dead-lettered and failed, "fixes the
cause" by inserting the orders into ``console_shop.fixed``, and re-drives or re-runs
them from the console. ``CONSOLE_SHOP_TOPIC`` names the source topic (its DLQ topic
is that name + ``.dlq``); the namespace is the app's name, ``shop``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import BaseModel

from kafka_idem import App, Context, Permanent

TOPIC = os.environ.get("CONSOLE_SHOP_TOPIC", "console-shop.orders")
CREATE = ("CREATE SCHEMA IF NOT EXISTS console_shop; "
          "CREATE TABLE IF NOT EXISTS console_shop.paid "
          "(order_id text PRIMARY KEY, amount int NOT NULL); "
          "CREATE TABLE IF NOT EXISTS console_shop.fixed (order_id text PRIMARY KEY)")


class Order(BaseModel):
    tenant_id: str
    order_id: str
    amount: int
    note: str = ""


app = App("shop")


@app.migration
def create_tables(conn: Any) -> None:
    conn.execute(CREATE)


@app.handler(topic=TOPIC, model=Order, key="{tenant_id}:pay:{order_id}",
             hash_fields=("amount",))
def pay(msg: Order, ctx: Context) -> dict[str, Any]:
    fixed = ctx.tx.execute("SELECT 1 FROM console_shop.fixed WHERE order_id IN (%s, '*')",
                           (msg.order_id,)).fetchone()
    if msg.amount < 1 and fixed is None:
        raise Permanent(f"amount must be positive, not {msg.amount}"
                        + (f" ({msg.note})" if msg.note else ""))
    ctx.tx.execute("INSERT INTO console_shop.paid VALUES (%s, %s)", (msg.order_id, msg.amount))
    return {"paid": msg.amount}


def encode(tenant_id: str, order_id: str, amount: int, note: str = "") -> bytes:
    """An order's bytes, as a producer sends them (JSON)."""
    return json.dumps({"tenant_id": tenant_id, "order_id": order_id, "amount": amount,
                       "note": note}).encode()
