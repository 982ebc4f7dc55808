"""The outbox's statements (a base of :class:`~kafka_idem.store.Store`): writing a
transaction's events (``ctx.emit``), and the relay's reads and deletes.

Like the protocol's methods they never commit: the events are written in the
handler's own transaction, so they exist if and only if its effect committed.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from kafka_idem.store.admin import AdminQueries
from kafka_idem.store.errors import translate_errors
from kafka_idem.store.types import AsyncConn, Conn, Event, OutboxRow

# The channel the relays LISTEN on; the payload is "<shard>:<namespace>".
CHANNEL = "kafka_idem_outbox"


class OutboxQueries(AdminQueries):
    def _outbox_params(self, events: Sequence[Event]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The two statements' parameters: the slots to lock (sorted, distinct) and
        the notifications; the rows."""
        slots = sorted({e.slot for e in events})
        notes = sorted({f"{e.shard}:{self.ns}" for e in events})
        lock = {"ns": self.ns, "slots": slots, "channel": CHANNEL, "notes": notes}
        rows = {
            "ns": self.ns,
            "shards": [e.shard for e in events],
            "topics": [e.topic for e in events],
            "keys": [e.key for e in events],
            "values": [e.value for e in events],
            "headers": [Jsonb([[k, base64.b64encode(v).decode()] for k, v in e.headers])
                        if e.headers else None for e in events],  # most have none: NULL
            "idem_keys": [e.idem_key for e in events],
            # an event lives on its message's shard (a distributed store; NULL: none)
            "shard_keys": [self.shard_of(e.idem_key, e.shard_key) for e in events],
            "source_topics": [e.source.topic if e.source else None for e in events],
            "source_partitions": [e.source.partition if e.source else None for e in events],
            "source_offsets": [e.source.offset if e.source else None for e in events],
        }
        return lock, rows

    def outbox_write(self, conn: Conn, events: Sequence[Event], *,
                     wake: set[str] | None = None) -> None:
        """Write ``events`` in the caller's transaction: lock their key slots in slot
        order, then insert them in emit order (pipeline-friendly: no result read).
        The relays of their shards are notified at the commit, or, with ``wake``, not:
        their notes are added to it, for :meth:`outbox_wake` later."""
        if not events:
            return
        lock, rows = self._outbox_params(events)
        if wake is not None:
            wake.update(lock["notes"])
            lock["notes"] = []
        with translate_errors():
            conn.execute(self.q["outbox_lock_slots"], lock)
            if self.distributed:
                conn.cursor().executemany(self.q["outbox_insert"], _each(rows))
            else:
                conn.execute(self.q["outbox_insert"], rows)

    def outbox_wake(self, conn: Conn, notes: Sequence[str]) -> None:
        """Notify the relays of ``notes`` (``"<shard>:<namespace>"``), at the caller's
        commit."""
        with translate_errors():
            conn.execute(self.q["outbox_wake"], {"channel": CHANNEL, "notes": sorted(notes)})

    async def outbox_write_async(self, conn: AsyncConn, events: Sequence[Event]) -> None:
        """:meth:`outbox_write` on an async connection (an ``async def`` handler's)."""
        if not events:
            return
        lock, rows = self._outbox_params(events)
        with translate_errors():
            await conn.execute(self.q["outbox_lock_slots"], lock)
            if self.distributed:
                await conn.cursor().executemany(self.q["outbox_insert"], _each(rows))
            else:
                await conn.execute(self.q["outbox_insert"], rows)

    def outbox_rows(self, conn: Conn, shard: int, limit: int) -> list[OutboxRow]:
        """The rows of ``shard`` visible now, in id order (at most ``limit``)."""
        with translate_errors():
            found = conn.execute(self.q["outbox_select"],
                                 {"ns": self.ns, "shard": shard, "limit": limit}).fetchall()
        return [OutboxRow(id=r[0], topic=r[1], key=r[2], value=r[3],
                          headers=[(k, base64.b64decode(v)) for k, v in r[4]] if r[4] else [],
                          idem_key=r[5], source_topic=r[6], source_partition=r[7],
                          source_offset=r[8], created_at=r[9]) for r in found]

    def outbox_delete(self, conn: Conn, ids: Sequence[int]) -> int:
        """Delete exactly ``ids`` (published): how many rows were still there."""
        if not ids:
            return 0
        with translate_errors():
            return conn.execute(self.q["outbox_delete"], {"ns": self.ns, "ids": list(ids)}
                                ).rowcount

    def outbox_identity(self, conn: Conn, schema: str) -> str:
        """This outbox's identity (database and table), as its markers name it."""
        with translate_errors():
            row = conn.execute(self.q["outbox_identity"],
                               {"table": f'"{schema}".outbox'}).fetchone()
        assert row is not None
        return str(row[0])

    def outbox_pending(self, conn: Conn, namespace: str | None) -> list[dict[str, Any]]:
        """``{namespace, pending, oldest_age_seconds}`` per namespace with unpublished
        rows (``namespace`` ``None``: all of them)."""
        with translate_errors():
            cur = conn.cursor(row_factory=dict_row)
            return cur.execute(self.q["outbox_pending"], {"ns": namespace}).fetchall()


def _each(rows: dict[str, Any]) -> list[dict[str, Any]]:
    """``outbox_insert``'s arrays as one parameter set per event (a distributed store's
    ``outbox_insert_distributed``), in emit order."""
    arrays = {k: v for k, v in rows.items() if k != "ns"}
    n = len(arrays["topics"])
    return [{"ns": rows["ns"], **{k: v[i] for k, v in arrays.items()}} for i in range(n)]
