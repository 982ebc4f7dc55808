"""``python -m bench.citus``'s SQL part: one message's statements on a distributed store
(the claim, a ledger row, the tenant's balance upsert, the fenced completion: what the
payments example's local-mode member sends, through :class:`~kafka_idem.store.Store`),
committed three ways, to choose how batches meet Citus:

* ``per_message``: a transaction per message, one shard each (what a member does on a
  distributed store);
* ``batch_2pc``: one transaction per 500 messages, over every worker their tenants
  live on: Citus commits it with two-phase commit;
* ``per_worker``: the 500 grouped by the worker of their tenant's shard, one
  transaction per group: each a one-phase commit on one worker;
* ``per_message_apart``: a transaction per message as ``per_message``, but the ledger
  and balances distributed by order id and currency, apart from the records: what
  single-shard routing saves (most messages then span two workers: two-phase commit).

Statements are pipelined in each transaction (psycopg's pipeline mode), as the member
does. Throughput and PostgreSQL CPU (the three nodes) per message.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg

from bench.citus import TENANTS, node_cpu, postmasters
from kafka_idem.admin.migrate import distribute_store, migrate
from kafka_idem.store import Delivery, Store
from tools import citus as citus_db

MESSAGES = 4_000
BATCH = 500
LEDGER = ("INSERT INTO payments.ledger (tenant_id, order_id, amount, currency, idempotency_key)"
          " VALUES (%s, %s, 5.00, 'EUR', %s)")
BALANCE = ("INSERT INTO payments.balances AS b (tenant_id, currency, balance) VALUES "
           "(%s, 'EUR', 5.00) ON CONFLICT (tenant_id, currency) DO UPDATE SET balance = "
           "b.balance + EXCLUDED.balance")


def strategies(url: str) -> dict[str, dict[str, Any]]:
    name = f"bench_citus_sql_{uuid.uuid4().hex[:8]}"
    dsn = citus_db.create_database(url, name)
    try:
        migrate(dsn, "kafka_idem", "task_idempotency")
        distribute_store(dsn, "kafka_idem", "task_idempotency", citus=True)
        with psycopg.connect(dsn) as conn:
            from consumers.payments import create_tables

            create_tables(conn)
            for table in ("payments.ledger", "payments.balances"):
                conn.execute("SELECT create_distributed_table(%s, 'tenant_id', colocate_with "
                             "=> 'kafka_idem.task_idempotency')", (table,))
        workers = worker_of_tenants(dsn)
        out = {}
        for how in ("per_message", "batch_2pc", "per_worker"):
            out[how] = measure(dsn, how, workers)
        with psycopg.connect(dsn) as conn:  # the same tables, placed apart from the records
            for table, column in (("payments.ledger", "order_id"),
                                  ("payments.balances", "currency")):
                conn.execute("SELECT undistribute_table(%s)", (table,))
                if table == "payments.ledger":
                    conn.execute("ALTER TABLE payments.ledger DROP CONSTRAINT ledger_pkey, "
                                 "ADD PRIMARY KEY (order_id, id)")
                else:
                    conn.execute("ALTER TABLE payments.balances DROP CONSTRAINT "
                                 "balances_pkey, ADD PRIMARY KEY (currency, tenant_id)")
                conn.execute("SELECT create_distributed_table(%s, %s, colocate_with => "
                             "'none')", (table, column))
        out["per_message_apart"] = measure(dsn, "per_message_apart", workers)
        return out
    finally:
        citus_db.drop_database(url, name)


def worker_of_tenants(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        return {f"t{i}": int(conn.execute(  # type: ignore[index]
            "SELECT nodeport FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid) "
            "WHERE p.shardid = get_shard_id_for_distribution_column('payments.ledger', "
            "%s::text)", (f"t{i}",)).fetchone()[0]) for i in range(TENANTS)}


def groups(how: str, workers: dict[str, int]) -> Iterator[list[tuple[str, str]]]:
    """The (tenant, order) messages of each transaction, in order."""
    msgs = [(f"t{i % TENANTS}", f"o{i}") for i in range(MESSAGES)]
    if how.startswith("per_message"):
        yield from ([m] for m in msgs)
        return
    for start in range(0, MESSAGES, BATCH):
        batch = msgs[start:start + BATCH]
        if how == "batch_2pc":
            yield batch
            continue
        for port in sorted(set(workers.values())):
            yield [m for m in batch if workers[m[0]] == port]


def measure(dsn: str, how: str, workers: dict[str, int]) -> dict[str, Any]:
    store = Store(schema="kafka_idem", table="task_idempotency", namespace=how,
                  distributed=True)
    pids = postmasters("citus")
    commits = 0
    with psycopg.connect(dsn) as conn:
        nodes0, t0 = node_cpu(pids), time.monotonic()
        for txn in groups(how, workers):
            with conn.pipeline(), conn.transaction():
                for tenant, order in txn:
                    key = f"{tenant}:charge:{order}"
                    claim = store.claim_new(conn, key=key, request_hash="v1:bench",
                                            delivery=Delivery("bench", 0, 0, "charge"),
                                            lease_seconds=30, shard=tenant)
                    assert claim is not None and claim.token is not None
                    conn.execute(LEDGER, (tenant, order, key))
                    conn.execute(BALANCE, (tenant,))
                    store.complete(conn, key=key, token=claim.token, result=None,
                                   wait=False, shard=tenant)
            commits += 1
        seconds = time.monotonic() - t0
        per_node = [b - a for a, b in zip(nodes0, node_cpu(pids), strict=True)]
    return {"messages": MESSAGES, "seconds": seconds, "rate": MESSAGES / seconds,
            "postgres_us": sum(per_node) / MESSAGES * 1e6,
            "coordinator_us": per_node[0] / MESSAGES * 1e6, "commits": commits,
            "prepared": "yes" if how in ("batch_2pc", "per_message_apart") else "no"}
