"""Background retention (setting ``retention``): what one run does and the rules it keeps.

A run is the one-off ``kafka-idem purge`` (:func:`~kafka_idem.admin.purge.purge`, its
audited batches, its guard) with three things added for running unattended:

- one member of an app at a time: a session advisory lock keyed by schema, table and
  namespace (:meth:`~kafka_idem.store.Store.retention_turn`), tried, never waited for;
- small batches (:data:`BATCH`, ``FOR UPDATE SKIP LOCKED``: a row a handler holds is
  skipped, never waited on), each its own transaction, paced (:func:`pace`) so the
  handlers keep most of the database;
- a summary row in the audit trail (action ``retention``) for a run that removed
  records: ``kafka-idem status`` shows the latest (:func:`last_runs`).

Only ``succeeded`` records are purged: ``processing`` and ``retryable_failed`` ones
are live, and ``failed`` (dead-lettered) ones are what a DLQ replay decides by
(``kafka-idem purge --include-failed`` removes those by hand).

The window must be at least every source topic's ``retention.ms``
(:func:`~kafka_idem.admin.purge.purge_risk`, as for ``purge``): a record purged while
its message can still be redelivered lets that message run its effect again.
:func:`refusal` says so in one line naming the setting; a run whose topics'
retention cannot be read purges nothing (:func:`unchecked`).
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable
from typing import Any

from kafka_idem.admin import audit
from kafka_idem.admin.purge import TopicRetention, purge, purge_risk
from kafka_idem.settings.durations import format_duration, parse_duration
from kafka_idem.store import Conn, Store, translate_errors

BATCH = 1000  # records per transaction: a few milliseconds of locks
PACE = 6.0  # after a batch, rest this many times as long as it took (busy a seventh of the time)
MIN_REST = 0.01  # seconds, at least, between two batches


def refusal(window: str, retentions: list[TopicRetention]) -> str | None:
    """The one line refusing ``retention=window`` when it is shorter than a source
    topic's retention (or any window, for a topic kept forever); ``None``: long enough,
    as far as the retentions that could be read tell (:func:`unchecked` says the rest)."""
    read = [r for r in retentions if r.ms is not None]
    risk = purge_risk(parse_duration(window), read) if read else None
    if risk is None:
        return None
    needed = risk.needed
    longer = (f"set retention to {format_duration(needed)} or longer, or "
              if needed is not None else "")
    topic = risk.retention.topic if risk.retention is not None else "the source topics"
    return (f"retention={window} (KAFKA_IDEM_RETENTION): {risk.facts(window)}; {longer}"
            f"set retention_force=true (KAFKA_IDEM_RETENTION_FORCE) if topic {topic} will "
            "never be re-read from before the window")


def unchecked(retentions: list[TopicRetention]) -> str | None:
    """Why the window could not be checked (a topic whose retention could not be read),
    or ``None``: every one was read. Such a run purges nothing (unless forced)."""
    unread = [r for r in retentions if r.ms is None]
    if not unread:
        return None
    return f"the retention of topic {unread[0].topic} could not be read ({unread[0].why})"


def pace(stopping: threading.Event, counted: Callable[[int], None] | None = None,
         ) -> Callable[[int, float], bool]:
    """The pause between two batches of a run: :data:`PACE` times the batch's time, at
    least :data:`MIN_REST`; false when the member stops meanwhile. ``counted`` is told
    what each batch deleted (the member's metric moves as the run goes)."""
    def between(deleted: int, took: float) -> bool:
        if counted is not None:
            counted(deleted)
        return not stopping.wait(max(took * PACE, MIN_REST))
    return between


def run_once(conn: Conn, store: Store, *, window: str, member: str, force: bool,
             stopping: threading.Event, batch: int = BATCH,
             counted: Callable[[int], None] | None = None) -> int | None:
    """One run on ``conn`` (a connection of its own, autocommit off): the app's turn
    taken, its succeeded records older than ``window`` purged in paced batches until
    none is left (or the member stops), a summary audit row when some were removed,
    the turn given back. The number removed, or ``None``: another member has the turn
    (``counted``: told what each full batch removed, as it goes)."""
    if not store.retention_turn(conn, take=True):
        conn.rollback()
        return None
    conn.commit()
    run = uuid.uuid4().hex
    try:
        removed = purge(conn, store, older_than=parse_duration(window), include_failed=False,
                        batch_size=batch, actor=f"retention:{member}",
                        reason=f"retention={window}", force=force,
                        between=pace(stopping, counted),
                        noted={"run": run, "retention": window})
        if removed:
            with translate_errors(), conn.transaction():
                audit.record(conn, store, actor=f"retention:{member}", action="retention",
                             reason=f"retention={window}",
                             selection={"run": run, "retention": window, "force": force,
                                        "older_than_seconds": parse_duration(window)},
                             counts={"deleted": removed})
        return removed
    finally:
        # a broken connection has lost its session, and its lock with it
        with contextlib.suppress(Exception):
            conn.rollback()
            store.retention_turn(conn, take=False)
            conn.commit()


def last_runs(conn: Conn, store: Store, namespace: str | None) -> dict[str, dict[str, Any]]:
    """The latest retention run that removed records, per namespace: when, by which
    member, how many, the window."""
    out: dict[str, dict[str, Any]] = {}
    for r in store.retention_last(conn, namespace):
        selection = r["selection"] or {}
        out[r["namespace"]] = {
            "at": r["at"].isoformat(), "member": str(r["actor"]).removeprefix("retention:"),
            "removed": int((r["counts"] or {}).get("deleted", 0)),
            "retention": selection.get("retention"), "force": bool(selection.get("force"))}
    return out
