"""Lease heartbeats for leased-mode handlers.

While a leased handler runs, a background thread extends its lease every
``lease / 3`` seconds on a connection of its own. When an extension finds the
token no longer owns the key, the hold's event is set (``ctx.lease_lost``) and
extensions stop; the fenced completion will refuse the stale owner anyway.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg

from kafka_idem.errors import StoreError
from kafka_idem.store import Conn, Store, connect, describe

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Hold:
    """A held lease: ``lost`` is set when a heartbeat finds it taken over."""

    lost: threading.Event
    release: Callable[[], None]


class LeaseKeeper(threading.Thread):
    def __init__(self, store: Store, dsn: str, lease_seconds: float) -> None:
        super().__init__(name="kafka-idem-leases", daemon=True)
        self.store = store
        self.dsn = dsn
        self.lease_seconds = lease_seconds
        self._held: dict[str, tuple[uuid.UUID, threading.Event, str | None]] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()  # not _stop: threading.Thread has a _stop()
        self._conn: Conn | None = None

    @contextmanager
    def hold(self, key: str, token: uuid.UUID, shard: str | None = None) -> Iterator[Hold]:
        """Keep ``key``'s lease alive while the block runs.

        ``shard``: the handler's shard key for the message (a distributed store).
        Call ``release()`` once the completion (or failure) statement has run, before
        its commit: a heartbeat that then finds the record no longer ``processing``
        is looking at our own finished work, not at a lost lease.
        """
        lost = threading.Event()

        def release() -> None:
            with self._lock:
                if self._held.get(key, (None,))[0] == token:
                    del self._held[key]

        with self._lock:
            self._held[key] = (token, lost, shard)
        try:
            yield Hold(lost, release)
        finally:
            release()

    def run(self) -> None:
        while not self._stopping.wait(self.lease_seconds / 3):
            self.beat()
        self._close()

    def beat(self) -> None:
        """Extend every held lease once; set the hold's ``lost`` when one is gone."""
        with self._lock:
            held = list(self._held.items())
        for key, (token, lost, shard) in held:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = connect(self.dsn, application_name="kafka_idem:leases")
                with self._conn.transaction():
                    alive = self.store.extend_lease(
                        self._conn, key=key, token=token, lease_seconds=self.lease_seconds,
                        shard=shard)
            except (StoreError, psycopg.Error) as exc:  # the commit itself can fail too
                log.warning("lease extension failed (%s)", describe(exc),
                            extra={"action": "heartbeat", "key": key})
                self._close()
                continue
            if alive:
                continue
            with self._lock:
                if self._held.get(key, (None,))[0] != token:
                    # Released (completed or failed by its owner) while we extended:
                    # not a loss. Never pop a newer hold of the same key either.
                    continue
                del self._held[key]
            lost.set()
            log.warning("lease lost", extra={"action": "lease_lost", "key": key})

    def _close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None

    def stop(self) -> None:
        self._stopping.set()
