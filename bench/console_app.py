"""The app ``python -m bench.console`` gives the web console: ``bench.console_app:app``.

The shop's order handler, on the source topic the benchmark's dead-letter topic
belongs to, so the console knows that topic (``<source>.dlq``) and reads it. The
benchmark names the source topic in ``BENCH_CONSOLE_TOPIC`` and the store's schema in
``KAFKA_IDEM_SCHEMA_NAME``; the app's name is its namespace (``shop``, the namespace
of the dead letters and of most records). Nothing ever runs the handler: the console
only reads the app's topics, namespace and settings.
"""

from __future__ import annotations

import os

from pydantic import BaseModel

from kafka_idem import App, Context

TOPIC_VAR = "BENCH_CONSOLE_TOPIC"
DEFAULT_TOPIC = "bench-console.orders"
NAMESPACE = "shop"
HANDLER = "place_order"


class Order(BaseModel):
    order_id: str  # eight digits: the key is order-00012345
    customer: str
    amount_cents: int
    currency: str


def build_app(topic: str) -> App:
    """The shop app with its order handler on ``topic`` (its DLQ: ``topic.dlq``)."""
    app = App(NAMESPACE)

    @app.handler(topic=topic, model=Order, key="order-{order_id}",
                 hash_fields=("customer", "amount_cents", "currency"), name=HANDLER)
    def place_order(msg: Order, ctx: Context) -> dict[str, str]:
        return {"placed": msg.order_id}

    return app


app = build_app(os.environ.get(TOPIC_VAR, DEFAULT_TOPIC))
