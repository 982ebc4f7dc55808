"""A processor's one database connection, and what losing it means.

A lost connection is our surroundings failing, never the message's fault: it leaves
here as :class:`StoreUnavailable` (the partition waits, nothing is charged) and the
connection is dropped, so the next try opens a fresh one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from kafka_idem.errors import StoreUnavailable
from kafka_idem.settings import Settings
from kafka_idem.store import Conn, classify_db_error, connect


class Database:
    def __init__(self, settings: Settings, *, application_name: str) -> None:
        self.settings = settings
        self.application_name = application_name
        self._conn: Conn | None = None

    def connection(self) -> Conn:
        """The open connection, or a new one when there is none or it broke."""
        if self._conn is None or self._conn.closed or self._conn.broken:
            self.close()
            self._conn = connect(
                self.settings.dsn,
                application_name=self.application_name,
                idle_in_transaction_timeout=self.settings.idle_in_transaction_timeout_seconds,
                lock_timeout=self.settings.lock_wait_seconds,
            )
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None

    def _lost(self, exc: BaseException) -> bool:
        conn = self._conn
        return classify_db_error(exc) is StoreUnavailable or (
            conn is not None and (conn.closed or conn.broken)
        )

    def gone(self, exc: BaseException) -> bool:
        """Whether ``exc`` means the connection is gone (it is then dropped, so the next
        try opens a fresh one)."""
        if isinstance(exc, StoreUnavailable) or self._lost(exc):
            self.close()
            return True
        return False

    def raise_if_gone(self, exc: BaseException) -> None:
        """Raise :class:`StoreUnavailable` (and drop the connection) when ``exc`` means
        the connection is gone; else return, and ``exc`` is the caller's to judge."""
        if self._lost(exc):
            self.close()
            raise StoreUnavailable(str(exc)) from exc

    @contextmanager
    def unavailable(self) -> Iterator[None]:
        """psycopg errors that mean the connection is gone become StoreUnavailable."""
        try:
            yield
        except psycopg.Error as exc:
            self.raise_if_gone(exc)
            raise
