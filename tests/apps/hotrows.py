"""Charges on a few hot rows, for the liveness tests: ``kafka-idem run
tests.apps.hotrows:app`` with ``PAYMENTS_TOPIC`` and ``HOT_EVENTS`` set to fresh
topics. Every charge updates its tenant's balance (the payments example's handler)
and emits an event keyed by its tenant, so members working different partitions
share rows and outbox slots; on the per-message path (``batch_path=False``).

``HOT_BLOCK_FILE`` / ``HOT_BLOCK_ORDERS`` (comma list): after charging one of those
orders (its tenant's balance row locked), wait while the file exists (saying so with
``HOT_BLOCK_FILE.<order>``): a test lines
two members' messages up on each other's rows."""

from __future__ import annotations

import os
import time
from typing import Any

from consumers import payments
from kafka_idem import App, Context

EVENTS = os.environ.get("HOT_EVENTS", "hotrows.charged")

app = App("hotrows", schemas_dir=payments.SCHEMAS_DIR, batch_path=False)
app.migration(payments.create_tables)
app.event_topic(EVENTS, partitions=2)


@app.handler(topic=payments.TOPIC, model=payments.ChargeRequested,
             key="{tenant_id}:charge:{order_id}", hash_fields=("amount", "currency"),
             schema=payments.SCHEMA)
def charge(msg: payments.ChargeRequested, ctx: Context) -> dict[str, Any]:
    ctx.emit(EVENTS, {"order_id": msg.order_id, "tenant": msg.tenant_id}, key=msg.tenant_id)
    result = payments.charge(msg, ctx)
    block = os.environ.get("HOT_BLOCK_FILE")
    if block and msg.order_id in os.environ.get("HOT_BLOCK_ORDERS", "").split(","):
        if os.path.exists(block):
            open(f"{block}.{msg.order_id}", "w").close()  # waiting: tests wait for it
        while os.path.exists(block):
            time.sleep(0.02)
    return result
