"""Example: charge requests, effects only in this database (local mode).

Topic ``payments.charge-requested``; Kafka key = order id; value = Avro
``payments.ChargeRequested`` (single-object encoding). Idempotency key
``{tenant_id}:charge:{order_id}``; the request hash covers amount and currency,
not the per-send ``request_id`` / ``requested_at``.

The ledger has *no* unique constraint on purpose: this example relies on the
framework alone, so a double execution would show as a second ledger row.

    kafka-idem migrate --app consumers.payments:app
    kafka-idem run consumers.payments:app
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kafka_idem import App, Context, Permanent
from kafka_idem.codec import AvroCodec

# The topic and mode can be changed from the environment so tests and demos can
# run the same example on a fresh topic (PAYMENTS_TOPIC) or in leased mode.
TOPIC = os.environ.get("PAYMENTS_TOPIC", "payments.charge-requested")
MODE = os.environ.get("PAYMENTS_MODE", "local")
SCHEMA = "payments.ChargeRequested"
CURRENCIES = frozenset({"EUR", "USD", "GBP", "CHF", "JPY"})
SCHEMAS_DIR = Path(__file__).resolve().parent.parent / "schemas"


class ChargeRequested(BaseModel):
    tenant_id: str
    order_id: str
    amount: Decimal
    currency: str
    request_id: str
    requested_at: dt.datetime


def create_tables(conn: Any) -> None:
    conn.execute("CREATE SCHEMA IF NOT EXISTS payments")
    conn.execute(
        """
        CREATE TABLE IF NOT EXISTS payments.ledger (
            id              bigserial PRIMARY KEY,
            tenant_id       text          NOT NULL,
            order_id        text          NOT NULL,
            amount          numeric(18,2) NOT NULL,
            currency        text          NOT NULL,
            idempotency_key text          NOT NULL,
            created_at      timestamptz   NOT NULL DEFAULT now()
        )
        """
    )
    conn.execute(
        """
        CREATE TABLE IF NOT EXISTS payments.balances (
            tenant_id text          NOT NULL,
            currency  text          NOT NULL,
            balance   numeric(18,2) NOT NULL,
            PRIMARY KEY (tenant_id, currency)
        )
        """
    )


def charge(msg: ChargeRequested, ctx: Context) -> dict[str, Any]:
    if msg.amount <= 0:
        raise Permanent(f"amount must be positive, got {msg.amount}")
    if msg.currency not in CURRENCIES:
        raise Permanent(f"unknown currency {msg.currency!r}")
    ctx.tx.execute(
        "INSERT INTO payments.ledger (tenant_id, order_id, amount, currency, idempotency_key)"
        " VALUES (%s, %s, %s, %s, %s)",
        (msg.tenant_id, msg.order_id, msg.amount, msg.currency, ctx.idempotency_key),
    )
    ctx.tx.execute(
        "INSERT INTO payments.balances AS b (tenant_id, currency, balance) VALUES (%s, %s, %s)"
        " ON CONFLICT (tenant_id, currency) DO UPDATE SET balance = b.balance + EXCLUDED.balance",
        (msg.tenant_id, msg.currency, msg.amount),
    )
    return {"order_id": msg.order_id, "amount": str(msg.amount), "currency": msg.currency}


def build_app(
    *, topic: str = TOPIC, mode: str = MODE, name: str = "payments", **settings: Any
) -> App:
    """The payments app on ``topic``; ``settings`` override Settings fields."""
    settings.setdefault("schemas_dir", SCHEMAS_DIR)
    settings.setdefault("group_id", "payments")
    application = App(name, **settings)
    application.migration(create_tables)
    application.handler(
        topic=topic,
        model=ChargeRequested,
        key="{tenant_id}:charge:{order_id}",
        hash_fields=("amount", "currency"),
        schema=SCHEMA,
        mode=mode,  # type: ignore[arg-type]
    )(charge)
    return application


app = build_app()


@functools.cache
def codec() -> AvroCodec:
    return AvroCodec.from_dir(SCHEMAS_DIR)


def encode_charge(
    tenant_id: str,
    order_id: str,
    amount: Decimal | str,
    currency: str = "EUR",
    *,
    request_id: str | None = None,
    requested_at: dt.datetime | None = None,
) -> bytes:
    """The Avro single-object bytes of one charge request (what producers send)."""
    return codec().encode(
        SCHEMA,
        {
            "tenant_id": tenant_id,
            "order_id": order_id,
            "amount": Decimal(amount),
            "currency": currency,
            "request_id": request_id or str(uuid.uuid4()),
            "requested_at": requested_at or dt.datetime.now(dt.UTC),
        },
    )
