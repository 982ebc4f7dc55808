"""The outbox relay: publishes an app's outbox to Kafka, exactly once.

Which relay publishes which shard is decided by a consumer group over the control
topic ``<name_prefix>kafka-idem-outbox.<namespace>`` (one partition per shard): a
relay publishes the shards whose partitions it is assigned, each on a thread of its
own (:class:`~kafka_idem.outbox.shard.ShardWorker`). The group only spreads the
work; the safety comes from the per-shard transactional producer (a zombie's
transaction is fenced) and the markers (:mod:`kafka_idem.outbox.marker`).

The emitting transactions notify the relays (``pg_notify`` on channel
``kafka_idem_outbox``, delivered at commit): a shard is looked at as soon as it
has something, and at least every ``outbox_poll_seconds`` without one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from kafka_idem.deadletters import headers as h
from kafka_idem.errors import ConfigError, FrameworkError, StoreError
from kafka_idem.observe.health import Health
from kafka_idem.observe.metrics import Metrics
from kafka_idem.outbox.shard import Episode, ShardWorker, backoff
from kafka_idem.settings import TOPIC_CHARS, Settings
from kafka_idem.store import CHANNEL, OutboxRow, Store, connect

log = logging.getLogger(__name__)


def control_topic(settings: Settings, namespace: str) -> str:
    """The control topic of ``namespace``'s outbox (a namespace Kafka cannot name is
    spelled with ``_`` and a short hash, so two namespaces never share one)."""
    name = namespace
    if not TOPIC_CHARS.fullmatch(name) or len(name) > 150:
        digest = hashlib.sha256(namespace.encode()).hexdigest()[:8]
        name = re.sub(r"[^a-zA-Z0-9._-]", "_", namespace)[:140] + "-" + digest
    return f"{settings.name_prefix}kafka-idem-outbox.{name}"


# How long a stopping relay waits for its shards' rounds to end (see _stop_workers).
STOP_JOIN_SECONDS = 1.5

class RelayHooks:
    """Points a test can act at (a crash, a pause): no-ops here."""

    def before_commit(self, shard: int, ids: Sequence[int]) -> None:
        """The round's events and marker are produced, the transaction not committed."""

    def after_commit(self, shard: int, ids: Sequence[int]) -> None:
        """The Kafka transaction committed; its rows are not deleted yet."""


class Source(Protocol):
    """What a relay reads of its app (a :class:`kafka_idem.App`): its settings and the
    namespace whose outbox it publishes."""

    @property
    def settings(self) -> Settings: ...

    @property
    def namespace(self) -> str: ...


class Relay:
    """Publishes ``app``'s outbox while :meth:`run` runs (in a member's thread, or
    alone: ``kafka-idem relay``); ``settings``: instead of the app's."""

    def __init__(self, app: Source, settings: Settings | None = None, *,
                 metrics: Metrics | None = None, health: Health | None = None,
                 hooks: RelayHooks | None = None, live: bool = False) -> None:
        self.live = live  # its loop rounds are the process's liveness (a relay alone)
        self._stopping = threading.Event()  # run()'s stop: set, no shard is taken
        self.settings = s = settings or app.settings
        self.namespace = app.namespace
        self._namespace = self.namespace.encode()
        self.store = Store(schema=s.schema_name, table=s.table, namespace=self.namespace)
        self.control_topic = control_topic(s, self.namespace)
        self.metrics = metrics or Metrics()
        self.health = health
        self.hooks = hooks or RelayHooks()
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.workers: dict[int, ShardWorker] = {}
        self.assigned: set[int] = set()
        self._fenced_at: dict[int, float] = {}
        self._problems: dict[str, str] = {}
        self._lock = threading.Lock()
        self._listen = Episode(self, "outbox relay notifications")
        self._sampled_at = 0.0
        self._missing_said = False

    # --- what the workers report ------------------------------------------------------

    def headers(self, row: OutboxRow) -> list[tuple[str, bytes]]:
        """An event's headers: the emitter's, then the intent's ``idem.*``."""
        out = [*row.headers, (h.EVENT_KEY.name, row.idem_key.encode()),
               (h.EVENT_NAMESPACE.name, self._namespace),
               (h.EVENT_ID.name, str(row.id).encode())]
        if row.source_topic is not None:
            out += [(h.EVENT_SOURCE_TOPIC.name, row.source_topic.encode()),
                    (h.EVENT_SOURCE_PARTITION.name, str(row.source_partition).encode()),
                    (h.EVENT_SOURCE_OFFSET.name, str(row.source_offset).encode())]
        return out

    def published(self, rows: Sequence[OutboxRow]) -> None:
        self.metrics.outbox_published.inc(len(rows))

    def report(self, what: str, problem: str | None) -> None:
        """A trouble episode started (``problem``) or ended (``None``): for /readyz."""
        with self._lock:
            if problem is None:
                self._problems.pop(what, None)
            else:
                self._problems[what] = problem
            current = "; ".join(f"{k}: {v}" for k, v in sorted(self._problems.items()))
        if self.health is not None:
            self.health.outbox(current or None)

    # --- the loop -----------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Publish until ``stop`` is set; then stop every shard after its round and
        leave the group (the shards move at once)."""
        self._stopping = stop
        consumer = Consumer(self._group_config())
        try:
            self._check_control_topic(consumer)
        except BaseException:
            consumer.close()
            raise
        consumer.subscribe([self.control_topic], on_assign=self._on_assign,
                           on_revoke=self._on_revoke, on_lost=self._on_revoke)
        log.info("outbox relay started (control topic %s, %d shards)", self.control_topic,
                 self.settings.outbox_shards, extra={"action": "outbox_started"})
        listener: psycopg.Connection[Any] | None = None
        attempt = 0
        try:
            while not stop.is_set():
                msg = consumer.poll(0)
                err = msg.error() if msg is not None else None
                if err is not None:
                    self._kafka_error(err)
                self._tend()
                self._sample()
                if self.live and self.health is not None:
                    self.health.round()
                try:
                    if listener is None or listener.closed:
                        listener = self._listener()
                    self._wait(listener, stop)
                    self._listen.ended()
                    attempt = 0
                except (psycopg.Error, StoreError) as exc:  # the database down or gone:
                    # waited out (the workers poll on their own meanwhile)
                    self._listen.failed("database", exc)
                    listener = None
                    attempt += 1
                    stop.wait(backoff(attempt))
        finally:
            self._stop_workers(sorted(self.workers))
            consumer.close()
            if listener is not None:
                listener.close()
            log.info("outbox relay stopped", extra={"action": "outbox_stopped"})

    def _group_config(self) -> dict[str, Any]:
        conf = self.settings.consumer_config(self.control_topic)
        conf.pop("group.instance.id", None)
        # Eager: a revoked shard stops (its round finished) before any other relay
        # gets it; round-robin spreads the shards evenly.
        conf["partition.assignment.strategy"] = "roundrobin"
        conf["auto.offset.reset"] = "latest"
        # A control topic created after the start is noticed within seconds, not at
        # librdkafka's five-minute metadata refresh.
        conf.setdefault("topic.metadata.refresh.interval.ms", 10_000)
        return conf

    def _check_control_topic(self, consumer: Consumer) -> None:
        """A control topic with fewer partitions than shards would leave the shards
        beyond its partitions unpublished forever: refused (a missing one is waited for)."""
        try:
            md = consumer.list_topics(self.control_topic, timeout=10)
        except KafkaException:
            return  # the broker is not answering yet: the loop says so
        found = md.topics.get(self.control_topic)
        if found is None or found.error is not None:
            return
        if len(found.partitions) < self.settings.outbox_shards:
            raise ConfigError(
                f"outbox control topic {self.control_topic} has {len(found.partitions)} "
                f"partitions, fewer than the {self.settings.outbox_shards} outbox shards: "
                "lower outbox_shards or recreate the topic (with an empty outbox)",
                setting="outbox_shards")

    def _listener(self) -> psycopg.Connection[Any]:
        conn = connect(self.settings.dsn, application_name="kafka_idem-relay")
        try:
            conn.autocommit = True
            conn.execute(f"LISTEN {CHANNEL}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _wait(self, listener: psycopg.Connection[Any], stop: threading.Event) -> None:
        """Wake the shards the notifications name, for up to ``outbox_poll_seconds``."""
        suffix = f":{self.namespace}"
        for note in listener.notifies(timeout=self.settings.outbox_poll_seconds):
            shard, _, ns = note.payload.partition(":")
            if f":{ns}" == suffix and shard.isdigit():
                worker = self.workers.get(int(shard))
                if worker is not None:
                    worker.wake.set()
            if stop.is_set():
                break

    def _kafka_error(self, err: KafkaError) -> None:
        if err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
            if self._missing_said:
                return
            self._missing_said = True  # said once: the group joins when the topic exists
            log.warning("outbox control topic %s does not exist: create it with `kafka-idem "
                        "topics create MODULE:APP` (%d partitions, one per shard)",
                        self.control_topic, self.settings.outbox_shards,
                        extra={"action": "topics_missing", "topic": self.control_topic})
        else:
            log.debug("outbox relay consumer: %s", err.str())

    # --- shards ---------------------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        consumer.assign(partitions)
        consumer.pause(partitions)  # nothing is read through the group: it only assigns
        shards = sorted(p.partition for p in partitions)
        self.assigned = set(shards)
        for shard in shards:
            self._fenced_at.pop(shard, None)
            self._start(shard)
        self.metrics.outbox_shards.set(len(self.workers))
        if shards:
            log.info("outbox shards assigned to %s: %s", self.owner, shards,
                     extra={"action": "outbox_assigned"})

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        shards = sorted(p.partition for p in partitions)
        log.info("outbox shards revoked from %s: %s", self.owner, shards,
                 extra={"action": "outbox_revoked"})
        self._stop_workers(shards)  # each finishes its round first
        self.assigned -= set(shards)
        self.metrics.outbox_shards.set(len(self.workers))
        consumer.unassign()

    def _start(self, shard: int) -> None:
        if self._stopping.is_set():  # a relay told to stop takes no shard
            return
        old = self.workers.get(shard)
        if old is not None and old.is_alive():
            return
        worker = self.workers[shard] = ShardWorker(self, shard)
        worker.start()

    def _stop_workers(self, shards: list[int]) -> None:
        stopping = [self.workers.pop(s) for s in shards if s in self.workers]
        for worker in stopping:
            worker.stop()
        # A round ends within its Kafka calls' timeouts; a relay that is stopping waits
        # no longer than a member's stop may take (the workers are daemons: a round one
        # did not finish is fenced and settled by the shard's next owner).
        until = time.monotonic() + STOP_JOIN_SECONDS if self._stopping.is_set() else None
        for worker in stopping:
            worker.join(None if until is None else max(until - time.monotonic(), 0.0))

    def _tend(self) -> None:
        """Restart a shard's worker that died (an unexpected error: it settles the shard
        again through the marker); one fenced out stays stopped, and if the group still
        gives the shard to this relay two session timeouts later, takes it over again."""
        now = time.monotonic()
        for shard, worker in list(self.workers.items()):
            if worker.is_alive() or shard not in self.assigned:
                continue
            if worker.fenced:
                since = self._fenced_at.setdefault(shard, now)
                if now - since <= 2 * self.settings.session_timeout_ms / 1000:
                    continue
                del self._fenced_at[shard]
            else:
                log.error("outbox shard %d: its publisher stopped unexpectedly; restarting it",
                          shard, extra={"action": "outbox_restart", "shard": shard})
            del self.workers[shard]
            self._start(shard)
        self.metrics.outbox_shards.set(sum(1 for w in self.workers.values() if not w.fenced))

    def _sample(self) -> None:
        """The outbox gauges, every ``metrics_sample_seconds`` (on a worker's turn)."""
        now = time.monotonic()
        if now - self._sampled_at < self.settings.metrics_sample_seconds:
            return
        self._sampled_at = now
        try:
            with connect(self.settings.dsn, application_name="kafka_idem-relay") as conn:
                rows = self.store.outbox_pending(conn, self.namespace)
        except Exception:
            log.debug("outbox gauges not sampled", exc_info=True)
            return
        self.metrics.outbox_pending.set(sum(r["pending"] for r in rows))
        self.metrics.outbox_oldest_age.set(max((r["oldest_age_seconds"] for r in rows),
                                               default=0.0))


class RelayThread(threading.Thread):
    """A member's relay (``kafka-idem run``): :meth:`Relay.run` on a thread, stopped
    with the member; a framework error it ends with (e.g. a control topic with too few
    partitions) is kept in :attr:`error` for the member to stop on."""

    def __init__(self, relay: Relay) -> None:
        super().__init__(name="kafka-idem-outbox", daemon=True)
        self.relay = relay
        self.stopping = threading.Event()
        self.error: FrameworkError | None = None

    def run(self) -> None:
        try:
            self.relay.run(self.stopping)
        except FrameworkError as exc:
            log.error("outbox relay stopped: %s", exc, extra={"action": "outbox_failed"})
            self.error = exc

    def close(self, timeout: float = 60.0) -> None:
        self.stopping.set()
        if self.is_alive():
            self.join(timeout)
