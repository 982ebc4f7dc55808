"""A member's background retention (setting ``retention``): a thread that, every
``retention_interval_seconds`` (with jitter), tries the app's turn and purges its
succeeded records older than the window (:mod:`kafka_idem.admin.retention`: the
rules, the batches, the turn).

At start, the source topics' ``retention.ms`` is asked of the broker: a window shorter
than one of them refuses the start (:class:`~kafka_idem.errors.ConfigError` naming
``retention``: ``kafka-idem run`` exits 2) unless ``retention_force``. A broker that
does not answer then does not stop the member; each run asks again and purges nothing
until every source topic's retention could be read (a run's check is the same as the
start's, so a topic's retention raised later stops the purges, with an error line).

A run never stops the member: a database or broker outage is one warning line, and
the next interval tries again. A stop ends the run between two batches; the member's
close waits for it a bounded time (the thread is a daemon, and a batch is short).
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time

from kafka_idem.admin import retention
from kafka_idem.admin.purge import read_retention
from kafka_idem.errors import ConfigError
from kafka_idem.observe.metrics import Metrics
from kafka_idem.settings import Settings
from kafka_idem.store import Store, connect, describe

log = logging.getLogger(__name__)

FIRST_RUN_SECONDS = 10.0  # the first run comes within this (or the interval, if shorter)
READ_SECONDS = 5.0  # the longest a run waits for the topics' retention.ms


class Retention(threading.Thread):
    """The member's retention thread; does nothing when ``retention`` is unset."""

    def __init__(self, settings: Settings, store: Store, metrics: Metrics,
                 topics: list[str], *, batch: int = retention.BATCH) -> None:
        super().__init__(name="kafka-idem-retention", daemon=True)
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.topics = topics
        self.batch = batch
        self.window = settings.retention
        self.member = settings.group_instance_id or f"{socket.gethostname()}:{os.getpid()}"
        self.stopping = threading.Event()

    def start(self) -> None:
        """Check the window against the source topics' retention, then start (retention
        set); raises :class:`ConfigError` naming ``retention`` when it is too short."""
        if self.window is None:
            return
        found = read_retention(self.settings, self.topics, timeout=READ_SECONDS)
        line = retention.refusal(self.window, found)
        if line is not None and not self.settings.retention_force:
            raise ConfigError(line, setting="retention")
        if line is not None:
            log.warning("retention_force: %s", line, extra={"action": "retention_forced"})
        unread = retention.unchecked(found)
        if unread is not None and not self.settings.retention_force:
            log.warning("retention=%s not checked at start: %s; nothing is purged until it "
                        "can be", self.window, unread, extra={"action": "retention_unchecked"})
        super().start()

    def run(self) -> None:
        interval = self.settings.retention_interval_seconds
        delay = random.uniform(0, min(interval, FIRST_RUN_SECONDS))
        while not self.stopping.wait(delay):
            self.once()
            delay = interval * random.uniform(0.8, 1.2)

    def once(self) -> int | None:
        """One run: what it removed, ``None`` when it did not purge (another member's
        turn, a window it could not check, an error)."""
        assert self.window is not None
        try:
            if not self._checked():
                return None
            started = time.monotonic()
            seen = [0]  # what the run's full batches removed, counted as they went

            def counted(n: int) -> None:
                seen[0] += n
                self.metrics.retention_purged.inc(n)

            conn = connect(self.settings.dsn, application_name="kafka_idem:retention",
                           idle_in_transaction_timeout=60.0,
                           lock_timeout=self.settings.lock_wait_seconds)
            try:
                removed = retention.run_once(
                    conn, self.store, window=self.window, member=self.member,
                    force=self.settings.retention_force, stopping=self.stopping,
                    batch=self.batch, counted=counted)
            finally:
                conn.close()
        except Exception as exc:  # never the member's end: the next interval tries again
            self.metrics.retention_errors.labels("database").inc()
            log.warning("retention run failed (%s); trying again in about %.0fs",
                        describe(exc), self.settings.retention_interval_seconds,
                        extra={"action": "retention_failed"})
            return None
        if removed is None:
            log.debug("retention: another member has the turn", extra={"action": "retention"})
            return None
        self.metrics.retention_purged.inc(removed - seen[0])  # the last batch
        self.metrics.retention_last_run.set(time.time())
        log.log(logging.INFO if removed else logging.DEBUG,
                "retention: removed %d succeeded records older than %s in %.1fs", removed,
                self.window, time.monotonic() - started, extra={"action": "retention"})
        return removed

    def _checked(self) -> bool:
        """Whether the window may be purged now: at least every source topic's
        retention.ms (or forced), each one read."""
        assert self.window is not None
        if self.settings.retention_force:
            return True
        found = read_retention(self.settings, self.topics, timeout=READ_SECONDS)
        line = retention.refusal(self.window, found)
        why = line or retention.unchecked(found)
        if why is None:
            return True
        kind = "too_short" if line is not None else "unchecked"
        self.metrics.retention_errors.labels(kind).inc()
        log.log(logging.ERROR if line is not None else logging.WARNING,
                "retention run skipped, nothing purged: %s", why,
                extra={"action": "retention_skipped"})
        return False

    def close(self, timeout: float) -> None:
        """Stop the runs: one under way ends after its current batch, waited for at
        most ``timeout`` seconds."""
        self.stopping.set()
        if self.is_alive():
            self.join(timeout)
