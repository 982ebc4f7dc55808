"""Distributing a store that already ran on one PostgreSQL (``kafka-idem migrate --citus``
on a store with records), and ``app.co_locate``'s refusals, on a real Citus cluster. The
app: tests/apps/citus_ledger.py (its tables co-located by ``app.co_locate``, which does
nothing while the store is local)."""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.apps.citus_ledger import encode
from tests.citus import CitusStore
from tests.conftest import ROOT, Members, Topics, caught_up, produce, wait_for
from tests.integration.test_citus_store import APP, cli, deposits, env_of, worker

NAMESPACE = "citus-ledger"  # the app's (its name)


def legacy_records(store: CitusStore) -> None:
    """A record in every status, written without a shard key (a handler without
    ``shard_key=`` on one PostgreSQL), each through the guard's legal transitions; and an
    outbox row without one."""
    records = sql.Identifier(store.schema, "task_idempotency")
    with psycopg.connect(store.url, autocommit=True) as conn:
        for status in ("processing", "succeeded", "retryable_failed", "failed"):
            conn.execute(sql.SQL(
                "INSERT INTO {} (idempotency_key, request_hash, status, owner_token, "
                "lease_until, attempts, namespace, handler) VALUES (%s, 'v1:h', 'processing', "
                "gen_random_uuid(), now() + interval '1 hour', 1, %s, 'legacy')").format(
                records), (f"legacy:{status}", NAMESPACE))
            if status != "processing":
                conn.execute(sql.SQL(
                    "UPDATE {} SET status = %s, completed_token = CASE WHEN %s = 'succeeded' "
                    "THEN owner_token END, error_kind = CASE WHEN %s <> 'succeeded' THEN "
                    "'transient' END, next_attempt_at = now() WHERE idempotency_key = %s"
                ).format(records), (status, status, status, f"legacy:{status}"))
        conn.execute(sql.SQL(
            "INSERT INTO {} (namespace, shard, topic, key, value, idem_key) "
            "VALUES (%s, 0, 'legacy.events', 'k', 'v', 'legacy:succeeded')").format(
            sql.Identifier(store.schema, "outbox")), (NAMESPACE,))


def snapshot(store: CitusStore) -> set[tuple[Any, ...]]:
    return {(r["idempotency_key"], r["status"], r["attempts"], r["request_hash"],
             r["completed_token"], r["shard_key"] or r["idempotency_key"])
            for r in store.records()}


def refused(store: CitusStore, statement: str, *args: Any) -> str:
    with psycopg.connect(store.url, autocommit=True) as conn, pytest.raises(
            psycopg.Error) as caught:
        conn.execute(statement, args)
    return str(caught.value)


def test_a_store_with_records_in_every_status_is_distributed_later(
    citus_store: CitusStore, topics: Topics, members: Members, group: str,
) -> None:
    """The store and the app's tables first local on the coordinator (one PostgreSQL):
    a member applies deposits (records with their tenant as shard key, events in the
    outbox); records in every status and an outbox row written without a shard key
    join them. ``migrate --citus`` then distributes all of it, each row unchanged (the
    missing shard keys filled, and said); a member applies new deposits once each and
    answers the redeliveries of the old ones from their records; the guard still
    refuses illegal transitions, on every worker."""
    topic, events = topics(partitions=2), topics(partitions=1, dlq=False)
    env = env_of(citus_store, topic, events) | {"KAFKA_IDEM_OUTBOX_RELAY": "false"}
    s, app_schema = citus_store.schema, citus_store.app_schema
    local = cli(env, "migrate", "--no-citus", "--app", APP)
    assert local.returncode == 0, local.stderr
    assert citus_store.placement(f"{s}.task_idempotency") is None
    assert citus_store.placement(f"{app_schema}.entry") is None
    old = deposits(24, tenants=4)
    produce(topic, [(o.encode(), encode(t, o, a)) for t, o, a in old + old[::3]])
    member = members.start(APP, env, group=group)
    wait_for(lambda: caught_up(group, topic), timeout=90, what="the member to catch up")
    member.terminate()
    assert member.wait(30) == 0
    legacy_records(citus_store)
    before = snapshot(citus_store)
    assert {r[1] for r in before} == {"processing", "succeeded", "retryable_failed", "failed"}
    outbox = sql.Identifier(s, "outbox").as_string(None)
    assert citus_store.value(f"SELECT count(*) FROM {outbox}") == len(old) + 1

    done = cli(env, "migrate", "--citus", "--app", APP)
    assert done.returncode == 0, done.stderr
    assert f'schema {s}: distributed "{s}"."task_idempotency" by shard_key' in done.stdout
    # the app's tables, made by the first run, distributed by this one (app.co_locate)
    assert (f"app citus-ledger: ledger_tables: distributed {app_schema}.balance by tenant, "
            f"{app_schema}.entry by tenant\n") in done.stdout
    (filled,) = [ln for ln in done.stdout.splitlines() if "without a shard key" in ln]
    assert filled.startswith(f"schema {s}: placed 4 record(s) written without a shard key "
                             "by their idempotency key")
    for table, column in ((f"{s}.task_idempotency", "shard_key"), (f"{s}.outbox", "shard_key"),
                          (f"{app_schema}.entry", "tenant"), (f"{app_schema}.balance", "tenant")):
        assert citus_store.placement(table) == ("h", column)
    assert snapshot(citus_store) == before
    assert {(r["idempotency_key"], r["shard_key"]) for r in citus_store.records()
            if not r["idempotency_key"].startswith("legacy:")} == {
        (f"{t}:deposit:{o}", t) for t, o, _a in old}
    rows = citus_store.rows(f"SELECT idem_key, shard_key FROM {outbox}")
    assert len(rows) == len(old) + 1 and all(r["shard_key"] for r in rows)
    assert {r["shard_key"] for r in rows if r["idem_key"].startswith("legacy:")} == {
        "legacy:succeeded"}

    new = deposits(48, tenants=4)[24:]
    produce(topic, [(o.encode(), encode(t, o, a)) for t, o, a in new + old[::2] + new[::4]])
    members.start(APP, env, group=group)
    wait_for(lambda: caught_up(group, topic), timeout=90, what="the member to catch up")
    entries = citus_store.rows(f"SELECT tenant, order_id FROM {app_schema}.entry")
    assert sorted((e["tenant"], e["order_id"]) for e in entries) == sorted(
        (t, o) for t, o, _a in old + new)
    want: dict[str, Decimal] = {}
    for t, _o, a in old + new:
        want[t] = want.get(t, Decimal(0)) + Decimal(a)
    balances = citus_store.rows(f"SELECT tenant, balance FROM {app_schema}.balance")
    assert {b["tenant"]: b["balance"] for b in balances} == want
    ledger = [r for r in citus_store.records() if not r["idempotency_key"].startswith("legacy:")]
    assert {(r["status"], r["attempts"]) for r in ledger} == {("succeeded", 1)}
    assert len(ledger) == len(old + new)

    records = sql.Identifier(s, "task_idempotency").as_string(None)
    tenants = sorted(want)
    for t in tenants:
        key = f"{t}:deposit:{next(o for t2, o, _a in old if t2 == t)}"
        assert "illegal transition succeeded -> processing" in refused(
            citus_store, f"UPDATE {records} SET status = 'processing' WHERE "
            "idempotency_key = %s AND shard_key = %s", key, t)
        assert "illegal transition (new) -> failed" in refused(
            citus_store, f"INSERT INTO {records} (idempotency_key, request_hash, status, "
            "namespace, shard_key) VALUES (%s, 'h', 'failed', %s, %s)",
            f"{t}:forged", NAMESPACE, t)
    assert len({worker(citus_store, f"{s}.task_idempotency", t) for t in tenants}) == 2
    assert snapshot(citus_store) >= before


COLOCATE_APP = """
import os
from kafka_idem import App

app = App("citus-colocate")


@app.migration
def tables(conn):
    for statement in os.environ["CASE_SQL"].split(";"):
        if statement.strip():
            conn.execute(statement)
    app.co_locate(conn, os.environ["CASE_TABLE"], os.environ["CASE_COLUMN"])
"""

# case: (the migration's statements, the table and column given to co_locate, what the
# one line of a refusal says after "app.co_locate: table SCHEMA.TABLE ")
CASES: dict[str, tuple[str, str, str, str]] = {
    "pk": ("CREATE TABLE {s}.t (id bigserial PRIMARY KEY, tenant text NOT NULL)", "t", "tenant",
           "has a primary key without tenant, t_pkey (PRIMARY KEY (id)): Citus needs the "
           "distribution column in every unique key; add tenant to it, e.g. PRIMARY KEY "
           "(tenant, id)"),
    "unique": ("CREATE TABLE {s}.t (tenant text, id text, code text, PRIMARY KEY (tenant, id), "
               "UNIQUE (code))", "t", "tenant", "has a unique constraint without tenant, "
               "t_code_key (UNIQUE (code))"),
    "int": ("CREATE TABLE {s}.t (tenant_no int, id bigserial, PRIMARY KEY (tenant_no, id))",
            "t", "tenant_no", "column tenant_no is integer, not text like the records' "
            "shard_key: Citus co-locates only columns of one type; make it text (ALTER TABLE "
            "{s}.t ALTER COLUMN tenant_no TYPE text) or name a text column"),
    "no column": ("CREATE TABLE {s}.t (id text PRIMARY KEY)", "t", "tenant",
                  "has no column tenant"),
    "no table": ("", "t", "tenant", "does not exist"),
    "by another column": (
        "CREATE TABLE {s}.t (tenant text, sku text, PRIMARY KEY (tenant, sku));"
        "SELECT create_distributed_table('{s}.t', 'sku')", "t", "tenant",
        "is distributed by sku, not tenant: a message's rows there would not share its "
        "record's shard; undistribute it (SELECT undistribute_table('{s}.t')) and run "
        "`kafka-idem migrate --app MODULE:APP` again"),
    "apart": ("CREATE TABLE {s}.t (tenant text PRIMARY KEY);"
              "SELECT create_distributed_table('{s}.t', 'tenant', colocate_with => 'none')",
              "t", "tenant", "is distributed by tenant apart from the store's records: "
              "co-locate it with SELECT update_distributed_table_colocation('{s}.t', "
              "colocate_with => '\"{store}\".\"task_idempotency\"')"),
    "reference": ("CREATE TABLE {s}.t (tenant text PRIMARY KEY);"
                  "SELECT create_reference_table('{s}.t')", "t", "tenant",
                  "has no distribution column (a reference or single-shard table)"),
}


def test_co_locate_refuses_a_table_it_cannot_place_with_the_records(
    citus_store: CitusStore, tmp_path: Any,
) -> None:
    """Each mistake: exit 2, one line naming the table, what is wrong and the fix; the
    migration rolled back (its table not created). A table that fits is distributed
    with the records, and a second run leaves it so."""
    (tmp_path / "colocate_app.py").write_text(COLOCATE_APP)
    s, store = citus_store.app_schema, citus_store.schema
    env = env_of(citus_store) | {"PYTHONPATH": f"{tmp_path}:{ROOT}"}
    done = cli(env, "migrate", "--citus")
    assert done.returncode == 0, done.stderr
    with psycopg.connect(citus_store.url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(s)))
    for case, (statements, table, column, said) in CASES.items():
        run = cli(env | {"CASE_SQL": statements.format(s=s), "CASE_TABLE": f"{s}.{table}",
                         "CASE_COLUMN": column}, "migrate", "--app", "colocate_app:app")
        assert run.returncode == 2, (case, run.stdout, run.stderr)
        (line,) = run.stderr.strip().splitlines()
        assert line.startswith(f"error: app.co_locate: table {s}.{table} "
                               f"{said.format(s=s, store=store)}"), (case, line)
        assert "(docs/CITUS.md)" in line, (case, line)
        assert citus_store.value("SELECT to_regclass(%s) IS NULL", (f"{s}.t",)), case
    good = {"CASE_SQL": f"CREATE TABLE IF NOT EXISTS {s}.t (tenant text, id bigserial, "
            "note text, PRIMARY KEY (tenant, id), UNIQUE (tenant, note))",
            "CASE_TABLE": f"{s}.t", "CASE_COLUMN": "tenant"}
    for _ in range(2):
        run = cli(env | good, "migrate", "--app", "colocate_app:app")
        assert run.returncode == 0, run.stderr
        assert citus_store.placement(f"{s}.t") == ("h", "tenant")
    groups = citus_store.rows("SELECT DISTINCT colocationid FROM pg_dist_partition WHERE "
                              "logicalrelid IN (%s::regclass, %s::regclass)",
                              (f"{s}.t", f"{store}.task_idempotency"))
    assert len(groups) == 1


def test_a_migration_after_distribution_changes_the_guard_on_every_shard(citus: str) -> None:
    """A store distributed at migration 0009, then migrated: 0010 (the guard's new
    (new) -> succeeded) is applied statement by statement, with the shards' triggers
    replaced; every shard then takes a one-row success and refuses (new) -> failed."""
    from kafka_idem.admin.migrate import distribute_store, migrate, migrations, render

    schema = f"m_{uuid.uuid4().hex[:10]}"
    versions = sql.Identifier(schema, "schema_migrations")
    records = sql.Identifier(schema, "task_idempotency")
    with psycopg.connect(citus, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        try:
            conn.execute(sql.SQL("CREATE TABLE {} (version integer PRIMARY KEY, name text NOT "
                                 "NULL, applied_at timestamptz NOT NULL DEFAULT now())").format(
                versions))
            for m in migrations():
                if m.version <= 9:
                    conn.execute(render(m, schema, "task_idempotency"))
                    conn.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(versions),
                                 (m.version, m.name))
            assert distribute_store(citus, schema, "task_idempotency", citus=True)
            assert [m.version for m in migrate(citus, schema, "task_idempotency")] == [10]
            keys = [f"k{i}" for i in range(8)]
            shard = "SELECT get_shard_id_for_distribution_column(%s::regclass, %s::text)"
            shards = {conn.execute(shard, (records.as_string(conn), k)).fetchone()
                      for k in keys}
            assert len(shards) > 1
            for k in keys:
                conn.execute(sql.SQL(
                    "INSERT INTO {} (namespace, idempotency_key, request_hash, status, "
                    "completed_token, attempts, shard_key) VALUES ('n', %s, 'h', 'succeeded', "
                    "gen_random_uuid(), 1, %s)").format(records), (k, k))
                with pytest.raises(psycopg.Error, match=r"illegal transition \(new\) -> failed"):
                    conn.execute(sql.SQL(
                        "INSERT INTO {} (namespace, idempotency_key, request_hash, status, "
                        "attempts, shard_key) VALUES ('n', %s, 'h', 'failed', 1, %s)").format(
                        records), (f"{k}-f", k))
            assert conn.execute(sql.SQL("SELECT count(*) FROM {} WHERE status = 'succeeded'")
                                .format(records)).fetchone() == (len(keys),)
        finally:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
