"""Admin operations on the store: status, inspect, audited re-run (retention purges:
:mod:`~kafka_idem.admin.purge`).

Records are identified by (namespace, key). Admin reads take a namespace or
``None`` for every namespace; a state change runs on a store scoped to the
record's namespace (:func:`resolve` finds it for a key given without one).

Every state change here is an audited admin action: it runs with
``kafka_idem.admin_action`` set for its transaction (the transition guard lets
``failed -> retryable_failed`` and DELETE through only then) and appends its
audit row in that same transaction.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from kafka_idem.admin import audit
from kafka_idem.errors import KafkaIdemError
from kafka_idem.settings.durations import parse_duration as parse_duration  # re-exported
from kafka_idem.store import Conn, Store, translate_errors

STATUSES = ("processing", "succeeded", "retryable_failed", "failed")


class Refused(KafkaIdemError):
    """The admin action was refused."""


def set_admin_action(conn: Conn, store: Store, action: str) -> None:
    """Let the guard through for ``action`` until the transaction ends (on every node of a
    distributed store: :meth:`~kafka_idem.store.Store.admin_action`)."""
    store.admin_action(conn, action)


@dataclass
class Status:
    by_status: dict[str, int]
    processing_live: int
    processing_expired: int
    long_running: int
    retry_backlog: int
    retry_due_now: int
    next_retry_at: dt.datetime | None
    failed_by_kind: dict[str, int] = field(default_factory=dict)
    namespace: str | None = None  # the one asked for, or None: every namespace
    by_namespace: dict[str, dict[str, int]] = field(default_factory=dict)
    # {namespace: (unpublished rows, age of the oldest in seconds)}
    outbox: dict[str, tuple[int, float]] = field(default_factory=dict)

    def outbox_pending(self) -> dict[str, tuple[int, float | None]]:
        """Unpublished events (count, age of the oldest) of every namespace shown: the
        one asked for or each that holds records, with 0 and no age when none wait."""
        known = [self.namespace] if self.namespace is not None else list(self.by_namespace)
        pending: dict[str, tuple[int, float | None]] = dict.fromkeys(known, (0, None))
        pending.update(self.outbox)
        return pending

    def to_json(self) -> dict[str, Any]:
        return {
            "outbox": {ns: {"pending": n,
                            "oldest_age_seconds": None if age is None else round(age, 3)}
                       for ns, (n, age) in self.outbox_pending().items()},
            "namespace": self.namespace,
            "by_status": self.by_status,
            "by_namespace": self.by_namespace,
            "processing": {"live": self.processing_live, "expired": self.processing_expired},
            "long_running": self.long_running,
            "retry_backlog": {
                "count": self.retry_backlog,
                "due_now": self.retry_due_now,
                "next_due_at": self.next_retry_at.isoformat() if self.next_retry_at else None,
            },
            "failed_by_kind": self.failed_by_kind,
        }


def status(conn: Conn, store: Store, *, long_running_seconds: float,
           namespace: str | None = None) -> Status:
    """Counts over ``namespace`` (``None``: every namespace), and per namespace."""
    rows, kinds = store.status_rows(conn, namespace=namespace,
                                    long_running_seconds=long_running_seconds)
    totals: dict[str, int] = dict.fromkeys(STATUSES, 0)
    by_namespace: dict[str, dict[str, int]] = {}
    for r in rows:
        totals[r["status"]] += int(r["n"])
        by_namespace.setdefault(r["namespace"], dict.fromkeys(STATUSES, 0))[r["status"]] = \
            int(r["n"])
    retry = [r for r in rows if r["status"] == "retryable_failed"]
    due = [r["next_due"] for r in retry if r["next_due"] is not None]
    failed_by_kind: dict[str, int] = {}
    for r in kinds:
        failed_by_kind[r["kind"]] = failed_by_kind.get(r["kind"], 0) + int(r["n"])
    return Status(
        by_status=totals,
        processing_live=sum(int(r["live"]) for r in rows),
        processing_expired=sum(int(r["expired"]) for r in rows),
        long_running=sum(int(r["long_running"]) for r in rows),
        retry_backlog=sum(int(r["n"]) for r in retry),
        retry_due_now=sum(int(r["due_now"]) for r in retry),
        next_retry_at=min(due) if due else None,
        failed_by_kind=failed_by_kind,
        namespace=namespace,
        by_namespace=dict(sorted(by_namespace.items())),
        outbox={r["namespace"]: (int(r["pending"]), float(r["oldest_age_seconds"]))
                for r in store.outbox_pending(conn, namespace)},
    )


def shown(namespace: str) -> str:
    """A namespace as operators read it ('' is the unassigned one)."""
    return namespace if namespace else "(unassigned)"


def require_namespace(conn: Conn, store: Store, namespace: str) -> None:
    """Refuse a namespace that has no records in this store (a typo, most likely)."""
    known = store.namespaces(conn)
    if namespace not in known:
        names = ", ".join(repr(n) for n in known) or "none: the store is empty"
        raise Refused(f"no records in namespace {namespace!r} (namespaces in this store: "
                      f"{names})")


def resolve(conn: Conn, store: Store, key: str, namespace: str | None) -> Store:
    """The store scoped to the one namespace that holds ``key``: ``namespace`` if
    given, else the only namespace with that key; refuses none or several."""
    if namespace is not None:
        require_namespace(conn, store, namespace)
        return store.scoped(namespace)
    found = [r["namespace"] for r in store.find(conn, key, store.namespaces(conn))]
    if not found:
        raise Refused("no record with this key", key=key)
    if len(found) > 1:
        raise Refused(f"the key exists in namespaces {', '.join(repr(n) for n in found)}: "
                      "give --namespace", key=key)
    return store.scoped(found[0])


RECORD_FIELDS = (
    "namespace", "shard_key", "status", "request_hash", "attempts", "attempts_counted",
    "owner_token", "lease_until",
    "lease_live", "next_attempt_at", "result_json", "error_kind", "error_class",
    "error_message", "first_failure_at", "last_failure_at", "completed_token", "handler",
    "kafka_topic", "kafka_partition", "kafka_offset", "created_at", "updated_at",
    "completed_at",
)
AUDIT_COLUMNS = ("at", "actor", "action", "reason", "previous_status", "previous_error")


AUDIT_JSON = ("at", "actor", "action", "reason", "previous_status", "previous_error",
              "selection", "counts")


def record_json(key: str, rec: dict[str, Any]) -> dict[str, Any]:
    """``inspect --json``: the documented fields only (docs/reference/cli-conventions.md,
    JSON output), whatever columns later migrations add to the table."""
    out: dict[str, Any] = {"idempotency_key": key}
    out.update({name: rec.get(name) for name in RECORD_FIELDS})
    out["audit"] = [{name: row.get(name) for name in AUDIT_JSON} for row in rec["audit"]]
    return out


def inspect(conn: Conn, store: Store, key: str,
            namespace: str | None = None) -> list[dict[str, Any]]:
    """The records of ``key`` (in ``namespace``, else in every namespace), each with
    its audit trail; ``[]`` when there is none."""
    if namespace is not None:
        require_namespace(conn, store, namespace)
    spaces = [namespace] if namespace is not None else store.namespaces(conn)
    records = store.find(conn, key, spaces)
    for record in records:
        record["lease_live"] = bool(
            record["status"] == "processing" and record["lease_until"] > record["db_now"]
        )
        record["audit"] = audit.trail(conn, store.scoped(record["namespace"]), key)
    return records


def escaped_forms(key: str, *, limit: int = 10) -> list[str]:
    """The keys a template could have built for what ``key`` shows unescaped: each
    separator character (not a letter or digit) either the template's own or a
    value's, percent-encoded (docs/BAD_INPUT.md); a value's ``%`` is always
    encoded. Only the first ``limit`` separators vary (2^limit forms at most)."""
    def encoded(ch: str) -> str:
        return "".join(f"%{b:02X}" for b in ch.encode())

    forms = [""]
    varying = 0
    for ch in key:
        if ch.isalnum():
            forms = [f + ch for f in forms]
        elif ch == "%":
            forms = [f + "%25" for f in forms] + [f + "%" for f in forms]
        elif varying < limit:
            varying += 1
            forms = [f + ch for f in forms] + [f + encoded(ch) for f in forms]
        else:
            forms = [f + ch for f in forms]
        forms = forms[: 2 ** (limit + 1)]
    return [f for f in dict.fromkeys(forms) if f != key]


def similar_keys(conn: Conn, store: Store, key: str,
                 namespace: str | None = None) -> list[str]:
    """Records whose key is ``key`` with some of its separators percent-encoded, for
    an ``inspect`` that found nothing under the key as typed."""
    forms = escaped_forms(key)
    if not forms:
        return []
    spaces = [namespace] if namespace is not None else store.namespaces(conn)
    return store.keys_among(conn, forms, spaces)


def rerun(
    conn: Conn,
    store: Store,
    *,
    key: str,
    actor: str,
    reason: str,
    selection: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``failed -> retryable_failed`` with an audit row, in the caller's transaction.

    Refuses a missing key, a ``succeeded`` record, a live ``processing`` record,
    and anything not ``failed`` (it is already on its way), except a key
    *stranded* by a replay (:func:`stranded_by`): its state stays, an audit row
    says it was taken up again (``"stranded_by"`` in the result names the replay),
    and the caller sends its message. ``selection`` (e.g. the replay's group and
    run) is kept in the audit row.
    """
    if not reason.strip():
        raise Refused("a reason is required for a re-run", key=key)
    with translate_errors(key=key):
        rec = store.lock_record(conn, key)
        if rec is None:
            raise Refused("no record with this key", key=key)
        state = rec["status"]
        if state == "succeeded":
            raise Refused("the operation already succeeded; a re-run would do it twice", key=key)
        if state == "processing" and rec["lease_until"] > rec["db_now"]:
            raise Refused("the operation is being processed right now (live lease)", key=key)
        stranded = stranded_by(conn, store, key) if state == "retryable_failed" else None
        if stranded is not None:
            audit_id = audit.record(
                conn, store, actor=actor, action="rerun", key=key, reason=reason,
                previous_status=state, previous_error=None,
                selection={**(selection or {}), "stranded_by": stranded})
            return {"key": key, "previous": rec, "audit_id": audit_id,
                    "stranded_by": stranded}
        if state != "failed":
            raise Refused(f"the record is {state}, not failed; the consumer retries it", key=key)
        audit_id = _rerun_locked(conn, store, rec, actor=actor, reason=reason,
                                 selection=selection)
    return {"key": key, "previous": rec, "audit_id": audit_id}


def stranded_by(conn: Conn, store: Store, key: str) -> dict[str, Any] | None:
    """The replay that re-ran ``key`` and may never have sent its message, or ``None``.

    A key is *stranded* when it is ``retryable_failed``, its latest audit row is a
    ``dlq replay`` re-run, and nothing changed the record since (no claim, no
    attempt): the replay's Kafka transaction may have failed after the re-run
    committed (an earlier version re-ran a batch's keys before its records were
    accepted; a crash between the two commits does it still, and a run of the same
    replay resends them). Sending its dead letter again is safe either way: if the
    first copy is on its way after all, the second is answered as a duplicate."""
    rows = store.redrive_states(conn, [(store.ns, key)])
    if not rows:
        return None
    row = rows[0]
    if not (row["status"] == "retryable_failed" and row["last_action"] == "rerun"
            and row["last_via"] == "dlq replay" and row["untouched"]):
        return None
    return {"group": row["last_group"], "run": row["last_run"],
            "at": row["last_at"].isoformat() if row["last_at"] is not None else None,
            "dlq_topic": row["last_topic"]}


def rerun_if_failed(
    conn: Conn,
    store: Store,
    *,
    key: str,
    actor: str,
    reason: str,
    selection: dict[str, Any] | None = None,
    shard: str | None = None,
) -> dict[str, Any] | None:
    """Like :func:`rerun` for bulk re-runs: lock the record and re-run it if it is
    still ``failed``; otherwise (gone, succeeded or back in the consumer's hands
    since it was selected) return ``None`` and change nothing. ``shard``: the record's
    ``shard_key`` when the caller's selection read it (else it is looked up)."""
    if not reason.strip():
        raise Refused("a reason is required for a re-run", key=key)
    with translate_errors(key=key):
        rec = store.lock_record(conn, key, shard)
        if rec is None or rec["status"] != "failed":
            return None
        audit_id = _rerun_locked(conn, store, rec, actor=actor, reason=reason,
                                 selection=selection)
    return {"key": key, "previous": rec, "audit_id": audit_id}


def _rerun_locked(conn: Conn, store: Store, rec: dict[str, Any], *, actor: str, reason: str,
                  selection: dict[str, Any] | None) -> int:
    key = rec["idempotency_key"]
    set_admin_action(conn, store, "rerun")
    store.rerun(conn, key, rec.get("shard_key"))
    previous_error = f"{rec['error_kind']}: {rec['error_class']}: {rec['error_message']}"
    return audit.record(
        conn, store, actor=actor, action="rerun", key=key, reason=reason,
        previous_status=rec["status"], previous_error=previous_error, selection=selection,
    )
