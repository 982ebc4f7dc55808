"""The chaos run's background retention (issue 35): a purge running under load.

Before the members start, the store gets ``--old-records`` succeeded records of the
payments app (keys ``chaos-old:N``, written as a member would leave them) older than a
window twice the source topic's ``retention.ms`` (at least two days), and the members
run with that window as ``retention`` (checked at their start against the topic, as
always) and a retention run every 5 seconds: while the load and the faults go on, one
member at a time purges them, in its batches. The checker then reads the store: an old
record left would be a phantom (check 6), and :func:`left` says how many are left
(the run's health: none). The run's own records are minutes old: never in the window.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from kafka_idem.admin.purge import read_retention
from kafka_idem.settings import Settings
from kafka_idem.settings.durations import format_duration
from tools.old_records import fill

PREFIX = "chaos-old:"
NAMESPACE = "payments"  # consumers.payments:app's name, the namespace of its records
DAY = 86400.0


def seed(s: Settings, dsn: str, topic: str, n: int) -> tuple[dict[str, str], dict[str, Any]]:
    """Write the old records; the members' variables and what the report says. No
    retention (empty variables) when the topic keeps its messages forever or its
    retention cannot be read."""
    (found,) = read_retention(s, [topic])
    if n <= 0 or found.ms is None or found.ms < 0:
        why = "off" if n <= 0 else f"topic retention.ms {found.ms} ({found.why or 'forever'})"
        return {}, {"retention": None, "why": why}
    window = 2 * max(found.ms / 1000, DAY)
    fill(dsn, n=n, age_seconds=window + DAY, prefix=PREFIX, namespace=NAMESPACE, topic=topic,
         schema=s.schema_name, table=s.table)
    text = format_duration(window)
    return ({"KAFKA_IDEM_RETENTION": text, "KAFKA_IDEM_RETENTION_INTERVAL_SECONDS": "5"},
            {"retention": text, "old_records": n})


def left(dsn: str, s: Settings) -> int:
    """The old records the members' retention did not remove."""
    with psycopg.connect(dsn, application_name="chaos-run") as conn:
        row = conn.execute(sql.SQL(
            "SELECT count(*) FROM {} WHERE namespace = %s AND starts_with(idempotency_key, %s)"
        ).format(sql.Identifier(s.schema_name, s.table)), (NAMESPACE, PREFIX)).fetchone()
    return int(row[0]) if row else 0
