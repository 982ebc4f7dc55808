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
   (:func:`_deliver`). A refusal that is the broker's (down, timed out, fenced)
   stops the run, nothing of the batch committed anywhere;
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

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from kafka_idem import admin, audit
from kafka_idem.errors import BrokerError, ConfigError
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
    TokenBucket,
    delivery_wait,
    republish,
)
from kafka_idem.replay.targets import Targets, fault_of, reason_of
from kafka_idem.replay.trust import Boundary
from kafka_idem.settings import Settings
from kafka_idem.store import Conn, Store, connect

if TYPE_CHECKING:
    from kafka_idem.app import App

# The logger name from before kafka_idem.replay became a package, kept for log filters.
log = logging.getLogger("kafka_idem.replay")

REPLAY_GROUP_PREFIX = "kafka-idem-replay"
SHOWN = 100  # unsendable records listed in a summary (all are counted and logged)


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
    ``untrusted`` counts the records outside the boundary by reason
    (:data:`~kafka_idem.replay.trust.REASONS`); ``unsendable`` lists the first
    :data:`SHOWN` records whose target could not take them, with why; ``verified``
    says whether signatures were checked (signing keys configured).
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
    verified: bool = False
    untrusted: dict[str, int] = field(default_factory=dict)
    unsendable: list[dict[str, Any]] = field(default_factory=list)

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
            "verified": self.verified,
            "untrusted": dict(sorted(self.untrusted.items())),
            "unsendable": list(self.unsendable),
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
    app: App | None = None,
    trust_unsigned: bool = False,
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
    sent). A real run appends one ``replay`` audit row with the counts, also when it
    is interrupted. ``store`` defaults to the settings' schema and table.
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
    boundary: Boundary,
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
        with Progress(progress, total, "replaying", sent=True) as advance:
            for msgs in batches(consumer, dlq_topic, starts, ends, size):
                done = summary.sent + summary.would_send
                remaining = None if limit is None else limit - done
                batch = decide(conn, store, msgs, selection, boundary, targets, remaining,
                               group=group, include_permanent=include_permanent,
                               redriven=summary.redriven, starts=starts)
                if producer is not None:
                    _require_reason(batch, reason)
                    _deliver(producer, consumer, conn, store, summary, batch,
                             actor=actor, reason=reason, bucket=bucket, wait=wait)
                if on_record is not None:  # once committed (or, in a dry run, decided)
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


def _require_reason(batch: Batch, reason: str | None) -> None:
    if batch.rerun and (reason is None or not reason.strip()):
        raise admin.Refused(
            f"{len(batch.rerun)} failed key(s) to re-run (e.g. "
            f"{batch.rerun[0].idempotency_key}): give --reason TEXT (kept in the audit "
            "trail); nothing of this batch was sent")


class _Gone(Exception):
    """Keys that left ``failed`` since the batch was decided: roll their re-runs back."""

    def __init__(self, records: list[DlqRecord]) -> None:
        super().__init__(f"{len(records)} key(s) no longer failed")
        self.records = records


def _deliver(producer: Producer, consumer: Consumer, conn: Conn, store: Store,
             summary: ReplaySummary, batch: Batch, *, actor: str, reason: str | None,
             bucket: TokenBucket | None, wait: float) -> None:
    """Steps 3-5 for one batch: produce, re-run, commit, until the batch commits with
    every record the broker takes. Each pass either commits, sets aside at least one
    record, or (several records refused at once, which may share one produce request)
    produces the next pass one record at a time to find the one at fault."""
    one_by_one = False
    while True:
        refused = _produce(producer, summary, batch, actor=actor, bucket=bucket, wait=wait,
                           one_by_one=one_by_one)
        if refused:
            _abort(producer)
            named = [(rec, err) for rec, err in refused if fault_of(err) == "target"]
            if named or len(refused) == 1 or one_by_one:
                for rec, err in named or refused:
                    batch.skip(rec, "skipped_unsendable", f"refused: {reason_of(err)}")
                one_by_one = False
            else:
                one_by_one = True
            continue
        try:
            with conn.transaction():  # step 4: committed only with the messages produced
                gone = rerun_failed(conn, store, batch, group=summary.group,
                                    run=summary.run, actor=actor, reason=reason)
                if gone:
                    raise _Gone(gone)
        except _Gone as exc:
            _abort(producer)
            for rec in exc.records:
                batch.skip(rec, "skipped_in_progress")
            continue
        except BaseException:
            _abort(producer)
            raise
        with kafka_errors("replaying a batch", topic=summary.dlq_topic, group=summary.group):
            try:  # step 5
                offsets = [TopicPartition(summary.dlq_topic, p, o)
                           for p, o in batch.positions.items()]
                producer.send_offsets_to_transaction(
                    offsets, consumer.consumer_group_metadata(), TIMEOUT)
                _commit(producer)
            except BaseException:
                _abort(producer)
                raise
        return


def _produce(producer: Producer, summary: ReplaySummary, batch: Batch, *, actor: str,
             bucket: TokenBucket | None, wait: float, one_by_one: bool,
             ) -> list[tuple[DlqRecord, Any]]:
    """Step 3: begin the batch's transaction and produce its records; return the ones
    refused for themselves or their target (the caller then aborts the transaction).
    Any other refusal, or a report missing after ``wait``, aborts and raises
    :class:`BrokerError` (exit 3): the broker's fault, nothing of the batch committed.
    ``one_by_one`` waits for each record's report before the next and stops at the
    first refusal: the one at fault."""
    where = {"topic": summary.dlq_topic, "group": summary.group}
    reports: dict[int, Any] = {}
    produced = 0

    def report(index: int) -> Callable[[Any, Any], None]:
        def on_delivery(err: Any, _msg: Any) -> None:
            reports[index] = err
        return on_delivery

    with kafka_errors("replaying a batch", **where):
        producer.begin_transaction()
    try:
        for i, (rec, _target) in enumerate(batch.send):
            if bucket is not None:
                bucket.acquire()
            produced += 1
            try:
                _republish(producer, summary, rec, actor, report(i), wait)
            except KafkaException as exc:  # refused before it left: unknown partition...
                reports[i] = exc.args[0] if exc.args else exc
            if one_by_one:
                producer.flush(wait)
                if reports.get(i) is not None:
                    break
        producer.flush(wait)
    except BaseException:
        _abort(producer)
        raise
    failures = {i: err for i, err in reports.items() if err is not None}
    refused = [(batch.send[i][0], err) for i, err in sorted(failures.items())
               if fault_of(err) is not None]
    missing = produced - len(reports)
    if not refused and (failures or missing):
        _abort(producer)
        first = next(iter(failures.values()), None)
        raise BrokerError(
            f"replaying a batch: {len(failures)} of {produced} record(s) refused"
            + (f" ({reason_of(first)})" if first is not None else "")
            + (f", {missing} not acknowledged in time" if missing else ""), **where)
    return refused


def _republish(producer: Producer, summary: ReplaySummary, rec: DlqRecord, actor: str,
               on_delivery: Callable[[Any, Any], None], wait: float) -> None:
    try:
        republish(producer, rec, to_topic=summary.to_topic, actor=actor,
                  group=summary.group, on_delivery=on_delivery)
    except BufferError:  # the local queue is full: let it drain, then once more
        producer.flush(wait)
        republish(producer, rec, to_topic=summary.to_topic, actor=actor,
                  group=summary.group, on_delivery=on_delivery)


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
    for (partition, offset), (kind, outcome) in sorted(batch.outcomes.items()):
        per = summary.by_kind.setdefault(kind, {})
        per[outcome] = per.get(outcome, 0) + 1
        why = batch.reasons.get((partition, offset))
        if why is None:
            continue
        if outcome == "skipped_untrusted":
            summary.untrusted[why] = summary.untrusted.get(why, 0) + 1
        elif outcome == "skipped_unsendable" and len(summary.unsendable) < SHOWN:
            summary.unsendable.append({"partition": partition, "offset": offset,
                                       "reason": why})
    summary.skipped_succeeded = summary.total("skipped_succeeded")
    summary.skipped_truncated = summary.total("skipped_truncated")
    summary.redriven |= batch.redriven
    if summary.dry_run:
        summary.would_send += len(batch.send)
    else:
        summary.sent += len(batch.send)
    for _rec, target in batch.send:
        summary.targets[target] = summary.targets.get(target, 0) + 1
