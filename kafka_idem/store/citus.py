"""The store on a Citus cluster: its tables distributed so that one message's rows live on
one shard (docs/CITUS.md).

:func:`distribute` (``kafka-idem migrate --citus``, or ``migrate`` on a database with the
``citus`` extension) turns a migrated store into a distributed one:

* the records and the outbox are *distributed* by ``shard_key``, co-located: a message's
  record and its events share a shard, and so do the user's tables distributed by the
  same value with ``colocate_with`` the records table. The claim, the business writes,
  the events and the completion of one message are then one single-shard transaction,
  which Citus routes to one worker;
* the audit trail, the paused handlers and the outbox's slots are *reference* tables (a
  copy on every node; admin actions and rare writes);
* ``schema_migrations`` stays on the coordinator.

Missing shard keys are filled with the idempotency key (a handler's default), the column
becomes NOT NULL and part of the primary keys (Citus needs the distribution column in
every unique constraint). The guard's triggers are kept (``citus.enable_unsafe_triggers``:
they read and write only the row they fire for, on its own shard); they are off while the
records are filled and copied into the shards (the copy inserts every record, whatever its
status, which the guard refuses of a new row) and on again, on every shard, after.

:func:`layout` says how a store's tables are placed and :func:`check_layout` refuses a
store half distributed, naming the table and the fix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from kafka_idem.errors import ConfigError
from kafka_idem.store.protocol import Store
from kafka_idem.store.queries import identifiers

log = logging.getLogger(__name__)

# How each store table is placed on a distributed store.
DISTRIBUTED = ("table", "outbox")
REFERENCE = ("audit", "pauses", "outbox_slots")
FIX = "run `kafka-idem migrate --citus` to finish distributing the store"
# What distributing says of the records written without a shard key (docs/CITUS.md).
FILLED = ("placed {n} record(s) written without a shard key by their idempotency key: if "
          "their handler sets `shard_key=`, it looks for them on another shard and runs "
          "their messages again when redelivered (docs/CITUS.md, Move an existing store)")


def citus_version(conn: psycopg.Connection[Any]) -> str | None:
    """The ``citus`` extension's version in this database, ``None`` without it."""
    row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'citus'").fetchone()
    return str(row[0]) if row else None


@dataclass(frozen=True)
class Layout:
    """Where a store's tables are: ``placement`` maps each table's role (``table``,
    ``outbox``, ...) to ``local``, ``distributed`` or ``reference``; ``columns`` the
    distributed ones' distribution columns."""

    placement: dict[str, str]
    columns: dict[str, str]
    names: dict[str, str]

    @property
    def distributed(self) -> bool:
        return any(p != "local" for p in self.placement.values())

    @property
    def complete(self) -> bool:
        return (all(self.placement[r] == "distributed" and self.columns[r] == "shard_key"
                    for r in DISTRIBUTED)
                and all(self.placement[r] == "reference" for r in REFERENCE))


def _placement(conn: psycopg.Connection[Any], qualified: str) -> tuple[str, str]:
    row = conn.execute(
        "SELECT CASE partmethod WHEN 'h' THEN 'distributed' WHEN 'n' THEN 'reference' "
        "ELSE 'local' END, coalesce(column_to_column_name(logicalrelid, partkey), '') "
        "FROM pg_dist_partition WHERE logicalrelid = %s::regclass", (qualified,)).fetchone()
    return (str(row[0]), str(row[1])) if row else ("local", "")


def layout(conn: psycopg.Connection[Any], schema: str, table: str) -> Layout | None:
    """The store's placement on a Citus coordinator; ``None`` when the database has no
    ``citus`` extension (one PostgreSQL: every table local)."""
    if citus_version(conn) is None:
        return None
    names = identifiers(schema, table)
    placement, columns, shown = {}, {}, {}
    for role in DISTRIBUTED + REFERENCE:
        qualified = names[role].as_string(conn)
        shown[role] = qualified
        placement[role], columns[role] = _placement(conn, qualified)
    return Layout(placement, columns, shown)


def check_layout(found: Layout | None) -> bool:
    """``True`` for a distributed store, ``False`` for a local one; a store half
    distributed (some tables placed, others not, or by another column) is a
    :class:`ConfigError` naming the first such table and the fix."""
    if found is None or not found.distributed:
        return False
    for role in DISTRIBUTED:
        if found.placement[role] != "distributed":
            raise ConfigError(f"the store is half distributed: {found.names[role]} is "
                              f"{found.placement[role]}, not distributed by shard_key; {FIX}",
                              setting="schema_name")
        if found.columns[role] != "shard_key":
            raise ConfigError(f"the store is distributed by the wrong column: "
                              f"{found.names[role]} by {found.columns[role]!r}, not shard_key; "
                              "undistribute it (undistribute_table) and run `kafka-idem "
                              "migrate --citus`", setting="schema_name")
    for role in REFERENCE:
        if found.placement[role] != "reference":
            raise ConfigError(f"the store is half distributed: {found.names[role]} is "
                              f"{found.placement[role]}, not a reference table; {FIX}",
                              setting="schema_name")
    return True


def distribute(conn: psycopg.Connection[Any], schema: str, table: str) -> list[str]:
    """Distribute a migrated store on this Citus coordinator, in the caller's transaction;
    return what it changed (``["distributed kafka_idem.task_idempotency by shard_key",
    ...]``; nothing for a store distributed already)."""
    if citus_version(conn) is None:
        raise ConfigError("this database has no citus extension: distributing the store "
                          "needs a Citus coordinator (CREATE EXTENSION citus, with the "
                          "workers added)", setting="database_url")
    names = identifiers(schema, table)
    found = layout(conn, schema, table)
    assert found is not None
    done: list[str] = []
    conn.execute("SET LOCAL citus.enable_unsafe_triggers = on")
    conn.execute("SET LOCAL citus.multi_shard_modify_mode = 'sequential'")
    if found.placement["table"] == "local":
        # the guard off until the rows are in their shards: Citus copies them with INSERTs
        # its INSERT trigger refuses (a record not new); on again, on every shard, after
        conn.execute(sql.SQL("ALTER TABLE {} DISABLE TRIGGER USER").format(names["table"]))
        filled = _key_columns(conn, names["table"], names["pkey"], fill="idempotency_key",
                              key=("namespace", "idempotency_key", "shard_key"))
        _create(conn, "create_distributed_table(%s, 'shard_key')", found.names["table"])
        conn.execute(sql.SQL("ALTER TABLE {} ENABLE TRIGGER USER").format(names["table"]))
        done.append(f"distributed {found.names['table']} by shard_key")
        if filled:
            done.append(FILLED.format(n=filled))
    if found.placement["outbox"] == "local":
        pkey = sql.Identifier(conn.execute(
            "SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'p'",
            (found.names["outbox"],)).fetchone()[0])  # type: ignore[index]
        _key_columns(conn, names["outbox"], pkey, fill="idem_key", key=("shard_key", "id"))
        _create(conn, "create_distributed_table(%s, 'shard_key', colocate_with => %s)",
                found.names["outbox"], found.names["table"])
        done.append(f"distributed {found.names['outbox']} by shard_key, with the records")
    for role in REFERENCE:
        if found.placement[role] == "local":
            _create(conn, "create_reference_table(%s)", found.names[role])
            done.append(f"made {found.names[role]} a reference table")
    for line in done:
        log.debug("store %s", line, extra={"action": "distributed", "schema": schema})
    return done


def _key_columns(conn: psycopg.Connection[Any], table: sql.Composable, pkey: sql.Composable,
                 *, fill: str, key: tuple[str, ...]) -> int:
    """``shard_key`` filled where missing (with ``fill``'s value), NOT NULL, and in the
    primary key ``key``; the number of rows filled. (The guard would refuse the fill of
    a succeeded record: the caller turned its triggers off.)"""
    filled = conn.execute(sql.SQL("UPDATE {t} SET shard_key = {f} WHERE shard_key IS NULL")
                          .format(t=table, f=sql.Identifier(fill))).rowcount
    conn.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN shard_key SET NOT NULL").format(table))
    conn.execute(sql.SQL("ALTER TABLE {t} DROP CONSTRAINT {k}, ADD CONSTRAINT {k} "
                         "PRIMARY KEY ({cols})").format(
        t=table, k=pkey, cols=sql.SQL(", ").join(map(sql.Identifier, key))))
    return max(filled, 0)


def _create(conn: psycopg.Connection[Any], call: str, *args: str) -> None:
    conn.execute(sql.SQL("SELECT " + call), args)


def fit(conn: psycopg.Connection[Any], store: Store) -> bool:
    """Give ``store`` the queries of its placement (:meth:`Store.distribute` on a store
    distributed on Citus); a store half distributed is refused (:func:`check_layout`).
    ``True`` when it is distributed."""
    if check_layout(layout(conn, store.schema, store.table)):
        store.distribute()
        return True
    return False


def refuse_uncolocated(conn: psycopg.Connection[Any], store: Store, tables: list[str]) -> None:
    """Each of ``tables`` (an app's, e.g. its SQLAlchemy metadata's) that exists must be a
    reference table or distributed with the store's records (one colocation group):
    else a :class:`ConfigError` naming the first other one and the fix. A message's
    writes there would commit apart from its record (a table local to the coordinator)
    or on another shard (a two-phase commit for every message)."""
    records = identifiers(store.schema, store.table)["table"].as_string(conn)
    group = conn.execute("SELECT colocationid FROM pg_dist_partition WHERE logicalrelid = "
                         "%s::regclass", (records,)).fetchone()
    for table in tables:
        row = conn.execute(
            "SELECT p.partmethod::text, p.colocationid FROM (SELECT to_regclass(%s) AS r) t "
            "LEFT JOIN pg_dist_partition p ON p.logicalrelid = t.r WHERE t.r IS NOT NULL",
            (table,)).fetchone()
        if row is None or row[0] == "n":
            continue  # not created yet (migrate makes it), or a reference table
        if row[0] is None:
            how = "is local to the coordinator"
        elif group is None or row[1] != group[0]:
            how = "is distributed apart from the store's records"
        else:
            continue
        raise ConfigError(
            f"table {table} {how}: a message's writes there would not share its record's "
            f"shard; distribute it by the shard key with create_distributed_table('{table}', "
            f"'<column>', colocate_with => '{records}'), or make it a reference table "
            "(docs/CITUS.md)", setting="shard_key")


def co_locate(conn: psycopg.Connection[Any], table: str, column: str, *, schema: str,
              records: str) -> bool:
    """In an app's migration: distribute ``table`` by ``column`` (its shard key's
    values) with the store's records (``schema.records``), when the store is
    distributed on Citus and ``table`` is not distributed yet; nothing on one
    PostgreSQL. ``True`` when it distributed the table. A table that cannot be (no such
    table or column, a column of another type than ``shard_key``, a unique constraint
    without the column) or that is placed otherwise already (by another column, apart
    from the records, a reference table) is a :class:`ConfigError` naming the fix."""
    found = layout(conn, schema, records)
    if found is None or found.placement["table"] != "distributed":
        return False
    row = conn.execute("SELECT to_regclass(%s)::oid", (table,)).fetchone()
    if row is None or row[0] is None:
        raise _misfit(table, "does not exist: create it before app.co_locate distributes it")
    relid, ours = int(row[0]), found.names["table"]
    placed = conn.execute(
        "SELECT p.partmethod::text, coalesce(column_to_column_name(p.logicalrelid, "
        "p.partkey), ''), p.colocationid = r.colocationid FROM pg_dist_partition p, "
        "pg_dist_partition r WHERE p.logicalrelid = %s AND r.logicalrelid = %s::regclass",
        (relid, ours)).fetchone()
    if placed is not None:
        _check_placed(table, column, ours, str(placed[0]), str(placed[1]), bool(placed[2]))
        return False
    _check_column(conn, relid, table, column, ours)
    _check_unique(conn, relid, table, column)
    conn.execute("SELECT create_distributed_table(%s, %s, colocate_with => %s)",
                 (table, column, ours))
    return True


def _misfit(table: str, what: str) -> ConfigError:
    return ConfigError(f"app.co_locate: table {table} {what} (docs/CITUS.md)",
                       setting="shard_key")


def _check_placed(table: str, column: str, records: str, method: str, by: str,
                  together: bool) -> None:
    """A table distributed already is fine by ``column`` with the records, else refused."""
    again = (f"undistribute it (SELECT undistribute_table('{table}')) and run `kafka-idem "
             "migrate --app MODULE:APP` again, so that app.co_locate distributes it by "
             f"{column} with the records")
    if method != "h":
        raise _misfit(table, f"has no distribution column (a reference or single-shard "
                             f"table), not distributed by {column}: {again}")
    if by != column:
        raise _misfit(table, f"is distributed by {by}, not {column}: a message's rows there "
                             f"would not share its record's shard; {again}")
    if not together:
        raise _misfit(table, f"is distributed by {column} apart from the store's records: "
                             f"co-locate it with SELECT update_distributed_table_colocation("
                             f"'{table}', colocate_with => '{records}')")


def _check_column(conn: psycopg.Connection[Any], relid: int, table: str, column: str,
                  records: str) -> None:
    """``column`` exists and has the records' ``shard_key``'s type and collation (Citus
    co-locates only those)."""
    row = conn.execute(
        "SELECT format_type(a.atttypid, a.atttypmod), format_type(r.atttypid, r.atttypmod), "
        "a.atttypid = r.atttypid, a.attcollation = r.attcollation FROM pg_attribute a, "
        "pg_attribute r WHERE a.attrelid = %s AND a.attname = %s AND NOT a.attisdropped "
        "AND r.attrelid = %s::regclass AND r.attname = 'shard_key'",
        (relid, column, records)).fetchone()
    if row is None:
        raise _misfit(table, f"has no column {column}: name the column that holds the "
                             "handler's shard_key values")
    mine, theirs, same_type, same_collation = row
    if not same_type:
        raise _misfit(table, f"column {column} is {mine}, not {theirs} like the records' "
                             f"shard_key: Citus co-locates only columns of one type; make it "
                             f"{theirs} (ALTER TABLE {table} ALTER COLUMN {column} TYPE "
                             f"{theirs}) or name a {theirs} column")
    if not same_collation:
        raise _misfit(table, f"column {column} has another collation than the records' "
                             f"shard_key: give it the database's default collation")


def _check_unique(conn: psycopg.Connection[Any], relid: int, table: str, column: str) -> None:
    """Every primary key, unique or exclusion constraint (or unique index) of the table
    holds ``column``, as Citus needs of a distributed table."""
    row = conn.execute(
        "SELECT coalesce(c.contype::text, ''), coalesce(c.conname, i.relname), "
        "coalesce(pg_get_constraintdef(c.oid), pg_get_indexdef(x.indexrelid)) "
        "FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
        "LEFT JOIN pg_constraint c ON c.conindid = x.indexrelid AND c.conrelid = x.indrelid "
        "WHERE x.indrelid = %s AND (x.indisunique OR x.indisexclusion) AND NOT ("
        "SELECT attnum FROM pg_attribute WHERE attrelid = %s AND attname = %s) "
        "= ANY (x.indkey::int2[]) ORDER BY x.indisprimary DESC, 2 LIMIT 1",
        (relid, relid, column)).fetchone()
    if row is None:
        return
    kind, name, definition = str(row[0]), str(row[1]), str(row[2])
    what = {"p": "primary key", "u": "unique constraint",
            "x": "exclusion constraint"}.get(kind, "unique index")
    example = (f", e.g. {definition.replace('(', f'({column}, ', 1)}"
               if kind in ("p", "u") else "")
    raise _misfit(table, f"has a {what} without {column}, {name} ({definition}): Citus "
                         f"needs the distribution column in every unique key; add {column} "
                         f"to it{example}")


def workers_of(conn: psycopg.Connection[Any], store: Store, shards: list[str]) -> dict[str, int]:
    """``{shard key: the Citus node group (a worker) holding its shard of the records}``,
    in one statement run on the coordinator alone (its metadata): how local mode groups
    a unit's messages per worker (:mod:`~kafka_idem.consume.paths.worker_groups`). A
    placement only: an answer gone stale (a shard moved since) makes a group span two
    workers, which Citus then commits with two-phase commit; no guarantee rests on it."""
    records = sql.Identifier(store.schema, store.table).as_string(None)
    rows = conn.execute(
        "SELECT s.shard, min(p.groupid) FROM unnest(%s::text[]) AS s(shard) "
        "JOIN pg_dist_placement p ON p.shardid = "
        "get_shard_id_for_distribution_column(%s::regclass, s.shard) GROUP BY s.shard",
        (shards, records)).fetchall()
    return {str(shard): int(group) for shard, group in rows}
