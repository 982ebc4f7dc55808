"""The payments example emitting one event per charge to ``OUTBOX_EVENTS`` (JSON, key:
the order id), for the outbox's CLI tests: ``kafka-idem run|relay tests.apps.outbox:app``
with ``PAYMENTS_TOPIC`` and ``OUTBOX_EVENTS`` set to fresh topics."""

from __future__ import annotations

import os
from typing import Any

from consumers import payments
from kafka_idem import Context

EVENTS = os.environ.get("OUTBOX_EVENTS", "outbox.charged")


def charge(msg: payments.ChargeRequested, ctx: Context) -> dict[str, Any]:
    ctx.emit(EVENTS, {"order_id": msg.order_id, "amount": str(msg.amount)}, key=msg.order_id)
    return payments.charge(msg, ctx)


app = payments.build_app(name="outbox", batch_path=False)
app.handlers[payments.TOPIC].fn = charge
app.handlers[payments.TOPIC].bulk = None
app.event_topic(EVENTS, partitions=2)
