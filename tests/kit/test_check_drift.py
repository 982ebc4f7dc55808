"""Harness.check on a handler that makes values anew (a time or a random id in its SQL,
a counter of the process) and stores, returns and emits them: two correct deliveries
differ in them, so the report leaves them out, a column and an event field alike, and
says so in a block no reader can miss (and in pytest's terminal summary), instead of
calling every scenario a failure."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel

from kafka_idem import App, Context
from kafka_idem.testing import Harness
from tests.conftest import ADMIN_DSN


class Order(BaseModel):
    tenant_id: str
    order_id: str
    amount: int


app = App("kit-drift")
app.event_topic("drift.placed", format="json")
DOUBLE = {"now": False}  # the mistake a check must still catch
COUNTER = itertools.count(1)  # counts on across deliveries: a value of the process


@app.migration
def tables(conn: Any) -> None:
    conn.execute("CREATE SCHEMA IF NOT EXISTS drift")
    conn.execute("CREATE TABLE IF NOT EXISTS drift.orders (id serial PRIMARY KEY, key text,"
                 " amount int, created timestamptz NOT NULL DEFAULT now(), seen timestamptz,"
                 " ref uuid, n bigint)")


@app.handler(topic="drift.orders", model=Order, key="{tenant_id}:o:{order_id}",
             hash_fields=("amount",), batch=True)
def order(msg: Order, ctx: Context) -> dict[str, Any]:
    n = next(COUNTER)
    insert = ("INSERT INTO drift.orders (key, amount, seen, ref, n) VALUES (%s, %s,"
              " clock_timestamp(), gen_random_uuid(), %s) RETURNING id, seen, ref")
    row = ctx.tx.execute(insert, (ctx.idempotency_key, msg.amount, n)).fetchone()
    if DOUBLE["now"]:
        with psycopg.connect(ctx.tx.info.dsn, autocommit=True) as own:  # not in the tx
            own.execute(insert, (ctx.idempotency_key, msg.amount, n))
    assert row is not None
    # the same counter and random id in the event as in the row: left out the same way
    ctx.emit("drift.placed", {"key": ctx.idempotency_key, "amount": msg.amount, "n": n,
                              "ref": str(row[2]), "token": uuid.uuid4().hex})
    return {"id": row[0], "seen": row[1].isoformat(), "amount": msg.amount}


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    with Harness(app, database_url=ADMIN_DSN) as h:
        yield h


ORDER = {"tenant_id": "t1", "order_id": "o-1", "amount": 3}


WHY = ("differs between two deliveries of the reference: a value the handler makes anew, "
       "e.g. now(), a random id or a counter of the process")
LEFT_OUT = [
    "drift.orders.id (default nextval('drift.orders_id_seq'::regclass))",
    "drift.orders.created (default now())",
    f"drift.orders.seen ({WHY})", f"drift.orders.ref ({WHY})", f"drift.orders.n ({WHY})",
    f"the stored result['seen'] ({WHY})",
    f"event drift.placed field n ({WHY})", f"event drift.placed field ref ({WHY})",
    f"event drift.placed field token ({WHY})"]


def test_values_the_handler_makes_anew_are_left_out_and_said(harness: Harness) -> None:
    report = harness.check("drift.orders", ORDER)
    assert report.passed, str(report)
    # a counter of the process and a random id: left out of the event as of the row
    assert report.left_out == LEFT_OUT
    lines = str(report).splitlines()
    assert lines[0].endswith("; 9 value(s) LEFT OUT of the comparison (listed below)")
    start = lines.index("  LEFT OUT: 9 value(s) no scenario compares (a mistake in them "
                        "would not fail this check):")
    assert lines[start + 1:start + 10] == [f"    - {line}" for line in LEFT_OUT]
    # the event's other fields are still compared: the reference has its event
    assert "  reference: events: 1 to drift.placed" in lines


def test_the_left_out_values_are_listed_in_pytests_terminal_summary(tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text(textwrap.dedent("""
        from tests.kit.test_check_drift import ORDER, app

        def test_drift(kafka_idem_harness):
            kafka_idem_harness(app).check("drift.orders", ORDER)
    """))
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
         f"--rootdir={tmp_path}", f"--kafka-idem-database-url={ADMIN_DSN}",
         "--kafka-idem-require-database", str(tmp_path / "test_user.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout.splitlines()
    [head] = [i for i, line in enumerate(out)
              if "kafka_idem: values Harness.check LEFT OUT (not compared)" in line]
    assert out[head + 1] == ("handler 'order' (topic drift.orders, local mode), checked "
                             "by test_user.py::test_drift:")
    assert out[head + 2:head + 11] == [f"    - {line}" for line in LEFT_OUT]


def test_a_write_outside_the_transaction_is_still_caught(harness: Harness) -> None:
    DOUBLE["now"] = True
    try:
        with pytest.raises(AssertionError) as caught:
            harness.check("drift.orders", ORDER, scenarios=["crash_before_commit"])
    finally:
        DOUBLE["now"] = False
    assert "table drift.orders: 1 row(s) more than the reference" in str(caught.value)
