"""The append-only audit trail of admin actions (rerun, purge, replay).

Every admin action writes one row in the same transaction as its effect, so an
effect without its audit row cannot exist. The table refuses UPDATE and DELETE.
"""

from __future__ import annotations

import getpass
import os
from typing import Any

from kafka_idem.store import Conn, Store


def default_actor() -> str:
    """Who is acting: ``KAFKA_IDEM_ACTOR``, else the OS user."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return os.environ.get("KAFKA_IDEM_ACTOR") or user


def record(
    conn: Conn,
    store: Store,
    *,
    actor: str,
    action: str,
    key: str | None = None,
    selection: dict[str, Any] | None = None,
    reason: str | None = None,
    previous_status: str | None = None,
    previous_error: str | None = None,
    counts: dict[str, Any] | None = None,
) -> int:
    """Append one audit row inside the caller's transaction; return its id. The row's
    namespace is the store's (``None`` for an action over every namespace)."""
    return store.audit_insert(
        conn, actor=actor, action=action, key=key, selection=selection, reason=reason,
        previous_status=previous_status, previous_error=previous_error, counts=counts)


def trail(conn: Conn, store: Store, key: str) -> list[dict[str, Any]]:
    return store.audit_for_key(conn, key)
