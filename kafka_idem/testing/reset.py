"""A clean database again, in place: the state the migrations (and ``setup``) left.

Captured once after the migrations: every table outside the system schemas (the
app's, whatever ``setup`` made) with the rows it had then, and every sequence's
position. Restored before each scenario, in one transaction and a few milliseconds:
the connections still open to the database are ended (a thread a scenario left
behind cannot hold a lock), each table is emptied (``DELETE``, children first; the
tables with triggers of their own have them switched off meanwhile, so emptying and
refilling writes nothing else), its rows written back (``COPY``, parents first),
every sequence set back, and the store emptied by the store itself
(:meth:`~kafka_idem.store.Store.wipe`). A foreign-key cycle makes it ``TRUNCATE``
the tables instead, which costs more but needs no order.

What a handler could change besides rows and sequences (a table it creates, a large
object) is not undone: no handler should.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from graphlib import CycleError, TopologicalSorter
from typing import Any

from psycopg import sql

from kafka_idem.store import Conn, Store
from kafka_idem.testing.tables import split_name


def _ident(name: str) -> sql.Identifier:
    return sql.Identifier(*split_name(name))


@dataclass
class CleanState:
    """Everything :meth:`restore` needs."""

    tables: list[str]  # parents first (or any order, with ``truncate``)
    truncate: bool  # a foreign-key cycle: no order to delete in
    triggered: list[str]  # tables with triggers of their own
    rows: dict[str, tuple[list[str], list[tuple[Any, ...]]]] = field(default_factory=dict)
    sequences: list[tuple[str, int, bool]] = field(default_factory=list)

    @classmethod
    def capture(cls, conn: Conn, tables: set[str], *, store: set[str]) -> CleanState:
        """The state of ``tables`` and of every sequence but those of the ``store``'s
        tables now (the store is emptied by its own :meth:`~kafka_idem.store.Store.wipe`)."""
        graph: dict[str, set[str]] = {t: set() for t in tables}
        for child, parent in conn.execute(
            f"SELECT {_NAME.format(c='c.conrelid')}, {_NAME.format(c='c.confrelid')}"
            " FROM pg_constraint c WHERE c.contype = 'f'"
        ).fetchall():
            if child in graph and parent in graph and child != parent:
                graph[child].add(parent)
        try:
            order = list(TopologicalSorter(graph).static_order())  # parents first
            truncate = False
        except CycleError:
            order, truncate = sorted(tables), True
        triggered = sorted({r[0] for r in conn.execute(
            f"SELECT {_NAME.format(c='tgrelid')} FROM pg_trigger WHERE NOT tgisinternal"
        ).fetchall()} & tables)
        state = cls(order, truncate, triggered)
        for name in order:
            cols = [r[0] for r in conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass"
                " AND attnum > 0 AND NOT attisdropped AND attgenerated = '' ORDER BY attnum",
                (_ident(name).as_string(conn),)).fetchall()]
            rows = conn.execute(sql.SQL("SELECT {} FROM {}").format(
                sql.SQL(", ").join(map(sql.Identifier, cols)), _ident(name))).fetchall()
            if rows:
                state.rows[name] = (cols, [tuple(r) for r in rows])
        state.sequences = [
            (name, start if last is None else last, last is not None)
            for name, start, last, owner in conn.execute(
                "SELECT s.schemaname || '.' || s.sequencename, s.start_value, s.last_value,"
                f" (SELECT {_NAME.format(c='d.refobjid')} FROM pg_depend d"
                "   WHERE d.classid = 'pg_class'::regclass AND d.deptype IN ('a', 'i')"
                "     AND d.objid = format('%I.%I', s.schemaname, s.sequencename)::regclass"
                "   LIMIT 1)"
                " FROM pg_sequences s"
                " WHERE s.schemaname NOT IN ('pg_catalog', 'information_schema')").fetchall()
            if owner not in store]
        return state

    def move_apart(self, conn: Conn, *, room: int = 1_000_000) -> None:
        """Move every sequence on from its clean position to a range of its own: the
        ``k``-th (by name) of those that count up to ``top + (k + 1) * step``, ``top``
        the highest clean position, ``step`` ``room`` or less where a sequence's
        maximum leaves less (a ``serial`` of ``smallint``), those that count down
        alike below the lowest. A delivery then draws other numbers than the
        reference's, and numbers no other sequence gives (for fewer than ``step`` rows
        each), so an event field's number names the one column it comes from. A
        sequence with no room left stays where it is."""
        rows = conn.execute(
            "SELECT schemaname || '.' || sequencename, increment_by, min_value, max_value"
            " FROM pg_sequences WHERE schemaname || '.' || sequencename = ANY(%s)",
            ([n for n, _, _ in self.sequences],)).fetchall()
        info = {r[0]: (int(r[1]), int(r[2]), int(r[3])) for r in rows}
        clean = {n: v for n, v, _ in self.sequences if n in info}
        moved: dict[str, int] = {}
        for sign in (1, -1):
            names = sorted(n for n in clean if (info[n][0] > 0) == (sign > 0))
            if not names:
                continue
            edge = max(sign * clean[n] for n in names)  # top (or minus the bottom)
            limit = min(sign * info[n][2 if sign > 0 else 1] for n in names)
            step = min(room, (limit - edge) // (len(names) + 1))
            if step > 0:
                moved.update({n: sign * (edge + (k + 1) * step) for k, n in enumerate(names)})
        if moved:
            conn.execute(
                "SELECT setval(s.name::regclass, s.value, true)"
                " FROM unnest(%s::text[], %s::bigint[]) AS s(name, value)",
                ([_ident(n).as_string(conn) for n in moved], list(moved.values())))

    def restore(self, conn: Conn, store: Store) -> None:
        """Put the database ``conn`` is connected to back in the captured state (every
        other connection to it is ended first)."""
        conn.autocommit = True
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()")
        with conn.transaction():
            self._restore(conn, store)

    def _restore(self, conn: Conn, store: Store) -> None:
        for name in self.triggered:
            conn.execute(sql.SQL("ALTER TABLE {} DISABLE TRIGGER USER").format(_ident(name)))
        if self.truncate and self.tables:
            conn.execute(sql.SQL("TRUNCATE {}").format(
                sql.SQL(", ").join(_ident(t) for t in self.tables)))
        else:
            for name in reversed(self.tables):  # children first
                conn.execute(sql.SQL("DELETE FROM {}").format(_ident(name)))
        with conn.cursor() as cur:
            for name in self.tables:  # parents first
                if name not in self.rows:
                    continue
                cols, rows = self.rows[name]
                with cur.copy(sql.SQL("COPY {} ({}) FROM STDIN").format(
                        _ident(name), sql.SQL(", ").join(map(sql.Identifier, cols)))) as copy:
                    for row in rows:
                        copy.write_row(row)
        for name in self.triggered:
            conn.execute(sql.SQL("ALTER TABLE {} ENABLE TRIGGER USER").format(_ident(name)))
        if self.sequences:
            conn.execute(
                "SELECT setval(s.name::regclass, s.value, s.called)"
                " FROM unnest(%s::text[], %s::bigint[], %s::bool[]) AS s(name, value, called)",
                ([_ident(n).as_string(conn) for n, _, _ in self.sequences],
                 [v for _, v, _ in self.sequences], [c for _, _, c in self.sequences]))
        store.wipe(conn)


# schema.table of a relation's oid (the expression for column {c})
_NAME = ("(SELECT n.nspname || '.' || r.relname FROM pg_class r"
         " JOIN pg_namespace n ON n.oid = r.relnamespace WHERE r.oid = {c})")
