"""The test kit's harness: an app's handlers run through the real message path on a
throwaway PostgreSQL database, without Kafka.

A message goes where the runner would send it: :class:`~kafka_idem.consume.paths.processor.
Processor` (the batch path, the per-message local path or the leased path, with the
claim, the fenced completion, the retry decisions and the dead letters of production),
on a database of its own that the harness made from the store's and the app's
migrations. What a consumer would produce to a dead-letter topic is captured in
memory by the framework's own DLQ code. Waiting is switched off: a retry is due at
once (:func:`kafka_idem.no_wait`), a lease ends when the kit says so
(:meth:`Harness.expire_leases`).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.rows import dict_row

from kafka_idem.admin.migrate import migrate, migrate_app
from kafka_idem.app import App
from kafka_idem.consume.outcome import TP
from kafka_idem.errors import ConfigError
from kafka_idem.handler import Handler
from kafka_idem.store import Conn, Store, connect
from kafka_idem.testing.check import check as check_matrix
from kafka_idem.testing.databases import Databases
from kafka_idem.testing.events import EmittedEvent
from kafka_idem.testing.hooks import Hooks
from kafka_idem.testing.letters import CapturedLetter
from kafka_idem.testing.message import FakeMessage, Headers
from kafka_idem.testing.remote import Remote
from kafka_idem.testing.report import CheckReport
from kafka_idem.testing.reset import CleanState
from kafka_idem.testing.sandbox import Delivered, Path, Sandbox
from kafka_idem.testing.tables import (
    State,
    Table,
    describe_tables,
    list_tables,
    snapshot,
    split_name,
)


def load_app(spec: str) -> App:
    """The :class:`App` ``module:attribute`` names."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{spec!r} is not MODULE:APP (e.g. myapp.consumer:app)", setting="app")
    app = getattr(importlib.import_module(module_name), attr, None)
    if not isinstance(app, App):
        raise ConfigError(f"{spec!r} is not a kafka_idem App", setting="app")
    return app


@dataclass
class _Offsets:
    next: dict[TP, int] = field(default_factory=dict)

    def take(self, tp: TP) -> int:
        offset = self.next.get(tp, 0)
        self.next[tp] = offset + 1
        return offset


class Harness:
    """An app's handlers on a throwaway PostgreSQL database, through the real protocol.

        harness = Harness(app, database_url="postgresql://me@localhost/postgres")
        d = harness.deliver("orders.placed", {"tenant_id": "t1", "order_id": "o-1", ...})
        assert d.outcome == "succeeded" and harness.deliver(...).outcome == "replayed"
        harness.check("orders.placed", {...})   # the scenario matrix (raises AssertionError)
        harness.close()

    ``database_url`` names a PostgreSQL server (default: the app's ``database_url``,
    i.e. ``KAFKA_IDEM_DATABASE_URL``) where the role may ``CREATE DATABASE``: the
    harness makes its databases there (``kafka_idem_kit_*``), runs the store's and the
    app's migrations and ``setup(conn)`` (seed rows...), and drops them on
    :meth:`close`. ``tables`` names the tables :meth:`check` compares (default: the
    ones the migrations and ``setup`` created); ``ignore`` leaves columns out
    (``{"shop.orders": ["remote_id"]}``), or an event topic's fields
    (``{"shop.order-placed": ["sent_at"]}``); ``remotes`` are the fakes of the remote
    services the handlers call (see :class:`~kafka_idem.testing.remote.Remote`), reset
    now and before each scenario.
    """

    def __init__(
        self,
        app: App | str,
        *,
        database_url: str | None = None,
        tables: Iterable[str] | None = None,
        ignore: Mapping[str, Iterable[str]] | None = None,
        remotes: Mapping[str, Remote] | None = None,
        setup: Callable[[psycopg.Connection[Any]], None] | None = None,
        concurrency: int = 4,
    ) -> None:
        self.app = load_app(app) if isinstance(app, str) else app
        if concurrency < 2:
            raise ConfigError("concurrency must be at least 2", setting="concurrency")
        self.concurrency = concurrency
        self.remotes: dict[str, Remote] = dict(remotes or {})
        # ignore= names event topics too: their fields are left out of the event comparison
        self.event_ignore = {t: frozenset(f) for t, f in (ignore or {}).items()
                             if t in self.app.event_topics}
        ignore = {t: f for t, f in (ignore or {}).items() if t not in self.event_ignore}
        self.databases = Databases(database_url or self.app.settings.dsn)
        self.hooks = Hooks()
        self._offsets = _Offsets()
        self._sandbox: Sandbox | None = None
        s = self.app.settings
        self._store = Store(schema=s.schema_name, table=s.table)
        self._apps: dict[tuple[str, tuple[tuple[str, Any], ...]], App] = {}
        self._kits: dict[str, Conn] = {}
        try:
            work = self.databases.create()
            self._work = work
            self.tables, self.clean, self._state = self._build(work, tables, ignore, setup)
            self._check_dsn = self.databases.create("_check", template=work)
            self.base = self.app.derived(database_url=work)
            self.hooks.install(self.base)
            self._sandbox = self._open(work)
            for remote in self.remotes.values():
                remote.reset()  # a clean database, and clean remotes
        except BaseException:
            self.close()
            raise

    def _build(
        self, dsn: str, tables: Iterable[str] | None,
        ignore: Mapping[str, Iterable[str]] | None,
        setup: Callable[[psycopg.Connection[Any]], None] | None,
    ) -> tuple[list[Table], State, CleanState]:
        """Migrate the new database ``dsn``; find and describe the app's tables."""
        s = self.app.settings
        migrate(dsn, s.schema_name, s.table)
        with psycopg.connect(dsn) as conn:
            before = list_tables(conn)
        migrate_app(dsn, s.schema_name, self.app.migrations)
        with psycopg.connect(dsn) as conn:
            if setup is not None:
                setup(conn)
                conn.commit()
            every = list_tables(conn)
            described = describe_tables(conn, every - before if tables is None else tables,
                                        ignore)
            store = {f"{s.schema_name}.{name}"
                     for name in (s.table, "admin_audit", "schema_migrations")}
            state = CleanState.capture(conn, every - store, store=store)
            return described, snapshot(conn, described), state

    # --- databases ------------------------------------------------------------------

    def _kit(self, dsn: str) -> Conn:
        """The kit's own connection to ``dsn`` (resets, reads, the clock)."""
        conn = self._kits.get(dsn)
        if conn is None or conn.closed or conn.broken:
            conn = self._kits[dsn] = connect(dsn, application_name="kafka_idem:testing")
            conn.autocommit = True
        return conn

    def _open(self, dsn: str, **settings: Any) -> Sandbox:
        """A sandbox on ``dsn`` with the app (its settings overridden by ``settings``)."""
        key = (dsn, tuple(sorted(settings.items())))
        if key not in self._apps:
            self._apps[key] = self.base.derived(database_url=dsn, **settings)
        return Sandbox(self._apps[key], self._kit(dsn))

    @contextmanager
    def scratch(self, **settings: Any) -> Iterator[Sandbox]:
        """The check database, clean again (the state the migrations and ``setup``
        left), with the app pointed at it for the time of a block; ``settings``
        override the app's (e.g. ``batch_path=True``)."""
        self._state.restore(self._kit(self._check_dsn), self._store)
        sb = self._open(self._check_dsn, **settings)
        try:
            yield sb
        finally:
            sb.close()

    def move_sequences(self, conn: Conn) -> None:
        """Move every sequence of the clean state on, each to a range of its own
        (:meth:`~kafka_idem.testing.reset.CleanState.move_apart`): a delivery then gets
        other numbers from them, and no two give the same (how :meth:`check` tells a
        number the database made, and which column's it is)."""
        self._state.move_apart(conn)

    @property
    def current(self) -> Sandbox:
        """The database :meth:`deliver` works in."""
        if self._sandbox is None:
            raise ConfigError("the harness is closed", setting="harness")
        return self._sandbox

    @property
    def dsn(self) -> str:
        """The URL of the database :meth:`deliver` works in (to look at it yourself)."""
        return self.current.dsn

    def reset(self) -> None:
        """Start :meth:`deliver` again on a clean database (and clean remotes): the
        state the migrations and ``setup`` left, the dead letters forgotten."""
        sb = self.current
        sb.close()
        self._state.restore(self._kit(sb.dsn), self._store)
        self._sandbox = self._open(sb.dsn)
        for remote in self.remotes.values():
            remote.reset()

    def rebind(self, *, remotes: Mapping[str, Remote] | None = None) -> None:
        """Take up the app's handlers as they are now (a test may have replaced one) and
        these ``remotes``, and start again on a clean database (see :meth:`reset`)."""
        self.remotes = dict(remotes or {})
        self.base = self.app.derived(database_url=self._work)
        self.hooks = Hooks()
        self.hooks.install(self.base)
        self._apps.clear()
        self.reset()

    def close(self) -> None:
        """Drop every database the harness made."""
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None
        for conn in self._kits.values():
            conn.close()
        self._kits.clear()
        self.databases.close()

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # --- messages --------------------------------------------------------------------

    def handler(self, topic: str) -> Handler[Any]:
        """The (instrumented copy of the) handler of ``topic``."""
        try:
            return self.base.handlers[topic]
        except KeyError:
            known = ", ".join(sorted(self.base.handlers)) or "none"
            raise ConfigError(f"the app has no handler for topic {topic!r} (it has: {known})",
                              setting="topic") from None

    def encode(self, topic: str, value: Any) -> bytes:
        """``value`` as the bytes a producer sends to ``topic``: bytes as they are, a
        payload (a model instance, a mapping) encoded by the handler's own codec."""
        if isinstance(value, bytes | bytearray | memoryview):
            return bytes(value)
        return self.handler(topic).encode(value)

    def message(self, topic: str, value: Any, *, key: str | bytes | None = None,
                headers: Headers | None = None, partition: int = 0,
                offset: int | None = None) -> FakeMessage:
        """The message a consumer of ``topic`` would receive for ``value``, at the next
        offset of its partition unless ``offset`` is given."""
        tp = (topic, partition)
        return FakeMessage(topic, partition=partition,
                           offset=self._offsets.take(tp) if offset is None else offset,
                           key=key, value=self.encode(topic, value), headers=headers,
                           timestamp=int(time.time() * 1000))

    def path(self, topic: str) -> Path:
        """The path the runner takes for ``topic`` with the app's settings."""
        handler = self.handler(topic)
        if handler.mode == "leased":
            return "leased"
        return "batch" if handler.batch and self.app.settings.batch_path else "per-message"

    def deliver(self, topic: str, value: Any, key: str | bytes | None = None,
                headers: Headers | None = None, *, partition: int = 0) -> Delivered:
        """Deliver ``value`` to the app as Kafka would, once, and say what happened.

        It runs until the message is finished, as the runner would: a failed attempt is
        retried at once with its count kept (no waiting); a key another owner holds
        comes back ``deferred`` (``busy``). The dead letters it produced are in
        ``dead_letters``, with the headers a consumer writes."""
        msg = self.message(topic, value, key=key, headers=headers, partition=partition)
        return self.redeliver(msg)

    def redeliver(self, msg: FakeMessage) -> Delivered:
        """Deliver ``msg`` (e.g. ``delivered.message``) again: the same record, as Kafka
        redelivers it after a restart that had not committed its offset."""
        sb = self.current
        return sb.drive(sb.main, msg, self.path(msg.topic()))

    def expire_leases(self, key: str | None = None) -> list[str]:
        """Let time pass beyond every live lease (or ``key``'s): the next delivery of
        such a key takes it over, as after its owner died. Returns the keys."""
        return self.current.expire_leases(key)

    @property
    def dead_letters(self) -> list[CapturedLetter]:
        """Every dead letter produced since the last :meth:`reset`."""
        return self.current.letters.letters

    def events(self, topic: str | None = None) -> list[EmittedEvent]:
        """Every event in the outbox (what the handlers' committed ``ctx.emit`` calls
        wrote since the last :meth:`reset`; to ``topic`` only, if given), in the order
        they were written."""
        return [e for e in self.current.events() if topic is None or e.topic == topic]

    def rows(self, table: str) -> list[dict[str, Any]]:
        """Every row of ``table`` (all its columns) in the current database."""
        query = psycopg.sql.SQL("SELECT * FROM {}").format(
            psycopg.sql.Identifier(*split_name(table)))
        with self.current.conn().cursor(row_factory=dict_row) as cur:
            return cur.execute(query).fetchall()

    def check(
        self,
        topic: str,
        value: Any,
        *,
        key: str | bytes | None = None,
        headers: Headers | None = None,
        conflict: Any = None,
        batch: Iterable[Any] | None = None,
        scenarios: Iterable[str] | None = None,
    ) -> CheckReport:
        """Prove ``topic``'s handler idempotent on ``value``: run the scenario matrix
        (:data:`~kafka_idem.testing.SCENARIOS`, or the ``scenarios`` named), each from a
        clean database, and compare the app's tables, the events in the outbox and the
        remotes' effects with a single delivery's; raise ``AssertionError`` with the
        report when one differs.

        ``value`` is a payload or raw bytes, sent with ``key`` and ``headers``;
        ``conflict`` is the payload with the same key and another request (made from
        ``value`` when not given); ``batch`` the payloads the batch path is compared on
        (``value`` and two with keys of their own when not given).

            report = harness.check("orders.placed", order)
            assert report.result("crash_before_commit", "batch").passed
        """
        __tracebackhide__ = True  # pytest shows the report, not the kit's source
        return check_matrix(self, topic, value, key=key, headers=headers, conflict=conflict,
                            batch=batch, scenarios=scenarios)
