"""Plans: a step of the protocol written once, run on a sync or an async connection.

A step whose next statement depends on the last one's row (the claim of a key that
already exists: insert, lock, then decide) is written as a generator, its *plan*: it
yields each :class:`Statement` (the query, its parameters, how its row is read) and
is sent that statement's first row (``None`` when there is none), and it returns its
answer. It holds the decisions and does no I/O, so :func:`run_plan` (a
:class:`~kafka_idem.store.types.Conn`, the sync paths) and :func:`run_plan_async` (an
:class:`~kafka_idem.store.types.AsyncConn`, the ``async def`` handlers' event loop)
send exactly the same statements in the same order, and decide the same. The
transaction is the caller's, as for every method of :class:`~kafka_idem.store.Store`;
so is the translation of errors (:func:`~kafka_idem.store.errors.translate_errors`
around the driver: a plan's own errors, ``StaleOwner`` or a transient race, leave
through it unchanged).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from psycopg import sql
from psycopg.rows import dict_row

from kafka_idem.store.types import AsyncConn, Conn

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Statement:
    """One statement of a plan; its first row (one row at most: ``fetchone``) is sent
    back to the plan, a tuple, or a dict when ``dicts``."""

    query: sql.SQL
    params: Mapping[str, Any]
    dicts: bool = False


# yields the statements, is sent each one's row, returns the step's answer
Plan = Generator[Statement, Any, T]


def run_plan(conn: Conn, plan: Plan[T]) -> T:
    """``plan`` run on ``conn``: each statement sent, its row read, until it answers."""
    row: Any = None
    while True:
        try:
            stmt = plan.send(row)
        except StopIteration as done:
            answer: T = done.value
            return answer
        if stmt.dicts:
            row = conn.cursor(row_factory=dict_row).execute(stmt.query, stmt.params).fetchone()
        else:
            row = conn.execute(stmt.query, stmt.params).fetchone()


async def run_plan_async(conn: AsyncConn, plan: Plan[T]) -> T:
    """:func:`run_plan` on an async connection: the same statements, the same rows."""
    row: Any = None
    while True:
        try:
            stmt = plan.send(row)
        except StopIteration as done:
            answer: T = done.value
            return answer
        if stmt.dicts:
            cur = await conn.cursor(row_factory=dict_row).execute(stmt.query, stmt.params)
            row = await cur.fetchone()
        else:
            row = await (await conn.execute(stmt.query, stmt.params)).fetchone()
