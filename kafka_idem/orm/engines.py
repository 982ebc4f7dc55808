"""The engines behind ``ctx.session``: SQLAlchemy over the connection kafka_idem lends.

A handler's session must write in the transaction that also completes its idempotency
record, so it cannot come from a pool of its own: the engine's pool
(:class:`LendingPool`) hands out the connection the framework is running the handler
on (:data:`LENT`, set just before), never a new one. What SQLAlchemy would otherwise do
to a pooled connection is the framework's alone, so the engine's dialect
(:func:`_guard`) never ends the transaction or closes the connection:

* ``COMMIT`` is refused (a ``ProgrammingError`` with no SQLSTATE, a code defect, as
  psycopg's own ``commit()`` inside a transaction block is); the handler's writes commit
  with the completion or not at all;
* ``ROLLBACK`` and closing are no-ops: SQLAlchemy releases the connection at the end of
  a session, and the framework rolls back a failed attempt itself;
* the isolation level is read without psycopg's ``rollback()`` of an idle connection
  (a leased attempt's connection looks idle while its ``BEGIN`` is still queued).

Each lent connection gets one pool record, made the first time it is lent (SQLAlchemy's
``connect`` hooks and the dialect's first-connect check run then, in that handler's
transaction: reads only; an async engine awaits them, so no lock is held meanwhile), and
reused while the connection lives.

In a pipeline (the batch path, a leased attempt) psycopg knows a statement's columns
and row count only once its result is read, while SQLAlchemy looks at both right after
the statement (whether it returned rows; an ``UPDATE`` that matched no row is a
``StaleDataError``): every statement but an ``INSERT`` without ``RETURNING`` is synced
at once (:func:`_synced`; an ``AsyncSession``'s, :func:`_sync_results`).
"""

from __future__ import annotations

import collections
import contextvars
import threading
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.pq import PipelineStatus
from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.pool import ConnectionPoolEntry, Pool
from sqlalchemy.pool.base import _ConnectionRecord

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

LENT: contextvars.ContextVar[Any] = contextvars.ContextVar("kafka_idem_lent", default=None)
"""The psycopg connection (sync or async) the next checkout of a lending engine gets."""

URL = "postgresql+psycopg://"

# Engine options a handler's engine accepts; the pool, the connection and its
# transaction settings are the framework's.
ENGINE_OPTIONS = frozenset({
    "echo", "hide_parameters", "execution_options", "query_cache_size", "logging_name",
})


def refused(what: str) -> psycopg.ProgrammingError:
    """The error a handler gets for ending its transaction itself: a code defect
    (no SQLSTATE), so the attempt fails at once and nothing of it commits."""
    return psycopg.ProgrammingError(
        f"{what} inside a handler: kafka_idem commits the handler's writes together with "
        "its idempotency record once the handler returns (use session.begin_nested() for "
        "a part that may be undone)")


class LendingPool(Pool):
    """A pool of no connections of its own: a checkout gets :data:`LENT`."""

    def __init__(self, creator: Any, **kw: Any) -> None:
        super().__init__(creator, **kw)
        self._records: dict[int, _ConnectionRecord] = {}
        self._lock = threading.Lock()
        self._swept_at = 16

    def status(self) -> str:
        return f"LendingPool ({len(self._records)} lent connections known)"

    def _do_get(self) -> ConnectionPoolEntry:
        lent = LENT.get()
        if lent is None:
            raise psycopg.ProgrammingError(
                "ctx.session used outside its handler: a handler's session only works "
                "while the handler runs (kafka_idem closes it when the handler returns)")
        with self._lock:
            rec = self._records.get(id(lent))
        if rec is not None and rec.dbapi_connection is not None \
                and rec.driver_connection is lent:
            return rec
        # Made without the lock: making it runs the dialect's connect hooks, which an
        # async engine awaits, while other handlers' checkouts run on the same thread
        # (a lent connection is one handler's: no one else makes its record meanwhile).
        rec = _ConnectionRecord(self)  # calls the creator: LENT, as the dialect wants it
        with self._lock:
            self._records[id(lent)] = rec
            if len(self._records) > self._swept_at:
                self._sweep()
        return rec

    def _sweep(self) -> None:
        """Forget the records of connections the framework has closed since."""
        for key, rec in list(self._records.items()):
            conn = rec.driver_connection
            if conn is None or conn.closed:
                del self._records[key]
        self._swept_at = max(16, 2 * len(self._records))

    def _do_return_conn(self, record: ConnectionPoolEntry) -> None:
        pass  # the connection stays the framework's

    def dispose(self) -> None:
        with self._lock:
            self._records.clear()

    def recreate(self) -> LendingPool:
        return self.__class__(self._creator, reset_on_return=self._reset_on_return,
                              echo=self.echo, logging_name=self._orig_logging_name,
                              _dispatch=self.dispatch, dialect=self._dialect)


def _lent_sync() -> Any:
    return LENT.get()


def _no_op(*_args: Any, **_kw: Any) -> None:
    return None


def _refuse_commit(_dbapi_connection: Any) -> None:
    raise refused("a commit of the handler's transaction")


def _isolation_level(dialect: Any) -> Any:
    def get_isolation_level(dbapi_connection: Any) -> str:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("SHOW transaction_isolation")
            row = cursor.fetchone()
        finally:
            cursor.close()
        return str(row[0]).upper()
    return get_isolation_level


def _guard(engine: Engine) -> None:
    """The dialect of a lending engine: see the module's docstring."""
    dialect: Any = engine.dialect
    dialect.do_commit = _refuse_commit
    dialect.do_rollback = _no_op
    dialect.do_close = _no_op
    dialect.do_terminate = _no_op
    dialect.get_isolation_level = _isolation_level(dialect)
    _sync_each_statement(dialect)
    event.listen(engine, "after_cursor_execute", _sync_results)


def _sync_each_statement(dialect: Any) -> None:
    """A sync statement is synced by the dialect's own ``do_execute*`` rather than by an
    engine event: the dialect's first-connect check (server version, ...) runs on a
    connection without engine events, and in a pipeline it would read no rows."""
    for name in ("do_execute", "do_executemany", "do_execute_no_params"):
        setattr(dialect, name, _synced(getattr(dialect, name)))


def _synced(do: Any) -> Any:
    def run(cursor: Any, statement: str, *args: Any) -> None:
        do(cursor, statement, *args)
        driver = getattr(cursor, "connection", None)
        context = args[-1] if args else None
        if (isinstance(driver, psycopg.Connection)
                and driver.info.pipeline_status != PipelineStatus.OFF and not _unread(context)):
            with driver.pipeline():  # a nested block: its end syncs
                pass
    return run


def _sync_results(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any,
                  executemany: bool) -> None:
    """An ``AsyncSession``'s ``INSERT`` without ``RETURNING`` that its cursor left queued
    (:func:`_queued_insert`) but that runs inside a savepoint: synced (:func:`_unread`).
    Its other statements were synced by the cursor, a sync session's by :func:`_synced`."""
    driver = conn.connection.driver_connection
    if (isinstance(driver, psycopg.Connection)
            or driver.info.pipeline_status == PipelineStatus.OFF
            or not _queued_insert(statement) or _unread(context)):
        return
    from sqlalchemy.util import await_only

    await_only(_sync_async(driver))


def _unread(context: Any) -> bool:
    """An ``INSERT`` without ``RETURNING`` outside a savepoint: SQLAlchemy reads neither
    its rows nor its row count, so it stays queued with what follows. Inside one
    (``session.begin_nested()``) it is synced too: its error must come while the
    savepoint is open, where SQLAlchemy rolls back to it, not at its ``RELEASE``, after
    which SQLAlchemy takes the savepoint for gone and the transaction stays aborted."""
    if context is None or not context.isinsert:
        return False
    if context.root_connection.in_nested_transaction():
        return False
    compiled = context.compiled
    return compiled is not None and not compiled.effective_returning


async def _sync_async(driver: psycopg.AsyncConnection[Any]) -> None:
    async with driver.pipeline():
        pass


def _checked(options: dict[str, Any]) -> dict[str, Any]:
    from kafka_idem.errors import ConfigError

    if "isolation_level" in (options.get("execution_options") or {}):
        raise ConfigError(
            "app.sqlalchemy(engine_options=...): execution_options cannot set "
            "isolation_level: a handler's transaction is the framework's (the "
            "server's default isolation)", setting="sqlalchemy")
    unknown = sorted(set(options) - ENGINE_OPTIONS)
    if unknown:
        raise ConfigError(
            f"app.sqlalchemy(engine_options=...) does not take {', '.join(unknown)}: a "
            "handler's session runs on the framework's connection and transaction (it "
            f"takes {', '.join(sorted(ENGINE_OPTIONS))})", setting="sqlalchemy")
    return options


def lending_engine(options: dict[str, Any]) -> Engine:
    """A sync engine whose every connection is the one lent (``ctx.tx``)."""
    engine = create_engine(URL, creator=_lent_sync, poolclass=LendingPool,
                           pool_reset_on_return=None, **_checked(options))
    _guard(engine)
    return engine


def lending_async_engine(options: dict[str, Any]) -> AsyncEngine:
    """An async engine whose every connection is the async one lent (``ctx.tx`` of an
    ``async def`` handler), adapted as SQLAlchemy's own psycopg adapter does, but for
    statements in a pipeline (:class:`_LentAsyncCursor`)."""
    from sqlalchemy.dialects.postgresql.psycopg import (
        AsyncAdapt_psycopg_connection,
        AsyncAdapt_psycopg_cursor,
    )
    from sqlalchemy.ext.asyncio import create_async_engine  # greenlet: async handlers only

    class _LentAsyncCursor(AsyncAdapt_psycopg_cursor):
        """SQLAlchemy's adapter reads a statement's rows right after it, only if its
        result is there: in a pipeline it is not yet, so it is synced first."""

        __slots__ = ()

        async def _execute_async(self, operation: Any, parameters: Any) -> Any:
            cursor: Any = self._cursor
            driver = cursor.connection
            if (driver.info.pipeline_status == PipelineStatus.OFF
                    or _queued_insert(operation)):
                return await super()._execute_async(  # type: ignore[no-untyped-call]
                    operation, parameters)
            if parameters is None:
                result = await cursor.execute(operation)
            else:
                result = await cursor.execute(operation, parameters)
            await _sync_async(driver)
            res = cursor.pgresult
            if res is not None and res.status == self._adapt_connection.dbapi.ExecStatus.TUPLES_OK:
                self._rows = collections.deque(await self._cursor.fetchall())
            return result

    class _LentAsyncConnection(AsyncAdapt_psycopg_connection):
        __slots__ = ()

        def cursor(self, name: Any = None, /) -> Any:
            if name:
                return super().cursor(name)  # type: ignore[no-untyped-call]
            return _LentAsyncCursor(self)

    def adapted() -> Any:
        return _LentAsyncConnection(engine.sync_engine.dialect.loaded_dbapi, LENT.get())

    engine = create_async_engine(URL, creator=adapted, poolclass=LendingPool,
                                 pool_reset_on_return=None, **_checked(options))
    _guard(engine.sync_engine)
    return engine


def _queued_insert(operation: Any) -> bool:
    """An ``INSERT`` without ``RETURNING`` (nothing of it is read: it may stay queued)."""
    text = str(operation).lstrip()[:6].upper()
    return text == "INSERT" and "RETURNING" not in str(operation).upper()
