"""The claim/complete protocol against the real database (verification scenarios 1-4)."""

from __future__ import annotations

import multiprocessing as mp
import uuid
from collections import Counter
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from consumers.payments import encode_charge
from kafka_idem.errors import IllegalTransition, StaleOwner
from kafka_idem.keys import request_hash
from kafka_idem.store import Delivery, Outcome, Store, connect
from tests.apps.workers import process_one
from tests.conftest import DB, wait_for
from tests.integration.support import record_in

# Each test runs on one PostgreSQL and on Citus (the store distributed).
pytestmark = pytest.mark.both_stores

TOPIC = "protocol.charge-requested"
KEY = "t1:charge:o1"


def race(db: DB, mode: str, values: list[bytes], hold: float = 0.0) -> list[tuple[Any, ...]]:
    """Run one process per value, released together by a barrier; return their results."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(values))
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=process_one,
                    args=(db.dsn, TOPIC, mode, value, i, barrier, queue, hold))
        for i, value in enumerate(values)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=90) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


@pytest.mark.parametrize("mode", ["local", "leased"])
def test_concurrent_duplicates_behind_a_barrier_take_effect_once(db: DB, mode: str) -> None:
    value = encode_charge("t1", "o1", "10.00")
    results = race(db, mode, [value] * 6, hold=0.3)
    outcomes = Counter(r[1] for r in results)
    assert outcomes["succeeded"] == 1, results
    assert set(outcomes) <= {"succeeded", "replayed", "busy"}, results
    assert db.ledger_counts() == {KEY: 1}
    assert db.balances() == {("t1", "EUR"): Decimal("10.00")}
    rec = db.record(KEY)
    assert rec is not None
    assert rec["status"] == "succeeded"
    assert rec["attempts"] == 1
    assert rec["result_json"] == {"order_id": "o1", "amount": "10.00", "currency": "EUR"}


@pytest.mark.parametrize("mode", ["local", "leased"])
def test_same_key_different_payload_concurrently_keeps_the_first(db: DB, mode: str) -> None:
    amounts = ["10.00", "20.00", "30.00", "40.00"]
    results = race(db, mode, [encode_charge("t1", "o1", a) for a in amounts], hold=0.3)
    outcomes = Counter(r[1] for r in results)
    assert outcomes["succeeded"] == 1, results
    assert set(outcomes) <= {"succeeded", "conflict"}, results
    assert all(r[2] == "payload_conflict" for r in results if r[1] == "conflict")
    ledger = db.ledger()
    assert len(ledger) == 1
    winner = ledger[0]["amount"]
    rec = db.record(KEY)
    assert rec is not None and rec["status"] == "succeeded"
    assert rec["request_hash"] == request_hash({"amount": winner, "currency": "EUR"})
    assert db.balances() == {("t1", "EUR"): winner}


def _claim(store: Store, conn: Any, *, lease: float, h: str = "v1:sha256:aa") -> Any:
    with conn.transaction():
        return store.claim(conn, key=KEY, request_hash=h,
                           delivery=Delivery(TOPIC, 0, 0, "charge"), lease_seconds=lease,
                           max_attempts=5, max_elapsed_seconds=3600)


def _ledger_write(conn: Any, who: str) -> None:
    conn.execute("INSERT INTO payments.ledger (tenant_id, order_id, amount, currency, "
                 "idempotency_key) VALUES ('t1', %s, 1, 'EUR', %s)", (who, KEY))


def test_stale_owner_cannot_commit_after_lease_takeover(db: DB) -> None:
    store = db.store(namespace="tests")
    a_conn, b_conn = connect(db.dsn), connect(db.dsn)
    a = _claim(store, a_conn, lease=0.2)
    assert a.outcome is Outcome.CLAIMED and a.attempts == 1
    # While A's lease is live, B is told to wait.
    busy = _claim(store, b_conn, lease=30)
    assert busy.outcome is Outcome.BUSY or busy.took_over
    wait_for(lambda: db.value("SELECT lease_until < clock_timestamp() FROM "
                              "kafka_idem.task_idempotency WHERE idempotency_key = %s", (KEY,)),
             what="A's lease to expire by the database clock")
    b = _claim(store, b_conn, lease=30)
    assert b.outcome is Outcome.CLAIMED and b.took_over
    assert b.token != a.token and b.attempts == 2
    assert b.previous_error_kind == "lease_expired"

    # A wakes up and tries to finish: its business write rolls back with the refused completion.
    with pytest.raises(StaleOwner), a_conn.transaction():
        _ledger_write(a_conn, "A")
        store.complete(a_conn, key=KEY, token=a.token, result={"by": "A"})
    assert db.ledger() == []

    with b_conn.transaction():
        _ledger_write(b_conn, "B")
        store.complete(b_conn, key=KEY, token=b.token, result={"by": "B"})
    rec = db.record(KEY)
    assert rec is not None
    assert (rec["status"], rec["attempts"], rec["completed_token"]) == ("succeeded", 2, b.token)
    assert rec["result_json"] == {"by": "B"}
    assert [r["order_id"] for r in db.ledger()] == ["B"]
    a_conn.close()
    b_conn.close()


def test_a_withdrawn_claim_is_no_takeover_unless_it_was_one_itself(db: DB) -> None:
    """A claim withdrawn before its call (a stop or a revoke) made no call: the next
    claim is no takeover and owes no reconcile for it, nor is it charged against the
    limit. A withdrawn claim that had itself taken over a lease that ran out mid-call
    never reconciled that call: the claim after it still does."""
    store = db.store(namespace="tests")
    conn = connect(db.dsn)
    first = _claim(store, conn, lease=30)
    assert first.outcome is Outcome.CLAIMED and not first.took_over
    with conn.transaction():
        assert store.withdraw_claim(conn, key=KEY, token=first.token, took_over=False)
    again = _claim(store, conn, lease=0.2)
    assert again.outcome is Outcome.CLAIMED and again.token != first.token
    assert (again.took_over, again.previous_error_kind, again.attempts, again.budget_used) == (
        False, None, 2, 1)
    rec = db.record(KEY)
    assert rec is not None and rec["next_attempt_at"] is None  # the mark is gone with it
    # This claim's lease runs out (its owner died mid-call): the next one takes over...
    wait_for(lambda: db.value("SELECT lease_until < clock_timestamp() FROM "
                              "kafka_idem.task_idempotency WHERE idempotency_key = %s", (KEY,)),
             what="the lease to run out by the database clock")
    taking = _claim(store, conn, lease=30)
    assert (taking.took_over, taking.previous_error_kind) == (True, "lease_expired")
    # ... and is withdrawn before its call (and its reconcile) ran: still owed.
    with conn.transaction():
        assert store.withdraw_claim(conn, key=KEY, token=taking.token, took_over=True)
    last = _claim(store, conn, lease=30)
    assert (last.took_over, last.previous_error_kind) == (True, "lease_expired")
    # A stale token withdraws nothing.
    with conn.transaction():
        assert not store.withdraw_claim(conn, key=KEY, token=first.token, took_over=False)
    rec = db.record(KEY)
    assert rec is not None
    assert (rec["status"], rec["owner_token"], rec["attempts"], rec["attempt_base"]) == (
        "processing", last.token, 4, 2)
    conn.close()


def test_database_refuses_completion_with_a_stale_token_even_in_plain_sql(db: DB) -> None:
    store = db.store(namespace="tests")
    conn = connect(db.dsn)
    claim = _claim(store, conn, lease=30)
    with psycopg.connect(db.dsn) as raw, pytest.raises(psycopg.Error) as err:
        raw.execute("UPDATE kafka_idem.task_idempotency SET status = 'succeeded', "
                    "completed_token = %s WHERE idempotency_key = %s", (uuid.uuid4(), KEY))
    assert err.value.sqlstate == "KI002"
    rec = db.record(KEY)
    assert rec is not None and rec["status"] == "processing" and rec["owner_token"] == claim.token
    conn.close()


def test_repeat_after_success_replays_the_stored_result_exactly(db: DB) -> None:
    store = db.store(namespace="tests")
    conn = connect(db.dsn)
    # falsy results are results (never mistaken for "no result")
    for result in (0, False, [], None, {"a": 1}):
        key = f"t1:charge:{uuid.uuid4().hex}"
        with conn.transaction():
            c = store.claim(conn, key=key, request_hash="v1:x", delivery=Delivery(TOPIC, 0, 0, "h"),
                            lease_seconds=30, max_attempts=5, max_elapsed_seconds=3600)
            assert c.token is not None
            store.complete(conn, key=key, token=c.token, result=result)
        before = db.record(key)
        with conn.transaction():
            again = store.claim(conn, key=key, request_hash="v1:x",
                                delivery=Delivery(TOPIC, 0, 1, "h"), lease_seconds=30,
                                max_attempts=5, max_elapsed_seconds=3600)
        assert again.outcome is Outcome.REPLAY
        assert again.result == result and type(again.result) is type(result)
        assert db.record(key) == before  # a replay writes nothing
    conn.close()


ILLEGAL = [
    ("succeeded", "processing"),
    ("succeeded", "retryable_failed"),
    ("succeeded", "failed"),
    ("failed", "processing"),
    ("failed", "succeeded"),
    ("failed", "retryable_failed"),  # only inside an audited admin re-run
    ("retryable_failed", "succeeded"),
]


@pytest.mark.parametrize(("old", "new"), ILLEGAL)
def test_database_rejects_illegal_transitions(db: DB, old: str, new: str) -> None:
    key = record_in(db, old)
    with psycopg.connect(db.dsn) as conn, pytest.raises(psycopg.Error) as err:
        # a token from here: Citus refuses volatile functions in a distributed UPDATE
        conn.execute("UPDATE kafka_idem.task_idempotency SET status = %s, owner_token = %s, "
                     "lease_until = now() + interval '1 minute' "
                     "WHERE idempotency_key = %s", (new, uuid.uuid4(), key))
    assert err.value.sqlstate == "KI001"
    rec = db.record(key)
    assert rec is not None and rec["status"] == old


def test_database_rejects_silent_deletes_and_new_rows_not_processing(db: DB) -> None:
    key = record_in(db, "succeeded")
    with psycopg.connect(db.dsn) as conn, pytest.raises(psycopg.Error) as err:
        conn.execute("DELETE FROM kafka_idem.task_idempotency WHERE idempotency_key = %s", (key,))
    assert err.value.sqlstate == "KI001"
    with psycopg.connect(db.dsn) as conn, pytest.raises(psycopg.Error) as err:
        # with a shard key: Citus needs the distribution column before the guard can look
        conn.execute("INSERT INTO kafka_idem.task_idempotency (idempotency_key, shard_key, "
                     "request_hash, status) VALUES ('x', 'x', 'v1:x', 'succeeded')")
    assert err.value.sqlstate == "KI001"
    assert db.record(key) is not None


def test_store_error_translation_maps_transition_refusal(db: DB) -> None:
    store = db.store(namespace="tests")
    key = record_in(db, "failed")
    conn = connect(db.dsn)
    with pytest.raises(IllegalTransition), conn.transaction():
        # failed -> processing through the store's own SQL is refused by the guard
        from kafka_idem.store import translate_errors
        with translate_errors(key=key):
            conn.execute(store.q["claim_take"], {"ns": store.ns, "key": key,
                                                 "token": uuid.uuid4(), "lease": 30,
                                                 "charge": 1, "handler": "h", "topic": TOPIC,
                                                 "partition": 0, "offset": 0,
                                                 "shard": store.shard_of(key, None)})
    conn.close()
