"""``ctx.session``: an app's ORM sessions, each on its handler's own transaction.

:class:`Sessions` is what ``app.sqlalchemy(...)`` configures (an app that never calls
it gets the defaults): the engines (made once per app and process, on first use;
:mod:`kafka_idem.orm.engines`), the options of each session, and the app's
``MetaData`` for ``kafka-idem migrate --app``. :meth:`Sessions.open` gives a
handler's context its :class:`Opened` session, which the framework *settles* when the
handler returns (a flush, inside the attempt's transaction, before the completion) or
*discards* when it raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import psycopg

from kafka_idem.errors import ConfigError

if TYPE_CHECKING:
    from sqlalchemy import MetaData
    from sqlalchemy.engine import Connection, Engine
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
    from sqlalchemy.orm import Session

EXTRA = "pip install 'kafka-idem[sqlalchemy]'"

# Session options the framework sets itself.
OWN_SESSION_OPTIONS = frozenset({"bind", "binds", "join_transaction_mode", "autobegin",
                                 "sync_session_class", "twophase"})


def _sqlalchemy(*, asyncio: bool = False) -> None:
    """SQLAlchemy importable (with its asyncio extension and greenlet for ``asyncio``),
    else the configuration error naming the extra."""
    try:
        import sqlalchemy

        if asyncio:
            import sqlalchemy.ext.asyncio  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"ctx.session needs SQLAlchemy 2 ({EXTRA}): {exc}",
                          setting="sqlalchemy") from None


class Sessions:
    """An app's ORM configuration and engines (``app.sqlalchemy``)."""

    def __init__(self) -> None:
        self.metadata: MetaData | None = None
        self.engine_options: dict[str, Any] = {}
        self.session_options: dict[str, Any] = {}
        self.configured = False
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._async_engine: AsyncEngine | None = None

    def table_names(self) -> list[str]:
        """The qualified names of :attr:`metadata`'s tables (none without it)."""
        if self.metadata is None:
            return []
        return [psycopg.sql.Identifier(t.schema or "public", t.name).as_string(None)
                for t in self.metadata.tables.values()]

    def configure(self, metadata: MetaData | None, engine_options: Mapping[str, Any] | None,
                  session_options: Mapping[str, Any] | None) -> None:
        _sqlalchemy()
        if self.configured:
            raise ConfigError("app.sqlalchemy(...) was called twice: configure the app's "
                              "ORM once", setting="sqlalchemy")
        from kafka_idem.orm.engines import _checked

        own = sorted(set(session_options or ()) & OWN_SESSION_OPTIONS)
        if own:
            raise ConfigError(f"app.sqlalchemy(session_options=...) cannot set "
                              f"{', '.join(own)}: a handler's session is bound to the "
                              "handler's transaction by kafka_idem", setting="sqlalchemy")
        self.engine_options = _checked(dict(engine_options or {}))
        self.session_options = dict(session_options or {})
        self.metadata = metadata
        self.configured = True

    # --- engines, made once ----------------------------------------------------------

    def engine(self) -> Engine:
        if self._engine is None:
            _sqlalchemy()
            from kafka_idem.orm.engines import lending_engine

            with self._lock:
                if self._engine is None:
                    self._engine = lending_engine(self.engine_options)
        return self._engine

    def async_engine(self) -> AsyncEngine:
        if self._async_engine is None:
            _sqlalchemy(asyncio=True)
            from kafka_idem.orm.engines import lending_async_engine

            with self._lock:
                if self._async_engine is None:
                    self._async_engine = lending_async_engine(self.engine_options)
        return self._async_engine

    # --- a handler's session -----------------------------------------------------------

    def open(self, conn: psycopg.Connection[Any]) -> Opened:
        """A session on ``conn``, the handler's connection inside its transaction."""
        if self._engine is None:
            _sqlalchemy()  # the ConfigError naming the extra, before engines.py imports it
        from kafka_idem.orm.engines import LENT

        token = LENT.set(conn)
        try:
            bound = self.engine().connect()
        finally:
            LENT.reset(token)
        try:
            bound.begin()  # no statement: the session joins the framework's transaction
            from kafka_idem.orm.handler_session import HandlerSession

            session = HandlerSession(bind=bound, join_transaction_mode="rollback_only",
                                     **self.session_options)
        except BaseException:
            bound.close()
            raise
        return Opened(session, bound)

    def open_async(self, conn: psycopg.AsyncConnection[Any]) -> AsyncOpened:
        """An ``AsyncSession`` on ``conn`` (an ``async def`` handler's): its connection
        is checked out at its first statement, in the handler's task (:data:`LENT`)."""
        if self._async_engine is None:
            _sqlalchemy(asyncio=True)
        from kafka_idem.orm.engines import LENT

        LENT.set(conn)
        from kafka_idem.orm.handler_session import HandlerSession, async_session_class

        sync_class, async_class = HandlerSession, async_session_class()
        session = async_class(bind=self.async_engine(), sync_session_class=sync_class,
                              **self.session_options)
        return AsyncOpened(session, conn)

    # --- migrations -------------------------------------------------------------------

    def create_tables(self) -> Callable[[psycopg.Connection[Any]], None]:
        """The app migration that creates the tables of :attr:`metadata` (those missing,
        and their schemas), in the migration's transaction (``kafka-idem migrate --app``),
        at its place among the app's migrations (``app.sqlalchemy`` registers it)."""
        def sqlalchemy_metadata(conn: psycopg.Connection[Any]) -> None:
            assert self.metadata is not None
            from kafka_idem.orm.engines import LENT

            token = LENT.set(conn)
            try:
                bound = self.engine().connect()
            finally:
                LENT.reset(token)
            try:
                for schema in sorted({t.schema for t in self.metadata.tables.values()
                                      if t.schema}):
                    bound.exec_driver_sql(  # create_all creates tables, not their schemas
                        f'CREATE SCHEMA IF NOT EXISTS "{schema.replace(chr(34), chr(34) * 2)}"')
                self.metadata.create_all(bound, checkfirst=True)
            finally:
                bound.close()
        return sqlalchemy_metadata


class Opened:
    """A sync handler's session and the connection it is bound to."""

    __slots__ = ("_bound", "session")

    def __init__(self, session: Session, bound: Connection) -> None:
        self.session = session
        self._bound = bound

    def settle(self) -> None:
        """The handler returned: flush what it left pending (its error is the handler's),
        then release the session; its writes commit with the completion."""
        from kafka_idem.orm.engines import LENT

        token = LENT.set(self._bound.connection.driver_connection)
        try:
            self.session.flush()
        finally:
            LENT.reset(token)
            self.discard()

    def discard(self) -> None:
        """Release the session's connection without a statement (the framework commits or
        rolls back); the session is left to be freed with the handler's context.

        Not ``session.close()``: on CPython 3.11 (3.11.7 here; not 3.12), closing a
        session whose identity map held a few hundred loaded objects (a lazy-loaded
        collection), right after its flush, on the batch path, crashed the process in the
        garbage collector (a segfault in the detach of its states; gone with the GC
        off, or without the close). The objects are released when the session is
        freed instead; a later use of the session fails on its closed connection."""
        self._bound.close()


class AsyncOpened:
    """An ``async def`` handler's session."""

    __slots__ = ("_conn", "session")

    def __init__(self, session: AsyncSession, conn: psycopg.AsyncConnection[Any]) -> None:
        self.session = session
        self._conn = conn

    async def settle(self) -> None:
        from kafka_idem.orm.engines import LENT

        token = LENT.set(self._conn)
        try:
            await self.session.flush()
        finally:
            LENT.reset(token)
            await self.discard()

    async def discard(self) -> None:
        try:
            await self.session.close()
        finally:
            self.session.sync_session.bind = None  # used again: no connection to lend
