"""A second app on the payments topic, with the payments model and key template:
its handler writes one row per run to ``twin.effects`` (app, key, order), so a test
sees which app ran which key, and how often. The app's name is ``TWIN_APP``; while
``twin.blocked`` has a row for it, its handler raises Retryable.

Several of them on one store are issue 10's "second app": without keys scoped per
app, the second one was answered with the first one's results and never ran.
"""

from __future__ import annotations

import os
from typing import Any

from consumers import payments
from kafka_idem import App, Context, Retryable

CREATE = ("CREATE SCHEMA IF NOT EXISTS twin; "
          "CREATE TABLE IF NOT EXISTS twin.effects (app text NOT NULL, "
          "idempotency_key text NOT NULL, order_id text NOT NULL); "
          "CREATE TABLE IF NOT EXISTS twin.blocked (app text PRIMARY KEY)")

app = App(os.environ.get("TWIN_APP", "twin-a"), schemas_dir=payments.SCHEMAS_DIR)


@app.migration
def create_tables(conn: Any) -> None:
    conn.execute(CREATE)


@app.handler(topic=payments.TOPIC, model=payments.ChargeRequested,
             key="{tenant_id}:charge:{order_id}", hash_fields=("amount", "currency"),
             schema=payments.SCHEMA)
def charge(msg: payments.ChargeRequested, ctx: Context) -> dict[str, Any]:
    if ctx.tx.execute("SELECT 1 FROM twin.blocked WHERE app = %s", (app.name,)).fetchone():
        raise Retryable(f"{app.name} is blocked")  # until the test "fixes" it
    ctx.tx.execute("INSERT INTO twin.effects VALUES (%s, %s, %s)",
                   (app.name, ctx.idempotency_key, msg.order_id))
    return {"by": app.name}
