"""Helpers for the ORM failure tests: the ledger app (tests/apps/orm_ledger.py) on a
topic with a chosen handler, run in process until the group caught up, and what the
tests read back (records, entries, the dead letter)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg

from kafka_idem import App, RetryPolicy
from tests.apps.orm_ledger import build_app, encode
from tests.conftest import DB, InProcess, app_settings, caught_up, produce, read_topic, wait_for
from tests.integration.support import assert_dead_letter, migrate_app

SEED = "o-secret-4711"  # the seed entry's order: a value no record may quote
FAST = RetryPolicy(base=0.05, cap=0.1, max_attempts=5)


def ledger_app(db: DB, topic: str, group: str, mode: str, fn: Callable[..., Any]) -> App:
    """The ledger app with ``fn`` as its handler, its tables migrated, the seed account
    ``a0`` with the entry of order :data:`SEED` in them."""
    migrate_app(db, build_app(topic=topic, mode=mode))
    with_seed(db)
    return build_app(topic=topic, mode=mode, fn=fn, retry=FAST,
                     **app_settings(db, group_id=group))


def with_seed(db: DB) -> None:
    with psycopg.connect(db.dsn) as conn:
        conn.execute("INSERT INTO public.orm_account (id, balance, version) VALUES ('a0', 0, 1) "
                     "ON CONFLICT DO NOTHING")
        conn.execute("INSERT INTO public.orm_entry (account_id, order_id, amount, "
                     "idempotency_key) VALUES ('a0', %s, 1, 'seed') ON CONFLICT DO NOTHING",
                     (SEED,))


def run_one(app: App, topic: str, group: str, order: str, amount: str = "2.50") -> Any:
    """Produce deposit ``order`` to account a0, run until it is committed; the runner's
    metrics."""
    produce(topic, [(order.encode(), encode("a0", order, amount))])
    with InProcess(app) as r:
        wait_for(lambda: caught_up(group, topic), what=f"order {order} to be decided")
        return r.runner.metrics


def key(order: str) -> str:
    return f"a0:deposit:{order}"


def entries(db: DB, idempotency_key: str) -> list[dict[str, Any]]:
    return db.rows("SELECT * FROM public.orm_entry WHERE idempotency_key = %s",
                   (idempotency_key,))


def framework_errors(metrics: Any) -> float:
    return sum(s.value for metric in metrics.framework_errors.collect()
               for s in metric.samples if s.name.endswith("_total"))


def assert_failed_permanently(db: DB, topic: str, group: str, order: str) -> dict[str, Any]:
    """The record failed permanently at attempt 1, nothing of the attempt committed, and
    the one dead letter says what the record says; the record."""
    rec = db.record(key(order))
    assert rec is not None
    assert (rec["status"], rec["error_kind"], rec["attempts"]) == ("failed", "permanent", 1), rec
    assert entries(db, key(order)) == []
    (source,) = read_topic(topic)
    (letter,) = read_topic(f"{topic}.dlq")
    assert_dead_letter(letter, source, kind="permanent", attempts=1, group=group,
                       handler="deposit", key=key(order), record=rec)
    return rec
