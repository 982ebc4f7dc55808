"""A replay run: republish the selected records of a DLQ topic, resumably, with an
audit row.

A replay never sends a record twice, even when interrupted, and never re-runs a key
whose message is not on its way. Its position lives in a consumer group of its
own, named from the DLQ topic, the selection and the target (:func:`replay_group`),
and every batch runs in one Kafka transaction:

1. consume a batch from the replay group's committed position;
2. decide per record (:func:`~kafka_idem.replay.redrive.decide`): a record outside
   the replay's :class:`~kafka_idem.replay.trust.Boundary` (signature, topic,
   namespace, key) is skipped as untrusted; for the others the state of each key
   the batch names is read in one query: a ``failed`` key is *re-driven* (its latest
   dead letter of the batch is sent after an audited re-run), a succeeded key is
   skipped, a key in the consumer's hands is left to it, a record without a key or
   record (undecodable, payload conflict) is republished as it is; a record whose
   target cannot take it (no such topic or partition, too large) is skipped as
   unsendable;
3. produce the records to send with lineage headers in the batch's Kafka
   transaction and wait for every delivery report. A record the broker refuses for
   itself or its target aborts that attempt and is set aside (unsendable, with the
   broker's reason); the batch is produced again without it
   (:func:`~kafka_idem.replay.transaction.deliver`). A refusal that is the broker's
   (down, timed out, fenced) stops the run, nothing of the batch committed anywhere;
4. re-run the failed keys of the records produced (``failed -> retryable_failed``,
   fresh retry budget, one audit row each naming this replay's group and run) and
   COMMIT that in the database;
5. add the replay group's new DLQ offsets to the Kafka transaction and commit it:
   the records and the new position become visible together, or not at all.

Step 4 commits before step 5, so a crash between them leaves keys that are
``retryable_failed`` with this replay's ``rerun`` as their latest audit row and no
message on the way: the same replay run again reads the same batch (its position
did not move) and sends those keys' dead letters ("resend"); ``kafka-idem rerun
KEY`` takes such a key too. The other order would let a crash leave the position
past a key that is still ``failed``.

An interrupted replay resumes after the last committed batch; the transactional
id (the group name) fences a zombie run of the same replay, and an uncommitted
batch is aborted and invisible to ``read_committed`` consumers.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import psycopg
from confluent_kafka import Consumer, Producer, TopicPartition

from kafka_idem.admin import audit
from kafka_idem.admin import operations as admin
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
    Batch,
    decide,
)
from kafka_idem.replay.republishing import (
    TokenBucket,
    delivery_wait,
)
from kafka_idem.replay.summary import ReplaySummary, apply_batch, replay_group
from kafka_idem.replay.targets import Targets
from kafka_idem.replay.transaction import deliver
from kafka_idem.replay.trust import Boundary
from kafka_idem.settings import Settings
from kafka_idem.store import Conn, Store, connect

if TYPE_CHECKING:
    from kafka_idem.app import App

log = logging.getLogger(__name__)


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
    app: App | None = None,
    trust_unsigned: bool = False,
    on_progress: Callable[[int, int, int], None] | None = None,
) -> ReplaySummary:
    """Republish the records of ``dlq_topic`` matching ``selection`` (see the module doc).

    Only records inside the replay's boundary are acted on
    (:class:`~kafka_idem.replay.trust.Boundary`): with ``app``, the topics of its
    handlers whose DLQ this is, its namespace, and values that build the key they
    name; without, the DLQ's own source topic and ``selection.namespace`` (no key is
    re-run without one); where ``settings`` has signing keys, a valid signature
    (``trust_unsigned`` admits unsigned records). Each record inside is decided by
    its key's record in the store (module doc, step 2): ``failed`` keys
    (``exhausted``; ``permanent`` too with ``include_permanent``) are re-run with an
    audit row carrying ``reason`` (required: :class:`admin.Refused` before anything of
    the batch is sent) and their latest dead letter sent once; records whose
    idempotency key already ``succeeded`` are skipped and counted.
    ``rate`` caps records/s, ``limit`` the records sent in this run (the rest stays
    for the next run of the same replay). ``dry_run`` produces nothing, commits no
    position and writes no audit row; ``on_record(record, target)`` is called for
    each record sent, once its batch committed (or, in a dry run, that would be
    sent). A real run appends one ``replay`` audit row with the counts and ``reason``,
    also when it is interrupted. ``store`` defaults to the settings' schema and table.
    ``on_progress(scanned, total, sent)`` is called as batches are done.
    """
    if limit is not None and limit < 1:
        raise ConfigError("limit must be >= 1", setting="limit")
    if to_topic is not None and to_topic == dlq_topic:
        raise ConfigError("the target topic cannot be the DLQ topic itself", setting="to_topic")
    boundary = Boundary.of(settings, dlq_topic, app=app, namespace=selection.namespace,
                           to_topic=to_topic, trust_unsigned=trust_unsigned)
    store = store or Store(schema=settings.schema_name, table=settings.table)
    group = group or replay_group(dlq_topic, selection, to_topic, include_permanent,
                                  prefix=settings.name_prefix)
    summary = ReplaySummary(dlq_topic, group, to_topic, dry_run, run=uuid.uuid4().hex[:12],
                            verified=boundary.verifies)
    conn = connect(settings.dsn, application_name="kafka_idem.replay")
    try:
        if selection.namespace is not None and app is None:  # a typo'd --namespace
            with conn.transaction():
                admin.require_namespace(conn, store, selection.namespace)
        try:
            _run(settings, conn, store, summary, selection, boundary, rate=rate, limit=limit,
                 actor=actor, progress=progress, on_record=_both(on_record, on_action),
                 include_permanent=include_permanent, reason=reason,
                 on_progress=on_progress)
        except BaseException:
            if not dry_run and summary.scanned:
                _audit_quietly(conn, store, summary, selection, actor, limit, rate, reason)
            raise
        if not dry_run:
            _audit(conn, store, summary, selection, actor, limit, rate, reason)
    finally:
        conn.close()
    return summary


def _run(
    settings: Settings,
    conn: Conn,
    store: Store,
    summary: ReplaySummary,
    selection: Selection,
    boundary: Boundary,
    *,
    rate: float | None,
    limit: int | None,
    actor: str,
    progress: bool,
    on_record: Callable[[DlqRecord, str, str], None] | None,
    include_permanent: bool,
    reason: str | None,
    on_progress: Callable[[int, int, int], None] | None = None,
) -> None:
    dlq_topic, group, to_topic = summary.dlq_topic, summary.group, summary.to_topic
    consumer = Consumer(reader_config(settings, group))
    producer: Producer | None = None
    conf = settings.producer_config()
    wait = delivery_wait(conf)
    try:
        if not summary.dry_run:
            producer = Producer({**conf, "transactional.id": group})
            # Fences an older run of the same replay and settles its open transaction,
            # so the committed position read below is final.
            with kafka_errors("initialising the replay transaction", group=group):
                producer.init_transactions(TIMEOUT)
        if to_topic is not None:
            _check_topic(consumer, to_topic)
        targets = Targets(consumer, settings.admin_config(), actor=actor, group=group,
                          compressed=str(conf.get("compression.type",
                                                  conf.get("compression.codec", "none")))
                          not in ("none", ""))
        resume = _committed(consumer, dlq_topic, partitions_of(consumer, dlq_topic, selection))
        summary.resumed = bool(resume)
        starts, ends = bounds(consumer, dlq_topic, selection, resume)
        total = sum(ends[p] - starts[p] for p in starts)
        bucket = TokenBucket(rate) if rate is not None and producer is not None else None
        # Keep each transaction short (well inside transaction.timeout.ms) when rate-limited.
        size = BATCH_SIZE if rate is None else max(1, min(BATCH_SIZE, int(rate)))
        with Progress(progress, total, "replaying", sent=True, report=on_progress) as advance:
            for msgs in batches(consumer, dlq_topic, starts, ends, size):
                done = summary.sent + summary.would_send
                remaining = None if limit is None else limit - done
                batch = decide(conn, store, msgs, selection, boundary, targets, remaining,
                               group=group, include_permanent=include_permanent,
                               redriven=summary.redriven, starts=starts)
                if producer is not None:
                    _require_reason(batch, reason)
                    deliver(producer, consumer, conn, store, summary, batch,
                             actor=actor, reason=reason, bucket=bucket, wait=wait)
                if on_record is not None:  # once committed (or, in a dry run, decided)
                    for rec, target in batch.send:
                        on_record(rec, target, batch.actions[id(rec)])
                apply_batch(summary, batch)
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
    reason: str | None,
) -> None:
    with conn.transaction():
        audit.record(
            conn, store, actor=actor, action="replay", reason=reason,
            selection={**selection.to_json(), "dlq_topic": summary.dlq_topic,
                       "to_topic": summary.to_topic, "group": summary.group,
                       "run": summary.run, "limit": limit, "rate": rate},
            counts=summary.counts(),
        )


def _audit_quietly(conn: Conn, store: Store, summary: ReplaySummary, selection: Selection,
                   actor: str, limit: int | None, rate: float | None,
                   reason: str | None) -> None:
    """The audit row of an interrupted replay, without hiding why it was interrupted."""
    try:
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.rollback()
        _audit(conn, store, summary, selection, actor, limit, rate, reason)
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


def _require_reason(batch: Batch, reason: str | None) -> None:
    if batch.rerun and (reason is None or not reason.strip()):
        raise admin.Refused(
            f"{len(batch.rerun)} failed key(s) to re-run (e.g. "
            f"{batch.rerun[0].idempotency_key}): give --reason TEXT (kept in the audit "
            "trail); nothing of this batch was sent")


