"""``session.begin_nested()`` in a pipeline (the batch path, a leased attempt): an
``INSERT`` that fails inside the savepoint rolls back to it, and the handler's
transaction goes on (kafka_idem/orm/engines.py, ``_unread``).

Outside a savepoint an ``INSERT`` without ``RETURNING`` stays queued in the pipeline;
inside one it is synced at once, so its error comes while the savepoint is open. Queued,
the error came at ``RELEASE SAVEPOINT``, after which SQLAlchemy takes the savepoint for
gone: no ``ROLLBACK TO SAVEPOINT``, the transaction aborted, every later statement (the
completion) failing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from kafka_idem.orm.sessions import Sessions
from tests.conftest import DB


class Base(DeclarativeBase):
    pass


class Redemption(Base):
    __tablename__ = "redemptions"
    coupon: Mapped[str] = mapped_column(primary_key=True)  # no RETURNING on insert
    order_no: Mapped[int]


@pytest.fixture
def sessions(db: DB) -> Sessions:
    with psycopg.connect(db.dsn) as conn:
        conn.execute("CREATE TABLE redemptions (coupon text PRIMARY KEY, order_no int)")
    made = Sessions()
    made.configure(None, None, None)
    return made


def redeem_sync(sessions: Sessions, conn: psycopg.Connection[Any], order_no: int) -> str:
    opened = sessions.open(conn)
    try:
        with opened.session.begin_nested():
            opened.session.add(Redemption(coupon="WELCOME", order_no=order_no))
        outcome = "redeemed"
    except IntegrityError as exc:
        outcome = type(exc.orig).__name__
    opened.settle()
    return outcome


def test_a_failed_insert_in_a_savepoint_rolls_back_to_it_in_a_pipeline(
    db: DB, sessions: Sessions,
) -> None:
    with psycopg.connect(db.dsn) as conn:
        # the engine's first connect outside the pipeline (not this test's subject)
        opened = sessions.open(conn)
        opened.session.execute(text("SELECT 1"))
        opened.settle()
        conn.rollback()
        with conn.pipeline(), conn.transaction():
            outcomes = [redeem_sync(sessions, conn, n) for n in (1, 2)]
            conn.execute("INSERT INTO redemptions VALUES ('after', 3)")  # still usable
    assert outcomes == ["redeemed", "UniqueViolation"]
    assert db.rows("SELECT coupon, order_no FROM redemptions ORDER BY 2") == [
        {"coupon": "WELCOME", "order_no": 1}, {"coupon": "after", "order_no": 3}]


async def redeem_async(sessions: Sessions, conn: psycopg.AsyncConnection[Any],
                       order_no: int) -> str:
    opened = sessions.open_async(conn)
    try:
        async with opened.session.begin_nested():
            opened.session.add(Redemption(coupon="WELCOME", order_no=order_no))
        outcome = "redeemed"
    except IntegrityError as exc:
        outcome = type(exc.orig).__name__
    await opened.settle()
    return outcome


def test_the_same_with_an_async_session(db: DB, sessions: Sessions) -> None:
    async def run() -> list[str]:
        async with await psycopg.AsyncConnection.connect(db.dsn) as conn:
            async with conn.pipeline(), conn.transaction():
                outcomes = [await redeem_async(sessions, conn, n) for n in (1, 2)]
                await conn.execute("INSERT INTO redemptions VALUES ('after', 3)")
            return outcomes

    assert asyncio.run(run()) == ["redeemed", "UniqueViolation"]
    assert db.rows("SELECT coupon, order_no FROM redemptions ORDER BY 2") == [
        {"coupon": "WELCOME", "order_no": 1}, {"coupon": "after", "order_no": 3}]
