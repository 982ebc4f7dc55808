"""The ORM payments example (consumers/payments_orm.py) end to end: migrated with
``kafka-idem migrate --app``, its topics made by ``kafka-idem topics create``, run by
``kafka-idem run`` against the real broker (local mode, and leased key-ordered
``async def``): one ledger row per charge that took effect, the balances their sums,
one ``payments.charge-completed`` event each with its ledger row's id and time. Its
metadata and payments.py's ``create_tables`` make the same tables in either order; its
balance upsert lets two transactions make a new (tenant, currency) at once."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid
from collections import defaultdict
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import AdminClient
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from consumers import payments, payments_orm
from kafka_idem.admin.migrate import migrate_app
from tests.conftest import (
    DB,
    ROOT,
    Members,
    Topics,
    caught_up,
    dsn_for,
    empty_database,
    headers,
    member_env,
    produce,
    wait_for,
)
from tests.integration.outbox_support import read_committed, wait_published

# on one PostgreSQL and on Citus (the store distributed, the example's tables co-located)
pytestmark = pytest.mark.both_stores


APP = "consumers.payments_orm:app"
VALID = [("t1", "o1", "5.00", "EUR"), ("t2", "o2", "7.25", "USD"), ("t1", "o3", "1.10", "EUR"),
         ("t3", "o4", "2.00", "GBP"), ("t4", "o5", "3.00", "GBP"), ("t1", "o6", "0.90", "EUR")]


def cli(env: dict[str, str], *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "kafka_idem.cli", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def charge(tenant: str, order: str, amount: str, currency: str = "EUR") -> tuple[bytes, bytes]:
    return order.encode(), payments.encode_charge(tenant, order, amount, currency)


@pytest.mark.parametrize("variant", [
    {},
    {"PAYMENTS_MODE": "leased", "PAYMENTS_ASYNC": "1", "PAYMENTS_CONCURRENCY": "4",
     "PAYMENTS_ORDERING_KEY": "{tenant_id}"},
], ids=["local", "leased-async-keyed"])
def test_kafka_idem_run_charges_once_and_emits_one_event_per_charge(
    db: DB, topics: Topics, members: Members, group: str, admin: AdminClient,
    variant: dict[str, str],
) -> None:
    source = topics(partitions=2)
    prefix = f"po{uuid.uuid4().hex[:8]}-"
    env = member_env(db, source, KAFKA_IDEM_NAME_PREFIX=prefix, KAFKA_IDEM_OUTBOX_SHARDS="2",
                     KAFKA_IDEM_OUTBOX_POLL_SECONDS="0.2", **variant)
    cli(env, "migrate", "--app", APP)  # over payments.py's tables (the template's): no change
    events = payments.events_topic(source)
    cli(env, "topics", "create", APP, "--partitions", "2")  # + the events, the relays' control
    made = [t for t in admin.list_topics(timeout=10).topics if t.startswith(prefix) or t == events]
    topics.created.extend(made)
    assert events in made and len(made) == 2, made
    produce(source, [charge(*c) for c in VALID] + [
        charge(*VALID[0]),  # a re-send: replayed, no event
        charge("t2", "o2", "8.00", "USD"),  # another amount for o2: a conflict, no event
        charge("t1", "o7", "0"),  # invalid: Permanent, nothing written
        (b"o8", b"\x00garbage"),  # undecodable
    ])
    members.start(APP, env, group=group)
    wait_for(lambda: caught_up(group, source), timeout=90, what="the charges")
    got = wait_published(db, events, len(VALID))
    assert len(read_committed(events)) == len(VALID), members.logs()

    assert db.ledger_counts() == {f"{t}:charge:{o}": 1 for t, o, _, _ in VALID}
    sums: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
    for tenant, _, amount, currency in VALID:
        sums[(tenant, currency)] += Decimal(amount)
    assert db.balances() == sums
    statuses = {r["idempotency_key"]: r["status"] for r in db.records()}
    assert statuses == {**{f"{t}:charge:{o}": "succeeded" for t, o, _, _ in VALID},
                        "t1:charge:o7": "failed"}
    ledger = {r["idempotency_key"]: r for r in db.ledger()}
    for m in got:
        name, value = payments.codec().decode(m.value())
        event = payments.ChargeCompleted.model_validate(value)
        row = ledger[event.idempotency_key]
        assert name == payments.EVENT_SCHEMA and m.key() == row["order_id"].encode()
        assert (event.tenant_id, event.order_id, event.amount, event.currency) == (
            row["tenant_id"], row["order_id"], row["amount"], row["currency"])
        assert (event.ledger_entry.id, event.ledger_entry.created_at) == (
            row["id"], row["created_at"])
        assert headers(m)["idem.key"] == event.idempotency_key
    assert sorted(m.key() for m in got) == sorted(o.encode() for _, o, _, _ in VALID)


CATALOG = """
SELECT c.table_name, c.column_name, c.data_type, c.numeric_precision, c.numeric_scale,
       c.is_nullable, c.column_default
  FROM information_schema.columns c WHERE c.table_schema = 'payments'
UNION ALL
SELECT t.relname, con.conname, con.contype::text, NULL, NULL, NULL,
       pg_get_constraintdef(con.oid)
  FROM pg_constraint con JOIN pg_class t ON t.oid = con.conrelid
  JOIN pg_namespace n ON n.oid = t.relnamespace WHERE n.nspname = 'payments'
UNION ALL
SELECT tablename, indexname, 'index', NULL, NULL, NULL, indexdef
  FROM pg_indexes WHERE schemaname = 'payments'
ORDER BY 1, 2, 3, 7
"""


@pytest.mark.parametrize("first", ["create_tables", "metadata"])
def test_the_metadata_and_create_tables_make_the_same_tables_in_either_order(
    first: str,
) -> None:
    with empty_database("kafka_idem_orm") as one, empty_database("kafka_idem_orm") as both:
        with psycopg.connect(dsn_for(one)) as conn:
            payments.create_tables(conn)
            reference = conn.execute(CATALOG).fetchall()
        steps = [payments.create_tables, *payments_orm.app.migrations]
        if first == "metadata":
            steps.reverse()
        done = migrate_app(dsn_for(both), "kafka_idem", steps)
        assert [s.name for s in done][steps.index(payments.create_tables)] == "create_tables"
        with psycopg.connect(dsn_for(both)) as conn:
            assert conn.execute(CATALOG).fetchall() == reference
        assert {r[0] for r in reference} == {"balances", "ledger"}


@pytest.mark.postgres_only("it finds the second upsert's lock wait in pg_locks, which on Citus "
                            "shows on the worker, not the coordinator it reads")
def test_two_transactions_make_a_new_balance_at_once_without_a_unique_violation(
    db: DB,
) -> None:
    """The second upsert waits on the first's uncommitted row, then adds to it."""
    engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(db.dsn))
    msg = payments.ChargeRequested(**payments.charge_payload("t-new", "o1", "4.00", "CHF"))
    other = msg.model_copy(update={"order_id": "o2", "amount": Decimal("6.00")})
    failed: list[BaseException] = []
    with Session(engine) as first, Session(engine) as second:
        first.execute(payments_orm.balance_upsert(msg))  # the row, not yet committed
        waiter = second.execute(text("SELECT pg_backend_pid()")).scalar_one()

        def upsert() -> None:
            try:
                second.execute(payments_orm.balance_upsert(other))
                second.commit()
            except BaseException as exc:  # the assertion below says it
                failed.append(exc)

        t = threading.Thread(target=upsert)
        t.start()
        wait_for(lambda: waits_on_a_lock(db, waiter), what="the second upsert to wait")
        first.commit()
        t.join(30)
    engine.dispose()
    assert not t.is_alive() and failed == []
    assert db.balances() == {("t-new", "CHF"): Decimal("10.00")}


def waits_on_a_lock(db: DB, pid: int) -> Any:
    return db.value("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                    (pid,))
