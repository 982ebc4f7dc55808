"""Versioned, add-only schema migrations (``kafka_idem/admin/migrations/NNNN_name.sql``).

``migrate()`` builds a new store from ``schema.sql`` (the full current schema)
in one step and records every version as applied; an existing store gets the
missing versions in order, each in its own transaction. An advisory lock keeps
two migrators apart; running it twice is a no-op. A test checks that
``schema.sql`` equals all migrations applied in order.

``migrate_app()`` runs an app's own migrations (``@app.migration``) under the same
advisory lock: concurrent ``kafka-idem migrate --app`` runs would otherwise race
on ``CREATE ... IF NOT EXISTS`` (not safe against a concurrent create).
Database errors leave as :mod:`kafka_idem.errors` classes (``StoreUnavailable``...).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import psycopg
from psycopg import sql

from kafka_idem.errors import ConfigError
from kafka_idem.store import translate_errors
from kafka_idem.store.queries import identifiers

log = logging.getLogger(__name__)

_FILE = re.compile(r"(\d{4})_(\w+)\.sql")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str


def migrations() -> list[Migration]:
    found = []
    for entry in resources.files("kafka_idem.admin.migrations").iterdir():
        match = _FILE.fullmatch(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text()))
    return sorted(found, key=lambda m: m.version)


def render(migration: Migration, schema: str, table: str) -> sql.Composed:
    return sql.SQL(migration.text).format(**identifiers(schema, table))


_DOLLAR = re.compile(r"\$\w*\$")


def statements(text: str) -> list[str]:
    """A migration's statements, one by one: a statement ends with a line that ends in
    ``;`` outside a dollar-quoted body (the migrations are written that way). Citus
    refuses a string of several commands that change a distributed table ("cannot
    insert multiple commands into a prepared statement", sent on to its workers)."""
    out: list[str] = []
    current: list[str] = []
    quote: str | None = None
    for line in text.splitlines():
        current.append(line)
        code = line.split("--", 1)[0] if quote is None else line
        for tag in _DOLLAR.findall(code):
            quote = tag if quote is None else (None if tag == quote else quote)
        if quote is None and code.rstrip().endswith(";"):
            out.append("\n".join(current))
            current = []
    rest = "\n".join(current).strip()
    if rest and any(line.split("--", 1)[0].strip() for line in rest.splitlines()):
        out.append(rest)
    return out


def applied_versions(conn: psycopg.Connection[Any], schema: str) -> list[int]:
    names = identifiers(schema, "x")
    exists = conn.execute(
        "SELECT to_regclass(format('%%I.schema_migrations', %s::text)) IS NOT NULL", (schema,)
    ).fetchone()
    if not exists or not exists[0]:
        return []
    rows = conn.execute(
        sql.SQL("SELECT version FROM {} ORDER BY version").format(names["migrations"])
    ).fetchall()
    return [int(r[0]) for r in rows]


def require_current(conn: psycopg.Connection[Any], schema: str, *,
                    command: str = "kafka-idem migrate") -> None:
    """Raise :class:`ConfigError` when the store lacks migrations this code needs
    (a deploy before its migrate): run ``command`` first (an app's member names its
    ``kafka-idem migrate --app MODULE:APP``, which also creates the app's tables)."""
    have = set(applied_versions(conn, schema))
    if not have:
        raise ConfigError(
            f"this database has no kafka_idem store in schema {schema!r}: run `{command}` "
            "to create it (or give the store's --database-url / --schema)",
            setting="schema_name",
        )
    missing = [m for m in migrations() if m.version not in have]
    if missing:
        names = ", ".join(f"{m.version:04d}_{m.name}" for m in missing)
        raise ConfigError(
            f"store schema {schema!r} lacks migrations {names}: run `{command}`",
            setting="schema_name",
        )


def full_schema() -> str:
    return resources.files("kafka_idem.admin").joinpath("schema.sql").read_text()


def _lock(conn: psycopg.Connection[Any], schema: str) -> None:
    """One migrator per store schema at a time (held to the end of the transaction)."""
    conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"kafka_idem:{schema}",))


_KINDS = {"r": "table", "p": "table", "v": "view", "m": "materialized view"}
# What an app's migration can create that a reader of its report cares about, each with
# the xmin of its catalog row (who created it: this run, or another one meanwhile).
_CATALOG = """
SELECT 'schema', nspname, '', xmin::text FROM pg_namespace
UNION ALL
SELECT c.relkind::text, n.nspname, c.relname, c.xmin::text FROM pg_class c
  JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind IN ('r','p','v','m')
UNION ALL
SELECT 'column', n.nspname, c.relname || '.' || a.attname, a.xmin::text FROM pg_attribute a
  JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace
  WHERE c.relkind IN ('r','p') AND a.attnum > 0 AND NOT a.attisdropped
"""
# On a Citus coordinator: the tables distributed (by their column) or made reference tables.
_PLACED = """
SELECT CASE p.partmethod WHEN 'h' THEN 'distributed' ELSE 'reference' END, n.nspname,
  c.relname || coalesce(' by ' || column_to_column_name(p.logicalrelid, p.partkey), ''),
  p.xmin::text FROM pg_dist_partition p JOIN pg_class c ON c.oid = p.logicalrelid
  JOIN pg_namespace n ON n.oid = c.relnamespace
"""
Catalog = dict[tuple[str, str, str], str]  # (kind, schema, name) -> its catalog row's xmin


@dataclass(frozen=True)
class AppStep:
    """What one of an app's migrations (``@app.migration``) did: its name, the objects
    it created (``kind name``) and the tables it distributed on Citus (``name by
    column``) or made reference tables (``name``)."""

    name: str
    created: tuple[str, ...]
    distributed: tuple[str, ...] = ()
    referenced: tuple[str, ...] = ()

    def describe(self) -> str:
        did = [f"created {', '.join(self.created)}"] if self.created else []
        did += [f"distributed {', '.join(self.distributed)}"] if self.distributed else []
        did += ([f"made {', '.join(self.referenced)} reference table(s)"]
                if self.referenced else [])
        return f"{self.name}: " + ("; ".join(did) or
                                   "nothing new (what it creates exists already)")


def _catalog(conn: psycopg.Connection[Any], *, citus: bool) -> Catalog:
    skip = ("pg_catalog", "information_schema")
    rows = conn.execute(_CATALOG + ("UNION ALL" + _PLACED if citus else "")).fetchall()
    return {(kind, ns, name): xmin for kind, ns, name, xmin in rows
            if ns not in skip and not ns.startswith(("pg_toast", "pg_temp"))}


def _ours(conn: psycopg.Connection[Any], xmins: set[str]) -> set[str]:
    """Which of ``xmins`` (of catalog rows new since the step began) are this
    transaction's own (or one of its savepoints'), not another session's that committed
    meanwhile (another app's migration, ``kafka-idem verify``'s schemas)."""
    row = conn.execute("SELECT pg_current_xact_id()::text").fetchone()
    assert row is not None
    top = int(row[0])
    wide = {}
    for xmin in xmins:  # the 32-bit xid with the current epoch, as recent as it must be
        full = top - top % 2**32 + int(xmin)
        full += 2**32 if full < top - 2**31 else -2**32 if full > top + 2**31 else 0
        if int(xmin) > 2 and full > 2:  # not frozen (1, 2: never one of ours)
            wide[xmin] = str(full)
    if not wide:
        return set()
    mine = conn.execute("SELECT x FROM unnest(%s::text[], %s::text[]) AS t(x, w) WHERE "
                        "pg_xact_status(w::xid8) = 'in progress'",
                        (list(wide), list(wide.values()))).fetchall()
    return {str(r[0]) for r in mine}


def _step(conn: psycopg.Connection[Any], name: str, before: Catalog, after: Catalog) -> AppStep:
    """What the step did: the objects new since ``before`` that its transaction made."""
    fresh = {k: v for k, v in after.items() if k not in before}
    ours = _ours(conn, set(fresh.values()))
    new = {k for k, v in fresh.items() if v in ours}
    tables = {(ns, name) for kind, ns, name in new if kind in ("r", "p")}
    created, distributed, referenced = [], [], []
    for kind, ns, what in sorted(new, key=lambda t: (t[0] != "schema", t[1], t[2])):
        if kind == "column" and (ns, what.split(".", 1)[0]) in tables:
            continue  # the columns of a new table are the table
        if kind == "distributed":
            distributed.append(f"{ns}.{what}")
        elif kind == "reference":
            referenced.append(f"{ns}.{what}")
        else:
            created.append(f"schema {ns}" if kind == "schema"
                           else f"{_KINDS.get(kind, kind)} {ns}.{what}")
    return AppStep(name, tuple(created), tuple(distributed), tuple(referenced))


def migrate_app(
    dsn: str, schema: str, steps: Sequence[Callable[[psycopg.Connection[Any]], None]]
) -> list[AppStep]:
    """Run an app's own migrations in one transaction, under the store's advisory lock;
    return what each one did (``kafka-idem migrate --app`` prints it)."""
    if not steps:
        return []
    done = []
    with (translate_errors(), psycopg.connect(dsn, autocommit=False) as conn,
          conn.transaction()):
        _lock(conn, schema)
        citus = conn.execute("SELECT to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL"
                             ).fetchone() == (True,)
        for step in steps:
            before = _catalog(conn, citus=citus)
            step(conn)
            done.append(_step(conn, getattr(step, "__name__", repr(step)), before,
                              _catalog(conn, citus=citus)))
    return done


def migrate(
    dsn: str, schema: str, table: str, *, from_scratch: bool = True
) -> list[Migration]:
    """Apply the missing migrations; return the ones applied.

    ``from_scratch=False`` applies a new store's migrations one by one instead
    of ``schema.sql`` (the test that compares both uses it).
    """
    with translate_errors():
        return _migrate(dsn, schema, table, from_scratch=from_scratch)


def _migrate(dsn: str, schema: str, table: str, *, from_scratch: bool) -> list[Migration]:
    names = identifiers(schema, table)
    done: list[Migration] = []
    with psycopg.connect(dsn, autocommit=False) as conn:
        with conn.transaction():
            _lock(conn, schema)
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(names["schema"]))
            conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (version integer PRIMARY KEY, "
                    "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
                ).format(names["migrations"])
            )
        with conn.transaction():
            _lock(conn, schema)
            if from_scratch and not applied_versions(conn, schema):
                conn.execute(sql.SQL(full_schema()).format(**names))
                for migration in migrations():
                    conn.execute(
                        sql.SQL("INSERT INTO {} (version, name) VALUES (%s, %s)").format(
                            names["migrations"]
                        ),
                        (migration.version, migration.name),
                    )
                    done.append(migration)
                log.info("store created", extra={"action": "migrated", "schema": schema})
                return done
        from kafka_idem.store.citus import citus_version

        with conn.transaction():  # its own: each migration below commits on its own
            citus = citus_version(conn) is not None
        for migration in migrations():
            with conn.transaction():
                _lock(conn, schema)
                if migration.version in applied_versions(conn, schema):
                    continue
                if citus:  # the store's triggers live on its shards (kafka_idem.store.citus)
                    conn.execute("SET LOCAL citus.enable_unsafe_triggers = on")
                    for text in statements(migration.text):
                        conn.execute(sql.SQL(text).format(**identifiers(schema, table)))
                else:
                    conn.execute(render(migration, schema, table))
                conn.execute(
                    sql.SQL("INSERT INTO {} (version, name) VALUES (%s, %s)").format(
                        names["migrations"]
                    ),
                    (migration.version, migration.name),
                )
                log.info(
                    "migration applied",
                    extra={"action": "migrated", "version": migration.version, "schema": schema},
                )
                done.append(migration)
    return done


def distribute_store(dsn: str, schema: str, table: str, *, citus: bool | None) -> list[str]:
    """After :func:`migrate`: distribute the store on a Citus coordinator
    (:func:`kafka_idem.store.citus.distribute`). ``citus=None`` does it when the database
    has the ``citus`` extension, ``True`` insists (a ConfigError without it), ``False``
    leaves the store's tables local. Returns what changed."""
    from kafka_idem.store import citus as dist

    if citus is False:
        return []
    with (translate_errors(), psycopg.connect(dsn, autocommit=False) as conn,
          conn.transaction()):
        if citus is None and dist.citus_version(conn) is None:
            return []
        _lock(conn, schema)
        return dist.distribute(conn, schema, table)
