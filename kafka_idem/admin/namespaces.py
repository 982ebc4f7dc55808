"""Keys scoped per app: records written before namespaces, and their adoption.

A record is identified by (namespace, idempotency key); an app's namespace is its
``namespace`` setting, else its name. Records written before namespaces existed
(migration 0005) have the reserved namespace '' ("unassigned"): no app sees them.
They still say which handler of which topic wrote them, so an app *adopts* the
ones of its own (topic, handler) pairs into its namespace: ``kafka-idem migrate
--app MODULE:APP``, one audited admin action. Until then the app is refused at
start, because running it would process again keys those records say are done.

An unassigned record whose key the namespace already holds is left where it is
(reported, never merged): the namespace's own record decides that key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kafka_idem.admin import audit
from kafka_idem.errors import ConfigError
from kafka_idem.store import Conn, Store, translate_errors

if TYPE_CHECKING:
    from kafka_idem.app import App

UNASSIGNED = ""  # the namespace of records written before namespaces


@dataclass(frozen=True)
class Pending:
    """Unassigned records of one (topic, handler) pair that an app would adopt."""

    topic: str
    handler: str
    records: int


def _pairs(app: App) -> list[tuple[str, str]]:
    return [(h.topic, h.name) for h in app.handlers.values()]


def unassigned(conn: Conn, store: Store, app: App) -> list[Pending]:
    """The unassigned records ``app`` would adopt, per (topic, handler)."""
    rows = store.scoped(app.namespace).unassigned(conn, _pairs(app))
    return [Pending(r["kafka_topic"], r["handler"], int(r["n"])) for r in rows]


def refuse_unassigned(conn: Conn, store: Store, app: App) -> None:
    """Raise :class:`ConfigError` if ``app`` has records to adopt first."""
    pending = unassigned(conn, store, app)
    if pending:
        total = sum(p.records for p in pending)
        where = ", ".join(f"{p.topic}/{p.handler}: {p.records}" for p in pending)
        raise ConfigError(
            f"the store holds {total} record(s) of this app's handlers written before keys "
            f"were scoped per app ({where}); running now would process those keys again. "
            f"Assign them to namespace {app.namespace!r} with `kafka-idem migrate --app "
            "MODULE:APP` (audited), then start again",
            setting="namespace",
        )


def adopt(conn: Conn, store: Store, app: App, *, actor: str) -> list[Pending]:
    """Move ``app``'s unassigned records into its namespace, with one audit row, in
    one transaction; return what moved, per (topic, handler)."""
    with translate_errors(), conn.transaction():
        store.admin_action(conn, "adopt")
        rows = store.scoped(app.namespace).adopt(conn, _pairs(app))
        counts: dict[tuple[str, str], int] = {}
        for r in rows:
            pair = (r["kafka_topic"], r["handler"])
            counts[pair] = counts.get(pair, 0) + 1
        moved = [Pending(t, h, n) for (t, h), n in sorted(counts.items())]
        if moved:
            audit.record(
                conn, store.scoped(app.namespace), actor=actor, action="adopt",
                selection={"app": app.name, "pairs": [[p.topic, p.handler] for p in moved]},
                reason="records written before namespaces, assigned to the app that wrote them",
                counts={"adopted": len(rows),
                        "by_pair": {f"{p.topic}/{p.handler}": p.records for p in moved}},
            )
    return moved
