"""The console's index of the app's dead-letter topics: every record's ``idem.*``
headers (never its value), kept in memory by a thread that tails the topics.

A page of the dead-letter list is then a walk of this index, newest first, through
:meth:`kafka_idem.replay.Selection.matches` (the filters of ``dlq list``), and one
record's page reads that record alone, by its partition and offset
(:class:`~kafka_idem.replay.reading.Reader`): no request reads a whole topic. The
tail reads ``read_committed`` with ``assign()`` only: it never joins or commits a
consumer group.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import datetime as dt
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from kafka_idem.observe.redact import redact
from kafka_idem.replay.reading import READER_GROUP, reader_config
from kafka_idem.replay.records import DlqRecord, Selection
from kafka_idem.settings import Settings

log = logging.getLogger(__name__)

METADATA_EVERY = 30.0  # look for new topics and partitions this often
BATCH = 1000
MESSAGE_CHARS = 500  # of an error message, what the index keeps
MAX_SHARED_TEXTS = 200_000  # distinct texts kept once (beyond: each record its own)


Order = tuple[int, int, int]  # (timestamp in ms, partition, offset): the list's order


def order_of(rec: DlqRecord) -> Order:
    ts = rec.timestamp or rec.last_failure_at
    return (int(ts.timestamp() * 1000) if ts is not None else 0, rec.partition, rec.offset)


@dataclass
class TopicIndex:
    """One DLQ topic's records (without their values), kept in record-time order (the
    catch-up read interleaves partitions: the list is sorted again when it must be)."""

    topic: str
    letters: list[DlqRecord] = field(default_factory=list)
    order: list[Order] = field(default_factory=list)  # order_of(letters[i])
    sizes: dict[tuple[int, int], int] = field(default_factory=dict)  # value size, -1: null
    in_order: bool = True
    _by_key: dict[str, list[int]] | None = None  # key -> positions, built when asked
    next_offset: dict[int, int] = field(default_factory=dict)  # partition -> next to read
    ends: dict[int, int] = field(default_factory=dict)  # end offsets when last asked
    exists: bool = False

    def add(self, rec: DlqRecord, size: int) -> None:
        o = order_of(rec)
        if self.order and o < self.order[-1]:
            self.in_order = False
            self._by_key = None
        elif self._by_key is not None:
            self._by_key.setdefault(rec.idempotency_key or "", []).append(len(self.letters))
        self.letters.append(rec)
        self.order.append(o)
        self.sizes[(rec.partition, rec.offset)] = size
        self.next_offset[rec.partition] = rec.offset + 1

    def sorted(self) -> None:
        """Put the list in record-time order (after an out-of-order read)."""
        if not self.in_order:
            pairs = sorted(zip(self.order, self.letters, strict=True), key=lambda x: x[0])
            self.order = [o for o, _ in pairs]
            self.letters = [r for _, r in pairs]
            self.in_order = True
            self._by_key = None

    def by_key(self) -> dict[str, list[int]]:
        self.sorted()
        if self._by_key is None:
            keys: dict[str, list[int]] = {}
            for i, rec in enumerate(self.letters):
                keys.setdefault(rec.idempotency_key or "", []).append(i)
            self._by_key = keys
        return self._by_key

    @property
    def behind(self) -> int:
        """Records on the topic the index has not read yet (as of the last ask)."""
        return sum(max(end - self.next_offset.get(p, 0), 0) for p, end in self.ends.items())


@dataclass(frozen=True)
class Page:
    """A page of the dead-letter list: records newest first, and where the next starts."""

    rows: list[DlqRecord]
    next_before: Order | None  # the next page is of the records before this (None: none)
    scanned: int


class DlqIndex:
    """The dead letters of ``topics``, indexed by a background thread (:meth:`start`)."""

    def __init__(self, settings: Settings, topics: Iterable[str]) -> None:
        self.settings = settings
        self.topics = {t: TopicIndex(t) for t in sorted(set(topics))}
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: str | None = None  # the last failure to read, shown on the pages
        self.started = time.monotonic()
        self.ready_after: float | None = None  # seconds it took to catch up, once it did
        self._texts: dict[str, str] = {}  # texts records share, kept once

    # --- reading the topics ----------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="kafka-idem-console-dlq",
                                       daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=3)  # a daemon: a broker that does not answer ends with us

    def _run(self) -> None:
        while not self.stop_event.is_set():
            consumer = None
            try:
                consumer = Consumer(reader_config(
                    self.settings, f"{self.settings.name_prefix}{READER_GROUP}"))
                self._tail(consumer)
            except Exception as exc:  # the broker went away: say so, try again
                self.error = redact(f"{type(exc).__name__}: {exc}",
                                    self.settings.secret_values())
                log.warning("console: reading the dead-letter topics failed: %s", exc)
                self.stop_event.wait(5.0)
            finally:
                if consumer is not None:
                    with contextlib.suppress(Exception):  # already broken
                        consumer.close()

    def _tail(self, consumer: Consumer) -> None:
        assigned: set[tuple[str, int]] = set()
        checked = 0.0
        while not self.stop_event.is_set():
            if time.monotonic() - checked > METADATA_EVERY or not assigned:
                assigned = self._assign(consumer, assigned)
                checked = time.monotonic()
            if not assigned:
                self.stop_event.wait(2.0)
                continue
            msgs = consumer.consume(BATCH, timeout=0.5)
            with self.lock:
                for m in msgs:
                    err = m.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            self._at_end(m.topic() or "", m.partition() or 0, m.offset())
                        elif err.fatal() or not err.retriable():
                            raise KafkaException(err)
                        continue
                    idx = self.topics.get(m.topic() or "")
                    if idx is None:
                        continue
                    value = m.value()
                    idx.add(self._slim(DlqRecord.from_message(m)),
                            -1 if value is None else len(value))
                self.error = None
                self._maybe_ready()

    def _slim(self, rec: DlqRecord) -> DlqRecord:
        """``rec`` as the index keeps it: no value, no raw headers, the error message
        cut, and the texts many records share (topic, kind, class, handler, group,
        namespace, often the message) kept once."""
        def once(text: str | None) -> str | None:
            if text is None:
                return None
            kept = self._texts.get(text)
            if kept is None:
                if len(self._texts) >= MAX_SHARED_TEXTS:
                    return text
                kept = self._texts[text] = text
            return kept

        return dataclasses.replace(
            rec, value=None, headers=(), dlq_topic=once(rec.dlq_topic) or rec.dlq_topic,
            kind=once(rec.kind), error_class=once(rec.error_class),
            error_message=once((rec.error_message or "")[:MESSAGE_CHARS] or None),
            handler=once(rec.handler), consumer_group=once(rec.consumer_group),
            original_topic=once(rec.original_topic), namespace=once(rec.namespace),
            truncated=once(rec.truncated), replayed_from=once(rec.replayed_from),
            replay_group=once(rec.replay_group))

    def _at_end(self, topic: str, partition: int, offset: int | None) -> None:
        idx = self.topics.get(topic)
        if idx is None:
            return
        if offset is not None and offset >= 0:
            idx.next_offset[partition] = max(idx.next_offset.get(partition, 0), offset)
            idx.ends[partition] = max(idx.ends.get(partition, 0), offset)

    def _assign(self, consumer: Consumer, assigned: set[tuple[str, int]]) -> set[tuple[str, int]]:
        """(Re)assign every partition of every topic, each from where the index is."""
        wanted: list[TopicPartition] = []
        found: set[tuple[str, int]] = set()
        for topic, idx in self.topics.items():
            md = consumer.list_topics(topic, timeout=10)
            meta = md.topics.get(topic)
            exists = meta is not None and meta.error is None and bool(meta.partitions)
            with self.lock:
                idx.exists = exists
            if not exists:
                continue
            for p in sorted(meta.partitions):
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                with self.lock:
                    start = max(idx.next_offset.get(p, 0), low)
                    idx.next_offset[p] = start
                    idx.ends[p] = high
                found.add((topic, p))
                wanted.append(TopicPartition(topic, p, start))
        if found != assigned:
            consumer.assign(wanted)
        with self.lock:
            self._maybe_ready()
        return found

    def _maybe_ready(self) -> None:
        if self.ready_after is None and all(i.behind == 0 for i in self.topics.values()):
            self.ready_after = time.monotonic() - self.started

    # --- what the pages ask ------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Whether the index read every record that was on the topics when it started."""
        return self.ready_after is not None

    def progress(self) -> dict[str, Any]:
        with self.lock:
            return {"indexed": sum(len(i.letters) for i in self.topics.values()),
                    "behind": sum(i.behind for i in self.topics.values()),
                    "ready": self.ready, "error": self.error,
                    "topics": {t: {"exists": i.exists, "records": len(i.letters),
                                   "behind": i.behind} for t, i in self.topics.items()}}

    def page(self, topic: str, selection: Selection, *, before: Order | None = None,
             limit: int = 50) -> Page:
        """The records of ``topic`` that ``selection`` matches, newest first, from before
        ``before`` (the previous page's ``next_before``); at most ``limit``."""
        idx = self.topics[topic]
        with self.lock:
            idx.sorted()
            letters = idx.letters
            end = len(letters) if before is None else bisect.bisect_left(idx.order, before)
            positions: Iterable[int]
            if selection.key is not None:
                positions = reversed([i for i in idx.by_key().get(selection.key, []) if i < end])
            else:
                positions = range(end - 1, -1, -1)
            rows: list[DlqRecord] = []
            scanned = 0
            for i in positions:
                scanned += 1
                rec = letters[i]
                if selection.matches(rec):
                    if len(rows) == limit:
                        return Page(rows, order_of(rows[-1]), scanned)
                    rows.append(rec)
            return Page(rows, None, scanned)

    def of_key(self, key: str, namespace: str | None = None) -> list[DlqRecord]:
        """Every dead letter of ``key`` (in ``namespace``: one from before namespaces
        matches any), oldest first, over every topic."""
        out: list[DlqRecord] = []
        with self.lock:
            for idx in self.topics.values():
                for i in idx.by_key().get(key, []):
                    rec = idx.letters[i]
                    if namespace is None or rec.namespace in (None, namespace):
                        out.append(rec)
        return out

    def partitions(self, topic: str) -> set[int]:
        """The partitions of ``topic`` the index knows (as of its last look)."""
        with self.lock:
            idx = self.topics.get(topic)
            return set(idx.ends) if idx is not None else set()

    def size_of(self, topic: str, partition: int, offset: int) -> int | None:
        """The value size of a record the index read (-1: a null value; None: unknown)."""
        with self.lock:
            idx = self.topics.get(topic)
            return None if idx is None else idx.sizes.get((partition, offset))

    def recent_by_kind(self, seconds: float) -> dict[str, dict[str, int]]:
        """Per topic, the records whose last failure is in the last ``seconds``, by kind
        (what ``/dlq?kind=K&since=T`` lists: the time is ``idem.last_failure_at``)."""
        since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=seconds)
        out: dict[str, dict[str, int]] = {}
        with self.lock:
            for topic, idx in self.topics.items():
                counts: dict[str, int] = {}
                for rec in idx.letters:
                    at = rec.last_failure_at
                    if at is not None and at >= since:
                        kind = rec.kind or "no idem headers"
                        counts[kind] = counts.get(kind, 0) + 1
                out[topic] = counts
        return out
