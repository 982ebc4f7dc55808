"""One message's bad data never holds its partition, and a finished lease is never
reported lost: against the real broker and database."""

from __future__ import annotations

import threading
import uuid

import psycopg

from consumers.payments import encode_charge
from kafka_idem.lease import LeaseKeeper
from kafka_idem.store import Delivery, Store, connect
from tests.conftest import DB, InProcess, Topics, caught_up, committed, headers, produce, wait_for
from tests.integration.support import charge_app, dlq_records

# A business rule checked at COMMIT (a deferred constraint trigger): the database
# refuses the whole transaction, not one statement, so no savepoint can isolate it.
DEFERRED_CHECK = """
CREATE FUNCTION payments.no_poison() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    IF NEW.order_id LIKE 'poison%' THEN
        RAISE EXCEPTION 'poisoned order %', NEW.order_id USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END
$fn$;
CREATE CONSTRAINT TRIGGER no_poison AFTER INSERT ON payments.ledger
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION payments.no_poison();
"""


def test_a_commit_refused_for_one_messages_data_dead_letters_that_message_alone(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=1)
    with psycopg.connect(db.dsn) as conn:
        conn.execute(DEFERRED_CHECK)
    orders = ["o1", "o2", "poison-3", "o4", "o5"]
    values = [encode_charge("t1", o, "10.00") for o in orders]
    produce(topic, [(o.encode(), v) for o, v in zip(orders, values, strict=True)])
    app = charge_app(db, topic, group)
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), timeout=60,
                 what="the partition to get past the poisoned commit")

    assert sorted(db.ledger_counts()) == ["t1:charge:o1", "t1:charge:o2", "t1:charge:o4",
                                          "t1:charge:o5"]
    assert db.record("t1:charge:poison-3") is None  # its transaction never committed
    assert db.status_counts() == {"succeeded": 4}
    letters = dlq_records(topic)
    assert len(letters) == 1
    h = headers(letters[0])
    assert h["idem.original.offset"] == "2"
    assert h["idem.error.kind"] == "permanent"
    assert h["idem.error.class"] == "DataRejected"
    assert "SQLSTATE 23514" in h["idem.error.message"]
    assert "poisoned order" in h["idem.error.message"]
    assert h["idem.key"] == "t1:charge:poison-3"
    assert letters[0].value() == values[2]
    assert committed(group, topic) == {0: 5}


def _waiting_on_a_lock(dsn: str) -> bool:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'kafka_idem:leases'"
            " AND wait_event_type = 'Lock'"
        ).fetchone()
    return bool(row and row[0])


def test_a_heartbeat_racing_the_completion_commit_is_not_a_lost_lease(db: DB) -> None:
    """The heartbeat's extension waits on the completion's row lock and finds the
    record succeeded once the owner commits: its own finished work, not a loss."""
    store = Store(schema="kafka_idem", table="task_idempotency")
    key = f"t:{uuid.uuid4().hex}"
    owner = connect(db.dsn)
    with owner.transaction():
        claim = store.claim(owner, key=key, request_hash="v1:x",
                            delivery=Delivery("t", 0, 0, "h"), lease_seconds=30,
                            max_attempts=5, max_elapsed_seconds=3600)
    assert claim.token is not None
    keeper = LeaseKeeper(store, db.dsn, lease_seconds=30)
    with keeper.hold(key, claim.token) as hold:
        with owner.transaction():
            store.complete(owner, key=key, token=claim.token, result={"ok": True})
            beat = threading.Thread(target=keeper.beat)  # it sees the hold, still held
            beat.start()
            wait_for(lambda: _waiting_on_a_lock(db.dsn), timeout=10,
                     what="the heartbeat to wait on the completion's row lock")
            hold.release()  # what the processor does before its commit
        beat.join(timeout=10)
        assert not beat.is_alive()
        assert not hold.lost.is_set()
    rec = db.record(key)
    assert rec is not None and rec["status"] == "succeeded"
    owner.close()


def test_a_heartbeat_finding_the_key_taken_over_reports_the_loss(db: DB) -> None:
    store = Store(schema="kafka_idem", table="task_idempotency")
    key = f"t:{uuid.uuid4().hex}"
    conn = connect(db.dsn)
    with conn.transaction():
        first = store.claim(conn, key=key, request_hash="v1:x",
                            delivery=Delivery("t", 0, 0, "h"), lease_seconds=0.01,
                            max_attempts=5, max_elapsed_seconds=3600)
    assert first.token is not None
    keeper = LeaseKeeper(store, db.dsn, lease_seconds=30)
    with keeper.hold(key, first.token) as hold:
        wait_for(lambda: db.value("SELECT lease_until < clock_timestamp() FROM "
                                  "kafka_idem.task_idempotency WHERE idempotency_key = %s",
                                  (key,)), timeout=10, what="the lease to expire")
        with conn.transaction():
            second = store.claim(conn, key=key, request_hash="v1:x",
                                 delivery=Delivery("t", 0, 1, "h"), lease_seconds=30,
                                 max_attempts=5, max_elapsed_seconds=3600)
        assert second.took_over
        keeper.beat()
        assert hold.lost.is_set()
    conn.close()
