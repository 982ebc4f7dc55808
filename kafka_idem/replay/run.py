"""A replay run: republish the selected records of a DLQ topic, resumably, with an
audit row.

A replay never sends a record twice, even when interrupted. Its position lives
in a consumer group of its own, named from the DLQ topic, the selection and the
target (:func:`replay_group`), and every batch runs in one Kafka transaction:

1. consume a batch from the replay group's committed position;
2. ask the store, in one query, the state of each key the batch names, and decide
   per record (:func:`~kafka_idem.replay.redrive.decide`): a ``failed`` key is
   *re-driven* (its latest dead letter of the batch is sent after an audited
   re-run), a succeeded key is
   skipped, a key in the consumer's hands is left to it, a record without a key or
   record (undecodable, payload conflict) is republished as it is;
3. re-run the batch's failed keys (``failed -> retryable_failed``, fresh retry
   budget, one audit row each naming this replay's group and run) and COMMIT that
   in the database;
4. produce the records to send with lineage headers, and add the replay group's new
   DLQ offsets to the same Kafka transaction;
5. commit: the records and the new position become visible together, or not at all.

Step 3 commits before step 5, so a crash between them leaves keys that are
``retryable_failed`` with this replay's ``rerun`` as their latest audit row and no
message on the way: the same replay run again reads the same batch (its position
did not move) and sends those keys' dead letters ("resend"). The other order would
let a crash leave the position past a key that is still ``failed``.

An interrupted replay resumes after the last committed batch; the transactional
id (the group name) fences a zombie run of the same replay, and an uncommitted
batch is aborted and invisible to ``read_committed`` consumers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from kafka_idem import admin, audit
from kafka_idem.errors import ConfigError
from kafka_idem.replay.progress import Progress
from kafka_idem.replay.reading import (
    BATCH_SIZE,
    TIMEOUT,
    batches,
    bounds,
    kafka_errors,
    partitions_of,
    reader_config,
)
from kafka_idem.replay.records import DlqRecord, Selection
from kafka_idem.replay.redrive import (
    OUTCOMES,
    Batch,
    RecordId,
    decide,
    rerun_failed,
)
from kafka_idem.replay.republishing import (
    Deliveries,
    TokenBucket,
    delivery_wait,
    republish,
)
from kafka_idem.settings import Settings
from kafka_idem.store import Conn, Store, connect

# The logger name from before kafka_idem.replay became a package, kept for log filters.
log = logging.getLogger("kafka_idem.replay")

REPLAY_GROUP_PREFIX = "kafka-idem-replay"


def replay_group(dlq_topic: str, selection: Selection, to_topic: str | None,
                 include_permanent: bool = False, prefix: str = "") -> str:
    """The replay's own consumer group (and transactional id): the same replay, run
    again, resumes where the last one stopped; a different selection starts afresh.
    ``prefix`` (the ``name_prefix`` setting, ``--prefix``) goes in front, for clusters
    whose ACLs grant group and transactional ids by prefix.

    >>> replay_group("p.dlq", Selection(kind="permanent"), None)  # doctest: +ELLIPSIS
    'kafka-idem-replay.p.dlq....'
    """
    spec_: dict[str, Any] = {"selection": selection.to_json(), "to": to_topic}
    if include_permanent:  # it sends records a replay without it skips: its own position
        spec_["include_permanent"] = True
    spec = json.dumps(spec_, sort_keys=True)
    digest = hashlib.sha256(spec.encode()).hexdigest()[:12]
    return f"{prefix}{REPLAY_GROUP_PREFIX}.{dlq_topic}.{digest}"


@dataclass
class ReplaySummary:
    """What a replay did. Counts cover the batches committed (all of them in a dry run).

    ``by_kind`` counts records per DLQ error kind and outcome (:data:`OUTCOMES`);
    ``rerun`` and ``resent`` are keys, as each key is sent once per run.
    """

    dlq_topic: str
    group: str
    to_topic: str | None
    dry_run: bool
    scanned: int = 0
    matched: int = 0
    sent: int = 0
    would_send: int = 0
    skipped_succeeded: int = 0
    skipped_truncated: int = 0  # DLQ copies without their value: nothing to send
    limited: bool = False  # stopped by --limit with records left to read
    completed: bool = False
    resumed: bool = False  # began at the position an earlier run of this replay committed
    run: str = ""
    targets: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    redriven: set[RecordId] = field(default_factory=set)  # re-run or resent by this run

    def total(self, outcome: str) -> int:
        return sum(c.get(outcome, 0) for c in self.by_kind.values())

    def counts(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "scanned": self.scanned,
            "matched": self.matched,
            "skipped_succeeded": self.skipped_succeeded,
            "skipped_truncated": self.skipped_truncated,
            "limited": self.limited,
            "completed": self.completed,
            "resumed": self.resumed,
            "targets": dict(self.targets),
        }
        for outcome in OUTCOMES:
            out.setdefault(outcome, self.total(outcome))
        out["by_kind"] = {k: dict(v) for k, v in sorted(self.by_kind.items())}
        out["would_send" if self.dry_run else "sent"] = (
            self.would_send if self.dry_run else self.sent
        )
        return out

    def to_json(self) -> dict[str, Any]:
        return {"dlq_topic": self.dlq_topic, "group": self.group, "run": self.run,
                "to_topic": self.to_topic, "dry_run": self.dry_run, **self.counts()}


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
    include_permanent: bool = False,
    reason: str | None = None,
    on_action: Callable[[DlqRecord, str, str], None] | None = None,
) -> ReplaySummary:
    """Republish the records of ``dlq_topic`` matching ``selection`` (see the module doc).

    Each record is decided by its key's record in the store (module doc, step 2):
    ``failed`` keys (``exhausted``; ``permanent`` too with ``include_permanent``) are
    re-run with an audit row carrying ``reason`` (required: :class:`admin.Refused`
    before anything of the batch is sent) and their latest dead letter sent once;
    records whose idempotency key already ``succeeded`` are skipped and counted.
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
        raise ConfigError("the target topic cannot be the DLQ topic itself", setting="to_topic")
    store = store or Store(schema=settings.schema_name, table=settings.table)
    group = group or replay_group(dlq_topic, selection, to_topic, include_permanent,
                                  prefix=settings.name_prefix)
    summary = ReplaySummary(dlq_topic, group, to_topic, dry_run, run=uuid.uuid4().hex[:12])
    conn = connect(settings.dsn, application_name="kafka_idem.replay")
    try:
        if selection.namespace is not None:
            with conn.transaction():
                admin.require_namespace(conn, store, selection.namespace)
        try:
            _run(settings, conn, store, summary, selection, rate=rate, limit=limit,
                 actor=actor, progress=progress, on_record=_both(on_record, on_action),
                 include_permanent=include_permanent, reason=reason)
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
    on_record: Callable[[DlqRecord, str, str], None] | None,
    include_permanent: bool,
    reason: str | None,
) -> None:
    dlq_topic, group, to_topic = summary.dlq_topic, summary.group, summary.to_topic
    consumer = Consumer(reader_config(settings, group))
    producer: Producer | None = None
    wait = delivery_wait(settings.producer_config())
    try:
        if not summary.dry_run:
            producer = Producer({**settings.producer_config(), "transactional.id": group})
            # Fences an older run of the same replay and settles its open transaction,
            # so the committed position read below is final.
            with kafka_errors("initialising the replay transaction", group=group):
                producer.init_transactions(TIMEOUT)
        known: set[str] = set()
        if to_topic is not None:
            _check_topic(consumer, to_topic)
            known.add(to_topic)
        resume = _committed(consumer, dlq_topic, partitions_of(consumer, dlq_topic, selection))
        summary.resumed = bool(resume)
        starts, ends = bounds(consumer, dlq_topic, selection, resume)
        total = sum(ends[p] - starts[p] for p in starts)
        bucket = TokenBucket(rate) if rate is not None and producer is not None else None
        # Keep each transaction short (well inside transaction.timeout.ms) when rate-limited.
        size = BATCH_SIZE if rate is None else max(1, min(BATCH_SIZE, int(rate)))
        with Progress(progress, total, "replaying", sent=True) as advance:
            for msgs in batches(consumer, dlq_topic, starts, ends, size):
                done = summary.sent + summary.would_send
                remaining = None if limit is None else limit - done
                batch = decide(conn, store, msgs, selection, to_topic, remaining,
                               group=group, include_permanent=include_permanent,
                               redriven=summary.redriven, starts=starts)
                for target in {t for _r, t in batch.send} - known:
                    _check_topic(consumer, target)
                    known.add(target)
                if producer is not None and batch.rerun:
                    rerun_failed(conn, store, batch, group=summary.group, run=summary.run,
                                 actor=actor, reason=reason)
                if producer is not None:
                    _send(producer, consumer, summary, batch, actor, bucket, on_record, wait)
                elif on_record is not None:  # dry run
                    for rec, target in batch.send:
                        on_record(rec, target, batch.actions[id(rec)])
                _apply(summary, batch)
                advance(batch.scanned, summary.sent + summary.would_send)
                if remaining is not None and len(batch.send) >= remaining:
                    summary.limited = summary.scanned < total
                    break
        summary.completed = True
    finally:
        consumer.close()  # the producer has nothing in flight: each batch was committed


def _both(on_record: Callable[[DlqRecord, str], None] | None,
          on_action: Callable[[DlqRecord, str, str], None] | None,
          ) -> Callable[[DlqRecord, str, str], None] | None:
    if on_record is None and on_action is None:
        return None

    def call(rec: DlqRecord, target: str, action: str) -> None:
        if on_record is not None:
            on_record(rec, target)
        if on_action is not None:
            on_action(rec, target, action)

    return call


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
                       "run": summary.run, "limit": limit, "rate": rate},
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
    with kafka_errors("reading the replay position", topic=topic):
        tps = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=TIMEOUT)
    return {tp.partition: tp.offset for tp in tps if tp.offset >= 0}


def _check_topic(consumer: Consumer, topic: str) -> None:
    with kafka_errors("reading topic metadata", topic=topic):
        md = consumer.list_topics(topic, timeout=TIMEOUT)
    meta = md.topics.get(topic)
    if meta is None or meta.error is not None or not meta.partitions:
        raise ConfigError(f"target topic {topic!r} does not exist", setting="to_topic")


def _send(
    producer: Producer,
    consumer: Consumer,
    summary: ReplaySummary,
    batch: Batch,
    actor: str,
    bucket: TokenBucket | None,
    on_record: Callable[[DlqRecord, str, str], None] | None,
    wait: float,
) -> None:
    """Steps 3-5: the records and the new position in one transaction. Every record's
    delivery report is checked before the position is added: a refused record aborts
    the batch (nothing of it becomes visible) with the broker's reason."""
    dlq_topic = summary.dlq_topic
    deliveries = Deliveries()
    with kafka_errors("replaying a batch", topic=dlq_topic, group=summary.group):
        producer.begin_transaction()
        try:
            for rec, target in batch.send:
                if bucket is not None:
                    bucket.acquire()
                republish(producer, rec, to_topic=summary.to_topic, actor=actor,
                          group=summary.group,
                          on_delivery=deliveries)
                if on_record is not None:
                    on_record(rec, target, batch.actions[id(rec)])
            if batch.send:
                producer.flush(wait)
                deliveries.check(len(batch.send), "replaying a batch", topic=dlq_topic,
                                 group=summary.group)
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


def _apply(summary: ReplaySummary, batch: Batch) -> None:
    summary.scanned += batch.scanned
    summary.matched += batch.matched
    for kind, outcome in batch.outcomes:
        per = summary.by_kind.setdefault(kind, {})
        per[outcome] = per.get(outcome, 0) + 1
    summary.skipped_succeeded = summary.total("skipped_succeeded")
    summary.skipped_truncated = summary.total("skipped_truncated")
    summary.redriven |= batch.redriven
    if summary.dry_run:
        summary.would_send += len(batch.send)
    else:
        summary.sent += len(batch.send)
    for _rec, target in batch.send:
        summary.targets[target] = summary.targets.get(target, 0) + 1
