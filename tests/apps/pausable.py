"""The pause tests' app (``tests/integration/test_pause.py``,
``tests/acceptance/test_cli_pause.py``): two JSON handlers, "alpha" on ``PAUSABLE_A``
and "beta" on ``PAUSABLE_B``, in leased mode (the path with the most in flight: units
on worker threads), each writing one row per call to ``pausable.calls`` (handler, key,
the member's process id) in its own transaction, so a test counts the calls that took
effect, and which member made them. ``kafka-idem pause tests.apps.pausable:app
--handler alpha`` is how the CLI tests name it.
"""

from __future__ import annotations

import os
from typing import Any

from kafka_idem import App, Context

CREATE = ("CREATE SCHEMA IF NOT EXISTS pausable; "
          "CREATE TABLE IF NOT EXISTS pausable.calls (handler text NOT NULL, "
          "idempotency_key text NOT NULL, member integer NOT NULL)")


def create_tables(conn: Any) -> None:
    conn.execute(CREATE)


def _call(name: str) -> Any:
    def call(msg: dict[str, Any], ctx: Context) -> dict[str, Any]:
        ctx.tx.execute("INSERT INTO pausable.calls VALUES (%s, %s, %s)",
                       (name, ctx.idempotency_key, os.getpid()))
        return {"by": name}

    call.__name__ = name
    return call


def build(a: str, b: str, name: str = "pausable", *, concurrency: int = 1,
          **settings: Any) -> App:
    """``concurrency``: alpha's (above 1: its messages run key-ordered, one job each)."""
    app = App(name, **settings)
    app.migration(create_tables)
    for topic, handler, n in ((a, "alpha", concurrency), (b, "beta", 1)):
        app.handler(topic=topic, key=f"{handler}:{{id}}", hash_fields=("id",), format="json",
                    mode="leased", concurrency=n)(_call(handler))
    return app


app = build(os.environ.get("PAUSABLE_A", "pausable.a"), os.environ.get("PAUSABLE_B", "pausable.b"))
