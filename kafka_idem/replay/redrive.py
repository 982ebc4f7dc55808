"""The re-drive's decisions: what a replay does with each dead letter it reads.

Per batch of DLQ records (:func:`decide`): a record outside the replay's
:class:`~kafka_idem.replay.trust.Boundary` (bad or missing signature, another
topic or namespace, a value that does not build its key) is skipped as
``skipped_untrusted``; the state of each (namespace, key) the others name is read
in one query, and each record gets one outcome (:data:`OUTCOMES`, explained in
:data:`WHY`): a ``failed`` key is re-run (:func:`rerun_failed`, audited, committed
only once its message is in the replay's Kafka transaction) and its latest dead
letter sent once; a succeeded key is skipped; a key in the consumer's hands is left
to it; a record without a record (undecodable, invalid) is sent as it is, once (a
payload conflict only once its key's record is gone: it would conflict again); the
dead letter of a copy a replay sent is not sent again by that replay (nor, when it
would go as it is, by any); a record written by someone else is left alone; a
record whose target cannot take it (no such topic or partition, too large) is
skipped as ``skipped_unsendable`` before its key is re-run.
:mod:`~kafka_idem.replay.run` sends what was decided, in a Kafka transaction with
the replay's position.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kafka_idem.admin import operations as admin
from kafka_idem.deadletters.dead_letter import PREFIX
from kafka_idem.replay.records import DlqRecord, Selection
from kafka_idem.replay.republishing import target_of
from kafka_idem.replay.targets import Targets
from kafka_idem.replay.trust import REASONS, Boundary
from kafka_idem.store import Conn, Store, translate_errors

log = logging.getLogger(__name__)

RecordId = tuple[str, str]  # (namespace, idempotency key): a record in the store

# What a replay does with one record read (see decide); "sent" ones first.
SENDS = ("rerun", "resend", "as_is")
SKIPS = ("skipped_succeeded", "skipped_permanent", "skipped_in_progress", "skipped_duplicate",
         "skipped_truncated", "skipped_ambiguous", "skipped_foreign", "skipped_replayed",
         "skipped_conflict", "skipped_untrusted", "skipped_unsendable")
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
    "skipped_untrusted": "outside the replay's boundary (signature, topic, namespace or key: "
                         "see untrusted)",
    "skipped_unsendable": "its target cannot take it (no such topic or partition, too "
                          "large, not authorised): see unsendable",
}
FOREIGN = "(foreign)"
NO_KIND = "(none)"


Position = tuple[int, int]  # (DLQ partition, offset)


@dataclass
class Batch:
    """One batch's decisions, applied to the summary only once committed."""

    scanned: int = 0
    matched: int = 0
    send: list[tuple[DlqRecord, str]] = field(default_factory=list)
    actions: dict[int, str] = field(default_factory=dict)  # id(record) -> one of SENDS
    rerun: list[DlqRecord] = field(default_factory=list)  # failed keys to re-run
    outcomes: dict[Position, tuple[str, str]] = field(default_factory=dict)  # (kind, outcome)
    reasons: dict[Position, str] = field(default_factory=dict)  # untrusted / unsendable: why
    redriven: set[RecordId] = field(default_factory=set)
    namespace: dict[int, str] = field(default_factory=dict)  # id(record) -> its key's
    positions: dict[int, int] = field(default_factory=dict)

    def skip(self, rec: DlqRecord, outcome: str, reason: str | None = None) -> None:
        """Take a record decided to be sent off the batch: it is skipped with ``outcome``
        (and ``reason``), its key neither re-run nor counted as re-driven."""
        self.send = [(r, t) for r, t in self.send if r is not rec]
        self.rerun = [r for r in self.rerun if r is not rec]
        self.actions.pop(id(rec), None)
        ns = self.namespace.pop(id(rec), None)
        if ns is not None and rec.idempotency_key is not None:
            self.redriven.discard((ns, rec.idempotency_key))
        self.outcomes[(rec.partition, rec.offset)] = (rec.kind or NO_KIND, outcome)
        if reason is not None:
            self.reasons[(rec.partition, rec.offset)] = reason
            _log_skip(rec, outcome, reason)


def _log_skip(rec: DlqRecord, outcome: str, reason: str) -> None:
    """One line per record a replay leaves out for its trust or its target: the
    position, the reason and what the record claimed (plain values: the CLI escapes)."""
    what = "untrusted" if outcome == "skipped_untrusted" else "unsendable"
    why = REASONS.get(reason, reason)
    log.warning(
        "not replayed (%s: %s): %s[%s]@%s names topic %s, namespace %s, key %s; %s",
        what, reason.split(":")[0], rec.dlq_topic, rec.partition, rec.offset,
        rec.original_topic, rec.namespace, rec.idempotency_key, why,
        extra={"action": f"replay_{what}", "reason": reason, "key": rec.idempotency_key},
    )


def is_foreign(rec: DlqRecord) -> bool:
    """Written by someone else: not one ``idem.*`` header."""
    return not any(k.startswith(PREFIX) for k, _v in rec.headers)


def _latest_key(rec: DlqRecord) -> tuple[dt.datetime, dt.datetime, int, int]:
    epoch = dt.datetime.min.replace(tzinfo=dt.UTC)
    return (rec.last_failure_at or epoch, rec.timestamp or epoch, rec.partition, rec.offset)


def _states(conn: Conn, store: Store, records: Sequence[DlqRecord],
            namespace: str | None) -> dict[int, list[dict[str, Any]]]:
    """``{id(record): [state, ...]}``: the record of its key in its namespace (one at
    most), or for a dead letter from before namespaces, in every namespace it may be
    in (the replay's, else all: the caller refuses to guess between several)."""
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
            if namespace is not None:
                wanted.add((namespace, rec.idempotency_key))
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
        ns = rec.namespace if rec.namespace is not None else namespace
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
    """Each matching record's outcome (and why, for the untrusted and the unsendable),
    and which dead letter of a re-driven key is its latest (the one sent)."""

    outcome: dict[Position, str] = field(default_factory=dict)
    reason: dict[Position, str] = field(default_factory=dict)
    ident: dict[int, RecordId] = field(default_factory=dict)  # id(record) -> its record
    latest: dict[RecordId, DlqRecord] = field(default_factory=dict)
    target: dict[int, str] = field(default_factory=dict)  # id(record) -> where it goes


def decide(
    conn: Conn,
    store: Store,
    msgs: Sequence[Any],
    selection: Selection,
    boundary: Boundary,
    targets: Targets,
    remaining: int | None,
    *,
    group: str,
    include_permanent: bool,
    redriven: set[RecordId],
    starts: dict[int, int],
) -> Batch:
    """Steps 1-2: which records of the batch go where, cut at the limit. Whether a
    record is inside the boundary and whether its target can take it are decided here,
    before anything is re-run or sent, so a dry run counts what a real run does."""
    records = [DlqRecord.from_message(m) for m in msgs]
    # The replay's namespace is its boundary, not a filter: a record naming another
    # namespace is matched by the other filters and counted as untrusted.
    selection = dataclasses.replace(selection, namespace=None)
    matching = [r for r in records if not is_foreign(r) and selection.matches(r)]
    outside = {id(r): why for r in matching if (why := boundary.outside(r)) is not None}
    states = _states(conn, store, [r for r in matching if id(r) not in outside],
                     boundary.namespace)
    decided = _Decided()
    for rec in matching:
        pos = (rec.partition, rec.offset)
        found = states.get(id(rec), [])
        what, why = _judge(rec, found, outside.get(id(rec)), boundary, group=group,
                           include_permanent=include_permanent, redriven=redriven,
                           starts=starts)
        if what in SENDS:
            target = target_of(rec, boundary.to_topic)
            unsendable = targets.unsendable(rec, target, to_topic=boundary.to_topic)
            if unsendable is not None:
                what, why = "skipped_unsendable", unsendable
            else:
                decided.target[id(rec)] = target
        decided.outcome[pos] = what
        if why is not None:
            decided.reason[pos] = why
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
    return _batch(records, decided, selection, remaining)


def _judge(rec: DlqRecord, found: list[dict[str, Any]], outside: str | None,
           boundary: Boundary, *, group: str, include_permanent: bool,
           redriven: set[RecordId], starts: dict[int, int]) -> tuple[str, str | None]:
    """One matching record's outcome and, for an untrusted one, why."""
    if outside is not None:
        return "skipped_untrusted", outside
    what = classify(rec, found, group=group, include_permanent=include_permanent,
                    redriven=redriven, starts=starts)
    if what in ("rerun", "resend"):
        if boundary.namespace is None:
            return "skipped_untrusted", "no_namespace"
        if not boundary.key_holds(rec, found[0]):
            return "skipped_untrusted", "key_mismatch"
    return what, None


def _batch(records: Sequence[DlqRecord], decided: _Decided, selection: Selection,
           remaining: int | None) -> Batch:
    """The records in order, up to the limit: what each one does, once per key."""
    batch = Batch()
    for rec in records:
        if remaining is not None and len(batch.send) >= remaining:
            break  # the rest stays for the next run: its position is not committed
        batch.scanned += 1
        batch.positions[rec.partition] = rec.offset + 1
        pos = (rec.partition, rec.offset)
        if is_foreign(rec):
            log.warning(
                "left alone: %s[%s]@%s has no idem.* headers (not written by kafka_idem)",
                rec.dlq_topic, rec.partition, rec.offset,
                extra={"action": "replay_foreign"},
            )
            batch.outcomes[pos] = (FOREIGN, "skipped_foreign")
            continue
        if not selection.matches(rec):
            continue
        batch.matched += 1
        what = decided.outcome[pos]
        if what in ("rerun", "resend"):
            rid = decided.ident[id(rec)]
            if decided.latest[rid] is not rec or rid in batch.redriven:
                what = "skipped_duplicate"
            else:
                batch.redriven.add(rid)
                batch.namespace[id(rec)] = rid[0]
                if what == "rerun":
                    batch.rerun.append(rec)
        batch.outcomes[pos] = (rec.kind or NO_KIND, what)
        if pos in decided.reason:
            batch.reasons[pos] = decided.reason[pos]
            _log_skip(rec, what, decided.reason[pos])
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
            batch.send.append((rec, decided.target[id(rec)]))
            batch.actions[id(rec)] = what
    return batch


def rerun_failed(conn: Conn, store: Store, batch: Batch, *, group: str, run: str, actor: str,
                 reason: str | None) -> list[DlqRecord]:
    """Step 4: re-run the batch's failed keys in the caller's open transaction (its
    commit comes only once their messages are in the replay's Kafka transaction);
    return the records whose key left ``failed`` since step 2 (another operator re-ran
    it): their messages must not go, so the caller starts the batch's sending again
    without them."""
    gone: list[DlqRecord] = []
    for rec in batch.rerun:
        if reason is None or not reason.strip():
            raise admin.Refused("a reason is required for a re-run", key=rec.idempotency_key)
        assert rec.idempotency_key is not None
        done = admin.rerun_if_failed(
            conn, store.scoped(batch.namespace[id(rec)]), key=rec.idempotency_key,
            actor=actor, reason=reason,
            selection={"via": "dlq replay", "group": group, "run": run,
                       "dlq_topic": rec.dlq_topic, "partition": rec.partition,
                       "offset": rec.offset},
        )
        if done is None:
            gone.append(rec)
    return gone
