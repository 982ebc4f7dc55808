"""What PostgreSQL holds durably, read in one repeatable-read, read-only snapshot.

:func:`read_database` returns the idempotency records by key, the payments
example's ledger rows by key and balances by (tenant, currency), and the state
of the transition guard's triggers (:data:`GUARD_TRIGGERS`) from the catalogue;
:func:`read_outbox`, what the outbox still holds unpublished.
"""

from __future__ import annotations

from collections import defaultdict
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import sql

# The transition guard's triggers (migration 0003: one per event, each with its WHEN).
GUARD_TRIGGERS = ("guard_transitions", "guard_transitions_insert", "guard_transitions_delete")
OUTBOX_TABLE = "outbox"  # migration 0006: rows deleted once published


def read_database(
    dsn: str, schema: str, table: str, ledger: tuple[str, str], balances: tuple[str, str]
) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict[str, Any]]],
           dict[tuple[str, str], Decimal], dict[str, str]]:
    from psycopg.rows import dict_row

    with psycopg.connect(dsn, application_name="chaos-checker") as conn:
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        cur = conn.cursor(row_factory=dict_row)
        records = {r["idempotency_key"]: r for r in cur.execute(sql.SQL(
            "SELECT idempotency_key, request_hash, status, owner_token, completed_token, "
            "lease_until, attempts, attempt_base, error_kind, completed_at, kafka_partition, "
            "kafka_offset FROM {}").format(sql.Identifier(schema, table))).fetchall()}
        rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in cur.execute(sql.SQL(
                "SELECT id, idempotency_key, tenant_id, order_id, amount, currency FROM {} "
                "ORDER BY id").format(sql.Identifier(*ledger))).fetchall():
            rows[r["idempotency_key"]].append(r)
        bal = {(r["tenant_id"], r["currency"]): Decimal(r["balance"]) for r in cur.execute(
            sql.SQL("SELECT tenant_id, currency, balance FROM {}").format(
                sql.Identifier(*balances))).fetchall()}
        trig = conn.execute(
            "SELECT t.tgname, t.tgenabled FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = %s AND t.tgname = ANY(%s)",
            (schema, table, list(GUARD_TRIGGERS))).fetchall()
    enabled = {str(name): str(state) for name, state in trig}
    return records, rows, bal, enabled


def read_outbox(dsn: str, schema: str, namespace: str) -> tuple[int, float | None] | None:
    """The namespace's unpublished outbox rows and the age in seconds of the oldest
    (None: the store has no outbox table)."""
    with psycopg.connect(dsn, application_name="chaos-checker") as conn:
        table = sql.Identifier(schema, OUTBOX_TABLE)
        found = conn.execute("SELECT to_regclass(%s)", (f"{schema}.{OUTBOX_TABLE}",)).fetchone()
        if found is None or found[0] is None:
            return None
        row = conn.execute(sql.SQL(
            "SELECT count(*), extract(epoch FROM clock_timestamp() - min(created_at)) FROM {} "
            "WHERE namespace = %s").format(table), (namespace,)).fetchone()
    assert row is not None
    return int(row[0]), None if row[1] is None else float(row[1])
