"""What a handler's ORM errors (``ctx.session``) do to its record and the DLQ, through
the real broker and database: a unique violation and a numeric overflow are
permanent and recorded as the same error through ``ctx.tx`` is (never with the
statement's parameters), a ``StaleDataError`` is retried and charged, a serialization
failure or a deadlock is retried without charge, and a connection lost while the
session works is the framework's, never the message's."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from sqlalchemy import text

from tests.apps.orm_ledger import Account, Deposit, Entry
from tests.conftest import DB, Topics
from tests.integration.orm_support import (
    SEED,
    assert_failed_permanently,
    entries,
    framework_errors,
    key,
    ledger_app,
    run_one,
)
from tests.integration.support import failures, record_history


def _insert_via_session(order_id: str, amount: str | None = None) -> Callable[..., Any]:
    def fn(msg: Deposit, ctx: Any) -> None:
        ctx.session.add(Entry(account_id="a0", order_id=order_id,
                              amount=amount or msg.amount, idempotency_key=ctx.idempotency_key))
        # no flush: the framework's, as the handler returns, fails
    return fn


def _insert_via_tx(order_id: str, amount: str | None = None) -> Callable[..., Any]:
    def fn(msg: Deposit, ctx: Any) -> None:
        ctx.tx.execute("INSERT INTO public.orm_entry (account_id, order_id, amount, "
                       "idempotency_key) VALUES ('a0', %s, %s, %s)",
                       (order_id, amount or msg.amount, ctx.idempotency_key))
    return fn


def _same_as_tx(db: DB, topics: Topics, group: str, mode: str,
                make: Callable[[Callable[..., Any]], Callable[..., Any]],
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The failed record of ``make``'s handler through the session (order o1), then
    through ``ctx.tx`` (order o2), each on its own topic and group."""
    out = []
    for order, via in (("o1", _insert_via_session), ("o2", _insert_via_tx)):
        topic, grp = topics(partitions=1), f"{group}-{order}"
        run_one(ledger_app(db, topic, grp, mode, make(via)), topic, grp, order)
        out.append(assert_failed_permanently(db, topic, grp, order))
    return out[0], out[1]


@pytest.mark.parametrize("mode", ["local", "leased"])
def test_a_unique_violation_is_permanent_and_recorded_as_through_ctx_tx(
    db: DB, topics: Topics, group: str, mode: str
) -> None:
    orm, tx = _same_as_tx(db, topics, group, mode, lambda via: via(SEED))
    assert (orm["error_class"], orm["error_message"]) == (tx["error_class"], tx["error_message"])
    assert orm["error_class"] == "DataRejected" and "SQLSTATE 23505" in orm["error_message"]
    assert SEED not in orm["error_message"] and "[parameters" not in orm["error_message"]


@pytest.mark.parametrize("mode", ["local", "leased"])
def test_a_numeric_overflow_is_permanent_and_keeps_its_value_out_of_the_record(
    db: DB, topics: Topics, group: str, mode: str
) -> None:
    huge = "98765432109876.00"  # numeric(12, 2) holds 10 digits before the point
    orm, tx = _same_as_tx(db, topics, group, mode, lambda via: via("o-big", huge))
    assert (orm["error_class"], orm["error_message"]) == (tx["error_class"], tx["error_message"])
    assert orm["error_class"] == "DataRejected" and "SQLSTATE 22003" in orm["error_message"]
    assert "98765432109876" not in orm["error_message"] and "o-big" not in orm["error_message"]


@pytest.mark.parametrize("mode", ["local", "leased"])
def test_a_stale_version_is_retried_and_charged(
    db: DB, topics: Topics, group: str, mode: str
) -> None:
    """A StaleDataError (the account's version bumped by another transaction between
    the handler's read and its flush) is retryable, and charged: the handler's read
    was stale, which a re-run with a fresh read fixes (not the database's contention
    error, which kafka_idem retries without charge)."""
    topic = topics(partitions=1)

    def bump_then_update(msg: Deposit, ctx: Any) -> None:
        acct = ctx.session.get(Account, "a0")
        if ctx.attempt == 1:
            with psycopg.connect(db.dsn, autocommit=True) as other:
                other.execute("UPDATE public.orm_account SET version = version + 1")
        acct.balance += msg.amount
        acct.entries.append(Entry(order_id=msg.order_id, amount=msg.amount,
                                  idempotency_key=ctx.idempotency_key))

    app = ledger_app(db, topic, group, mode, bump_then_update)
    record_history(db)
    run_one(app, topic, group, "o1")
    rec = db.record(key("o1"))
    assert rec is not None and (rec["status"], rec["attempts"]) == ("succeeded", 2)
    (failure,) = failures(db, key("o1"))
    assert (failure["attempts"], failure["error_kind"]) == (1, "retryable")
    assert len(entries(db, key("o1"))) == 1
    assert db.value("SELECT balance FROM public.orm_account") == Decimal("2.50")
    assert db.value("SELECT version FROM public.orm_account") == 3  # bumped once, updated once


@pytest.mark.parametrize("mode", ["local", "batch", "leased", "async"])
@pytest.mark.parametrize("sqlstate", ["40001", "40P01"], ids=["serialization", "deadlock"])
def test_contention_through_the_session_is_retried_without_charge(
    db: DB, topics: Topics, group: str, mode: str, sqlstate: str
) -> None:
    """The server's own serialization failure / deadlock error (raised with its SQLSTATE
    by the database, wrapped by SQLAlchemy as an OperationalError) on the first runs."""
    topic = topics(partitions=1)
    calls: list[int] = []
    contend = text(f"DO $$ BEGIN RAISE EXCEPTION 'contention' USING ERRCODE = '{sqlstate}'; "
                   "END $$")

    def contended(msg: Deposit, ctx: Any) -> None:
        calls.append(ctx.attempt)
        ctx.session.add(Entry(account_id="a0", order_id=msg.order_id, amount=msg.amount,
                              idempotency_key=ctx.idempotency_key))
        if len(calls) <= 2:
            ctx.session.execute(contend)

    async def contended_async(msg: Deposit, ctx: Any) -> None:
        calls.append(ctx.attempt)
        ctx.session.add(Entry(account_id="a0", order_id=msg.order_id, amount=msg.amount,
                              idempotency_key=ctx.idempotency_key))
        if len(calls) <= 2:
            await ctx.session.execute(contend)

    app = ledger_app(db, topic, group, mode, contended_async if mode == "async" else contended)
    run_one(app, topic, group, "o1")
    rec = db.record(key("o1"))
    assert rec is not None
    assert (rec["status"], rec["attempts"], rec["error_kind"]) == ("succeeded", 1, None)
    assert len(calls) >= 3 and set(calls) == {1}  # every run was attempt 1: never charged
    assert len(entries(db, key("o1"))) == 1


@pytest.mark.parametrize("mode", ["local", "leased", "async"])
def test_a_connection_lost_during_the_sessions_work_is_never_charged(
    db: DB, topics: Topics, group: str, mode: str
) -> None:
    """The member's backend is terminated while the handler's session has pending work:
    its flush meets a closed connection (the framework's problem, not the message's)."""
    topic = topics(partitions=1)
    calls: list[int] = []
    pid_sql = text("SELECT pg_backend_pid()")

    def terminate(pid: int) -> None:
        with psycopg.connect(db.dsn, autocommit=True) as other:
            assert other.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)

    def cut(msg: Deposit, ctx: Any) -> None:
        calls.append(ctx.attempt)
        s = ctx.session
        pid = s.execute(pid_sql).scalar_one()
        s.add(Entry(account_id="a0", order_id=msg.order_id, amount=msg.amount,
                    idempotency_key=ctx.idempotency_key))
        if len(calls) == 1:
            terminate(pid)
        s.flush()

    async def cut_async(msg: Deposit, ctx: Any) -> None:
        calls.append(ctx.attempt)
        s = ctx.session
        pid = (await s.execute(pid_sql)).scalar_one()
        s.add(Entry(account_id="a0", order_id=msg.order_id, amount=msg.amount,
                    idempotency_key=ctx.idempotency_key))
        if len(calls) == 1:
            terminate(pid)
        await s.flush()

    app = ledger_app(db, topic, group, mode, cut_async if mode == "async" else cut)
    metrics = run_one(app, topic, group, "o1")
    assert framework_errors(metrics) >= 1
    rec = db.record(key("o1"))
    assert rec is not None
    assert (rec["status"], rec["attempts"], rec["error_kind"]) == ("succeeded", 1, None)
    assert len(calls) >= 2 and set(calls) == {1}
    assert len(entries(db, key("o1"))) == 1
