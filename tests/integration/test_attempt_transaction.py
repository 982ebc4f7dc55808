"""A leased attempt's transaction is a psycopg transaction block queued in its
pipeline (:mod:`kafka_idem.store.attempt`): ``BEGIN`` travels with the handler's first
statement and ``COMMIT`` with the sync. What a handler does with ``ctx.tx`` inside it:

* ``ctx.tx.commit()`` raises (psycopg refuses it inside a transaction block): the
  handler's writes are never committed without their completion;
* ``psycopg.Rollback`` raised by the handler is the attempt's error, like any other,
  never swallowed into a success nobody completed;
* ``with ctx.tx.transaction():`` is a savepoint of the attempt's transaction, as in
  the local mode.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from consumers import payments
from consumers.payments import encode_charge
from kafka_idem import App, AsyncContext, Context, RetryPolicy
from kafka_idem.errors import InternalError
from kafka_idem.store import AttemptTransaction
from tests.conftest import (
    ADMIN_DSN,
    DB,
    InProcess,
    app_settings,
    caught_up,
    committed,
    produce,
    wait_for,
)
from tests.integration.support import migrate_app

MARK = ("INSERT INTO payments.ledger (tenant_id, order_id, amount, currency,"
        " idempotency_key) VALUES (%s, %s, %s, %s, %s)")
CASES = [(False, 1), (False, 4), (True, 4)]
IDS = ["sync", "sync-keyed", "async"]


def leased_app(db: DB, topic: str, group: str, fn: Any, *, concurrency: int) -> App:
    app = App("attempttx", **app_settings(db, group_id=group,
                                          schemas_dir=payments.SCHEMAS_DIR))
    app.migration(payments.create_tables)
    app.handler(
        topic=topic, model=payments.ChargeRequested, key="{tenant_id}:charge:{order_id}",
        hash_fields=("amount", "currency"), schema=payments.SCHEMA, mode="leased",
        concurrency=concurrency, retry=RetryPolicy(base=0.05, cap=0.05, max_attempts=3),
    )(fn)
    migrate_app(db, app)
    return app


def mark(msg: payments.ChargeRequested, key: str) -> tuple[str, tuple[Any, ...]]:
    return MARK, (msg.tenant_id, msg.order_id, msg.amount, msg.currency, key)


def run(db: DB, topic: str, group: str, fn: Any, concurrency: int, orders: list[str]) -> None:
    produce(topic, [(b"t1", encode_charge("t1", order, "1.00")) for order in orders])
    with InProcess(leased_app(db, topic, group, fn, concurrency=concurrency)):
        wait_for(lambda: caught_up(group, topic), timeout=120, what="the topic to drain")
    assert committed(group, topic) == {0: len(orders)}


@pytest.mark.parametrize(("use_async", "concurrency"), CASES, ids=IDS)
def test_a_handler_that_commits_commits_nothing(
    db: DB, topic: str, group: str, use_async: bool, concurrency: int,
) -> None:
    """``o-commit`` writes its ledger row, then commits ``ctx.tx`` itself: psycopg
    refuses (a code defect: dead-lettered at once), and no row of it is committed
    (before, the row was committed on its own, ahead of the completion the same
    transaction carries: a crash between them would have applied it again)."""
    refused: list[str] = []

    def sync_fn(msg: payments.ChargeRequested, ctx: Context) -> Any:
        ctx.tx.execute(*mark(msg, ctx.idempotency_key))
        if msg.order_id == "o-commit":
            try:
                ctx.tx.commit()
            except psycopg.ProgrammingError as exc:
                refused.append(str(exc))
                raise
        return payments.result_of(msg)

    async def async_fn(msg: payments.ChargeRequested, ctx: AsyncContext) -> Any:
        await ctx.tx.execute(*mark(msg, ctx.idempotency_key))
        if msg.order_id == "o-commit":
            try:
                await ctx.tx.commit()
            except psycopg.ProgrammingError as exc:
                refused.append(str(exc))
                raise
        return payments.result_of(msg)

    run(db, topic, group, async_fn if use_async else sync_fn, concurrency,
        ["o-commit", "o-ok"])
    assert refused and "commit() forbidden" in refused[0]
    bad = db.record("t1:charge:o-commit")
    assert bad is not None
    assert (bad["status"], bad["error_kind"], bad["attempts"]) == ("failed", "permanent", 1)
    assert bad["completed_token"] is None
    assert "commit() forbidden" in bad["error_message"]
    assert db.ledger_counts() == {"t1:charge:o-ok": 1}
    ok = db.record("t1:charge:o-ok")
    assert ok is not None and ok["status"] == "succeeded"


@pytest.mark.parametrize(("use_async", "concurrency"), CASES, ids=IDS)
def test_rollback_raised_by_a_handler_is_its_error_not_a_success(
    db: DB, topic: str, group: str, use_async: bool, concurrency: int,
) -> None:
    """psycopg swallows ``psycopg.Rollback`` at the end of the block it rolls back;
    the attempt's block lets it through: the attempt failed (retried, then exhausted),
    its row rolled back, and no ``succeeded`` record without a completion."""

    def sync_fn(msg: payments.ChargeRequested, ctx: Context) -> Any:
        ctx.tx.execute(*mark(msg, ctx.idempotency_key))
        if msg.order_id == "o-rollback":
            raise psycopg.Rollback()
        return payments.result_of(msg)

    async def async_fn(msg: payments.ChargeRequested, ctx: AsyncContext) -> Any:
        await ctx.tx.execute(*mark(msg, ctx.idempotency_key))
        if msg.order_id == "o-rollback":
            raise psycopg.Rollback()
        return payments.result_of(msg)

    run(db, topic, group, async_fn if use_async else sync_fn, concurrency,
        ["o-rollback", "o-ok"])
    bad = db.record("t1:charge:o-rollback")
    assert bad is not None
    assert (bad["status"], bad["error_class"]) == ("failed", "Rollback")
    assert bad["completed_token"] is None
    assert db.ledger_counts() == {"t1:charge:o-ok": 1}


@pytest.mark.parametrize("read_first", [False, True], ids=["first", "after-a-read"])
@pytest.mark.parametrize(("use_async", "concurrency"), CASES, ids=IDS)
def test_a_handlers_own_transaction_block_is_a_savepoint_of_the_attempt(
    db: DB, topic: str, group: str, use_async: bool, concurrency: int, read_first: bool,
) -> None:
    """The handler opens a savepoint block whose statement fails: only it rolls back;
    the row written after it and the completion commit together. ``first``: the block
    is the handler's first statement (before any statement of the attempt reached the
    server); ``after-a-read``: the handler read a result first (the attempt's ``BEGIN``
    went with that statement, but only a sync reports it): still a savepoint, not a
    ``BEGIN`` and ``COMMIT`` of its own, which would commit the writes before their
    completion."""

    def sync_fn(msg: payments.ChargeRequested, ctx: Context) -> Any:
        if read_first:
            assert ctx.tx.execute("SELECT 1").fetchone() == (1,)
        try:
            with ctx.tx.transaction():
                ctx.tx.execute(*mark(msg, ctx.idempotency_key))
                ctx.tx.execute("SELECT 1 / 0")
        except psycopg.errors.DivisionByZero:
            pass
        ctx.tx.execute(*mark(msg, ctx.idempotency_key))
        return payments.result_of(msg)

    async def async_fn(msg: payments.ChargeRequested, ctx: AsyncContext) -> Any:
        await asyncio.sleep(0.001)
        if read_first:
            assert await (await ctx.tx.execute("SELECT 1")).fetchone() == (1,)
        try:
            async with ctx.tx.transaction():
                await ctx.tx.execute(*mark(msg, ctx.idempotency_key))
                await ctx.tx.execute("SELECT 1 / 0")
        except psycopg.errors.DivisionByZero:
            pass
        await ctx.tx.execute(*mark(msg, ctx.idempotency_key))
        return payments.result_of(msg)

    run(db, topic, group, async_fn if use_async else sync_fn, concurrency, ["o-1", "o-2"])
    assert db.ledger_counts() == {"t1:charge:o-1": 1, "t1:charge:o-2": 1}
    for order in ("o-1", "o-2"):
        rec = db.record(f"t1:charge:{order}")
        assert rec is not None
        assert (rec["status"], rec["attempts"]) == ("succeeded", 1)
        assert rec["completed_token"] is not None


def test_an_attempt_refuses_a_connection_already_in_a_transaction() -> None:
    """The block would become a savepoint of that transaction and never commit: the
    framework's own error (never charged to the message), not a handler's."""
    with psycopg.connect(ADMIN_DSN) as conn:
        conn.execute("SELECT 1")  # a transaction is open
        with pytest.raises(InternalError, match="idle connection; this one is INTRANS"):
            AttemptTransaction(conn)
