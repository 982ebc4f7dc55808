"""Paused handlers, as one member honours them (``kafka-idem pause``; the store's side
is :mod:`kafka_idem.admin.pauses`).

:class:`PauseWatch` keeps the app's paused handlers as the store last said them: read
at the start (a member started while its handler is paused starts paused), again at
each notification of the pausing transactions (``LISTEN``), and every
``poll_seconds`` besides (a notification missed while the connection was down). On
its own thread and connection: the database down or slow never stops the loop, and the
state stays as last known meanwhile.

:class:`HandlerHold` applies it on the loop thread each round. The paused handlers'
assigned partitions are paused at the consumer (no fetch; new assignments of them are
paused at the start of the round that follows their assign, before its ``consume()``;
what the ``consume()`` that assigned them returned of them waits in the queue), their
messages already queued start no unit and no key-ordered job
(:attr:`~kafka_idem.consume.partitions.Partitions.held`; flow control leaves them
paused), and their work in flight is cancelled as a revoke cancels it (a leased unit
stops between two messages, a key-ordered job not started never starts; what runs
finishes). The pause is acknowledged, in a log line ``handler_paused`` and the gauge
``kafka_idem_handler_paused``, once none of the handler's work is in flight on this
member. Resuming resumes the partitions at the consumer, save those flow control holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import psycopg

from kafka_idem.admin.pauses import CHANNEL, Pause, handler_names, listed, topics_of
from kafka_idem.app import App
from kafka_idem.consume.committable import TP, Assigned, tps
from kafka_idem.consume.concurrency.units import Units
from kafka_idem.consume.partitions import Partitions
from kafka_idem.errors import StoreError
from kafka_idem.observe.health import Health
from kafka_idem.observe.metrics import Metrics
from kafka_idem.outbox.shard import backoff
from kafka_idem.store import Store, connect

log = logging.getLogger(__name__)

A = TypeVar("A", bound=Assigned)



class Pausing(Protocol[A]):
    """What :meth:`HandlerHold.unheld` asks of the consumer."""

    def pause(self, partitions: list[A], /) -> None: ...


POLL_SECONDS = 2.0  # a missed notification is made up for within this (the bound: 5 s)
SLICE = 0.2  # the longest a stop waits for the watcher's thread


class PauseWatch:
    """The app's paused handlers, by name, as the store last said them (thread-safe:
    :meth:`current` hands out a dict never changed after)."""

    def __init__(self, dsn: str, store: Store, *, poll_seconds: float = POLL_SECONDS) -> None:
        self.dsn = dsn
        self.store = store
        self.poll_seconds = poll_seconds
        self.stopped = threading.Event()
        self._paused: dict[str, Pause] = {}
        self._thread: threading.Thread | None = None
        self._failing = False

    def current(self) -> dict[str, Pause]:
        return self._paused

    def start(self) -> None:
        """Read once now (so the first round knows), then watch on a daemon thread."""
        try:
            with connect(self.dsn, application_name="kafka_idem-pauses") as conn:
                conn.autocommit = True
                self._read(conn)
        except (psycopg.Error, StoreError) as exc:
            self._failed(exc)
        self._thread = threading.Thread(target=self._run, name="kafka-idem-pauses",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Stop the thread: it ends within a slice of its wait (a database that does not
        answer may hold it longer: it is a daemon, left to end on its own)."""
        self.stopped.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        listener: psycopg.Connection[Any] | None = None
        attempt = 0
        while not self.stopped.is_set():
            try:
                if listener is None or listener.closed:
                    listener = self._listener()
                self._read(listener)  # after LISTEN: no change falls in between
                self._wait(listener)
                attempt = 0
            except (psycopg.Error, StoreError) as exc:
                self._failed(exc)
                if listener is not None:
                    listener.close()
                listener = None
                attempt += 1
                self.stopped.wait(backoff(attempt, cap=self.poll_seconds))
        if listener is not None:
            listener.close()

    def _listener(self) -> psycopg.Connection[Any]:
        conn = connect(self.dsn, application_name="kafka_idem-pauses")
        try:
            conn.autocommit = True
            conn.execute(f"LISTEN {CHANNEL}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _wait(self, listener: psycopg.Connection[Any]) -> None:
        """Until a change of this namespace's pauses is notified, ``poll_seconds`` pass
        or the watch stops (looked at every :data:`SLICE` seconds)."""
        deadline = time.monotonic() + self.poll_seconds
        while not self.stopped.is_set() and (left := deadline - time.monotonic()) > 0:
            for note in listener.notifies(timeout=min(left, SLICE)):
                if note.payload == self.store.ns:
                    return

    def _read(self, conn: psycopg.Connection[Any]) -> None:
        self._paused = {p.handler: p for p in listed(conn, self.store, self.store.ns)}
        if self._failing:
            self._failing = False
            log.info("paused handlers read again from the store",
                     extra={"action": "pauses_read"})

    def _failed(self, exc: BaseException) -> None:
        if not self._failing:
            self._failing = True
            log.warning("cannot read the paused handlers (%s); keeping the last known "
                        "(%s) and retrying", exc, ", ".join(sorted(self._paused)) or "none",
                        extra={"action": "pauses_unread"})


class HandlerHold:
    """What the loop does about the paused handlers, each round (loop thread only)."""

    def __init__(self, app: App, store: Store, parts: Partitions, *, metrics: Metrics,
                 health: Health) -> None:
        self.app = app
        self.watch = PauseWatch(app.settings.dsn, store)
        self.parts = parts
        self.metrics = metrics
        self.health = health
        self.held: dict[str, Pause] = {}
        self.acknowledged: set[str] = set()
        self.applied: set[TP] = set()  # partitions paused at the consumer for a pause
        self.topics: set[str] = set()  # the held handlers' topics
        self._seen: dict[str, Pause] | None = None  # the watch's read last taken up
        for name in handler_names(app):
            metrics.handler_paused.labels(name).set(0)

    def start(self) -> None:
        """Read the pauses, and hold their handlers' messages from the first round on."""
        self.watch.start()
        self._refresh()

    def stop(self) -> None:
        self.watch.stop()

    def unheld(self, partitions: Sequence[A], consumer: Pausing[A]) -> list[A]:
        """Of newly assigned partitions, those of no paused handler, for the loop to
        resume; the others are paused at ``consumer`` now, before its next ``consume()``
        (a pause or a revoke may have left them either way)."""
        held = [p for p in partitions if p.topic in self.topics]
        if held:
            consumer.pause(held)
        self.applied = (self.applied - set(tps(partitions))) | set(tps(held))
        return [p for p in partitions if p.topic not in self.topics]

    def pause_resume(self, flow: tuple[list[TP], list[TP]], assigned: set[TP],
                     units: Units) -> tuple[list[TP], list[TP]]:
        """Flow control's partitions to pause and resume (``flow``), and the paused
        handlers': the partitions to pause and to resume at the consumer now. The held
        topics are set on the partitions' table, the newly held partitions' work in
        flight cancelled."""
        pause, resume = self._round(assigned, units)
        return flow[0] + pause, flow[1] + resume

    def _refresh(self) -> None:
        """Take up what the watch read last (a new dict per read: nothing to do for the
        one taken up already, so a round without a pause costs next to nothing)."""
        pauses = self.watch.current()
        if pauses is self._seen:
            return
        self._seen = pauses
        if pauses != self.held:
            self._changed(pauses)
        self.held = pauses
        self.topics = topics_of(self.app, pauses)
        self.parts.held = frozenset(self.topics)

    def _round(self, assigned: set[TP], units: Units) -> tuple[list[TP], list[TP]]:
        self._refresh()
        if not self.topics and not self.applied:
            return [], []
        want = {tp for tp in assigned if tp[0] in self.topics}
        pause = sorted(want - self.applied)
        resume = sorted(tp for tp in self.applied - want if tp in assigned
                        and not getattr(self.parts.get(tp), "paused", False))
        if pause:
            units.cancel(set(pause))
        self.applied = want
        if self.held.keys() - self.acknowledged:
            self._acknowledge(units.running_topics())
        return pause, resume

    def _changed(self, pauses: dict[str, Pause]) -> None:
        for name in sorted(self.held.keys() - pauses.keys()):
            self.acknowledged.discard(name)
            self.metrics.handler_paused.labels(name).set(0)
            log.info("handler %s resumed on this member", name,
                     extra={"action": "handler_resumed", "handler": name})
        for name in sorted(pauses.keys() - self.held.keys()):
            p = pauses[name]
            log.info("handler %s paused by %s (%s): starting nothing of it", name, p.actor,
                     p.reason, extra={"action": "handler_pausing", "handler": name})
        self.health.paused({n: p.reason for n, p in pauses.items()},
                           topics_of(self.app, pauses))

    def _acknowledge(self, running: set[str]) -> None:
        """Say a pause holds once none of its handler's work is in flight here."""
        for name in sorted(self.held.keys() - self.acknowledged):
            if topics_of(self.app, [name]) & running:
                continue
            self.acknowledged.add(name)
            self.metrics.handler_paused.labels(name).set(1)
            log.info("handler %s paused on this member: no call of it runs or starts",
                     name, extra={"action": "handler_paused", "handler": name})
