"""The acceptance tests' mixed app (``tests/acceptance/conftest.py``, ``mixed``): the
payments example on ``MIXED_CHARGES`` plus a second handler, "refund", on
``MIXED_REFUNDS`` whose dead letters go to the charges' DLQ. ``kafka-idem dlq ...
--app tests.apps.mixed:app`` is how the tests name it; the fixture builds the same
app in-process with :func:`build`.
"""

from __future__ import annotations

import os
from typing import Any

from consumers.payments import SCHEMA, ChargeRequested, build_app, charge
from kafka_idem import App


def build(charges: str, refunds: str, **settings: Any) -> App:
    app = build_app(topic=charges, **settings)
    app.handler(topic=refunds, model=ChargeRequested, key="{tenant_id}:refund:{order_id}",
                hash_fields=("amount", "currency"), schema=SCHEMA, dlq_topic=f"{charges}.dlq",
                name="refund")(charge)
    return app


app = build(os.environ.get("MIXED_CHARGES", "mixed.charges"),
            os.environ.get("MIXED_REFUNDS", "mixed.refunds"))
