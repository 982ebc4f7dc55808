"""The re-drive's decisions: what a replay does with each dead letter it reads.

Per batch of DLQ records (:func:`decide`): the state of each (namespace, key) the
records name is read in one query, and each record gets one outcome
(:data:`OUTCOMES`, explained in :data:`WHY`): a ``failed`` key is re-run
(:func:`rerun_failed`, audited, committed before anything is sent) and its latest
dead letter sent once; a succeeded key is skipped; a key in the consumer's hands is
left to it; a record without a record (undecodable, invalid) is sent as it is,
once (a payload conflict only once its key's record is gone: it would conflict
again); the dead letter of a copy a replay sent is not sent again by that replay
(nor, when it would go as it is, by any); a record written by someone else is left
alone. :mod:`~kafka_idem.replay.run`
sends what was decided, in a Kafka transaction with the replay's position.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kafka_idem import admin
from kafka_idem.dlq import PREFIX
from kafka_idem.replay.records import DlqRecord, Selection
from kafka_idem.replay.republishing import target_of
from kafka_idem.store import Conn, Store, translate_errors

log = logging.getLogger("kafka_idem.replay")

RecordId = tuple[str, str]  # (namespace, idempotency key): a record in the store

# What a replay does with one record read (see decide); "sent" ones first.
SENDS = ("rerun", "resend", "as_is")
SKIPS = ("skipped_succeeded", "skipped_permanent", "skipped_in_progress", "skipped_duplicate",
         "skipped_truncated", "skipped_ambiguous", "skipped_foreign", "skipped_replayed",
         "skipped_conflict")
OUTCOMES = SENDS + SKIPS
WHY = {
    "rerun": "failed key: audited re-run, its latest dead letter sent",
    "resend": "re-run by an interrupted run of this replay, its message not sent yet",
    "as_is": "no record for the key (undecodable, invalid, a conflict whose record is "
             "gone): republished",
    "skipped_succeeded": "key already succeeded",
    "skipped_permanent": "failed permanently; --include-permanent re-runs them",
    "skipped_in_progress": "key retryable_failed or processing: the consumer has it",
    "skipped_duplicate": "an older dead letter of a key re-driven by this run",
    "skipped_truncated": "dead-lettered without its value",
    "skipped_ambiguous": "written before namespaces and its key is in several: "
                         "`kafka-idem rerun KEY --namespace NS`",
    "skipped_foreign": "no idem.* headers: not written by kafka_idem, left alone",
    "skipped_replayed": "dead letter of a copy a replay already sent (this replay, or "
                        "as-is): sent again it would only come back",
    "skipped_conflict": "payload conflict: its key's record holds another payload, it "
                        "would conflict again (`kafka-idem purge` the key to let it in)",
}
FOREIGN = "(foreign)"
NO_KIND = "(none)"


@dataclass
class Batch:
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


def is_foreign(rec: DlqRecord) -> bool:
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
        rows = store.redrive_states(conn, sorted(wanted))
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


def classify(rec: DlqRecord, states: list[dict[str, Any]], *, group: str,
              include_permanent: bool, redriven: set[RecordId],
              starts: dict[int, int]) -> str:
    """The outcome of one matching record with a value (see :data:`WHY`)."""
    if rec.replay_group == group:
        return "skipped_replayed"  # a replay run twice sends nothing twice
    if len(states) > 1:
        return "skipped_ambiguous"
    state = states[0] if states else None
    if state is not None and (state["namespace"], state["idempotency_key"]) in redriven:
        return "skipped_duplicate"
    if state is not None and state["status"] == "succeeded":
        return "skipped_succeeded"
    if rec.truncated is not None:
        return "skipped_truncated"
    if rec.kind == "payload_conflict" and state is not None:
        return "skipped_conflict"
    if state is None or rec.kind == "undecodable":
        # the same bytes again: worth it once (after a fix of the code), not per replay
        return "skipped_replayed" if rec.replayed_from == rec.dlq_topic else "as_is"
    if state["status"] == "failed":
        if state["error_kind"] != "exhausted" and not include_permanent:
            return "skipped_permanent"
        return "rerun"
    if _resend(rec, state, group, starts):
        return "resend"
    return "skipped_in_progress"


@dataclass
class _Decided:
    """Each matching record's outcome, and which dead letter of a re-driven key is its
    latest (the one sent)."""

    outcome: dict[tuple[int, int], str] = field(default_factory=dict)
    ident: dict[int, RecordId] = field(default_factory=dict)  # id(record) -> its record
    latest: dict[RecordId, DlqRecord] = field(default_factory=dict)


def decide(
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
) -> Batch:
    """Steps 1-2: which records of the batch go where, cut at the limit."""
    records = [DlqRecord.from_message(m) for m in msgs]
    matching = [r for r in records if not is_foreign(r) and selection.matches(r)]
    states = _states(conn, store, matching, selection)
    decided = _Decided()
    for rec in matching:
        found = states.get(id(rec), [])
        what = classify(rec, found, group=group, include_permanent=include_permanent,
                        redriven=redriven, starts=starts)
        decided.outcome[(rec.partition, rec.offset)] = what
        if what in ("rerun", "resend"):
            rid = decided.ident[id(rec)] = (found[0]["namespace"], found[0]["idempotency_key"])
            held = decided.latest.get(rid)
            if held is None or _latest_key(rec) > _latest_key(held):
                decided.latest[rid] = rec
        if what == "skipped_ambiguous":
            log.warning(
                "not replayed: %s[%s]@%s names key %s, written before namespaces, which "
                "is in namespaces %s; re-run it with `kafka-idem rerun KEY --namespace NS`",
                rec.dlq_topic, rec.partition, rec.offset, rec.idempotency_key,
                ", ".join(repr(f["namespace"]) for f in found),
                extra={"action": "replay_skipped", "key": rec.idempotency_key},
            )
    return _batch(records, decided, selection, to_topic, remaining)


def _batch(records: Sequence[DlqRecord], decided: _Decided, selection: Selection,
           to_topic: str | None, remaining: int | None) -> Batch:
    """The records in order, up to the limit: what each one does, once per key."""
    batch = Batch()
    for rec in records:
        if remaining is not None and len(batch.send) >= remaining:
            break  # the rest stays for the next run: its position is not committed
        batch.scanned += 1
        batch.positions[rec.partition] = rec.offset + 1
        if is_foreign(rec):
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
        what = decided.outcome[(rec.partition, rec.offset)]
        if what in ("rerun", "resend"):
            rid = decided.ident[id(rec)]
            if decided.latest[rid] is not rec or rid in batch.redriven:
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


def rerun_failed(conn: Conn, store: Store, batch: Batch, *, group: str, run: str, actor: str,
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
                selection={"via": "dlq replay", "group": group, "run": run,
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
