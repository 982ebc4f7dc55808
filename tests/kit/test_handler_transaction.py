"""What a handler may do with ``ctx.tx``, the same on every path: the batch path
(local mode), the per-message local path and a leased attempt.

* ``ctx.tx.commit()`` raises: a code defect, dead-lettered ``permanent`` at once,
  nothing of the attempt committed (on the batch path it used to commit the batch's
  transaction under the other messages' feet);
* ``psycopg.Rollback`` is the handler's error, retried then exhausted (local mode
  used to swallow it, then blame a framework variable);
* a leased handler's statement that fails on the server, read only as the pipeline
  ends, is its error, charged as an attempt (psycopg used to report it as "pipeline
  aborted", which looked like a lost connection: re-run without being charged).
Real PostgreSQL, no Kafka (the test kit).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel

from kafka_idem import App, AsyncContext, Context
from kafka_idem.testing import Harness
from tests.conftest import ADMIN_DSN

TOPICS = {"batch": "hx.batch", "local": "hx.local", "leased": "hx.leased",
          "async": "hx.async"}


class Reserve(BaseModel):
    shop: str
    order_id: str
    action: str


app = App("kit-handler-tx", max_attempts=3)


@app.migration
def tables(conn: Any) -> None:
    conn.execute("CREATE SCHEMA IF NOT EXISTS hx")
    conn.execute("CREATE TABLE IF NOT EXISTS hx.notes (order_id text, note text)")


def reserve(msg: Reserve, ctx: Context) -> dict[str, Any]:
    ctx.tx.execute("INSERT INTO hx.notes VALUES (%s, 'written')", (msg.order_id,))
    if msg.action == "commit":
        ctx.tx.commit()
    elif msg.action == "rollback":
        raise psycopg.Rollback()
    elif msg.action == "missing-table":  # the handler's last statement, never read
        ctx.tx.execute("UPDATE hx.no_such_table SET x = 1")
    return {"ok": msg.order_id}


async def reserve_async(msg: Reserve, ctx: AsyncContext) -> dict[str, Any]:
    await ctx.tx.execute("INSERT INTO hx.notes VALUES (%s, 'written')", (msg.order_id,))
    if msg.action == "commit":
        await ctx.tx.commit()
    elif msg.action == "rollback":
        raise psycopg.Rollback()
    elif msg.action == "missing-table":
        await ctx.tx.execute("UPDATE hx.no_such_table SET x = 1")
    return {"ok": msg.order_id}


for name, options in (("batch", {"batch": True}), ("local", {"batch": False}),
                      ("leased", {"mode": "leased"}), ("async", {"mode": "leased"})):
    app.handler(topic=TOPICS[name], model=Reserve, key="{shop}:r:{order_id}",
                hash_fields=("action",), name=name, **options)(
        reserve_async if name == "async" else reserve)


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    with Harness(app, database_url=ADMIN_DSN) as h:
        yield h


def written(h: Harness, order: str) -> int:
    return sum(1 for row in h.rows("hx.notes") if row["order_id"] == order)


def send(h: Harness, path: str, order: str, action: str) -> tuple[Any, tuple[str, ...]]:
    """Deliver one message; (the delivery, its one dead letter's kind, class, message)."""
    d = h.deliver(TOPICS[path], {"shop": "s", "order_id": order, "action": action})
    letters = [tuple(x.header(f"idem.error.{n}") or "" for n in ("kind", "class", "message"))
               for x in d.dead_letters]
    return d, letters[0] if len(letters) == 1 else ()


@pytest.mark.parametrize("path", list(TOPICS))
def test_a_handler_that_commits_is_dead_lettered_at_once_with_nothing_committed(
    harness: Harness, path: str,
) -> None:
    d, letter = send(harness, path, f"commit-{path}", "commit")
    assert (d.outcome, d.steps, d.status) == ("dead_lettered", ("dead_lettered",), "failed")
    assert letter[:2] == ("permanent", "ProgrammingError")
    assert "commit() forbidden" in letter[2]
    assert written(harness, f"commit-{path}") == 0
    ok, _ = send(harness, path, f"ok-{path}", "ok")
    assert ok.status == "succeeded" and written(harness, f"ok-{path}") == 1


@pytest.mark.parametrize("path", list(TOPICS))
def test_rollback_raised_by_a_handler_is_retried_then_exhausted(
    harness: Harness, path: str,
) -> None:
    d, letter = send(harness, path, f"rollback-{path}", "rollback")
    assert d.steps == ("retry", "retry", "dead_lettered") and d.status == "failed"
    assert letter[:2] == ("exhausted", "Rollback")
    assert written(harness, f"rollback-{path}") == 0


@pytest.mark.parametrize("path", ["leased", "async"])
def test_a_leased_statement_error_read_at_the_end_is_charged_every_time(
    harness: Harness, path: str,
) -> None:
    """Eight keys (psycopg's masking depended on what had arrived when the pipeline
    ended: about one attempt in three was re-run uncharged)."""
    for i in range(8):
        order = f"missing-{path}-{i}"
        d, letter = send(harness, path, order, "missing-table")
        assert d.steps == ("retry", "retry", "dead_lettered"), (order, d.steps)
        assert letter[:2] == ("exhausted", "UndefinedTable")
        assert written(harness, order) == 0
