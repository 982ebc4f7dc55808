"""A charge app whose handler logs as a user's app does: a line on its own logger and
one on a third-party library's (``urllib3``, installed: as an HTTP client logs each
request), both at INFO, for the test of which of them ``kafka-idem run`` shows.
``PAYMENTS_TOPIC`` names the source topic."""

from __future__ import annotations

import logging
from typing import Any

import urllib3  # noqa: F401  (the library is imported, as a client the app uses is)

from consumers import payments
from kafka_idem import App, Context

log = logging.getLogger(__name__)
library = logging.getLogger("urllib3.connectionpool")

app = App("chatty", schemas_dir=payments.SCHEMAS_DIR, batch_path=False)
app.migration(payments.create_tables)


@app.handler(topic=payments.TOPIC, model=payments.ChargeRequested,
             key="{tenant_id}:charge:{order_id}", hash_fields=("amount", "currency"),
             schema=payments.SCHEMA)
def charge(msg: payments.ChargeRequested, ctx: Context) -> dict[str, Any]:
    library.info("library line: POST https://bank.example/charges %s", msg.order_id)
    log.info("app line: charging %s", msg.order_id)
    return payments.charge(msg, ctx)
