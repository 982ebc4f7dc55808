"""A handler without a model (the JSON's dict), its key built from two of its fields:
``kafka-idem run tests.apps.rawkeys:app`` with ``RAWKEYS_TOPIC`` naming its topic. Each
charge it takes writes one row to the payments example's ledger."""

from __future__ import annotations

import os
from typing import Any

from kafka_idem import App, Context

app = App("rawkeys")


@app.handler(topic=os.environ.get("RAWKEYS_TOPIC", "rawkeys"), key="{tenant}:raw:{order}",
             hash_fields=("order",), format="json", name="raw")
def raw(msg: dict[str, Any], ctx: Context) -> dict[str, str]:
    ctx.tx.execute("INSERT INTO payments.ledger (tenant_id, order_id, amount, currency, "
                   "idempotency_key) VALUES (%s, %s, 1, 'EUR', %s)",
                   (str(msg["tenant"]), msg["order"], ctx.idempotency_key))
    return {"tenant": str(msg["tenant"])}
