"""Bulk re-run: ``kafka-idem rerun --kind exhausted --reason ...`` (without KEY).

Selects ``failed`` records in the store by filter (namespace, kind, last failure
time, handler, key prefix, limit), reads each DLQ topic involved ONCE to find each selected key's
latest dead letter, then re-runs and republishes in batches. Each batch is one
database transaction holding its records' row locks: the keys are re-run
(``failed -> retryable_failed``, an audit row each), their dead letters are
produced and every delivery acknowledged, and only then does the transaction
commit -- the order of the single-key ``rerun``. A refused or unacknowledged
record rolls the batch back (its keys stay ``failed``, a later run re-runs them);
a crash after the acknowledgement and before the commit leaves the keys
``failed`` (the consumer, blocked on the row lock until then, dead-letters the
message again), so no key is left re-run without a message. A repeat selects only
keys that are still (or again) ``failed``: a key re-run and not failed again is
never re-run twice.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from confluent_kafka import Producer

from kafka_idem.admin import operations as admin
from kafka_idem.replay.progress import Progress
from kafka_idem.replay.reading import kafka_errors, scan
from kafka_idem.replay.records import DlqRecord, Selection, dlq_topic_for
from kafka_idem.replay.republishing import Deliveries, delivery_wait, republish
from kafka_idem.replay.trust import Boundary
from kafka_idem.settings import Settings
from kafka_idem.store import Conn, Store

if TYPE_CHECKING:
    from kafka_idem.app import App

BATCH = 200
RecordId = tuple[str, str]  # (namespace, idempotency key)


@dataclass(frozen=True, slots=True)
class Filter:
    """Which ``failed`` records a bulk re-run selects (every set field must match)."""

    kind: str | None = None
    handler: str | None = None
    since: dt.datetime | None = None  # last failure at or after
    until: dt.datetime | None = None  # last failure before
    key_prefix: str | None = None
    limit: int | None = None
    namespace: str | None = None  # None: every namespace
    # only these (namespace, key): what a dry run selected (the console's confirmation)
    keys: frozenset[tuple[str, str]] | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: (v.isoformat() if isinstance(v, dt.datetime) else v)
                for k, v in (("namespace", self.namespace),
                             ("kind", self.kind), ("handler", self.handler),
                             ("since", self.since), ("until", self.until),
                             ("key_prefix", self.key_prefix), ("limit", self.limit),
                             ("keys", None if self.keys is None else len(self.keys)))
                if v is not None}


@dataclass
class BulkSummary:
    """What a bulk re-run selected and did (``rerun`` counts keys committed)."""

    dry_run: bool
    selected: int = 0
    rerun: int = 0
    not_failed: int = 0  # left failed between selection and re-run (someone else re-ran it)
    no_dead_letter: list[str] = field(default_factory=list)
    keys: list[tuple[str, str]] = field(default_factory=list)  # (namespace, key) selected
    truncated: list[str] = field(default_factory=list)
    dlq_topics: dict[str, int] = field(default_factory=dict)  # letters found per topic
    targets: dict[str, int] = field(default_factory=dict)

    @property
    def ready(self) -> int:
        return self.selected - len(self.no_dead_letter) - len(self.truncated)

    def to_json(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "selected": self.selected,
                "would_rerun" if self.dry_run else "rerun":
                    self.ready if self.dry_run else self.rerun,
                "not_failed": self.not_failed, "no_dead_letter": self.no_dead_letter,
                "truncated": self.truncated, "dlq_topics": self.dlq_topics,
                "targets": self.targets}


def select_failed(conn: Conn, store: Store, flt: Filter) -> list[dict[str, Any]]:
    rows = store.failed_selection(
        conn, namespace=flt.namespace, kind=flt.kind, handler=flt.handler, since=flt.since,
        until=flt.until, key_prefix=flt.key_prefix, limit=flt.limit)
    conn.rollback()
    if flt.keys is not None:
        rows = [r for r in rows if (r["namespace"], r["idempotency_key"]) in flt.keys]
    return rows


def _latest(rec: DlqRecord) -> tuple[dt.datetime, dt.datetime, int, int]:
    epoch = dt.datetime.min.replace(tzinfo=dt.UTC)
    return (rec.last_failure_at or epoch, rec.timestamp or epoch, rec.partition, rec.offset)


def latest_letters(settings: Settings, topics: dict[str, set[RecordId]],
                   accept: Callable[[DlqRecord, RecordId], bool] | None = None,
                   ) -> dict[RecordId, DlqRecord]:
    """Each (namespace, key)'s latest dead letter that ``accept`` takes: every DLQ topic
    read once, to its current end. A dead letter from before namespaces counts for
    its key in any."""
    found: dict[RecordId, DlqRecord] = {}
    for topic, wanted in sorted(topics.items()):
        spaces: dict[str, set[str]] = {}  # key -> the namespaces it is wanted in
        for ns, key in wanted:
            spaces.setdefault(key, set()).add(ns)
        records = scan(settings, topic, Selection())
        try:
            for rec in records:
                k = rec.idempotency_key
                if k is None or k not in spaces:
                    continue
                for ns in ([rec.namespace] if rec.namespace is not None else spaces[k]):
                    rid = (ns, k)
                    if rid not in wanted or (accept is not None and not accept(rec, rid)):
                        continue
                    if rid not in found or _latest(rec) > _latest(found[rid]):
                        found[rid] = rec
        finally:
            records.close()
    return found


def bulk_rerun(
    settings: Settings,
    conn: Conn,
    store: Store,
    flt: Filter,
    *,
    dlq_topic: str | None,
    actor: str,
    reason: str | None,
    dry_run: bool,
    progress: bool = False,
    batch_size: int = BATCH,
    trust_unsigned: bool = False,
    on_progress: Callable[[int, int, int], None] | None = None,
    app: App | None = None,
    via: str = "rerun",
) -> BulkSummary:
    """See the module doc. Raises :class:`admin.Refused` without a reason (unless a dry
    run), before anything is read or changed. A key's dead letter is taken only if it
    says it came from the key's record's own topic and, where signing keys are
    configured, its signature holds (``trust_unsigned``: or it has none).
    ``on_progress(done, total, 0)`` is called as batches of keys are re-run. With
    ``app``, a key's DLQ is its handler's (``dlq_topic``) when ``dlq_topic`` is not
    given; ``via`` names the caller in each audit row's selection."""
    if not dry_run and (reason is None or not reason.strip()):
        raise admin.Refused("a reason is required for a re-run: give --reason TEXT "
                            "(kept in the audit trail)")
    summary = BulkSummary(dry_run)
    rows = select_failed(conn, store, flt)
    summary.selected = len(rows)
    summary.keys = [(r["namespace"], r["idempotency_key"]) for r in rows]
    topics: dict[str, set[RecordId]] = {}
    source: dict[RecordId, str] = {}
    shards = {(r["namespace"], r["idempotency_key"]): r["shard_key"] for r in rows}
    for row in rows:
        topic = dlq_topic or dlq_topic_for(settings, row["kafka_topic"], app)
        rid = (row["namespace"], row["idempotency_key"])
        topics.setdefault(topic, set()).add(rid)
        source[rid] = row["kafka_topic"]

    def trusted(rec: DlqRecord, rid: RecordId) -> bool:
        boundary = Boundary(rec.dlq_topic, frozenset({source[rid]}), rid[0],
                            secrets=settings.signing_keys, trust_unsigned=trust_unsigned)
        return boundary.outside(rec) is None

    letters = latest_letters(settings, topics, trusted)
    ready: list[tuple[str, DlqRecord]] = []
    for row in rows:
        ns, k = row["namespace"], row["idempotency_key"]
        letter = letters.get((ns, k))
        if letter is None:
            summary.no_dead_letter.append(k)
        elif letter.truncated is not None:
            summary.truncated.append(k)
        else:
            ready.append((ns, letter))
            summary.dlq_topics[letter.dlq_topic] = summary.dlq_topics.get(letter.dlq_topic,
                                                                          0) + 1
    if dry_run or not ready:
        return summary
    assert reason is not None
    conf = settings.producer_config()
    producer = Producer(conf)
    wait = delivery_wait(conf)
    with Progress(progress, len(ready), "re-running", report=on_progress) as advance:
        for start in range(0, len(ready), batch_size):
            chunk = ready[start:start + batch_size]
            _batch(conn, store, producer, chunk, summary, actor=actor, reason=reason,
                   selection={"via": via, "filter": flt.to_json(),
                              "dlq_topic": dlq_topic}, wait=wait, shards=shards)
            advance(len(chunk))
    return summary


def _batch(conn: Conn, store: Store, producer: Producer,
           chunk: Sequence[tuple[str, DlqRecord]], summary: BulkSummary, *, actor: str,
           reason: str, selection: dict[str, Any], wait: float,
           shards: dict[RecordId, str | None]) -> None:
    deliveries = Deliveries()
    sent: list[DlqRecord] = []
    with conn.transaction():
        for ns, rec in chunk:
            assert rec.idempotency_key is not None
            done = admin.rerun_if_failed(
                conn, store.scoped(ns), key=rec.idempotency_key, actor=actor, reason=reason,
                selection={**selection, "partition": rec.partition, "offset": rec.offset,
                           "letter_topic": rec.dlq_topic},
                shard=shards.get((ns, rec.idempotency_key)),
            )
            if done is not None:
                sent.append(rec)
        with kafka_errors("republishing re-run keys' dead letters"):
            for rec in sent:
                republish(producer, rec, actor=actor, on_delivery=deliveries)
            producer.flush(wait)
        # Raises (rolling back the re-runs of this batch) unless every record was acked.
        deliveries.check(len(sent), "republishing re-run keys' dead letters")
    summary.rerun += len(sent)
    summary.not_failed += len(chunk) - len(sent)
    for rec in sent:
        target = rec.original_topic or "-"
        summary.targets[target] = summary.targets.get(target, 0) + 1
