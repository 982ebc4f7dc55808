"""A replay run: republish the selected records of a DLQ topic, resumably, with an
audit row.

A replay never sends a record twice, even when interrupted. Its position lives
in a consumer group of its own, named from the DLQ topic, the selection and the
target (:func:`replay_group`), and every batch runs in one Kafka transaction:

1. consume a batch from the replay group's committed position;
2. ask the store, in one query, the state of each key the batch names, and decide
   per record (:func:`_decide`): a ``failed`` key is *re-driven* (its latest dead
   letter of the batch is sent after an audited re-run), a succeeded key is
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

import datetime as dt
import hashlib
import json
import logging
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from psycopg.rows import dict_row

from kafka_idem import admin, audit
from kafka_idem.dlq import PREFIX
from kafka_idem.errors import ConfigError
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
from kafka_idem.replay.republishing import (
    Deliveries,
    TokenBucket,
    delivery_wait,
    republish,
    target_of,
)
from kafka_idem.settings import Settings
from kafka_idem.store import Conn, Store, connect, translate_errors

# The logger name from before kafka_idem.replay became a package, kept for log filters.
log = logging.getLogger("kafka_idem.replay")

REPLAY_GROUP_PREFIX = "kafka-idem-replay"


def replay_group(dlq_topic: str, selection: Selection, to_topic: str | None,
                 include_permanent: bool = False) -> str:
    """The replay's own consumer group (and transactional id): the same replay, run
    again, resumes where the last one stopped; a different selection starts afresh.

    >>> replay_group("p.dlq", Selection(kind="permanent"), None)  # doctest: +ELLIPSIS
    'kafka-idem-replay.p.dlq....'
    """
    spec_: dict[str, Any] = {"selection": selection.to_json(), "to": to_topic}
    if include_permanent:  # it sends records a replay without it skips: its own position
        spec_["include_permanent"] = True
    spec = json.dumps(spec_, sort_keys=True)
    digest = hashlib.sha256(spec.encode()).hexdigest()[:12]
    return f"{REPLAY_GROUP_PREFIX}.{dlq_topic}.{digest}"


RecordId = tuple[str, str]  # (namespace, idempotency key): a record in the store

# What a replay does with one record read (see _decide); "sent" ones first.
SENDS = ("rerun", "resend", "as_is")
SKIPS = ("skipped_succeeded", "skipped_permanent", "skipped_in_progress", "skipped_duplicate",
         "skipped_truncated", "skipped_ambiguous", "skipped_foreign")
OUTCOMES = SENDS + SKIPS
WHY = {
    "rerun": "failed key: audited re-run, its latest dead letter sent",
    "resend": "re-run by an interrupted run of this replay, its message not sent yet",
    "as_is": "no record for the key (undecodable, invalid, payload conflict): republished",
    "skipped_succeeded": "key already succeeded",
    "skipped_permanent": "failed permanently; --include-permanent re-runs them",
    "skipped_in_progress": "key retryable_failed or processing: the consumer has it",
    "skipped_duplicate": "an older dead letter of a key re-driven by this run",
    "skipped_truncated": "dead-lettered without its value",
    "skipped_ambiguous": "written before namespaces and its key is in several: "
                         "`kafka-idem rerun KEY --namespace NS`",
    "skipped_foreign": "no idem.* headers: not written by kafka_idem, left alone",
}
FOREIGN = "(foreign)"
NO_KIND = "(none)"


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


@dataclass
class _Batch:
    """One batch's decisions, applied to the summary only once committed."""

    scanned: int = 0
    matched: int = 0
    send: list[tuple[DlqRecord, str]] = field(default_factory=list)
    actions: dict[int, str] = field(default_factory=dict)  # id(record) -> one of SENDS
    rerun: list[DlqRecord] = field(default_factory=list)  # failed keys to re-run first
    outcomes: list[tuple[str, str]] = field(default_factory=list)  # (kind, outcome)
    redriven: set[RecordId] = field(default_factory=set)
    namespace: dict[int, str] = field(default_factory=dict)  # id(record) -> its key's
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
        raise ConfigError("the target topic cannot be the DLQ topic itself", setting="to")
    store = store or Store(schema=settings.schema_name, table=settings.table)
    group = group or replay_group(dlq_topic, selection, to_topic, include_permanent)
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
        starts, ends = bounds(consumer, dlq_topic, selection, resume)
        total = sum(ends[p] - starts[p] for p in starts)
        bucket = TokenBucket(rate) if rate is not None and producer is not None else None
        # Keep each transaction short (well inside transaction.timeout.ms) when rate-limited.
        size = BATCH_SIZE if rate is None else max(1, min(BATCH_SIZE, int(rate)))
        with _Progress(progress, total) as advance:
            for msgs in batches(consumer, dlq_topic, starts, ends, size):
                done = summary.sent + summary.would_send
                remaining = None if limit is None else limit - done
                batch = _decide(conn, store, msgs, selection, to_topic, remaining,
                                group=group, include_permanent=include_permanent,
                                redriven=summary.redriven, starts=starts)
                for target in {t for _r, t in batch.send} - known:
                    _check_topic(consumer, target)
                    known.add(target)
                if producer is not None and batch.rerun:
                    _rerun(conn, store, summary, batch, actor=actor, reason=reason)
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
        raise ConfigError(f"target topic {topic!r} does not exist", setting="to")


def _foreign(rec: DlqRecord) -> bool:
    """Written by someone else: not one ``idem.*`` header."""
    return not any(k.startswith(PREFIX) for k, _v in rec.headers)


def _latest_key(rec: DlqRecord) -> tuple[dt.datetime, dt.datetime, int, int]:
    epoch = dt.datetime.min.replace(tzinfo=dt.UTC)
    return (rec.last_failure_at or epoch, rec.timestamp or epoch, rec.partition, rec.offset)


def _states(conn: Conn, store: Store, records: Sequence[DlqRecord],
            selection: Selection) -> dict[int, list[dict[str, Any]]]:
    """``{id(record): [state, ...]}``: the record of its key in its namespace (one at
    most), or for a dead letter from before namespaces, in every namespace it may be
    in (the selection's, else all: the caller refuses to guess between several)."""
    # A key PostgreSQL cannot hold (a NUL, from a DLQ record written by an older version)
    # has no record: nothing to look up.
    keyed = [r for r in records
             if r.idempotency_key is not None and "\x00" not in r.idempotency_key]
    if not keyed:
        return {}
    with conn.transaction(), translate_errors():
        everywhere: list[str] | None = None
        wanted: set[RecordId] = set()
        for rec in keyed:
            assert rec.idempotency_key is not None
            if rec.namespace is not None:
                wanted.add((rec.namespace, rec.idempotency_key))
                continue
            if selection.namespace is not None:
                wanted.add((selection.namespace, rec.idempotency_key))
                continue
            if everywhere is None:
                everywhere = store.namespaces(conn)
            wanted.update((ns, rec.idempotency_key) for ns in everywhere)
        pairs = sorted(wanted)
        cur = conn.cursor(row_factory=dict_row)
        rows = cur.execute(store.q["redrive_states"], {
            "nss": [p[0] for p in pairs], "keys": [p[1] for p in pairs]}).fetchall()
    by_key: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_key.setdefault(row["idempotency_key"], []).append(row)
    out: dict[int, list[dict[str, Any]]] = {}
    for rec in keyed:
        found = by_key.get(rec.idempotency_key or "", [])
        ns = rec.namespace if rec.namespace is not None else selection.namespace
        out[id(rec)] = [f for f in found if ns is None or f["namespace"] == ns]
    return out


def _resend(rec: DlqRecord, state: dict[str, Any], group: str, starts: dict[int, int]) -> bool:
    """Re-run by an interrupted run of this replay for a dead letter at or after this
    run's start: that batch's Kafka transaction never committed, so nothing was sent.
    (A re-run for a dead letter before the start was sent with its committed batch.)"""
    if not (state["status"] == "retryable_failed" and state["last_action"] == "rerun"
            and state["last_group"] == group and state["last_topic"] == rec.dlq_topic):
        return False
    try:
        partition, offset = int(state["last_partition"]), int(state["last_offset"])
    except (TypeError, ValueError):
        return False
    return partition in starts and offset >= starts[partition]


def _classify(rec: DlqRecord, states: list[dict[str, Any]], *, group: str,
              include_permanent: bool, redriven: set[RecordId],
              starts: dict[int, int]) -> str:
    """The outcome of one matching record with a value (see :data:`WHY`)."""
    if len(states) > 1:
        return "skipped_ambiguous"
    state = states[0] if states else None
    if state is not None and (state["namespace"], state["idempotency_key"]) in redriven:
        return "skipped_duplicate"
    if state is not None and state["status"] == "succeeded":
        return "skipped_succeeded"
    if rec.truncated is not None:
        return "skipped_truncated"
    if state is None or rec.kind in ("payload_conflict", "undecodable"):
        return "as_is"
    if state["status"] == "failed":
        if state["error_kind"] != "exhausted" and not include_permanent:
            return "skipped_permanent"
        return "rerun"
    if _resend(rec, state, group, starts):
        return "resend"
    return "skipped_in_progress"


def _decide(
    conn: Conn,
    store: Store,
    msgs: Sequence[Any],
    selection: Selection,
    to_topic: str | None,
    remaining: int | None,
    *,
    group: str,
    include_permanent: bool,
    redriven: set[RecordId],
    starts: dict[int, int],
) -> _Batch:
    """Steps 1-2: which records of the batch go where, cut at the limit."""
    records = [DlqRecord.from_message(m) for m in msgs]
    matching = [r for r in records if not _foreign(r) and selection.matches(r)]
    states = _states(conn, store, matching, selection)
    outcome: dict[tuple[int, int], str] = {}
    ident: dict[int, RecordId] = {}  # id(record) -> (namespace, key) of a re-driven one
    latest: dict[RecordId, DlqRecord] = {}  # per re-driven key, its latest dead letter
    for rec in matching:
        found = states.get(id(rec), [])
        what = _classify(rec, found, group=group, include_permanent=include_permanent,
                         redriven=redriven, starts=starts)
        outcome[(rec.partition, rec.offset)] = what
        if what in ("rerun", "resend"):
            rid = ident[id(rec)] = (found[0]["namespace"], found[0]["idempotency_key"])
            held = latest.get(rid)
            if held is None or _latest_key(rec) > _latest_key(held):
                latest[rid] = rec
        if what == "skipped_ambiguous":
            log.warning(
                "not replayed: %s[%s]@%s names key %s, written before namespaces, which "
                "is in namespaces %s; re-run it with `kafka-idem rerun KEY --namespace NS`",
                rec.dlq_topic, rec.partition, rec.offset, rec.idempotency_key,
                ", ".join(repr(f["namespace"]) for f in found),
                extra={"action": "replay_skipped", "key": rec.idempotency_key},
            )
    batch = _Batch()
    for rec in records:
        if remaining is not None and len(batch.send) >= remaining:
            break  # the rest stays for the next run: its position is not committed
        batch.scanned += 1
        batch.positions[rec.partition] = rec.offset + 1
        if _foreign(rec):
            log.warning(
                "left alone: %s[%s]@%s has no idem.* headers (not written by kafka_idem)",
                rec.dlq_topic, rec.partition, rec.offset,
                extra={"action": "replay_foreign"},
            )
            batch.outcomes.append((FOREIGN, "skipped_foreign"))
            continue
        if not selection.matches(rec):
            continue
        batch.matched += 1
        what = outcome[(rec.partition, rec.offset)]
        if what in ("rerun", "resend"):
            rid = ident[id(rec)]
            if latest[rid] is not rec or rid in batch.redriven:
                what = "skipped_duplicate"
            else:
                batch.redriven.add(rid)
                batch.namespace[id(rec)] = rid[0]
                if what == "rerun":
                    batch.rerun.append(rec)
        batch.outcomes.append((rec.kind or NO_KIND, what))
        if what == "skipped_truncated":
            # Sent without its value (too large for the DLQ): replaying an empty value
            # would only dead-letter it again. Its value is still in the source topic.
            log.warning(
                "not replayed: %s[%s]@%s was dead-lettered without its %s; the original is "
                "%s[%s]@%s", rec.dlq_topic, rec.partition, rec.offset, rec.truncated,
                rec.original_topic, rec.original_partition, rec.original_offset,
                extra={"action": "replay_skipped", "key": rec.idempotency_key},
            )
        if what in SENDS:
            batch.send.append((rec, target_of(rec, to_topic)))
            batch.actions[id(rec)] = what
    return batch


def _rerun(conn: Conn, store: Store, summary: ReplaySummary, batch: _Batch, *, actor: str,
           reason: str | None) -> None:
    """Step 3: the batch's failed keys re-run, committed before anything is sent. A key
    that left ``failed`` since step 2 (another operator re-ran it) is not sent."""
    if reason is None or not reason.strip():
        raise admin.Refused(
            f"{len(batch.rerun)} failed key(s) to re-run (e.g. "
            f"{batch.rerun[0].idempotency_key}): give --reason TEXT (kept in the audit "
            "trail); nothing of this batch was sent")
    gone: set[int] = set()
    with conn.transaction():
        for rec in batch.rerun:
            assert rec.idempotency_key is not None
            done = admin.rerun_if_failed(
                conn, store.scoped(batch.namespace[id(rec)]), key=rec.idempotency_key,
                actor=actor, reason=reason,
                selection={"via": "dlq replay", "group": summary.group, "run": summary.run,
                           "dlq_topic": rec.dlq_topic, "partition": rec.partition,
                           "offset": rec.offset},
            )
            if done is None:
                gone.add(id(rec))
    if gone:
        batch.send = [(r, t) for r, t in batch.send if id(r) not in gone]
        for rec in batch.rerun:
            if id(rec) in gone:
                assert rec.idempotency_key is not None
                batch.outcomes.remove((rec.kind or NO_KIND, "rerun"))
                batch.outcomes.append((rec.kind or NO_KIND, "skipped_in_progress"))
                batch.redriven.discard((batch.namespace[id(rec)], rec.idempotency_key))
    batch.rerun = [r for r in batch.rerun if id(r) not in gone]


def _send(
    producer: Producer,
    consumer: Consumer,
    summary: ReplaySummary,
    batch: _Batch,
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


def _apply(summary: ReplaySummary, batch: _Batch) -> None:
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
