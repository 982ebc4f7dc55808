"""The payments example with one more app migration that keeps its transaction open
for a moment, as a real data migration does.

``kafka-idem migrate --app tests.apps.migrations:app`` run several times at once on a
fresh database must succeed every time: ``CREATE ... IF NOT EXISTS`` is not safe
against a concurrent create, so the app's migrations have to run one at a time (under
the store migrations' advisory lock). The pause makes the window in which two
unlocked runs would collide wide enough to be hit on every run.
"""

from __future__ import annotations

from typing import Any

from consumers import payments

app = payments.build_app()


@app.migration
def audit_tables(conn: Any) -> None:
    conn.execute("CREATE SCHEMA IF NOT EXISTS payments_audit")
    conn.execute("SELECT pg_sleep(0.5)")
    conn.execute("CREATE TABLE IF NOT EXISTS payments_audit.events (id bigserial PRIMARY KEY)")
