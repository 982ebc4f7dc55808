"""The console tests' app (``tests/integration/test_console_*.py``): JSON orders on
``CONSOLED_ORDERS`` (handler "order") and refunds on ``CONSOLED_REFUNDS`` (handler
"refund", dead-lettered into the orders' DLQ), each writing one ledger row of the
payments example per message that takes effect.

What a message does is in its ``do`` field: ``ok`` takes effect; ``permanent`` raises
:class:`Permanent` naming its ``note`` (an error text the tests fill with markup);
``check`` raises :class:`Permanent` and ``wait`` raises :class:`Retryable` until the
cause is fixed: a row for the order (or ``'*'``) in ``consoled.fixed``.
``kafka-idem console tests.apps.consoled:app`` is how the CLI tests name it.
"""

from __future__ import annotations

import os
from typing import Any

from kafka_idem import App, Context, Permanent, Retryable

CREATE = ("CREATE SCHEMA IF NOT EXISTS consoled; "
          "CREATE TABLE IF NOT EXISTS consoled.fixed (order_id text PRIMARY KEY)")


def create_tables(conn: Any) -> None:
    conn.execute(CREATE)


def _fixed(ctx: Context, order: str) -> bool:
    return ctx.tx.execute("SELECT 1 FROM consoled.fixed WHERE order_id IN (%s, '*')",
                          (order,)).fetchone() is not None


def take(msg: dict[str, Any], ctx: Context) -> dict[str, Any]:
    order, do = str(msg["order"]), msg.get("do", "ok")
    if do == "permanent":
        raise Permanent(f"rejected: {msg.get('note', '')}")
    if do == "check" and not _fixed(ctx, order):
        raise Permanent(f"not allowed yet: {msg.get('note', '')}")
    if do == "wait" and not _fixed(ctx, order):
        raise Retryable(f"not yet: {order}")
    ctx.tx.execute("INSERT INTO payments.ledger (tenant_id, order_id, amount, currency, "
                   "idempotency_key) VALUES (%s, %s, %s, 'EUR', %s)",
                   (str(msg["tenant"]), order, msg.get("amount", 1), ctx.idempotency_key))
    return {"order": order}


def build(orders: str, refunds: str, name: str = "consoled", **settings: Any) -> App:
    app = App(name, **settings)
    app.migration(create_tables)
    app.handler(topic=orders, key="{tenant}:order:{order}", hash_fields=("amount",),
                format="json", name="order", batch=False)(take)
    app.handler(topic=refunds, key="{tenant}:refund:{order}", hash_fields=("amount",),
                format="json", name="refund", dlq_topic=f"{orders}.dlq", batch=False)(take)
    return app


app = build(os.environ.get("CONSOLED_ORDERS", "consoled.orders"),
            os.environ.get("CONSOLED_REFUNDS", "consoled.refunds"))
