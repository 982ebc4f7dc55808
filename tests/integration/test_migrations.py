"""schema.sql (a new store in one step) equals every migration applied in order."""

from __future__ import annotations

import subprocess
import uuid

from kafka_idem.admin.migrate import migrate, migrations
from tests.conftest import DB


def dump(db: DB, schema: str) -> str:
    out = subprocess.run(
        ["pg_dump", "--schema-only", "--no-owner", "--no-privileges", "-n", schema, db.dsn],
        capture_output=True, text=True, check=True,
    ).stdout
    lines = [ln for ln in out.replace(schema, "SCHEMA").splitlines()
             if ln.strip() and not ln.startswith("--") and not ln.startswith("SET ")
             and "pg_catalog.set_config" not in ln
             and not ln.startswith(("\\restrict", "\\unrestrict"))]
    return "\n".join(lines)


def test_schema_from_scratch_equals_schema_from_all_migrations(db: DB) -> None:
    scratch, stepwise = f"a_{uuid.uuid4().hex[:6]}", f"b_{uuid.uuid4().hex[:6]}"
    assert [m.version for m in migrate(db.dsn, scratch, "task_idempotency")] == [
        m.version for m in migrations()]
    applied = migrate(db.dsn, stepwise, "task_idempotency", from_scratch=False)
    assert [m.version for m in applied] == [m.version for m in migrations()]
    assert dump(db, scratch) == dump(db, stepwise)
    # The version tables agree too, and a second run of either is a no-op.
    assert migrate(db.dsn, scratch, "task_idempotency") == []
    assert migrate(db.dsn, stepwise, "task_idempotency") == []
    assert db.rows(f'SELECT version FROM "{scratch}".schema_migrations ORDER BY 1') == \
        db.rows(f'SELECT version FROM "{stepwise}".schema_migrations ORDER BY 1')


def test_migrations_are_numbered_without_gaps() -> None:
    versions = [m.version for m in migrations()]
    assert versions == list(range(1, len(versions) + 1))


def test_each_pending_migration_commits_in_a_transaction_of_its_own(db: DB) -> None:
    """A store two migrations behind takes them in two transactions (a failure in the
    second keeps the first): each version row has its own applied_at, now() of its
    transaction (a savepoint's rows would share their transaction's)."""
    import psycopg
    from psycopg import sql

    from kafka_idem.admin.migrate import render

    schema = f"s_{uuid.uuid4().hex[:8]}"
    versions = sql.Identifier(schema, "schema_migrations")
    last = migrations()[-1].version
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        conn.execute(sql.SQL("CREATE TABLE {} (version integer PRIMARY KEY, name text NOT "
                             "NULL, applied_at timestamptz NOT NULL DEFAULT now())").format(
            versions))
        for m in migrations():
            if m.version <= last - 2:
                conn.execute(render(m, schema, "task_idempotency"))
                conn.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(versions),
                             (m.version, m.name))
    assert [m.version for m in migrate(db.dsn, schema, "task_idempotency")] == [
        last - 1, last]
    rows = db.rows(sql.SQL("SELECT version, applied_at FROM {} WHERE version >= %s")
                   .format(versions).as_string(None), (last - 1,))
    assert len({r["applied_at"] for r in rows}) == 2, rows
