"""Pausing and resuming a handler: an operator's audited admin action, durable in the
store (table ``handler_pauses``, migration 0008) until the resume.

A handler is identified by its app's namespace and its name (``@app.handler(name=...)``,
else the function's), as its records are: every member of the app honours the pause,
whatever its consumer group, across restarts and rebalances. The pausing transaction
notifies the members on :data:`CHANNEL` (payload: the namespace) and appends its audit
row (action ``pause`` or ``resume``, the handler in its selection), so a pause without
its audit row cannot exist. The members apply it (:mod:`kafka_idem.consume.pause_watch`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kafka_idem.admin import audit
from kafka_idem.admin.operations import Refused
from kafka_idem.app import App
from kafka_idem.errors import ConfigError
from kafka_idem.store import Conn, Store

# The channel the members LISTEN on; the payload is the namespace whose pauses changed.
CHANNEL = "kafka_idem_pause"


@dataclass(frozen=True)
class Pause:
    """One paused handler: who paused it, why and since when."""

    namespace: str
    handler: str
    reason: str
    actor: str
    since: dt.datetime

    @classmethod
    def of(cls, row: dict[str, Any]) -> Pause:
        return cls(row["namespace"], row["handler"], row["reason"], row["actor"],
                   row["paused_at"])

    def to_json(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "handler": self.handler, "reason": self.reason,
                "actor": self.actor, "since": self.since.isoformat()}


@dataclass(frozen=True)
class Change:
    """What a pause or a resume did: ``changed`` False when the handler was in that
    state already (nothing written, nothing audited)."""

    pause: Pause | None  # the pause that now stands (pause) or that ended (resume)
    changed: bool


def handler_names(app: App) -> list[str]:
    return sorted({h.name for h in app.handlers.values()})


def check_handler(app: App, name: str) -> None:
    """Refuse a name that is none of the app's handlers, naming the ones there are."""
    names = handler_names(app)
    if name not in names:
        raise ConfigError(f"app {app.name!r} has no handler {name!r} (its handlers: "
                          f"{', '.join(names) or 'none'})", setting="handler")


def topics_of(app: App, names: Iterable[str]) -> set[str]:
    """The topics the named handlers consume."""
    wanted = set(names)
    return {topic for topic, h in app.handlers.items() if h.name in wanted}


def pause(conn: Conn, store: Store, *, handler: str, actor: str, reason: str) -> Change:
    """Pause ``handler`` in ``store``'s namespace, in the caller's transaction; a handler
    paused already keeps its pause (who, why, since) and nothing is audited."""
    if not reason.strip():
        raise Refused("a reason is required to pause a handler")
    row = store.pause_insert(conn, handler=handler, reason=reason, actor=actor,
                             channel=CHANNEL)
    if row is None:
        return Change(current(conn, store).get(handler), changed=False)
    audit.record(conn, store, actor=actor, action="pause", reason=reason,
                 selection={"handler": handler})
    return Change(Pause.of(row), changed=True)


def resume(conn: Conn, store: Store, *, handler: str, actor: str,
           reason: str | None = None) -> Change:
    """Resume ``handler`` in ``store``'s namespace, in the caller's transaction; one not
    paused stays as it is and nothing is audited."""
    row = store.pause_delete(conn, handler=handler, channel=CHANNEL)
    if row is None:
        return Change(None, changed=False)
    audit.record(conn, store, actor=actor, action="resume", reason=reason,
                 selection={"handler": handler, "paused_by": row["actor"],
                            "paused_at": row["paused_at"].isoformat()})
    return Change(Pause.of(row), changed=True)


def current(conn: Conn, store: Store) -> dict[str, Pause]:
    """The paused handlers of ``store``'s namespace, by name."""
    return {p.handler: p for p in listed(conn, store, store.ns)}


def listed(conn: Conn, store: Store, namespace: str | None) -> list[Pause]:
    """The paused handlers of ``namespace`` (every namespace's with ``None``)."""
    return [Pause.of(r) for r in store.pauses_of(conn, namespace)]
