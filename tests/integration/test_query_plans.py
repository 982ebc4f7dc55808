"""The batch path's read probes the primary key once per key, whatever the planner's
statistics say (its one write, an insert, has no plan to choose).

A new store is planned with the statistics of an empty table until autovacuum's
first ANALYZE, and a store whose last ANALYZE saw few ``processing`` rows keeps
those statistics while a backlog is claimed. With either, the planner picked plans
that read every record of the namespace (the duplicate read: 130 ms instead of 3 ms
for 500 keys among 200,000) or, for the completion the batch path had before it wrote
each record once, every ``processing`` entry of the status index. These tests build
both situations on a real table and read the plans PostgreSQL chooses for the store's
own statements.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest
from psycopg import sql

from kafka_idem.store import Store

NS = "plans"
TABLE = "kafka_idem.task_idempotency"
ROWS = 50_000
BATCH = 500


def _fill(conn: psycopg.Connection[Any], *, processing: int) -> None:
    """``ROWS`` records of ``NS``: the first ``processing`` keys claimed, the rest
    succeeded."""
    conn.execute(
        f"""INSERT INTO {TABLE} (namespace, idempotency_key, request_hash, status,
                owner_token, lease_until, attempts, handler, kafka_topic, kafka_partition,
                kafka_offset, created_at, updated_at)
            SELECT %s, 'k' || lpad(g::text, 6, '0'), 'h', 'processing', gen_random_uuid(),
                   clock_timestamp() + interval '1 minute', 1, 'charge', 't', 0, g,
                   clock_timestamp(), clock_timestamp()
            FROM generate_series(0, %s) AS g""",
        (NS, ROWS - 1),
    )
    conn.execute(
        f"""UPDATE {TABLE} SET status = 'succeeded', result_json = '{{}}',
                completed_token = owner_token, owner_token = NULL, lease_until = NULL,
                completed_at = clock_timestamp()
            WHERE namespace = %s AND idempotency_key >= %s""",
        (NS, f"k{processing:06d}"),
    )


def _plan(conn: psycopg.Connection[Any], query: sql.Composable, params: dict[str, Any]) -> str:
    rows = conn.execute(sql.SQL("EXPLAIN (COSTS OFF) ") + query, params).fetchall()
    return "\n".join(r[0] for r in rows)


def _probes_only(plan: str) -> None:
    """The table is reached through its primary key, one probe per key (and, for an
    update, the row that probe found, by its ctid): no scan of the namespace, no status
    index, no hash of the table's rows."""
    assert "task_idempotency_pkey" in plan, plan
    lines = [ln for ln in plan.splitlines() if "task_idempotency" in ln and "Scan" in ln]
    assert lines and all(re.search(r"Index Scan using task_idempotency_pkey|Tid Scan", ln)
                         for ln in lines), plan
    assert "Hash" not in plan and "Bitmap" not in plan, plan
    assert "status_idx" not in plan, plan


@pytest.fixture
def store_conn(db: Any) -> Any:
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        yield conn


@pytest.mark.parametrize("stats", ["empty table", "current"])
def test_the_duplicate_read_probes_each_key_whatever_the_statistics(
    store_conn: psycopg.Connection[Any], stats: str
) -> None:
    conn = store_conn
    if stats == "empty table":
        conn.execute(f"ANALYZE {TABLE}")  # what a new store is planned with
    _fill(conn, processing=0)
    if stats == "current":
        conn.execute(f"ANALYZE {TABLE}")
    store = Store(schema="kafka_idem", table="task_idempotency", namespace=NS)
    keys = [f"k{i:06d}" for i in range(20_000, 20_000 + BATCH)]
    _probes_only(_plan(conn, store.q["succeeded_results"], {"ns": NS, "keys": keys}))
    with conn.transaction():
        found = store.found(conn, keys)
    assert sorted(found) == keys  # and it answers every key


def test_a_purge_batch_reads_few_old_records_down_the_status_index(db: Any) -> None:
    """Retention's selection (``purge`` and the members' background runs): when few
    records are older than the window, the status index (status, updated_at) bounds
    the read, instead of a sequential scan of the table per batch."""
    store = Store(schema="kafka_idem", table="task_idempotency", namespace=NS)
    with psycopg.connect(db.dsn) as conn:
        _fill(conn, processing=0)  # every record succeeded, just now
        conn.execute(f"ANALYZE {TABLE}")
        query = sql.SQL(store.q["purge_batch"].as_string(conn).replace("DELETE FROM", "SELECT "
                        "ctid FROM", 1).split("WHERE ctid IN (", 1)[1].rsplit(")", 1)[0])
        plan = _plan(conn, query, {"ns": NS, "statuses": ["succeeded"],
                                   "older_than": 86400.0, "batch": 1000})
    assert "Index Scan using task_idempotency_status_idx" in plan, plan
    assert "Seq Scan" not in plan, plan
