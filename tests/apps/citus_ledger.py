"""A tenant ledger on a store distributed on Citus: each deposit adds an entry and moves
its tenant's balance, in tables distributed by tenant and co-located with the store's
records (``shard_key="{tenant}"``), so a message is one single-shard transaction.

Configured by the environment (the test gives each run a schema of its own):
``CITUS_LEDGER_SCHEMA`` (the app's tables; the store's schema is the app's
``KAFKA_IDEM_SCHEMA_NAME``), ``CITUS_LEDGER_TOPIC``, ``CITUS_LEDGER_EVENTS`` (when set,
each deposit also emits a ``Deposited`` event there, keyed by tenant),
``CITUS_LEDGER_LOCAL_BALANCE`` (when set, the balance table is left local to the
coordinator: the mistake a member must refuse)."""

from __future__ import annotations

import json
import os
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import sql
from pydantic import BaseModel

from kafka_idem import App, Context

SCHEMA = os.environ.get("CITUS_LEDGER_SCHEMA", "citus_ledger")
TOPIC = os.environ.get("CITUS_LEDGER_TOPIC", "citus-deposits")
EVENTS = os.environ.get("CITUS_LEDGER_EVENTS")

app = App("citus-ledger")


class Deposit(BaseModel):
    tenant: str
    order: str
    amount: Decimal


class Deposited(BaseModel):
    tenant: str
    order: str
    balance: Decimal


if EVENTS:
    app.event_topic(EVENTS, format="json", model=Deposited)


def encode(tenant: str, order: str, amount: str) -> bytes:
    return json.dumps({"tenant": tenant, "order": order, "amount": amount}).encode()


@app.migration
def ledger_tables(conn: psycopg.Connection[Any]) -> None:
    """The ledger's tables, distributed by tenant with the store's records."""
    names = {"s": sql.Identifier(SCHEMA), "entry": sql.Identifier(SCHEMA, "entry"),
             "balance": sql.Identifier(SCHEMA, "balance")}
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {s}").format(**names))
    conn.execute(sql.SQL(
        "CREATE TABLE IF NOT EXISTS {entry} (tenant text NOT NULL, order_id text NOT NULL, "
        "amount numeric NOT NULL, PRIMARY KEY (tenant, order_id))").format(**names))
    conn.execute(sql.SQL(
        "CREATE TABLE IF NOT EXISTS {balance} (tenant text PRIMARY KEY, "
        "balance numeric NOT NULL, updates integer NOT NULL)").format(**names))
    local = {"balance"} if os.environ.get("CITUS_LEDGER_LOCAL_BALANCE") else set()
    for table in sorted({"entry", "balance"} - local):
        app.co_locate(conn, f"{SCHEMA}.{table}", "tenant")  # nothing while the store is local


MODE = os.environ.get("CITUS_LEDGER_MODE", "local")  # local, leased (concurrency 4), async


def apply(tx: Any, msg: Deposit) -> Decimal:
    """The deposit's entry and its tenant's new balance, returned."""
    tx.execute(sql.SQL("INSERT INTO {} (tenant, order_id, amount) VALUES (%s, %s, %s)").format(
        sql.Identifier(SCHEMA, "entry")), (msg.tenant, msg.order, msg.amount))
    row = tx.execute(sql.SQL(
        "INSERT INTO {t} AS b (tenant, balance, updates) VALUES (%s, %s, 1) "
        "ON CONFLICT (tenant) DO UPDATE SET balance = b.balance + EXCLUDED.balance, "
        "updates = b.updates + 1 RETURNING balance").format(t=sql.Identifier(SCHEMA, "balance")),
        (msg.tenant, msg.amount)).fetchone()
    return Decimal(row[0])


def emit(ctx: Any, msg: Deposit, balance: Decimal) -> None:
    if EVENTS:
        ctx.emit(EVENTS, Deposited(tenant=msg.tenant, order=msg.order, balance=balance),
                 key=msg.tenant)


OPTIONS: dict[str, Any] = {
    "topic": TOPIC, "model": Deposit, "key": "{tenant}:deposit:{order}",
    "shard_key": "{tenant}", "hash_fields": ["tenant", "order", "amount"]}

if MODE == "async":
    @app.handler(**OPTIONS, mode="leased", concurrency=4, ordering_key="{tenant}")
    async def deposit_async(msg: Deposit, ctx: Any) -> dict[str, str]:
        cur = await ctx.tx.execute(sql.SQL(
            "INSERT INTO {} (tenant, order_id, amount) VALUES (%s, %s, %s)").format(
            sql.Identifier(SCHEMA, "entry")), (msg.tenant, msg.order, msg.amount))
        cur = await ctx.tx.execute(sql.SQL(
            "INSERT INTO {t} AS b (tenant, balance, updates) VALUES (%s, %s, 1) "
            "ON CONFLICT (tenant) DO UPDATE SET balance = b.balance + EXCLUDED.balance, "
            "updates = b.updates + 1 RETURNING balance").format(
            t=sql.Identifier(SCHEMA, "balance")), (msg.tenant, msg.amount))
        row = await cur.fetchone()
        emit(ctx, msg, Decimal(row[0]))
        return {"order": msg.order}
else:
    extra: dict[str, Any] = ({"mode": "leased", "concurrency": 4, "ordering_key": "{tenant}"}
                             if MODE == "leased" else {})

    @app.handler(**OPTIONS, **extra)
    def deposit(msg: Deposit, ctx: Context) -> dict[str, str]:
        emit(ctx, msg, apply(ctx.tx, msg))
        return {"order": msg.order}
