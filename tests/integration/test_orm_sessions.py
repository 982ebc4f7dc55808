"""A handler's session cannot end its transaction (``commit()``, ``rollback()``: a
code defect, permanent at attempt 1, nothing of the attempt committed) but may undo a
part of it (``begin_nested()``), through the real broker and database."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.exc import IntegrityError

from tests.apps.orm_ledger import Deposit, Entry
from tests.conftest import DB, Topics
from tests.integration.orm_support import (
    SEED,
    assert_failed_permanently,
    entries,
    key,
    ledger_app,
    run_one,
)


def _entry(msg: Deposit, ctx: Any, order_id: str | None = None) -> Entry:
    return Entry(account_id="a0", order_id=order_id or msg.order_id, amount=msg.amount,
                 idempotency_key=ctx.idempotency_key)


@pytest.mark.parametrize("mode", ["local", "leased", "async"])
@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_ending_the_transaction_from_the_session_is_permanent_and_commits_nothing(
    db: DB, topics: Topics, group: str, mode: str, end: str
) -> None:
    topic = topics(partitions=1)

    def ends(msg: Deposit, ctx: Any) -> None:
        ctx.session.add(_entry(msg, ctx))
        ctx.session.flush()  # written in the attempt's transaction: must not survive
        getattr(ctx.session, end)()

    async def ends_async(msg: Deposit, ctx: Any) -> None:
        ctx.session.add(_entry(msg, ctx))
        await ctx.session.flush()
        await getattr(ctx.session, end)()

    run_one(ledger_app(db, topic, group, mode, ends_async if mode == "async" else ends),
            topic, group, "o1")
    rec = assert_failed_permanently(db, topic, group, "o1")  # no entry for its key either
    assert rec["error_class"] == "ProgrammingError"
    assert f"session.{end}() inside a handler" in rec["error_message"]


@pytest.mark.parametrize("mode", ["local", "batch", "leased", "async"])
def test_a_savepoint_undoes_its_part_and_the_handler_goes_on(
    db: DB, topics: Topics, group: str, mode: str
) -> None:
    topic = topics(partitions=1)

    def careful(msg: Deposit, ctx: Any) -> str:
        s = ctx.session
        try:
            with s.begin_nested():
                s.add(_entry(msg, ctx, SEED))  # the seed's order: a unique violation
        except IntegrityError:
            s.add(_entry(msg, ctx))
            return "recovered"
        return "unexpected"

    async def careful_async(msg: Deposit, ctx: Any) -> str:
        s = ctx.session
        try:
            async with s.begin_nested():
                s.add(_entry(msg, ctx, SEED))
        except IntegrityError:
            s.add(_entry(msg, ctx))
            return "recovered"
        return "unexpected"

    run_one(ledger_app(db, topic, group, mode, careful_async if mode == "async" else careful),
            topic, group, "o1")
    rec = db.record(key("o1"))
    assert rec is not None
    assert (rec["status"], rec["attempts"], rec["result_json"]) == ("succeeded", 1, "recovered")
    assert [e["order_id"] for e in entries(db, key("o1"))] == ["o1"]
    assert [e["idempotency_key"] for e in db.rows(
        "SELECT * FROM public.orm_entry WHERE order_id = %s", (SEED,))] == ["seed"]
