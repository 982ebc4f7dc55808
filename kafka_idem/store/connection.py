"""Connections fit for the protocol: the session every one of kafka_idem's connections
starts with, sync (:func:`connect`) and async (:func:`connect_async`, the event loop's
for ``async def`` handlers) alike."""

from __future__ import annotations

from typing import Any

import psycopg

from kafka_idem.store.errors import translate_errors
from kafka_idem.store.types import AsyncConn, Conn


def connect(
    dsn: str, *, application_name: str = "kafka_idem", idle_in_transaction_timeout: float = 0.0,
    lock_timeout: float = 0.0,
) -> Conn:
    """A connection fit for the protocol: synchronous commit on (an
    acknowledged commit must survive a server crash).

    ``idle_in_transaction_timeout`` (seconds, 0 = off) lets the server end the
    session of a member stalled inside a transaction (a zombie), releasing the
    row locks that would otherwise block the member that took its lease over.
    ``lock_timeout`` (seconds, 0 = off) bounds each wait for a lock: a member waiting on
    another's rows gets ``55P03`` (transient: retried, never charged) instead of
    waiting past its poll interval.
    """
    with translate_errors():
        conn = psycopg.connect(dsn, autocommit=False, application_name=application_name)
        for sql, params in _session(idle_in_transaction_timeout, lock_timeout):
            conn.execute(sql, params)
        conn.commit()
    return conn


async def connect_async(
    dsn: str, *, application_name: str = "kafka_idem", idle_in_transaction_timeout: float = 0.0,
    lock_timeout: float = 0.0,
) -> AsyncConn:
    """:func:`connect` for ``async def`` handlers: the same session settings."""
    with translate_errors():
        conn = await psycopg.AsyncConnection.connect(
            dsn, autocommit=False, application_name=application_name
        )
        for sql, params in _session(idle_in_transaction_timeout, lock_timeout):
            await conn.execute(sql, params)
        await conn.commit()
    return conn


def configure(conn: Conn) -> None:
    """Give ``conn`` (made elsewhere, e.g. by a pool) the session :func:`connect`'s have."""
    with translate_errors():
        for statement, params in _session(0.0):
            conn.execute(statement, params)
        conn.commit()


def _session(idle_in_transaction_timeout: float,
             lock_timeout: float = 0.0) -> list[tuple[str, tuple[Any, ...]]]:
    # An asynchronously committed success could vanish in a crash after its
    # Kafka offset was committed; insist on synchronous commit.
    return [
        ("SET synchronous_commit = on", ()),
        ("SELECT set_config('idle_in_transaction_session_timeout', %s, false)",
         (f"{int(idle_in_transaction_timeout * 1000)}ms",)),
        ("SELECT set_config('lock_timeout', %s, false)", (f"{int(lock_timeout * 1000)}ms",)),
    ]
