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
