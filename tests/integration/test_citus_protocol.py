"""The claim / complete protocol on a store distributed on Citus, statement by statement:
the guard's triggers refuse illegal transitions on the workers' shards, a stale owner's
completion is fenced (KI002 raised on the worker, StaleOwner here), duplicates racing on
one key leave one claim, and leases, heartbeats and withdrawals run on the database's
clock, each statement routed to the record's shard (its ``shard_key``)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from kafka_idem.admin.migrate import distribute_store, migrate
from kafka_idem.errors import StaleOwner
from kafka_idem.store import Delivery, Outcome, Store, connect
from tools import citus as citus_db

DELIVERY = Delivery("protocol.citus", 0, 7, "charge")


@pytest.fixture(scope="module")
def citus_dsn(citus: str) -> Iterator[str]:
    name = f"kafka_idem_citus_{uuid.uuid4().hex[:10]}"
    dsn = citus_db.create_database(citus, name)
    migrate(dsn, "kafka_idem", "task_idempotency")
    assert distribute_store(dsn, "kafka_idem", "task_idempotency", citus=None)
    yield dsn
    citus_db.drop_database(citus, name)


@pytest.fixture
def store() -> Store:
    return Store(schema="kafka_idem", table="task_idempotency",
                 namespace=f"ns-{uuid.uuid4().hex[:8]}", distributed=True)


def claim(store: Store, conn: Any, key: str, *, shard: str, lease: float = 30.0,
          h: str = "v1:sha256:aa") -> Any:
    with conn.transaction():
        return store.claim(conn, key=key, request_hash=h, delivery=DELIVERY, lease_seconds=lease,
                           max_attempts=5, max_elapsed_seconds=3600, shard=shard)


def record(dsn: str, store: Store, key: str) -> dict[str, Any]:
    with psycopg.connect(dsn) as conn:
        cur = conn.cursor(row_factory=psycopg.rows.dict_row)
        row = cur.execute("SELECT * FROM kafka_idem.task_idempotency WHERE namespace = %s "
                          "AND idempotency_key = %s", (store.ns, key)).fetchone()
    assert row is not None
    return row


def test_a_stale_owner_cannot_complete_after_a_takeover(citus_dsn: str, store: Store) -> None:
    conn = connect(citus_dsn)
    try:
        first = claim(store, conn, "t1:charge:o1", shard="t1", lease=0.2)
        assert first.outcome is Outcome.CLAIMED
        with psycopg.connect(citus_dsn, autocommit=True) as c:  # the lease runs out
            c.execute("SELECT pg_sleep(0.3)")
        second = claim(store, conn, "t1:charge:o1", shard="t1")
        assert second.outcome is Outcome.CLAIMED and second.token != first.token
        assert second.attempts == 2
        with pytest.raises(StaleOwner), conn.transaction():
            store.complete(conn, key="t1:charge:o1", token=first.token, result={"by": "a"},
                           shard="t1")
        with conn.transaction():
            store.complete(conn, key="t1:charge:o1", token=second.token, result={"by": "b"},
                           shard="t1")
    finally:
        conn.close()
    rec = record(citus_dsn, store, "t1:charge:o1")
    assert (rec["status"], rec["completed_token"], rec["result_json"], rec["shard_key"]) == (
        "succeeded", second.token, {"by": "b"}, "t1")


def test_the_guard_refuses_illegal_transitions_on_the_shards(citus_dsn: str,
                                                             store: Store) -> None:
    conn = connect(citus_dsn)
    try:
        got = claim(store, conn, "t2:charge:o1", shard="t2")
        with conn.transaction():
            store.complete(conn, key="t2:charge:o1", token=got.token, result=None, shard="t2")
        for statement in (
            "UPDATE kafka_idem.task_idempotency SET status = 'processing', lease_until = "
            "statement_timestamp(), owner_token = %s WHERE namespace = %s AND "
            "idempotency_key = 't2:charge:o1' AND shard_key = 't2'",
            "DELETE FROM kafka_idem.task_idempotency WHERE namespace = %s AND idempotency_key "
            "= 't2:charge:o1' AND shard_key = 't2'",
            "INSERT INTO kafka_idem.task_idempotency (namespace, idempotency_key, request_hash,"
            " status, error_kind, shard_key) VALUES (%s, 't2:charge:o2', 'h', "
            "'failed', %s, 't2')",
        ):
            params = ((uuid.uuid4(), store.ns) if statement.startswith("UPDATE") else
                      (store.ns,) if statement.startswith("DELETE") else (store.ns, "permanent"))
            with pytest.raises(psycopg.Error) as caught, conn.transaction():
                conn.execute(statement, params)
            assert caught.value.sqlstate == "KI001"
    finally:
        conn.close()
    assert record(citus_dsn, store, "t2:charge:o1")["status"] == "succeeded"


def test_duplicates_racing_on_one_key_leave_one_claim(citus_dsn: str, store: Store) -> None:
    barrier, outcomes, errors = threading.Barrier(6), [], []

    def one() -> None:
        conn = connect(citus_dsn)
        try:
            barrier.wait(timeout=30)
            outcomes.append(claim(store, conn, "t3:charge:o1", shard="t3").outcome)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            conn.close()

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert outcomes.count(Outcome.CLAIMED) == 1
    assert set(outcomes) <= {Outcome.CLAIMED, Outcome.BUSY}
    rec = record(citus_dsn, store, "t3:charge:o1")
    assert (rec["status"], rec["attempts"]) == ("processing", 1)


def test_heartbeat_withdrawal_and_failure_run_on_the_records_shard(citus_dsn: str,
                                                                  store: Store) -> None:
    conn = connect(citus_dsn)
    try:
        got = claim(store, conn, "t4:charge:o1", shard="t4", lease=5.0)
        before = record(citus_dsn, store, "t4:charge:o1")["lease_until"]
        with conn.transaction():
            assert store.extend_lease(conn, key="t4:charge:o1", token=got.token,
                                      lease_seconds=60, shard="t4")
        assert record(citus_dsn, store, "t4:charge:o1")["lease_until"] > before
        with conn.transaction():
            assert store.withdraw_claim(conn, key="t4:charge:o1", token=got.token,
                                        took_over=False, shard="t4")
        again = claim(store, conn, "t4:charge:o1", shard="t4")
        assert again.outcome is Outcome.CLAIMED and again.token != got.token
        with conn.transaction():
            failed = store.fail(conn, key="t4:charge:o1", token=again.token,
                                status="retryable_failed", kind="transient",
                                error_class="Boom", error_message="boom", delay=30.0,
                                shard="t4")
        assert failed.next_attempt_at is not None
        assert failed.first_failure_at == failed.last_failure_at
        with pytest.raises(StaleOwner), conn.transaction():  # no longer processing: fenced
            store.complete(conn, key="t4:charge:o1", token=again.token, result=None,
                           shard="t4")
    finally:
        conn.close()
    rec = record(citus_dsn, store, "t4:charge:o1")
    assert (rec["status"], rec["error_class"], rec["attempts"]) == (
        "retryable_failed", "Boom", 2)
    assert rec["next_attempt_at"] > rec["last_failure_at"]
