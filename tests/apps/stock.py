"""The payments example whose charges wait for stock: the handler raises Retryable
until a row for the order (or ``'*'``) exists in ``stock.arrived``.

A test runs it until its keys are exhausted (``KAFKA_IDEM_MAX_ATTEMPTS`` small,
short backoff), then "fixes the cause" by inserting the row and re-drives the dead
letters: ``kafka-idem run tests.apps.stock:app``.
"""

from __future__ import annotations

from typing import Any

from consumers import payments
from kafka_idem import Context, Retryable

CREATE = ("CREATE SCHEMA IF NOT EXISTS stock; "
          "CREATE TABLE IF NOT EXISTS stock.arrived (order_id text PRIMARY KEY)")


def charge(msg: payments.ChargeRequested, ctx: Context) -> dict[str, Any]:
    arrived = ctx.tx.execute(
        "SELECT 1 FROM stock.arrived WHERE order_id IN (%s, '*')", (msg.order_id,)
    ).fetchone()
    if arrived is None:
        raise Retryable(f"no stock yet for order {msg.order_id}")
    return payments.charge(msg, ctx)


def create_tables(conn: Any) -> None:
    conn.execute(CREATE)


app = payments.build_app(name="stock")
app.migration(create_tables)
app.handlers[payments.TOPIC].fn = charge
app.handlers[payments.TOPIC].bulk = None  # the per-message handler above, always
