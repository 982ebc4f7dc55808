"""Connections fit for the protocol: the session every one of kafka_idem's connections
starts with, sync (:func:`connect`) and async (:func:`connect_async`, the event loop's
for ``async def`` handlers) alike."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from kafka_idem.store.errors import translate_errors
from kafka_idem.store.types import AsyncConn, Conn


class Connection(psycopg.Connection[Any]):
    """psycopg's connection, whose ``transaction()`` is a savepoint inside a leased
    attempt (:class:`~kafka_idem.store.attempt.AttemptTransaction`) at any point.

    The attempt's ``BEGIN`` is only queued in the pipeline, and psycopg decides between
    ``BEGIN`` and ``SAVEPOINT`` for a block from the transaction state the server last
    reported, which only a sync brings. A handler's ``with ctx.tx.transaction():`` after
    a statement whose result it read would otherwise take itself for the outer
    transaction: an ``AssertionError`` in psycopg, or with ``python -O`` a ``COMMIT`` of
    the attempt's writes before their fenced completion. Here it syncs first (one round
    trip, only then)."""

    attempt_open = False  # an attempt's BEGIN is queued in this connection's pipeline

    @contextmanager
    def transaction(self, savepoint_name: str | None = None,
                    force_rollback: bool = False) -> Iterator[psycopg.Transaction]:
        if self.attempt_open and self.info.transaction_status == TransactionStatus.IDLE:
            with self.pipeline() as pipeline:
                pipeline.sync()
        with super().transaction(savepoint_name, force_rollback) as tx:
            yield tx


class AsyncConnection(psycopg.AsyncConnection[Any]):
    """:class:`Connection` for ``async def`` handlers."""

    attempt_open = False

    @asynccontextmanager
    async def transaction(self, savepoint_name: str | None = None,
                          force_rollback: bool = False) -> AsyncIterator[psycopg.AsyncTransaction]:
        if self.attempt_open and self.info.transaction_status == TransactionStatus.IDLE:
            async with self.pipeline() as pipeline:
                await pipeline.sync()
        async with super().transaction(savepoint_name, force_rollback) as tx:
            yield tx


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
        conn = Connection.connect(dsn, autocommit=False, application_name=application_name)
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
        conn = await AsyncConnection.connect(
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
