"""Old succeeded records, made fast, for what tests retention: the retention benchmark
(``python -m bench.retention``), the chaos run's purge under load and the tests."""

from __future__ import annotations

import psycopg
from psycopg import sql

SCHEMA, TABLE = "kafka_idem", "task_idempotency"


def fill(dsn: str, *, n: int, age_seconds: float, prefix: str, namespace: str,
         topic: str = "old.records", schema: str = SCHEMA, table: str = TABLE) -> None:
    """``n`` succeeded records of ``namespace`` whose last change was ``age_seconds`` ago,
    keys ``prefix`` + a number: inserted as ``processing`` (the only state a record
    starts in) and completed by their owner token in one statement, which the guard lets
    through with any ``updated_at``, so no trigger is switched off. Each record's shard
    key is its key (a store distributed on Citus places it by that; statement_timestamp()
    because Citus refuses a volatile function in an UPDATE of a distributed table)."""
    t = sql.Identifier(schema, table)
    with psycopg.connect(dsn) as conn:
        conn.execute(sql.SQL(
            "INSERT INTO {} (namespace, idempotency_key, request_hash, status, owner_token, "
            "lease_until, attempts, handler, kafka_topic, kafka_partition, kafka_offset, "
            "shard_key) "
            "SELECT %s, %s || g, 'v1:old', 'processing', gen_random_uuid(), "
            "clock_timestamp() + interval '1 hour', 1, 'charge', %s, 0, g, %s || g "
            "FROM generate_series(1, %s) AS g").format(t), (namespace, prefix, topic, prefix, n))
        conn.execute(sql.SQL(
            "UPDATE {} SET status = 'succeeded', completed_token = owner_token, "
            "owner_token = NULL, lease_until = NULL, result_json = 'null', "
            "completed_at = statement_timestamp() - make_interval(secs => %s), "
            "updated_at = statement_timestamp() - make_interval(secs => %s) "
            "WHERE namespace = %s AND starts_with(idempotency_key, %s) "
            "AND status = 'processing'").format(t), (age_seconds, age_seconds, namespace, prefix))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(t))
