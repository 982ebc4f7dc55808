"""One outbox shard's publisher: a thread, its database connection, its
transactional producer (``transactional.id`` stable per shard) and a reader of its
markers.

Taking the shard over: ``init_transactions`` (fences a previous owner, a zombie
included, and settles its open transaction), then the last committed marker's ids
deleted (published, maybe not deleted), then rounds. A round: the shard's rows
visible now in id order, one Kafka transaction with them and the marker listing
their ids, commit, delete exactly those ids. A round's ids are deleted before the
next round starts, so only the last marker can name undeleted rows.

Any doubt about the producer (an error other than one the transaction can abort)
drops it and takes the shard over again: the new ``init_transactions`` settles
whatever the old one left, and the marker tells what was committed.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer

from kafka_idem.outbox import marker
from kafka_idem.store import Conn, connect, describe

if TYPE_CHECKING:
    from kafka_idem.observe.metrics import Metrics
    from kafka_idem.settings import Settings
    from kafka_idem.store import OutboxRow, Store

log = logging.getLogger(__name__)

TIMEOUT = 30.0  # seconds for init / commit / abort / marker reads
_FENCED = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH,
           KafkaError.INVALID_PRODUCER_ID_MAPPING, KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED}


class Hooks(Protocol):
    """Points a test can act at in a round (:class:`~kafka_idem.outbox.relay.RelayHooks`)."""

    def before_commit(self, shard: int, ids: Sequence[int]) -> None: ...

    def after_commit(self, shard: int, ids: Sequence[int]) -> None: ...


class ShardRelay(Protocol):
    """What a shard's publisher and its trouble episodes use of their relay
    (:class:`kafka_idem.outbox.relay.Relay`)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def store(self) -> Store: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def hooks(self) -> Hooks: ...

    @property
    def control_topic(self) -> str: ...

    @property
    def owner(self) -> str: ...

    def headers(self, row: OutboxRow) -> list[tuple[str, bytes]]:
        """An event's headers (the emitter's, then the intent's ``idem.*``)."""

    def published(self, rows: Sequence[OutboxRow]) -> None:
        """``rows`` are published (committed to Kafka)."""

    def report(self, what: str, problem: str | None) -> None:
        """A trouble episode started (``problem``) or ended (``None``)."""


class Fenced(Exception):
    """Another relay took this shard over (this one is a zombie): stop publishing it."""


class Aborted(Exception):
    """The round's Kafka transaction was aborted: nothing of it is visible; retry."""


class Episode:
    """A run of failures of one kind: logged once when it starts (with the reason)
    and once when it ends, counted every time."""

    def __init__(self, relay: ShardRelay, what: str) -> None:
        self.relay = relay
        self.what = what
        self.since: float | None = None
        self.failures = 0

    def failed(self, kind: str, exc: BaseException) -> None:
        self.relay.metrics.outbox_relay_errors.labels(kind).inc()
        self.failures += 1
        if self.since is None:
            self.since = time.monotonic()
            log.warning("%s: %s (%s); retrying with backoff", self.what, kind, describe(exc),
                        extra={"action": "outbox_trouble", "kind": kind})
            self.relay.report(self.what, f"{kind}: {describe(exc)}")

    def ended(self) -> None:
        if self.since is not None:
            log.info("%s: recovered after %.1fs (%d failures)", self.what,
                     time.monotonic() - self.since, self.failures,
                     extra={"action": "outbox_recovered"})
            self.relay.report(self.what, None)
            self.since, self.failures = None, 0


class ShardWorker(threading.Thread):
    """Publishes one shard while this relay owns it."""

    def __init__(self, relay: ShardRelay, shard: int) -> None:
        super().__init__(name=f"kafka-idem-outbox-{shard}", daemon=True)
        self.relay = relay
        self.shard = shard
        self.settings = relay.settings
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.fenced = False
        self.episode = Episode(relay, f"outbox shard {shard}")
        self._conn: Conn | None = None
        self._producer: Producer | None = None
        self._reader: Consumer | None = None
        self._pending: list[int] = []  # committed to Kafka, not yet deleted
        self._attempt = 0
        self._identity: str | None = None

    @property
    def transactional_id(self) -> str:
        return f"{self.relay.control_topic}.{self.shard}"

    # --- the thread ----------------------------------------------------------------

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self._step()
        finally:
            self._close()

    def _step(self) -> None:
        """One round (taking over first if needed), or a failure and its backoff."""
        try:
            self.wake.clear()
            if self._producer is None:
                self._take_over()
            self._delete_pending()
            if self.stopping.is_set():  # revoked meanwhile: the next owner goes on
                return
            published = self._round()
        except Fenced as exc:
            self.relay.metrics.outbox_relay_errors.labels("fenced").inc()
            log.warning("outbox shard %d: %s; this relay (%s) stops publishing it", self.shard,
                        exc, self.relay.owner,
                        extra={"action": "outbox_fenced", "shard": self.shard})
            self._drop_producer()
            self.fenced = True
            self.stopping.set()
            return
        except Exception as exc:  # retried: every failure leaves the rows in the outbox
            self._failed(exc)
            return
        self.episode.ended()
        self._attempt = 0
        if published < self.settings.outbox_batch:
            self.wake.wait(self.settings.outbox_poll_seconds)

    def _failed(self, exc: Exception) -> None:
        if isinstance(exc, Aborted):
            kind = "kafka_aborted"
        elif isinstance(exc, KafkaException | TimeoutError | BufferError):
            kind = "kafka"
            self._drop_producer()  # in doubt: take the shard over again
        else:
            kind = "database"
            self._drop_conn()
        self.episode.failed(kind, exc)
        self._attempt += 1
        self.stopping.wait(backoff(self._attempt))

    # --- taking over -----------------------------------------------------------------

    def _take_over(self) -> None:
        """Fence the previous owner, then delete what its last committed round published."""
        conf = {**self.settings.producer_config(), "transactional.id": self.transactional_id}
        producer = Producer(conf)
        try:
            producer.init_transactions(TIMEOUT)
            self._pending = marker.last_marker(self._marker_reader(), self.relay.control_topic,
                                               self.shard, outbox=self.outbox(),
                                               timeout=TIMEOUT)
        except KafkaException as exc:
            _discard(producer)
            raise _translate(exc) from exc
        except BaseException:
            _discard(producer)
            raise
        self._producer = producer
        log.info("outbox shard %d taken over by %s (its last marker lists %d rows, deleted "
                 "if still there)",
                 self.shard, self.relay.owner, len(self._pending),
                 extra={"action": "outbox_shard", "shard": self.shard})

    def _marker_reader(self) -> Consumer:
        if self._reader is None:
            conf = self.settings.consumer_config(self.transactional_id)
            conf.update({"isolation.level": "read_committed", "enable.partition.eof": True,
                         "auto.offset.reset": "earliest"})
            conf.pop("group.instance.id", None)
            self._reader = Consumer(conf)
        return self._reader

    # --- a round ---------------------------------------------------------------------

    def conn(self) -> Conn:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.settings.dsn, application_name="kafka_idem-relay")
            self._conn.autocommit = True
        return self._conn

    def outbox(self) -> str:
        if self._identity is None:
            self._identity = self.relay.store.outbox_identity(self.conn(),
                                                              self.settings.schema_name)
        return self._identity

    def _delete_pending(self) -> None:
        if self._pending:
            self.relay.store.outbox_delete(self.conn(), self._pending)
            self._pending = []

    def _round(self) -> int:
        rows = self.relay.store.outbox_rows(self.conn(), self.shard, self.settings.outbox_batch)
        if not rows:
            return 0
        ids = [r.id for r in rows]
        producer = self._producer
        assert producer is not None
        try:
            producer.begin_transaction()
            for row in rows:
                _produce(producer, row.topic, key=row.key, value=row.value,
                         headers=self.relay.headers(row))
            _produce(producer, self.relay.control_topic, partition=self.shard, key=marker.KEY,
                     value=marker.encode(self.shard, ids, outbox=self.outbox(),
                                         owner=self.relay.owner))
            self.relay.hooks.before_commit(self.shard, ids)
            self._commit(producer)
        except KafkaException as exc:
            raise _translate(exc) from exc
        self._pending = ids  # published: deleted now, or by the next owner (the marker)
        self.relay.published(rows)
        self.relay.hooks.after_commit(self.shard, ids)
        self._delete_pending()
        return len(rows)

    def _commit(self, producer: Producer) -> None:
        try:
            producer.commit_transaction(TIMEOUT)
        except KafkaException as exc:
            err = exc.args[0]
            if isinstance(err, KafkaError) and err.txn_requires_abort() and not _fenced(err):
                producer.abort_transaction(TIMEOUT)
                raise Aborted(f"the Kafka transaction was aborted: {err.str()}") from exc
            raise

    # --- resources ---------------------------------------------------------------------

    def _drop_producer(self) -> None:
        if self._producer is not None:
            _discard(self._producer)
            self._producer = None

    def _drop_conn(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None

    def _close(self) -> None:
        self._drop_producer()
        self._drop_conn()
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def _produce(producer: Producer, topic: str, **kwargs: Any) -> None:
    """Produce, waiting for room in the local queue when it is full."""
    while True:
        try:
            producer.produce(topic, **kwargs)
            return
        except BufferError:
            producer.poll(0.05)


def _fenced(err: KafkaError) -> bool:
    return err.code() in _FENCED


def _translate(exc: KafkaException) -> Exception:
    err = exc.args[0] if exc.args else None
    if isinstance(err, KafkaError) and _fenced(err):
        return Fenced(f"fenced by a newer owner of its transactional id ({err.str()})")
    return exc


def _discard(producer: Producer) -> None:
    """Let a producer go without waiting for what it holds (its transaction, if
    open, is aborted by the next ``init_transactions`` or by its timeout)."""
    try:
        producer.purge()
        producer.close(timeout=1.0)  # type: ignore[call-arg]
    except (KafkaException, RuntimeError, TypeError):
        pass


def backoff(attempt: int, *, base: float = 0.2, cap: float = 10.0) -> float:
    """The wait after ``attempt`` failures in a row: doubling, jittered, capped."""
    bound = min(cap, base * 2 ** min(attempt, 16))
    return random.uniform(bound / 2, bound)
