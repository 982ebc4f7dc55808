"""The overview's numbers, sampled on a thread every few seconds while someone looks
(the counts read every record: a page never waits for them)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from confluent_kafka.admin import AdminClient

from kafka_idem.admin import operations as admin
from kafka_idem.app import App
from kafka_idem.console.dlq_index import DlqIndex
from kafka_idem.console.group import GroupView, describe
from kafka_idem.observe.redact import redact
from kafka_idem.settings import Settings
from kafka_idem.store import Store, connect

log = logging.getLogger(__name__)

IDLE_SECONDS = 60.0  # nobody looked for this long: stop sampling until someone does
STALE_WAIT = 2.0  # the first look after an idle spell waits this long for a new sample


@dataclass
class Snapshot:
    at: float
    took_ms: float
    status: admin.Status | None = None
    # {namespace: {handler: {status: records}}}
    handlers: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    group: GroupView | None = None
    dlq_hour: dict[str, dict[str, int]] = field(default_factory=dict)
    dlq_day: dict[str, dict[str, int]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


class Sampler:
    """Keeps the latest :class:`Snapshot`, sampled every ``every`` seconds."""

    def __init__(self, app: App, settings: Settings, store: Store, index: DlqIndex,
                 every: float) -> None:
        self.app, self.settings, self.store, self.index = app, settings, store, index
        self.every = every
        self.admin: AdminClient | None = None  # made on the sampler's thread, kept
        self.latest: Snapshot | None = None
        self.last_asked = time.monotonic()
        self.stop_event = threading.Event()
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kafka-idem-console-overview",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.wake.set()
        self.thread.join(timeout=3)  # a daemon: a broker that does not answer ends with us

    def get(self) -> Snapshot | None:
        """The latest snapshot; after an idle spell (sampling stopped) the first ask
        waits for a new one, up to :data:`STALE_WAIT` seconds."""
        idle = time.monotonic() - self.last_asked >= IDLE_SECONDS
        self.last_asked = time.monotonic()
        self.wake.set()
        latest = self.latest
        if idle and latest is not None:
            deadline = time.monotonic() + STALE_WAIT
            while self.latest is latest and time.monotonic() < deadline:
                time.sleep(0.05)
        return self.latest

    def _run(self) -> None:
        while not self.stop_event.is_set():
            if time.monotonic() - self.last_asked < IDLE_SECONDS:
                self.latest = self.sample()
                self.stop_event.wait(self.every)
            else:
                self.wake.wait(self.every)
                self.wake.clear()

    def sample(self) -> Snapshot:
        started = time.perf_counter()
        snap = Snapshot(at=time.time(), took_ms=0.0)
        secrets = self.settings.secret_values()
        try:
            conn = connect(self.settings.dsn, application_name="kafka_idem.console")
            try:
                snap.status = admin.status(conn, self.store,
                                           long_running_seconds=self.settings.long_running_seconds)
                for row in self.store.handler_counts(conn):
                    per = snap.handlers.setdefault(row["namespace"], {}).setdefault(
                        row["handler"], dict.fromkeys(admin.STATUSES, 0))
                    per[row["status"]] = int(row["n"])
                conn.rollback()
            finally:
                conn.close()
        except Exception as exc:
            snap.errors.append(redact(f"store: {type(exc).__name__}: {exc}", secrets))
        if self.admin is None:
            self.admin = AdminClient(self.settings.admin_config())
        snap.group = describe(self.settings, self.app.group_id, self.app.topics, self.admin)
        if snap.group.error:
            snap.errors.append(redact(f"group: {snap.group.error}", secrets))
        snap.dlq_hour = self.index.recent_by_kind(3600)
        snap.dlq_day = self.index.recent_by_kind(86400)
        snap.took_ms = (time.perf_counter() - started) * 1000
        return snap
