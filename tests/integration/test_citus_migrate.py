"""Distributing a store that already ran on one PostgreSQL (``kafka-idem migrate --citus``
on a store with records), and ``app.co_locate``'s refusals, on a real Citus cluster. The
app: tests/apps/citus_ledger.py (its tables co-located by ``app.co_locate``, which does
nothing while the store is local)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.apps.citus_ledger import encode
from tests.citus import CitusStore
from tests.conftest import Members, Topics, caught_up, produce, wait_for
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
        assert "illegal transition (new) -> succeeded" in refused(
            citus_store, f"INSERT INTO {records} (idempotency_key, request_hash, status, "
            "completed_token, namespace, shard_key) VALUES (%s, 'h', 'succeeded', "
            "gen_random_uuid(), %s, %s)", f"{t}:forged", NAMESPACE, t)
    assert len({worker(citus_store, f"{s}.task_idempotency", t) for t in tenants}) == 2
    assert snapshot(citus_store) >= before
