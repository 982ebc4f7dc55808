"""The event loop's database connections for ``async def`` handlers
(:class:`AsyncConnections`), and how many a member opens at most
(:func:`connection_limit`).

Every statement of an ``async def`` message runs on one of these, taken for one step
and given back as it ends (:mod:`~kafka_idem.consume.paths.async_leased_path`): its
claim (a new key's one statement, its dispatch round's, or the whole claim of a key
that exists, in a transaction of its own), then its handler's transaction
(``BEGIN``, the handler, the fenced completion, ``COMMIT``), then, on a failure, the
failure record (a transaction of its own), or a withdrawal. No message holds two at
once: its claim's connection is given back before the message waits for a handler
slot, and the handler's before the failure is recorded.

Why a wait for a connection always ends: nothing that holds a connection waits for a
slot or for another connection. A claim, a failure record, a withdrawal, a round's
statement and a completion wait only for the server (a row lock they meet, at most
``lock_timeout``); a handler's call, which takes its slot first and its connection
second, waits for its remote call, and that ends. So every connection taken comes
back, whatever the limit. The limit leaves room beyond the calls: at most
``max_concurrency`` calls hold a connection (one slot each), and
:func:`connection_limit` adds a quarter more (at least 2), so while every slot's call
holds one, claims and failure records still find connections, and wait at most for
steps that end.
"""

from __future__ import annotations

import asyncio
import contextlib

import psycopg
from psycopg.pq import TransactionStatus

from kafka_idem.settings import Settings
from kafka_idem.store import AsyncConn, connect_async


class AsyncConnections:
    """Idle async connections, reused; one in use per handler call, claim, failure
    record or withdrawal. In autocommit: the handler's transaction sends ``BEGIN``
    and ``COMMIT`` itself, pipelined with the statements (see
    :meth:`Steps._run_pipelined <kafka_idem.consume.paths.steps.Steps._run_pipelined>`);
    a claim of a key that exists and a failure record run in ``conn.transaction()``.

    ``limit``: at most that many open at once (:func:`connection_limit`); a task
    wanting one more waits for one to come back. Nothing holds a connection while it
    waits for anything but the server or its own call (a call takes its slot first,
    then its connection), so every holder gives its connection back and no wait is
    forever."""

    def __init__(self, settings: Settings, *, application_name: str,
                 limit: int | None = None) -> None:
        self.settings = settings
        self.application_name = application_name
        self.limit = limit
        self._idle: list[AsyncConn] = []
        self._room = asyncio.Semaphore(limit) if limit is not None else None

    async def take(self) -> AsyncConn:
        if self._room is not None:
            await self._room.acquire()
        try:
            while self._idle:
                conn = self._idle.pop()
                if not conn.closed and not conn.broken:
                    return conn
            conn = await connect_async(
                self.settings.dsn, application_name=self.application_name,
                idle_in_transaction_timeout=self.settings.idle_in_transaction_timeout_seconds,
                lock_timeout=self.settings.lock_wait_seconds,
            )
            await conn.set_autocommit(True)
        except BaseException:
            if self._room is not None:
                self._room.release()
            raise
        return conn

    async def give_back(self, conn: AsyncConn) -> None:
        try:
            if (conn.closed or conn.broken
                    or conn.info.transaction_status != TransactionStatus.IDLE):
                with contextlib.suppress(psycopg.Error):
                    await conn.close()
                return
            self._idle.append(conn)
        finally:
            if self._room is not None:
                self._room.release()

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            with contextlib.suppress(psycopg.Error):
                await conn.close()


def connection_limit(max_concurrency: int) -> int:
    """The async connections a member opens at most: one per handler call
    (``max_concurrency``), and a quarter more (at least 2) for the claims of the
    messages waiting for a call (new keys, their rounds, keys that exist), the
    completions of those whose call returned, and failure records (module doc)."""
    return max_concurrency + max(2, max_concurrency // 4)
