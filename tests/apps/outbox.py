"""A charge app emitting one event per charge to ``OUTBOX_EVENTS`` (JSON, key: the
order id), for the outbox's CLI tests: ``kafka-idem run|relay tests.apps.outbox:app``
with ``PAYMENTS_TOPIC`` and ``OUTBOX_EVENTS`` set to fresh topics. Built here, not
with ``payments.build_app``, so the example's own events (if any) stay out of it."""

from __future__ import annotations

import os
from typing import Any

from consumers import payments
from kafka_idem import App, Context

EVENTS = os.environ.get("OUTBOX_EVENTS", "outbox.charged")

app = App("outbox", schemas_dir=payments.SCHEMAS_DIR, batch_path=False)
app.migration(payments.create_tables)
app.event_topic(EVENTS, partitions=2)


@app.handler(topic=payments.TOPIC, model=payments.ChargeRequested,
             key="{tenant_id}:charge:{order_id}", hash_fields=("amount", "currency"),
             schema=payments.SCHEMA)
def charge(msg: payments.ChargeRequested, ctx: Context) -> dict[str, Any]:
    ctx.emit(EVENTS, {"order_id": msg.order_id, "amount": str(msg.amount)}, key=msg.order_id)
    return payments.charge(msg, ctx)
