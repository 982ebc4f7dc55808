"""Reading and replaying dead-letter topics (DESIGN §6).

    sel = Selection(kind="permanent", since=dt.datetime(2024, 5, 1, tzinfo=dt.UTC))
    for rec in scan(settings, "payments.charge-requested.dlq", sel):
        print(rec.partition, rec.offset, rec.idempotency_key, rec.error_message)

    summary = replay(settings, None, "payments.charge-requested.dlq", sel,
                     to_topic=None, actor="ops@example")

Reads are bounded: the end offsets are captured when a read starts, so a read
never waits for records that arrive later.

A replay never sends a record twice, even when interrupted. Its position lives
in a consumer group of its own, named from the DLQ topic, the selection and the
target (:func:`replay_group`), and every batch runs in one Kafka transaction:

1. consume a batch from the replay group's committed position;
2. ask the store, in one query, which of the batch's keys already succeeded;
3. produce the matching, not-yet-succeeded records with lineage headers;
4. add the replay group's new DLQ offsets to the same transaction;
5. commit: the records and the new position become visible together, or not at all.

An interrupted replay resumes after the last committed batch; the transactional
id (the group name) fences a zombie run of the same replay, and an uncommitted
batch is aborted and invisible to ``read_committed`` consumers.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from kafka_idem import audit
from kafka_idem.dlq import ERROR_KINDS, PREFIX
from kafka_idem.errors import BrokerError, ConfigError
from kafka_idem.settings import Settings
from kafka_idem.store import Conn, Store, connect

log = logging.getLogger(__name__)

READER_GROUP = "kafka-idem-dlq-reader"  # never joined, never committed: assign() only
REPLAY_GROUP_PREFIX = "kafka-idem-replay"
TIMEOUT = 30.0
STALL_SECONDS = 30.0  # no record and no end-of-partition for this long: the broker is gone
BATCH_SIZE = 500

Header = tuple[str, bytes | None]


def _header_text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("utf-8", "replace")


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _when(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


@dataclass(frozen=True, slots=True)
class DlqRecord:
    """One record read from a DLQ topic, with its ``idem.*`` headers parsed."""

    dlq_topic: str
    partition: int
    offset: int
    timestamp: dt.datetime | None
    key: bytes | None
    value: bytes | None
    headers: tuple[Header, ...]
    idempotency_key: str | None = None
    kind: str | None = None
    error_class: str | None = None
    error_message: str | None = None
    handler: str | None = None
    consumer_group: str | None = None
    attempts: int | None = None
    original_topic: str | None = None
    original_partition: int | None = None
    original_offset: int | None = None
    first_failure_at: dt.datetime | None = None
    last_failure_at: dt.datetime | None = None

    @classmethod
    def from_message(cls, msg: Any) -> DlqRecord:
        headers = tuple((k, v) for k, v in (msg.headers() or []))
        idem = {k: _header_text(v) for k, v in headers if k.startswith(PREFIX)}
        ts_type, ts = msg.timestamp()
        return cls(
            dlq_topic=msg.topic(),
            partition=msg.partition(),
            offset=msg.offset(),
            timestamp=dt.datetime.fromtimestamp(ts / 1000, dt.UTC) if ts_type else None,
            key=msg.key(),
            value=msg.value(),
            headers=headers,
            idempotency_key=idem.get("idem.key"),
            kind=idem.get("idem.error.kind"),
            error_class=idem.get("idem.error.class"),
            error_message=idem.get("idem.error.message"),
            handler=idem.get("idem.handler"),
            consumer_group=idem.get("idem.consumer_group"),
            attempts=_int(idem.get("idem.attempts")),
            original_topic=idem.get("idem.original.topic"),
            original_partition=_int(idem.get("idem.original.partition")),
            original_offset=_int(idem.get("idem.original.offset")),
            first_failure_at=_when(idem.get("idem.first_failure_at")),
            last_failure_at=_when(idem.get("idem.last_failure_at")),
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-able view; header values as text (``base64:...`` when not UTF-8)."""
        return {
            "dlq_topic": self.dlq_topic,
            "partition": self.partition,
            "offset": self.offset,
            "timestamp": self.timestamp.isoformat() if self.timestamp else None,
            "idempotency_key": self.idempotency_key,
            "kind": self.kind,
            "error_class": self.error_class,
            "error_message": self.error_message,
            "handler": self.handler,
            "consumer_group": self.consumer_group,
            "attempts": self.attempts,
            "original_topic": self.original_topic,
            "original_partition": self.original_partition,
            "original_offset": self.original_offset,
            "first_failure_at": _iso(self.first_failure_at),
            "last_failure_at": _iso(self.last_failure_at),
            "kafka_key": display_bytes(self.key),
            "value_size": len(self.value) if self.value is not None else None,
            "headers": [[k, display_bytes(v)] for k, v in self.headers],
        }


def display_bytes(value: bytes | None) -> str | None:
    """Text when the bytes are UTF-8, else ``base64:<data>``."""
    if value is None:
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        import base64

        return "base64:" + base64.b64encode(value).decode("ascii")


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


@dataclass(frozen=True, slots=True)
class Selection:
    """Which DLQ records to list or replay. Every set field must match.

    ``since`` is inclusive and ``until`` exclusive, both on ``idem.last_failure_at``;
    ``from_offset`` and ``to_offset`` are inclusive DLQ offsets (of every partition
    read, or of ``partition`` when it is set).
    """

    key: str | None = None
    kind: str | None = None
    handler: str | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    partition: int | None = None
    from_offset: int | None = None
    to_offset: int | None = None

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in ERROR_KINDS:
            raise ConfigError(f"kind must be one of {', '.join(ERROR_KINDS)}", setting="kind")
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and value.tzinfo is None:  # naive means UTC
                object.__setattr__(self, name, value.replace(tzinfo=dt.UTC))
        if (self.from_offset is not None and self.to_offset is not None
                and self.from_offset > self.to_offset):
            raise ConfigError("from_offset must be <= to_offset", setting="from_offset")

    def matches(self, rec: DlqRecord) -> bool:
        if self.key is not None and rec.idempotency_key != self.key:
            return False
        if self.kind is not None and rec.kind != self.kind:
            return False
        if self.handler is not None and rec.handler != self.handler:
            return False
        if self.since is not None or self.until is not None:
            at = rec.last_failure_at
            if at is None:
                return False
            if self.since is not None and at < self.since:
                return False
            if self.until is not None and at >= self.until:
                return False
        if self.partition is not None and rec.partition != self.partition:
            return False
        if self.from_offset is not None and rec.offset < self.from_offset:
            return False
        return self.to_offset is None or rec.offset <= self.to_offset

    def to_json(self) -> dict[str, Any]:
        """The set fields, JSON-able (for the audit trail and the replay group's name)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = value.isoformat() if isinstance(value, dt.datetime) else value
        return out


def dlq_topic_for(settings: Settings, source_topic: str) -> str:
    return f"{source_topic}{settings.dlq_suffix}"


def replay_group(dlq_topic: str, selection: Selection, to_topic: str | None) -> str:
    """The replay's own consumer group (and transactional id): the same replay, run
    again, resumes where the last one stopped; a different selection starts afresh.

    >>> replay_group("p.dlq", Selection(kind="permanent"), None)  # doctest: +ELLIPSIS
    'kafka-idem-replay.p.dlq....'
    """
    spec = json.dumps({"selection": selection.to_json(), "to": to_topic}, sort_keys=True)
    digest = hashlib.sha256(spec.encode()).hexdigest()[:12]
    return f"{REPLAY_GROUP_PREFIX}.{dlq_topic}.{digest}"


# --- reading ---------------------------------------------------------------------


def _reader_config(settings: Settings, group: str) -> dict[str, Any]:
    conf = settings.consumer_config(group)
    # A bounded read needs to know when a partition has no more records.
    conf.update({"enable.partition.eof": True, "isolation.level": "read_committed"})
    return conf


@contextmanager
def _kafka(what: str, **context: Any) -> Iterator[None]:
    """Turn a confluent-kafka exception into :class:`BrokerError` (``__cause__`` kept)."""
    try:
        yield
    except KafkaException as exc:
        raise BrokerError(f"{what}: {exc}", **context) from exc


def _partitions(consumer: Consumer, topic: str, selection: Selection) -> list[int]:
    with _kafka("reading topic metadata", topic=topic):
        md = consumer.list_topics(topic, timeout=TIMEOUT)
    meta = md.topics.get(topic)
    if meta is None or meta.error is not None or not meta.partitions:
        raise ConfigError(f"topic {topic!r} does not exist", setting="dlq")
    parts = sorted(meta.partitions)
    if selection.partition is not None:
        if selection.partition not in parts:
            raise ConfigError(
                f"topic {topic!r} has no partition {selection.partition} "
                f"(partitions 0..{parts[-1]})",
                setting="partition",
            )
        parts = [selection.partition]
    return parts


def _bounds(
    consumer: Consumer,
    topic: str,
    selection: Selection,
    resume: dict[int, int] | None = None,
) -> tuple[dict[int, int], dict[int, int]]:
    """Start and end (exclusive) offset per partition, the ends captured now."""
    starts: dict[int, int] = {}
    ends: dict[int, int] = {}
    for p in _partitions(consumer, topic, selection):
        with _kafka("reading offsets", topic=topic, partition=p):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=TIMEOUT)
        start = max(low, selection.from_offset or 0, (resume or {}).get(p, -1))
        end = high if selection.to_offset is None else min(high, selection.to_offset + 1)
        starts[p], ends[p] = start, max(end, start)
    return starts, ends


def _batches(
    consumer: Consumer, topic: str, starts: dict[int, int], ends: dict[int, int], size: int
) -> Iterator[list[Any]]:
    """Messages of ``[start, end)`` per partition, in batches of at most ``size``."""
    active = {p for p in starts if starts[p] < ends[p]}
    if not active:
        return
    with _kafka("assigning partitions", topic=topic):
        consumer.assign([TopicPartition(topic, p, starts[p]) for p in sorted(active)])
    last_progress = time.monotonic()
    while active:
        with _kafka("reading", topic=topic):
            msgs = consumer.consume(size, timeout=0.25)
        batch = []
        for m in msgs:
            p = m.partition()
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    active.discard(p)
                    continue
                if err.fatal() or not err.retriable():
                    raise BrokerError(f"reading: {err}", topic=topic, partition=p)
                continue
            offset = m.offset()
            if offset is None or p not in active:
                continue
            if offset >= ends[p]:
                active.discard(p)
                continue
            batch.append(m)
            if offset >= ends[p] - 1:
                active.discard(p)
        if msgs:
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > STALL_SECONDS:
            raise BrokerError("no progress reading the topic", topic=topic)
        if batch:
            yield batch


def scan(
    settings: Settings, dlq_topic: str, selection: Selection
) -> Generator[DlqRecord, None, None]:
    """The records of ``dlq_topic`` matching ``selection``, from the beginning to the end
    offsets captured when the scan starts (partition by partition in offset order)."""
    consumer = Consumer(_reader_config(settings, READER_GROUP))
    try:
        starts, ends = _bounds(consumer, dlq_topic, selection)
        for batch in _batches(consumer, dlq_topic, starts, ends, BATCH_SIZE):
            for m in batch:
                rec = DlqRecord.from_message(m)
                if selection.matches(rec):
                    yield rec
    finally:
        consumer.close()


def read_one(settings: Settings, dlq_topic: str, partition: int, offset: int) -> DlqRecord | None:
    """The record at ``partition``/``offset`` of ``dlq_topic``, or ``None``."""
    sel = Selection(partition=partition, from_offset=offset, to_offset=offset)
    found = scan(settings, dlq_topic, sel)
    try:
        return next(found, None)
    finally:
        found.close()


def latest_for_key(settings: Settings, dlq_topic: str, key: str) -> DlqRecord | None:
    """The most recently dead-lettered record of idempotency key ``key``, or ``None``."""
    found = list(scan(settings, dlq_topic, Selection(key=key)))
    if not found:
        return None
    epoch = dt.datetime.min.replace(tzinfo=dt.UTC)
    return max(found, key=lambda r: (r.last_failure_at or epoch, r.timestamp or epoch, r.offset))


# --- republishing ----------------------------------------------------------------


def replay_headers(
    record: DlqRecord, *, actor: str, at: dt.datetime | None = None
) -> list[Header]:
    """The record's original headers (no ``idem.*``) plus the ``idem.replay.*`` lineage."""
    kept = [(k, v) for k, v in record.headers if not k.startswith(PREFIX)]
    lineage = {
        "idem.replay.at": (at or dt.datetime.now(dt.UTC)).astimezone(dt.UTC).isoformat(),
        "idem.replay.by": actor,
        "idem.replay.source_topic": record.dlq_topic,
        "idem.replay.source_partition": str(record.partition),
        "idem.replay.source_offset": str(record.offset),
    }
    return kept + [(k, v.encode("utf-8")) for k, v in lineage.items()]


def target_of(record: DlqRecord, to_topic: str | None) -> str:
    target = to_topic or record.original_topic
    if not target:
        raise ConfigError(
            f"{record.dlq_topic}[{record.partition}]@{record.offset} has no "
            "idem.original.topic header; choose a target with --to",
            setting="to",
        )
    return target


def republish(
    producer: Producer,
    record: DlqRecord,
    *,
    to_topic: str | None = None,
    actor: str,
    on_delivery: Callable[[Any, Any], None] | None = None,
) -> None:
    """Produce ``record`` again: key and value bytes unchanged, lineage headers added.

    Back to the original topic it goes to its original partition, so it stays in
    order with the other messages of its key whatever partitioner their producer
    used; to another topic (``to_topic``) the producer's partitioner decides. The
    caller flushes (or commits its transaction).
    """
    target = target_of(record, to_topic)
    kwargs: dict[str, Any] = {
        "key": record.key,
        "value": record.value,
        "headers": replay_headers(record, actor=actor),
    }
    if to_topic is None and record.original_partition is not None:
        kwargs["partition"] = record.original_partition
    if on_delivery is not None:
        kwargs["on_delivery"] = on_delivery
    producer.produce(target, **kwargs)


# --- replay ------------------------------------------------------------------------


class TokenBucket:
    """At most ``rate`` acquisitions per second on average, bursts up to ``burst``.

    Tokens refill continuously at ``rate``/s up to ``burst`` (default: one second's
    worth, at least 1); :meth:`acquire` sleeps until a token is there. With
    ``rate=10``: 10 records go at once, then one every 0.1 s.
    """

    def __init__(
        self,
        rate: float,
        *,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rate <= 0:
            raise ConfigError("rate must be > 0 records per second", setting="rate")
        self.rate = rate
        self.burst = max(1.0, burst if burst is not None else rate)
        self.tokens = 1.0  # the first record goes at once, no burst at start-up
        self.clock = clock
        self.sleep = sleep
        self.last = clock()

    def acquire(self) -> None:
        while True:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                return
            self.sleep((1.0 - self.tokens) / self.rate)


@dataclass
class ReplaySummary:
    """What a replay did. Counts cover the batches committed (all of them in a dry run)."""

    dlq_topic: str
    group: str
    to_topic: str | None
    dry_run: bool
    scanned: int = 0
    matched: int = 0
    sent: int = 0
    would_send: int = 0
    skipped_succeeded: int = 0
    limited: bool = False  # stopped by --limit with records left to read
    completed: bool = False
    targets: dict[str, int] = field(default_factory=dict)

    def counts(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "scanned": self.scanned,
            "matched": self.matched,
            "skipped_succeeded": self.skipped_succeeded,
            "limited": self.limited,
            "completed": self.completed,
            "targets": dict(self.targets),
        }
        out["would_send" if self.dry_run else "sent"] = (
            self.would_send if self.dry_run else self.sent
        )
        return out

    def to_json(self) -> dict[str, Any]:
        return {"dlq_topic": self.dlq_topic, "group": self.group, "to_topic": self.to_topic,
                "dry_run": self.dry_run, **self.counts()}


@dataclass
class _Batch:
    """One batch's decisions, applied to the summary only once committed."""

    scanned: int = 0
    matched: int = 0
    skipped: int = 0
    send: list[tuple[DlqRecord, str]] = field(default_factory=list)
    positions: dict[int, int] = field(default_factory=dict)


def replay(
    settings: Settings,
    store: Store | None,
    dlq_topic: str,
    selection: Selection,
    *,
    to_topic: str | None = None,
    dry_run: bool = False,
    rate: float | None = None,
    limit: int | None = None,
    actor: str,
    progress: bool = False,
    group: str | None = None,
    on_record: Callable[[DlqRecord, str], None] | None = None,
) -> ReplaySummary:
    """Republish the records of ``dlq_topic`` matching ``selection`` (see the module doc).

    Records whose idempotency key already ``succeeded`` are skipped and counted.
    ``rate`` caps records/s, ``limit`` the records sent in this run (the rest stays
    for the next run of the same replay). ``dry_run`` produces nothing, commits no
    position and writes no audit row; ``on_record(record, target)`` is called for
    each record sent (or, in a dry run, that would be sent). A real run appends
    one ``replay`` audit row with the counts, also when it is interrupted.
    ``store`` defaults to the settings' schema and table.
    """
    if limit is not None and limit < 1:
        raise ConfigError("limit must be >= 1", setting="limit")
    if to_topic is not None and to_topic == dlq_topic:
        raise ConfigError("the target topic cannot be the DLQ topic itself", setting="to")
    store = store or Store(schema=settings.schema_name, table=settings.table)
    group = group or replay_group(dlq_topic, selection, to_topic)
    summary = ReplaySummary(dlq_topic, group, to_topic, dry_run)
    conn = connect(settings.dsn, application_name="kafka_idem.replay")
    try:
        try:
            _run(settings, conn, store, summary, selection, rate=rate, limit=limit,
                 actor=actor, progress=progress, on_record=on_record)
        except BaseException:
            if not dry_run and summary.scanned:
                _audit_quietly(conn, store, summary, selection, actor, limit, rate)
            raise
        if not dry_run:
            _audit(conn, store, summary, selection, actor, limit, rate)
    finally:
        conn.close()
    return summary


def _run(
    settings: Settings,
    conn: Conn,
    store: Store,
    summary: ReplaySummary,
    selection: Selection,
    *,
    rate: float | None,
    limit: int | None,
    actor: str,
    progress: bool,
    on_record: Callable[[DlqRecord, str], None] | None,
) -> None:
    dlq_topic, group, to_topic = summary.dlq_topic, summary.group, summary.to_topic
    consumer = Consumer(_reader_config(settings, group))
    producer: Producer | None = None
    try:
        if not summary.dry_run:
            producer = Producer({**settings.producer_config(), "transactional.id": group})
            # Fences an older run of the same replay and settles its open transaction,
            # so the committed position read below is final.
            with _kafka("initialising the replay transaction", group=group):
                producer.init_transactions(TIMEOUT)
        known: set[str] = set()
        if to_topic is not None:
            _check_topic(consumer, to_topic)
            known.add(to_topic)
        resume = _committed(consumer, dlq_topic, _partitions(consumer, dlq_topic, selection))
        starts, ends = _bounds(consumer, dlq_topic, selection, resume)
        total = sum(ends[p] - starts[p] for p in starts)
        bucket = TokenBucket(rate) if rate is not None and producer is not None else None
        # Keep each transaction short (well inside transaction.timeout.ms) when rate-limited.
        size = BATCH_SIZE if rate is None else max(1, min(BATCH_SIZE, int(rate)))
        with _Progress(progress, total) as advance:
            for msgs in _batches(consumer, dlq_topic, starts, ends, size):
                done = summary.sent + summary.would_send
                remaining = None if limit is None else limit - done
                batch = _decide(conn, store, msgs, selection, to_topic, remaining)
                for target in {t for _r, t in batch.send} - known:
                    _check_topic(consumer, target)
                    known.add(target)
                if producer is not None:
                    _send(producer, consumer, summary, batch, actor, bucket, on_record)
                elif on_record is not None:  # dry run
                    for rec, target in batch.send:
                        on_record(rec, target)
                _apply(summary, batch)
                advance(batch.scanned, summary.sent + summary.would_send)
                if remaining is not None and len(batch.send) >= remaining:
                    summary.limited = summary.scanned < total
                    break
        summary.completed = True
    finally:
        consumer.close()  # the producer has nothing in flight: each batch was committed


def _audit(
    conn: Conn,
    store: Store,
    summary: ReplaySummary,
    selection: Selection,
    actor: str,
    limit: int | None,
    rate: float | None,
) -> None:
    with conn.transaction():
        audit.record(
            conn, store, actor=actor, action="replay",
            selection={**selection.to_json(), "dlq_topic": summary.dlq_topic,
                       "to_topic": summary.to_topic, "group": summary.group,
                       "limit": limit, "rate": rate},
            counts=summary.counts(),
        )


def _audit_quietly(conn: Conn, store: Store, summary: ReplaySummary, selection: Selection,
                   actor: str, limit: int | None, rate: float | None) -> None:
    """The audit row of an interrupted replay, without hiding why it was interrupted."""
    try:
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.rollback()
        _audit(conn, store, summary, selection, actor, limit, rate)
    except Exception as exc:
        log.error("could not write the audit row of an interrupted replay: %s", exc,
                  extra={"action": "replay_audit_failed", "counts": summary.counts()})


def _committed(consumer: Consumer, topic: str, partitions: Sequence[int]) -> dict[int, int]:
    with _kafka("reading the replay position", topic=topic):
        tps = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=TIMEOUT)
    return {tp.partition: tp.offset for tp in tps if tp.offset >= 0}


def _check_topic(consumer: Consumer, topic: str) -> None:
    with _kafka("reading topic metadata", topic=topic):
        md = consumer.list_topics(topic, timeout=TIMEOUT)
    meta = md.topics.get(topic)
    if meta is None or meta.error is not None or not meta.partitions:
        raise ConfigError(f"target topic {topic!r} does not exist", setting="to")


def _decide(
    conn: Conn,
    store: Store,
    msgs: Sequence[Any],
    selection: Selection,
    to_topic: str | None,
    remaining: int | None,
) -> _Batch:
    """Steps 1-2: which records of the batch go where, cut at the limit."""
    records = [DlqRecord.from_message(m) for m in msgs]
    matching = [r for r in records if selection.matches(r)]
    keys = sorted({r.idempotency_key for r in matching if r.idempotency_key is not None})
    with conn.transaction():
        done = store.succeeded(conn, keys) if keys else {}
    batch = _Batch()
    for rec in records:
        if remaining is not None and len(batch.send) >= remaining:
            break  # the rest stays for the next run: its position is not committed
        batch.scanned += 1
        batch.positions[rec.partition] = rec.offset + 1
        if not selection.matches(rec):
            continue
        batch.matched += 1
        if rec.idempotency_key is not None and rec.idempotency_key in done:
            batch.skipped += 1
            continue
        batch.send.append((rec, target_of(rec, to_topic)))
    return batch


def _send(
    producer: Producer,
    consumer: Consumer,
    summary: ReplaySummary,
    batch: _Batch,
    actor: str,
    bucket: TokenBucket | None,
    on_record: Callable[[DlqRecord, str], None] | None,
) -> None:
    """Steps 3-5: the records and the new position in one transaction."""
    dlq_topic = summary.dlq_topic
    with _kafka("replaying a batch", topic=dlq_topic, group=summary.group):
        producer.begin_transaction()
        try:
            for rec, target in batch.send:
                if bucket is not None:
                    bucket.acquire()
                republish(producer, rec, to_topic=summary.to_topic, actor=actor)
                if on_record is not None:
                    on_record(rec, target)
            offsets = [TopicPartition(dlq_topic, p, o) for p, o in batch.positions.items()]
            producer.send_offsets_to_transaction(
                offsets, consumer.consumer_group_metadata(), TIMEOUT
            )
            _commit(producer)
        except BaseException:
            _abort(producer)
            raise


def _commit(producer: Producer) -> None:
    for _ in range(5):
        try:
            producer.commit_transaction(TIMEOUT)
            return
        except KafkaException as exc:
            err = exc.args[0]
            if not err.retriable() or err.txn_requires_abort():
                raise
            time.sleep(0.5)
    producer.commit_transaction(TIMEOUT)


def _abort(producer: Producer) -> None:
    try:
        producer.abort_transaction(TIMEOUT)
    except KafkaException as exc:  # a fenced or fatal producer: the broker aborts it anyway
        log.warning("could not abort the replay transaction: %s", exc,
                    extra={"action": "replay_abort_failed"})


def _apply(summary: ReplaySummary, batch: _Batch) -> None:
    summary.scanned += batch.scanned
    summary.matched += batch.matched
    summary.skipped_succeeded += batch.skipped
    if summary.dry_run:
        summary.would_send += len(batch.send)
    else:
        summary.sent += len(batch.send)
    for _rec, target in batch.send:
        summary.targets[target] = summary.targets.get(target, 0) + 1


class _Progress:
    """A rich progress bar on stderr when asked for and stderr is a terminal."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.bar: Any = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("scanned, {task.fields[sent]} sent"), TimeElapsedColumn(),
                console=Console(stderr=True),
            )
            self.task = self.bar.add_task("replaying", total=total, sent=0)

    def __enter__(self) -> Callable[[int, int], None]:
        if self.bar is None:
            return lambda scanned, sent: None
        self.bar.start()
        return lambda scanned, sent: self.bar.update(self.task, advance=scanned, sent=sent)

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()
