"""Example: orders placed, as JSON, validated into a pydantic model (local mode).

Topic ``orders.placed`` (``ORDERS_TOPIC``); Kafka key = order id; value = UTF-8 JSON::

    {"tenant_id": "t1", "order_id": "o-1", "amount": 10.0, "currency": "EUR",
     "items": 2, "request_id": "9b2c...", "placed_at": "2025-01-31T12:00:00Z"}

The bytes are validated straight into :class:`OrderPlaced` by pydantic's JSON
parser: no schema files, no registry. Idempotency key
``{tenant_id}:order:{order_id}``; the request hash covers amount, currency and
items (``10``, ``10.0`` and ``"10.00"`` are one amount), not the per-send
``request_id`` / ``placed_at``. Producers use the handler's own codec
(:func:`encode_order`), so what they send is exactly what the consumer reads.

    kafka-idem migrate --app consumers.orders_json:app
    kafka-idem run consumers.orders_json:app
"""

from __future__ import annotations

import datetime as dt
import os
import uuid
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, Field

from kafka_idem import App, Context

TOPIC = os.environ.get("ORDERS_TOPIC", "orders.placed")


class OrderPlaced(BaseModel):
    tenant_id: str = Field(min_length=1)
    order_id: str = Field(min_length=1)
    amount: Decimal = Field(gt=0, max_digits=18, decimal_places=2)
    currency: str = Field(pattern=r"^[A-Z]{3}$")
    items: int = Field(ge=1)
    request_id: str
    placed_at: dt.datetime


def create_tables(conn: Any) -> None:
    conn.execute("CREATE SCHEMA IF NOT EXISTS orders")
    # No unique constraint on purpose: a double execution would show as a second row.
    conn.execute(
        """
        CREATE TABLE IF NOT EXISTS orders.placed (
            id              bigserial PRIMARY KEY,
            tenant_id       text          NOT NULL,
            order_id        text          NOT NULL,
            amount          numeric(18,2) NOT NULL,
            currency        text          NOT NULL,
            items           integer       NOT NULL,
            idempotency_key text          NOT NULL,
            created_at      timestamptz   NOT NULL DEFAULT now()
        )
        """
    )


def place(msg: OrderPlaced, ctx: Context) -> dict[str, Any]:
    ctx.tx.execute(
        "INSERT INTO orders.placed (tenant_id, order_id, amount, currency, items,"
        " idempotency_key) VALUES (%s, %s, %s, %s, %s, %s)",
        (msg.tenant_id, msg.order_id, msg.amount, msg.currency, msg.items, ctx.idempotency_key),
    )
    return {"order_id": msg.order_id, "amount": str(msg.amount), "items": msg.items}


def build_app(*, topic: str = TOPIC, name: str = "orders", **settings: Any) -> App:
    """The orders app on ``topic``; ``settings`` override Settings fields."""
    application = App(name, **settings)
    application.migration(create_tables)
    application.handler(
        topic=topic,
        model=OrderPlaced,
        format="json",
        key="{tenant_id}:order:{order_id}",
        hash_fields=("amount", "currency", "items"),
    )(place)
    return application


app = build_app()


def encode_order(
    tenant_id: str,
    order_id: str,
    amount: Decimal | str | float,
    currency: str = "EUR",
    items: int = 1,
    *,
    request_id: str | None = None,
    placed_at: dt.datetime | None = None,
) -> bytes:
    """The JSON bytes of one order (what producers send), made by the handler's codec."""
    return app.handlers[TOPIC].encode({
        "tenant_id": tenant_id,
        "order_id": order_id,
        "amount": amount,
        "currency": currency,
        "items": items,
        "request_id": request_id or str(uuid.uuid4()),
        "placed_at": placed_at or dt.datetime.now(dt.UTC),
    })
