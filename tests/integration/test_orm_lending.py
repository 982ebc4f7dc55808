"""The lending engines' pool under concurrent ``async def`` handlers: key-ordered
concurrency runs many handlers on one event loop, each with its own connection. The
first checkout of a connection makes its pool record, which runs the dialect's
connect hooks (on the engine's first connection, its first-connect check): an async
engine awaits them, and the other handlers' checkouts run meanwhile on the same
thread. None of them may wait for the first one's record (a thread lock held across
those awaits stopped the whole event loop: ``kafka-idem run`` of an ORM app with
``concurrency`` > 1 hung at its first messages)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import psycopg
from sqlalchemy import text

from kafka_idem.orm.sessions import Sessions
from tests.conftest import DB

HANDLERS = 4


async def handlers_at_once(dsn: str) -> list[Any]:
    sessions = Sessions()  # a new app's: its async engine has never connected
    conns = [await psycopg.AsyncConnection.connect(dsn) for _ in range(HANDLERS)]

    async def handler(conn: psycopg.AsyncConnection[Any]) -> Any:
        opened = sessions.open_async(conn)  # in this task, as the async path does
        try:
            return (await opened.session.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        finally:
            await opened.discard()

    try:
        return await asyncio.gather(*(asyncio.create_task(handler(c)) for c in conns))
    finally:
        for c in conns:
            await c.close()


def test_concurrent_async_sessions_each_get_their_own_connection_without_waiting(
    db: DB,
) -> None:
    got: list[Any] = []
    loop_thread = threading.Thread(  # a hung event loop must not hang the test run
        target=lambda: got.append(asyncio.run(handlers_at_once(db.dsn))), daemon=True)
    loop_thread.start()
    loop_thread.join(30)
    assert not loop_thread.is_alive(), "the event loop hung in the sessions' checkouts"
    [pids] = got
    assert len(set(pids)) == HANDLERS  # each session ran on its handler's own connection


def _slow_first_connect(monkeypatch: Any, sessions: Sessions, *, is_async: bool) -> list[Any]:
    """The engine's first-connect check made slow (0.3 s), and what each statement saw of
    the dialect's state: SQLAlchemy runs the check for the first connect only and lets
    every other one through at once, initialized or not."""
    engine: Any = sessions.async_engine().sync_engine if is_async else sessions.engine()
    dialect = engine.dialect
    initialize = dialect.initialize
    seen: list[Any] = []

    def slow(connection: Any) -> None:
        import time

        time.sleep(0.3)  # on a thread of its own here (sync) or the loop (async): both wait
        initialize(connection)

    monkeypatch.setattr(dialect, "initialize", slow)
    from sqlalchemy import event

    @event.listens_for(engine, "before_cursor_execute")
    def look(*_args: Any) -> None:
        seen.append(dialect.server_version_info)

    return seen


def test_concurrent_first_checkouts_wait_for_the_engines_first_connect(
    db: DB, monkeypatch: Any,
) -> None:
    """Sync handlers on threads of their own: the first checkout runs the dialect's check;
    the others wait for it (SQLAlchemy's first-connect mutex, which the lending pool's
    records go through) instead of running on a dialect not yet initialized."""
    sessions = Sessions()
    seen = _slow_first_connect(monkeypatch, sessions, is_async=False)
    errors: list[BaseException] = []

    def handler() -> None:
        try:
            with psycopg.connect(db.dsn) as conn, conn.transaction():
                opened = sessions.open(conn)
                try:
                    opened.session.execute(text("SELECT 1"))
                finally:
                    opened.discard()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=handler) for _ in range(HANDLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert len(seen) >= HANDLERS and None not in seen


def test_concurrent_async_first_checkouts_wait_for_the_engines_first_connect(
    db: DB, monkeypatch: Any,
) -> None:
    """The same for ``async def`` handlers on one event loop: the others wait on the loop
    (the mutex is an asyncio one for an async engine's pool)."""
    sessions = Sessions()
    seen = _slow_first_connect(monkeypatch, sessions, is_async=True)

    async def run() -> None:
        conns = [await psycopg.AsyncConnection.connect(db.dsn) for _ in range(HANDLERS)]

        async def handler(conn: psycopg.AsyncConnection[Any]) -> None:
            async with conn.transaction():
                opened = sessions.open_async(conn)
                try:
                    await opened.session.execute(text("SELECT 1"))
                finally:
                    await opened.discard()

        try:
            await asyncio.gather(*(asyncio.create_task(handler(c)) for c in conns))
        finally:
            for c in conns:
                await c.close()

    asyncio.run(asyncio.wait_for(run(), 30))
    assert len(seen) >= HANDLERS and None not in seen
