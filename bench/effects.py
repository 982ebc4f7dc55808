"""Exactly-once effects, read back from the database after a path has drained a topic.

The ledger must hold exactly one row per distinct key that this path wrote
(rows after a mark taken before the path ran), with no key doubled; each
balance must have moved by exactly the sum of its intents; the store must
hold one ``succeeded`` record per intent (each run has a store schema of its own).
"""

from __future__ import annotations

from collections import Counter
from decimal import Decimal

import psycopg
from psycopg import sql

from bench.workload import Intent

TABLE = "task_idempotency"


def ledger_state(dsn: str, tenants: list[str]) -> tuple[int, dict[tuple[str, str], Decimal]]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT coalesce(max(id), 0) FROM payments.ledger").fetchone()
        balances = conn.execute(
            "SELECT tenant_id, currency, balance FROM payments.balances WHERE tenant_id = ANY(%s)",
            (tenants,),
        ).fetchall()
    assert row is not None
    return int(row[0]), {(t, c): b for t, c, b in balances}


def check_effects(
    dsn: str, schema: str, intents: list[Intent], mark: int,
    before: dict[tuple[str, str], Decimal],
) -> tuple[bool, str]:
    tenants = sorted({i.tenant_id for i in intents})
    expected_keys = {i.key for i in intents}
    with psycopg.connect(dsn) as conn:
        rows, keys, dup_keys = conn.execute(
            "SELECT count(*), count(DISTINCT idempotency_key),"
            " (SELECT count(*) FROM (SELECT 1 FROM payments.ledger WHERE tenant_id = ANY(%(t)s)"
            "   AND id > %(mark)s GROUP BY idempotency_key HAVING count(*) > 1) d)"
            " FROM payments.ledger WHERE tenant_id = ANY(%(t)s) AND id > %(mark)s",
            {"t": tenants, "mark": mark},
        ).fetchone() or (0, 0, 0)
        written = {
            r[0] for r in conn.execute(
                "SELECT DISTINCT idempotency_key FROM payments.ledger"
                " WHERE tenant_id = ANY(%s) AND id > %s", (tenants, mark)
            )
        }
        succeeded = conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE status = 'succeeded'").format(
                sql.Identifier(schema, TABLE)
            )
        ).fetchone()
        after = {
            (t, c): b for t, c, b in conn.execute(
                "SELECT tenant_id, currency, balance FROM payments.balances"
                " WHERE tenant_id = ANY(%s)", (tenants,)
            )
        }
    sums: Counter[tuple[str, str]] = Counter()
    for i in intents:
        sums[(i.tenant_id, i.currency)] += i.amount  # type: ignore[assignment]
    moved = {
        k: after.get(k, Decimal(0)) - before.get(k, Decimal(0))
        for k in after.keys() | sums.keys()
    }
    balances_ok = all(moved[k] == sums.get(k, Decimal(0)) for k in moved)
    store_ok = succeeded is not None and succeeded[0] == len(expected_keys)
    ok = rows == keys == len(expected_keys) and dup_keys == 0 and written == expected_keys
    ok = ok and balances_ok and store_ok
    text = (
        f"{rows} ledger rows / {keys} keys / {len(expected_keys)} intents; "
        f"{dup_keys} doubled; balances {'ok' if balances_ok else 'WRONG'}; "
        f"{succeeded[0] if succeeded else 0} succeeded records"
    )
    return ok, ("ok: " if ok else "FAILED: ") + text
