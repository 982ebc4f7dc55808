"""Connections that answer from a script, for the store's plans and the paths that run
them (no PostgreSQL): each statement gets the next row of the script, and every
statement sent (``BEGIN`` and ``COMMIT`` of a ``transaction()`` block too) is kept, by
its query's name in the store's queries."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from psycopg.rows import dict_row

from kafka_idem.store import Store

Sent = tuple[str, dict[str, Any], bool]  # query name, parameters, read as a dict


class Script:
    """The rows the statements get, in order, and what was sent."""

    def __init__(self, store: Store, rows: list[Any]) -> None:
        self.names = {id(query): name for name, query in store.q.items()}
        self.rows = list(rows)
        self.sent: list[Sent] = []

    def answer(self, query: Any, params: Any, dicts: bool) -> Any:
        self.sent.append((self.names[id(query)], dict(params), dicts))
        if isinstance(self.rows[0], BaseException):
            raise self.rows.pop(0)
        return self.rows.pop(0)

    def mark(self, what: str) -> None:
        self.sent.append((what, {}, False))

    def names_sent(self) -> list[str]:
        return [name for name, _, _ in self.sent]


class Cursor:
    def __init__(self, script: Script, dicts: bool) -> None:
        self.script, self.dicts, self.row = script, dicts, None

    def execute(self, query: Any, params: Any) -> Cursor:
        self.row = self.script.answer(query, params, self.dicts)
        return self

    def fetchone(self) -> Any:
        return self.row

    def fetchall(self) -> Any:
        return self.row


class Transaction:
    """``BEGIN`` ... ``COMMIT`` (``ROLLBACK`` on an error), as psycopg's block sends."""

    def __init__(self, script: Script) -> None:
        self.script = script

    def __enter__(self) -> None:
        self.script.mark("BEGIN")

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.script.mark("COMMIT" if et is None else "ROLLBACK")

    async def __aenter__(self) -> None:
        self.__enter__()

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.__exit__(et, exc, tb)


class SyncConn:
    closed = broken = False
    autocommit = False

    def __init__(self, script: Script) -> None:
        self.script = script

    def cursor(self, row_factory: Any = None) -> Cursor:
        return Cursor(self.script, row_factory is dict_row)

    def execute(self, query: Any, params: Any) -> Cursor:
        return Cursor(self.script, False).execute(query, params)

    def transaction(self) -> Transaction:
        return Transaction(self.script)


class AsyncCursor(Cursor):
    async def execute(self, query: Any, params: Any) -> AsyncCursor:  # type: ignore[override]
        self.row = self.script.answer(query, params, self.dicts)
        return self

    async def fetchone(self) -> Any:
        return self.row

    async def fetchall(self) -> Any:
        return self.row


class AsyncConn:
    broken = False

    def __init__(self, script: Script) -> None:
        self.script = script
        self.closed = False

    def cursor(self, row_factory: Any = None) -> AsyncCursor:
        return AsyncCursor(self.script, row_factory is dict_row)

    async def execute(self, query: Any, params: Any) -> AsyncCursor:
        return await AsyncCursor(self.script, False).execute(query, params)

    def transaction(self) -> Transaction:
        return Transaction(self.script)

    async def close(self) -> None:
        self.closed = True


class AsyncConns:
    """:class:`~kafka_idem.consume.paths.async_connections.AsyncConnections` over one
    script: how many connections are out, and the most at once."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.out = self.most = 0
        self.given: list[AsyncConn] = []

    async def take(self) -> AsyncConn:
        self.out += 1
        self.most = max(self.most, self.out)
        return AsyncConn(self.script)

    async def give_back(self, conn: AsyncConn) -> None:
        self.out -= 1
        self.given.append(conn)
