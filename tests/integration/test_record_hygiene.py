"""The record says what is true now: a success clears the error fields of earlier
failures, and a failed record dead-lettered again records when (real broker and
database)."""

from __future__ import annotations

import uuid

from consumers.payments import encode_charge
from kafka_idem.store import Delivery, Store, connect
from tests.conftest import DB, InProcess, Topics, caught_up, committed, headers, produce, wait_for
from tests.integration.support import charge_app, dlq_records, parse_ts

STORE = Store(schema="kafka_idem", table="task_idempotency", namespace="tests")


def _claim(conn: object, key: str) -> uuid.UUID:
    claim = STORE.claim(conn, key=key, request_hash="v1:x",  # type: ignore[arg-type]
                        delivery=Delivery("t", 0, 0, "h"), lease_seconds=30, max_attempts=5,
                        max_elapsed_seconds=3600)
    assert claim.token is not None
    return claim.token


def test_a_success_after_failures_clears_the_error_fields_and_keeps_the_failure_times(
    db: DB,
) -> None:
    key = f"t:{uuid.uuid4().hex}"
    conn = connect(db.dsn)
    with conn.transaction():
        token = _claim(conn, key)
        STORE.fail(conn, key=key, token=token, status="retryable_failed", kind="retryable",
                   error_class="Timeout", error_message="downstream slow", delay=0)
    with conn.transaction():
        token = _claim(conn, key)
        STORE.complete(conn, key=key, token=token, result={"ok": True})
    conn.close()
    rec = db.record(key)
    assert rec is not None and rec["status"] == "succeeded"
    assert (rec["error_kind"], rec["error_class"], rec["error_message"]) == (None, None, None)
    assert rec["first_failure_at"] is not None and rec["last_failure_at"] is not None
    assert rec["attempts"] == 2


def test_a_failed_record_dead_lettered_again_records_when(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=1)
    value = encode_charge("t1", "o1", "-5.00")  # a negative amount: permanent
    produce(topic, [(b"o1", value)])
    app = charge_app(db, topic, group)
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), what="the first dead letter")
        first = db.record("t1:charge:o1")
        assert first is not None and first["status"] == "failed"
        produce(topic, [(b"o1", value)])  # the same message again (a producer retry)
        wait_for(lambda: committed(group, topic) == {0: 2}, what="the second dead letter")

    again = db.record("t1:charge:o1")
    assert again is not None and again["status"] == "failed"
    assert again["attempts"] == first["attempts"]
    assert again["first_failure_at"] == first["first_failure_at"]
    assert again["last_failure_at"] > first["last_failure_at"]
    assert (again["kafka_offset"], again["error_kind"]) == (1, "permanent")
    letters = sorted(dlq_records(topic), key=lambda m: m.offset())
    assert len(letters) == 2
    h = headers(letters[1])
    assert h["idem.original.offset"] == "1"
    assert parse_ts(h["idem.last_failure_at"]) == again["last_failure_at"]
    assert parse_ts(h["idem.first_failure_at"]) == first["first_failure_at"]
