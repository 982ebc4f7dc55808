"""The store distributed on a real Citus cluster (a coordinator and two workers):
``kafka-idem migrate`` distributes it, a member refuses a store half distributed, and a
handler whose tables are co-located with its records (``shard_key``) applies each
message exactly once, each message's statements routed to its one shard (Citus's own
statistics say so). The app: tests/apps/citus_ledger.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from tests.apps.citus_ledger import encode
from tests.citus import CitusStore
from tests.conftest import (
    BOOTSTRAP,
    ROOT,
    Members,
    Topics,
    caught_up,
    committed,
    end_offsets,
    produce,
    wait_for,
)
from tests.integration.outbox_support import read_committed

APP = "tests.apps.citus_ledger:app"


MODES = ["local", "leased", "async"]


def env_of(store: CitusStore, topic: str = "unused", events: str = "",
           mode: str = "local") -> dict[str, str]:
    return {**os.environ, "CITUS_LEDGER_EVENTS": events, "CITUS_LEDGER_MODE": mode,
            "KAFKA_IDEM_DATABASE_URL": store.url,
            "KAFKA_IDEM_SCHEMA_NAME": store.schema, "KAFKA_IDEM_BOOTSTRAP_SERVERS": BOOTSTRAP,
            "KAFKA_IDEM_SESSION_TIMEOUT_MS": "6000",
            "KAFKA_IDEM_BATCH_MAX_WAIT_SECONDS": "0.05",
            "CITUS_LEDGER_SCHEMA": store.app_schema, "CITUS_LEDGER_TOPIC": topic,
            "PYTHONPATH": str(ROOT)}


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kafka_idem.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def migrated(store: CitusStore, topic: str = "unused", events: str = "",
             mode: str = "local") -> dict[str, str]:
    env = env_of(store, topic, events, mode)
    done = cli(env, "migrate", "--app", APP)
    assert done.returncode == 0, done.stderr
    return env


def test_migrate_distributes_the_store(citus_store: CitusStore) -> None:
    env = env_of(citus_store)
    done = cli(env, "migrate", "--app", APP)
    assert done.returncode == 0, done.stderr
    s = citus_store.schema
    assert f'schema {s}: distributed "{s}"."task_idempotency" by shard_key' in done.stdout
    a = citus_store.app_schema
    assert (f"app citus-ledger: ledger_tables: created schema {a}, table {a}.balance, table "
            f"{a}.entry; distributed {a}.balance by tenant, {a}.entry by tenant\n") in done.stdout
    # records and outbox by shard_key, co-located; the rest reference tables
    assert citus_store.placement(f"{s}.task_idempotency") == ("h", "shard_key")
    assert citus_store.placement(f"{s}.outbox") == ("h", "shard_key")
    for table in ("admin_audit", "handler_pauses", "outbox_slots"):
        assert citus_store.placement(f"{s}.{table}") == ("n", "")
    assert citus_store.placement(f"{s}.schema_migrations") is None
    groups = citus_store.rows(
        "SELECT logicalrelid::text AS t, colocationid FROM pg_dist_partition WHERE "
        "logicalrelid::text IN (%s, %s, %s)",
        (f"{s}.task_idempotency", f"{s}.outbox", f"{citus_store.app_schema}.entry"))
    assert len({g["colocationid"] for g in groups}) == 1 and len(groups) == 3
    # the primary key carries the distribution column; the guard's triggers stay
    pkey = citus_store.value(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = %s::regclass "
        "AND contype = 'p'", (f"{s}.task_idempotency",))
    assert pkey == "PRIMARY KEY (namespace, idempotency_key, shard_key)"
    again = cli(env, "migrate")
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == f"schema {s}: nothing to do"
    again = cli(env, "migrate", "--app", APP)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [f"schema {s}: nothing to do", "app citus-ledger: "
                                         "ledger_tables: nothing new (what it creates exists "
                                         "already)"]


def test_no_citus_keeps_the_store_local(citus_store: CitusStore) -> None:
    done = cli(env_of(citus_store), "migrate", "--no-citus")
    assert done.returncode == 0, done.stderr
    assert "distributed" not in done.stdout
    assert citus_store.placement(f"{citus_store.schema}.task_idempotency") is None


def test_a_store_half_distributed_is_refused_at_start(citus_store: CitusStore) -> None:
    env = migrated(citus_store)
    outbox = f"{citus_store.schema}.outbox"
    with psycopg.connect(citus_store.url, autocommit=True) as conn:
        conn.execute("SELECT undistribute_table(%s)", (outbox,))
    for command in (("run", APP, "--max-seconds", "5"), ("status",)):  # a member, a tool
        done = cli(env, *command)
        assert done.returncode == 2, done.stderr
        lines = [ln for ln in done.stderr.splitlines() if "half distributed" in ln]
        assert len(lines) == 1, done.stderr
        assert f'"{citus_store.schema}"."outbox" is local' in lines[0]
        assert "kafka-idem migrate --citus" in lines[0]
    fixed = cli(env, "migrate", "--citus")
    assert fixed.returncode == 0, fixed.stderr
    assert citus_store.placement(outbox) == ("h", "shard_key")


def deposits(n: int, tenants: int) -> list[tuple[str, str, str]]:
    return [(f"t{i % tenants}", f"o{i}", f"{(i % 4) + 1}.50") for i in range(n)]


@pytest.mark.parametrize("mode", MODES)
def test_co_located_messages_apply_once_each_on_its_shard(
    citus_store: CitusStore, topics: Topics, members: Members, group: str, mode: str,
) -> None:
    """Each mode: local (a transaction per message), leased with concurrency 4 (claim,
    then call and completion), ``async def``."""
    topic = topics(partitions=3)
    env = migrated(citus_store, topic, mode=mode)
    items = deposits(60, tenants=6)
    # every message; a third of them again in the same units (a producer's retries)...
    produce(topic, [(o.encode(), encode(t, o, a)) for t, o, a in items + items[::3]])
    reset_statistics(citus_store)
    members.start(APP, env, group=group)
    wait_for(lambda: caught_up(group, topic), timeout=90, what="the member to catch up")
    # ... and once they are done (a replay): their records are locked and answered
    produce(topic, [(o.encode(), encode(t, o, a)) for t, o, a in items[1::4]])
    wait_for(lambda: caught_up(group, topic), timeout=90, what="the member to catch up")
    assert committed(group, topic) == end_offsets(topic)
    routed = statement_statistics(citus_store)

    app_schema = citus_store.app_schema
    entries = citus_store.rows(f"SELECT tenant, order_id, amount FROM {app_schema}.entry")
    assert sorted((e["tenant"], e["order_id"]) for e in entries) == sorted(
        (t, o) for t, o, _a in items)
    want: dict[str, Decimal] = {}
    for t, _o, a in items:
        want[t] = want.get(t, Decimal(0)) + Decimal(a)
    balances = citus_store.rows(f"SELECT tenant, balance, updates FROM {app_schema}.balance")
    assert {b["tenant"]: b["balance"] for b in balances} == want
    assert {b["tenant"]: b["updates"] for b in balances} == Counter(t for t, _o, _a in items)
    records = citus_store.records()
    assert {(r["idempotency_key"], r["shard_key"]) for r in records} == {
        (f"{t}:deposit:{o}", t) for t, o, _a in items}
    assert {(r["status"], r["attempts"]) for r in records} == {("succeeded", 1)}
    assert "LOCK" in assert_routed_by_tenant(routed, {t for t, _o, _a in items})
    # a tenant's record shard and ledger shard are on one worker; the tenants on both
    workers = {t: {worker(citus_store, table, t) for table in (
        f"{citus_store.schema}.task_idempotency", f"{app_schema}.entry",
        f"{app_schema}.balance")} for t in want}
    assert all(len(w) == 1 for w in workers.values()), workers
    assert len(set().union(*workers.values())) == 2, workers


def worker(store: CitusStore, table: str, value: str) -> int:
    """The port of the worker holding ``table``'s shard for distribution value ``value``."""
    return int(store.value(
        "SELECT nodeport FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid) "
        "WHERE p.shardid = get_shard_id_for_distribution_column(%s, %s::text)", (table, value)))


def reset_statistics(store: CitusStore) -> None:
    with psycopg.connect(store.url, autocommit=True) as conn:
        conn.execute("SELECT citus_stat_statements_reset()")


@pytest.mark.parametrize("mode", ["local", "async"])
def test_events_from_a_distributed_outbox_once_each_in_key_order(
    citus_store: CitusStore, topics: Topics, members: Members, group: str, mode: str,
) -> None:
    """Each deposit emits its tenant's new balance, keyed by tenant: the events come out
    once per deposit, and a tenant's balances rise in its partition (per-key order);
    the outbox is empty after."""
    topic, events = topics(partitions=3), topics(partitions=2, dlq=False)
    env = migrated(citus_store, topic, events, mode)
    made = cli(env, "topics", "create", APP)  # the relay's control topic
    assert made.returncode == 0, made.stderr
    items = deposits(48, tenants=4)
    produce(topic, [(o.encode(), encode(t, o, a)) for t, o, a in items + items[::4]])
    reset_statistics(citus_store)
    members.start(APP, env, group=group)
    wait_for(lambda: caught_up(group, topic), timeout=90, what="the member to catch up")
    outbox = f'"{citus_store.schema}".outbox'
    wait_for(lambda: citus_store.value(f"SELECT count(*) FROM {outbox}") == 0, timeout=60,
             what="the relay to empty the outbox")
    got = [json.loads(m.value()) for m in read_committed(events)]
    assert sorted(e["order"] for e in got) == sorted(o for _t, o, _a in items)
    for tenant in {t for t, _o, _a in items}:
        seen = [Decimal(e["balance"]) for e in got if e["tenant"] == tenant]
        assert seen == sorted(seen) and len(set(seen)) == len(seen), (tenant, seen)
        assert seen[-1] == sum(Decimal(a) for t, _o, a in items if t == tenant)
    # the events were written on their message's shard (the relay's reads and deletes
    # of published rows span the shards: not a message's)
    routed = [r for r in statement_statistics(citus_store)
              if not r["query"].startswith("DELETE")]
    assert any("outbox" in r["query"] for r in routed)
    assert_routed_by_tenant(routed, {t for t, _o, _a in items})


def test_a_write_to_a_table_local_to_the_coordinator_is_refused_then_applied_once_fixed(
    citus_store: CitusStore, topics: Topics, members: Members, group: str,
) -> None:
    """The balance table left local: the record (on a worker) and the balance (on the
    coordinator) would not commit atomically. Each message is refused before its
    completion (rolled back, the partition held, nothing charged), the log naming the
    table and the fix; distributed, the same messages apply once each."""
    topic = topics(partitions=1)
    env = env_of(citus_store, topic) | {"CITUS_LEDGER_LOCAL_BALANCE": "1"}
    done = cli(env, "migrate", "--app", APP)  # the app's tables, the balance left local
    assert done.returncode == 0, done.stderr
    balance = f"{citus_store.app_schema}.balance"
    assert citus_store.placement(balance) is None
    items = deposits(6, tenants=2)
    produce(topic, [(o.encode(), encode(t, o, a)) for t, o, a in items])
    member = members.start(APP, env, group=group)
    wait_for(lambda: f"wrote {balance}, local to the Citus coordinator" in members.logs(),
             timeout=60, what="the member to refuse the local write")
    assert "colocate_with =>" in members.logs()
    assert citus_store.value(f"SELECT count(*) FROM {citus_store.app_schema}.entry") == 0
    assert citus_store.value(f"SELECT count(*) FROM {balance}") == 0
    assert {r["status"] for r in citus_store.records()} <= {"processing"}
    assert committed(group, topic).get(0, -1) <= 0
    member.terminate()
    member.wait(30)
    with psycopg.connect(citus_store.url, autocommit=True) as conn:
        conn.execute("SELECT create_distributed_table(%s, 'tenant', colocate_with => %s)",
                     (balance, f"{citus_store.schema}.task_idempotency"))
    members.start(APP, env, group=group)
    wait_for(lambda: caught_up(group, topic), timeout=90, what="the member to catch up")
    entries = citus_store.rows(f"SELECT order_id FROM {citus_store.app_schema}.entry")
    assert sorted(e["order_id"] for e in entries) == sorted(o for _t, o, _a in items)
    assert {r["status"] for r in citus_store.records()} == {"succeeded"}


ORM_APP = """
import os
import sqlalchemy as sa
from kafka_idem import App

SCHEMA = os.environ["CITUS_LEDGER_SCHEMA"]
metadata = sa.MetaData(schema=SCHEMA)
note = sa.Table("note", metadata, sa.Column("tenant", sa.Text, primary_key=True),
                sa.Column("body", sa.Text))
app = App("citus-orm")
app.sqlalchemy(metadata=metadata)


@app.handler(topic=os.environ["CITUS_LEDGER_TOPIC"], key="{tenant}:{n}", shard_key="{tenant}",
             hash_fields=["n"])
def noted(msg, ctx):
    ctx.session.execute(note.insert().values(tenant=msg["tenant"], body=msg["n"]))
"""


def test_an_orm_table_not_co_located_is_refused_at_start(
    citus_store: CitusStore, topics: Topics, tmp_path: Any,
) -> None:
    (tmp_path / "citus_orm_app.py").write_text(ORM_APP)
    topic = topics(partitions=1)
    env = env_of(citus_store, topic) | {"PYTHONPATH": f"{tmp_path}:{ROOT}"}
    done = cli(env, "migrate", "--app", "citus_orm_app:app")  # creates the table, local
    assert done.returncode == 0, done.stderr
    table = f'"{citus_store.app_schema}"."note"'
    run = cli(env, "run", "citus_orm_app:app", "--max-seconds", "5")
    assert run.returncode == 2, run.stderr
    lines = [ln for ln in run.stderr.splitlines() if "is local to the coordinator" in ln]
    assert len(lines) == 1 and table in lines[0], run.stderr
    assert f"colocate_with => '\"{citus_store.schema}\".\"task_idempotency\"'" in lines[0]
    with psycopg.connect(citus_store.url, autocommit=True) as conn:
        conn.execute("SELECT create_distributed_table(%s, 'tenant', colocate_with => 'none')",
                     (table,))
    run = cli(env, "run", "citus_orm_app:app", "--max-seconds", "5")
    assert run.returncode == 2 and "distributed apart from the store's records" in run.stderr
    with psycopg.connect(citus_store.url, autocommit=True) as conn:
        conn.execute("SELECT update_distributed_table_colocation(%s, colocate_with => %s)",
                     (table, f"{citus_store.schema}.task_idempotency"))
    run = cli(env, "run", "citus_orm_app:app", "--max-seconds", "5")
    assert run.returncode == 0, run.stderr


def statement_statistics(store: CitusStore) -> list[dict[str, Any]]:
    """Citus's statistics of the statements on the test's records and ledger tables."""
    return store.rows("SELECT query, executor, partition_key, calls FROM citus_stat_statements "
                      "WHERE query LIKE %s OR query LIKE %s OR query LIKE %s",
                      (f"%{store.schema}%task_idempotency%", f"%{store.schema}%outbox%",
                       f"%{store.app_schema}%"))


def assert_routed_by_tenant(rows: list[dict[str, Any]], tenants: set[str]) -> set[str]:
    """The member's claims, business writes, locks and completions each ran on one
    shard, found by a tenant (its distribution value); none ran on many shards (NULL).
    Reads that count records on every shard are the metrics sampler's, not a message's.
    Returns the kinds of statement seen."""
    by_kind: dict[str, set[Any]] = {}
    for r in rows:
        query = " ".join(r["query"].split())
        if query.startswith("SELECT") and "FOR UPDATE" not in query:
            continue
        verb = "LOCK" if query.startswith("SELECT") else query.split()[0]
        by_kind.setdefault(verb, set()).add(r["partition_key"])
    # claims and business rows (INSERT), completions (WITH), duplicates of keys done in
    # an earlier transaction locked (LOCK; a key's second message in one unit replays
    # the first's result without a statement)
    assert {"INSERT", "WITH"} <= set(by_kind) <= {"INSERT", "LOCK", "WITH"}, rows
    for verb, keys in by_kind.items():
        # (a statement psycopg prepared is counted under a distribution value it ran with)
        assert keys and keys <= tenants, (verb, keys, rows)
    return set(by_kind)


def test_a_shard_key_naming_a_field_the_key_lacks_is_refused() -> None:
    from kafka_idem import App
    from kafka_idem.errors import ConfigError

    app = App("shard-check")
    with pytest.raises(ConfigError) as caught:
        @app.handler(topic="t", key="{order}", shard_key="{tenant}", hash_fields=["order"])
        def h(msg: Any, ctx: Any) -> None:
            return None
    assert caught.value.context["setting"] == "shard_key"
    assert "'tenant'" in caught.value.message and "one shard" in caught.value.message
