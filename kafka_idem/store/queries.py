"""The store's SQL, parsed once from ``queries.sql`` into named blocks.

Configurable identifiers are filled with :class:`psycopg.sql.Identifier`, never
with string formatting, so a schema or table name can't change a statement.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from psycopg import sql

_BLOCK = re.compile(r"^-- name: (\w+)\n(.*?)(?=^-- name: |\Z)", re.M | re.S)


@cache
def raw_queries() -> dict[str, str]:
    text = resources.files(__package__).joinpath("queries.sql").read_text()
    queries = {}
    for name, body in _BLOCK.findall(text):
        lines = [ln for ln in body.strip().splitlines() if not ln.lstrip().startswith("--")]
        queries[name] = "\n".join(lines).rstrip().rstrip(";")
    return queries


def identifiers(schema: str, table: str) -> dict[str, sql.Composable]:
    """Every identifier a query or migration may name, quoted."""
    return {
        "schema": sql.Identifier(schema),
        "table": sql.Identifier(schema, table),
        "audit": sql.Identifier(schema, "admin_audit"),
        "guard": sql.Identifier(schema, f"{table}_guard"),
        "fence": sql.Identifier(schema, f"{table}_fence"),
        "audit_guard": sql.Identifier(schema, "admin_audit_guard"),
        "status_idx": sql.Identifier(f"{table}_status_idx"),
        "retry_idx": sql.Identifier(f"{table}_retry_idx"),
        "pkey": sql.Identifier(f"{table}_pkey"),
        "audit_key_idx": sql.Identifier("admin_audit_key_idx"),
        "migrations": sql.Identifier(schema, "schema_migrations"),
        "outbox": sql.Identifier(schema, "outbox"),
        "outbox_slots": sql.Identifier(schema, "outbox_slots"),
        "outbox_shard_idx": sql.Identifier("outbox_shard_idx"),
        "pauses": sql.Identifier(schema, "handler_pauses"),
    }


def compile_queries(schema: str, table: str, *, distributed: bool = False) -> dict[str, sql.SQL]:
    """Every query with its identifiers quoted, rendered once: psycopg renders a
    composed statement again at each execution (about 5 µs each, several per message
    on the leased path), a plain one it only encodes. ``distributed``: the flavour of a
    store distributed on Citus (``queries.sql`` says what differs)."""
    names = {**identifiers(schema, table), **_flavour(distributed)}
    raw = raw_queries()
    out = {}
    for name, text in raw.items():
        if distributed:
            text = raw.get(f"{name}_distributed", text).replace(
                "coalesce(first_failure_at, clock_timestamp())",
                "least(first_failure_at, clock_timestamp())").replace(
                "clock_timestamp()", "statement_timestamp()")
        out[name] = sql.SQL(sql.SQL(text).format(**names).as_string(None))
    return out


def _flavour(distributed: bool) -> dict[str, sql.Composable]:
    if distributed:
        return {"shard": sql.SQL("AND shard_key = %(shard)s"),
                "shard_join": sql.SQL("AND n.shard_key = u.shard_key"),
                "conflict": sql.SQL("(namespace, idempotency_key, shard_key)")}
    return {"shard": sql.SQL(""), "shard_join": sql.SQL(""),
            "conflict": sql.SQL("(namespace, idempotency_key)")}
