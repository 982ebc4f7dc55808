"""Retries, backoff, exhaustion and the dead-letter topic against the real broker and
database (verification scenario 6). Every check reads durable state: the
idempotency records (and their history, kept by a trigger), the business tables, the
DLQ records and headers, and the group's committed offsets."""

from __future__ import annotations

import random
import threading
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from consumers import payments
from consumers.payments import encode_charge
from kafka_idem import Context, Permanent, Retryable, RetryPolicy
from tests.conftest import (
    DB,
    InProcess,
    Topics,
    caught_up,
    committed,
    end_offsets,
    headers,
    produce,
    read_topic,
    wait_for,
)
from tests.integration.support import (
    HANDLER,
    assert_dead_letter,
    charge_app,
    claims,
    dlq_records,
    failures,
    record_history,
    seeded,
)

# Each test runs on one PostgreSQL and on Citus (the store distributed).
pytestmark = pytest.mark.both_stores

KEY = "t1:charge:o1"
# Scheduling slack on top of a backoff: the loop's own round trip (consume wait,
# claim). Generous on purpose: the lower bound is the property, this only catches
# a retry that forgot its delay altogether.
SLACK = 2.0


def _status(db: DB, key: str) -> str | None:
    rec = db.record(key)
    return rec["status"] if rec else None


def _source(topic: str, offset: int, partition: int = 0) -> Any:
    found = [m for m in read_topic(topic) if m.offset() == offset and m.partition() == partition]
    assert len(found) == 1
    return found[0]


def test_transient_errors_back_off_with_jitter_then_exhaust_into_the_dlq(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=1)
    record_history(db)
    seed = 20240501
    policy = RetryPolicy(base=0.2, cap=1.0, max_attempts=4, max_elapsed=600,
                         rng=random.Random(seed))
    twin = random.Random(seed)  # the same draws, in the same order, as the policy's
    expected = [twin.uniform(0.0, policy.bound(n)) for n in (1, 2, 3)]

    def write_then_fail(msg: payments.ChargeRequested, ctx: Context) -> Any:
        payments.charge(msg, ctx)  # business writes first: they must roll back
        raise Retryable(f"downstream busy on attempt {ctx.attempt}")

    produce(topic, [(b"o1", encode_charge("t1", "o1", "10.00"))])
    app = charge_app(db, topic, group, write_then_fail, retry=policy)
    with InProcess(app) as r:
        wait_for(lambda: caught_up(group, topic), what="the exhausted message to be committed")
        exhausted = r.runner.metrics.exhausted.labels(topic, HANDLER)._value.get()
        dead = r.runner.metrics.dead_lettered.labels(topic, HANDLER, "exhausted")._value.get()

    # Attempts: 1, 2, 3, 4, durable, each after the stored backoff.
    taken = claims(db, KEY)
    failed = failures(db, KEY)
    assert [c["attempts"] for c in taken] == [1, 2, 3, 4]
    assert [f["attempts"] for f in failed] == [1, 2, 3]
    for n, (fail, want, nxt) in enumerate(zip(failed, expected, taken[1:], strict=True), 1):
        stored = (fail["next_attempt_at"] - fail["last_failure_at"]).total_seconds()
        assert 0.0 <= stored <= policy.bound(n)
        assert stored == pytest.approx(want, abs=0.01), f"delay {n} is not the policy's draw"
        assert nxt["updated_at"] >= fail["next_attempt_at"], f"attempt {n + 1} came early"
        gap = (nxt["updated_at"] - fail["last_failure_at"]).total_seconds()
        assert want <= gap <= want + SLACK
    assert policy.bound(1) < policy.bound(2) < policy.bound(3)

    # Stopped at the limit: failed, exhausted, the last error kept.
    rec = db.record(KEY)
    assert rec is not None
    assert rec["status"] == "failed"
    assert rec["error_kind"] == "exhausted"
    assert rec["error_class"] == "Retryable"
    assert "downstream busy on attempt 4" in rec["error_message"]
    assert rec["attempts"] == policy.max_attempts
    assert rec["next_attempt_at"] is None

    # One DLQ record with the whole header contract; nothing written; offset committed.
    letters = dlq_records(topic)
    assert len(letters) == 1
    assert_dead_letter(letters[0], _source(topic, 0), kind="exhausted", attempts=4, group=group,
                       key=KEY, record=rec)
    assert db.ledger() == []
    assert db.balances() == {}
    assert committed(group, topic) == {0: 1}
    assert exhausted == 1
    assert dead == 1


def test_retries_stop_at_the_elapsed_time_limit(db: DB, topics: Topics, group: str) -> None:
    topic = topics(partitions=1)
    policy = RetryPolicy(base=0.1, cap=0.2, max_attempts=1000, max_elapsed=1.0)

    def always_busy(msg: payments.ChargeRequested, ctx: Context) -> Any:
        raise Retryable("still busy")

    produce(topic, [(b"o1", encode_charge("t1", "o1", "10.00"))])
    with InProcess(charge_app(db, topic, group, always_busy, retry=policy)) as r:
        wait_for(lambda: caught_up(group, topic), what="the key to run out of time")
        exhausted = r.runner.metrics.exhausted.labels(topic, HANDLER)._value.get()
    rec = db.record(KEY)
    assert rec is not None
    assert (rec["status"], rec["error_kind"]) == ("failed", "exhausted")
    assert 2 <= rec["attempts"] < policy.max_attempts
    assert (rec["last_failure_at"] - rec["first_failure_at"]).total_seconds() >= 1.0
    (letter,) = dlq_records(topic)
    assert_dead_letter(letter, _source(topic, 0), kind="exhausted", attempts=rec["attempts"],
                       group=group, key=KEY, record=rec)
    assert exhausted == 1


def test_permanent_error_is_dead_lettered_at_once_and_the_partition_moves_on(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=1)
    record_history(db)

    def declined(msg: payments.ChargeRequested, ctx: Context) -> Any:
        result = payments.charge(msg, ctx)
        if msg.order_id == "o1":
            raise Permanent("card declined")
        if msg.order_id == "o3":  # a huge error text must not bloat the record or the DLQ
            raise Permanent("fraud check: " + "ü" * 20_000)
        return result

    produce(topic, [(b"o1", encode_charge("t1", "o1", "10.00")),
                    (b"o2", encode_charge("t1", "o2", "4.00")),
                    (b"o3", encode_charge("t1", "o3", "1.00"))])
    app = charge_app(db, topic, group, declined,
                     retry=RetryPolicy(base=0.1, cap=0.2, max_attempts=5))
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), what="the partition to drain")

    rec = db.record(KEY)
    assert rec is not None
    assert (rec["status"], rec["error_kind"], rec["attempts"]) == ("failed", "permanent", 1)
    assert rec["error_class"] == "Permanent" and rec["error_message"] == "card declined"
    assert [c["attempts"] for c in claims(db, KEY)] == [1]  # never retried
    letters = dlq_records(topic)
    assert len(letters) == 2
    assert_dead_letter(dlq_records(topic, source_offset=0)[0], _source(topic, 0),
                       kind="permanent", attempts=1, group=group, key=KEY, record=rec)
    big = db.record("t1:charge:o3")
    assert big is not None and big["status"] == "failed"
    limit = app.settings.error_message_max
    assert len(big["error_message"].encode()) <= limit
    (big_letter,) = dlq_records(topic, source_offset=2)
    h = assert_dead_letter(big_letter, _source(topic, 2), kind="permanent", attempts=1,
                           group=group, key="t1:charge:o3", record=big)
    assert len(h["idem.error.message"].encode()) <= limit
    assert sum(len(k) + len(v or b"") for k, v in big_letter.headers()) < 2 * limit
    assert db.ledger_counts() == {"t1:charge:o2": 1}
    assert db.balances() == {("t1", "EUR"): Decimal("4.00")}
    assert committed(group, topic) == {0: 3}


def test_poison_bytes_are_dead_lettered_as_undecodable_and_the_consumer_keeps_going(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=1)
    truncated = encode_charge("t1", "ox", "1.00")[:12]
    produce(topic, [(b"o1", encode_charge("t1", "o1", "1.00")),
                    (b"junk", b"\xff\xfenot avro at all"),
                    (None, truncated),
                    (b"o2", encode_charge("t1", "o2", "2.00"))])
    with InProcess(charge_app(db, topic, group)):
        wait_for(lambda: caught_up(group, topic), what="the partition to drain")

    letters = sorted(dlq_records(topic), key=lambda m: int(headers(m)["idem.original.offset"]))
    assert [headers(m)["idem.original.offset"] for m in letters] == ["1", "2"]
    for letter, offset in zip(letters, (1, 2), strict=True):
        h = assert_dead_letter(letter, _source(topic, offset), kind="undecodable", attempts=0,
                               group=group, key=None)
        assert h["idem.error.class"] == "Undecodable"
    assert letters[1].key() is None and letters[1].value() == truncated
    assert db.ledger_counts() == {"t1:charge:o1": 1, "t1:charge:o2": 1}
    assert {r["idempotency_key"] for r in db.records()} == {"t1:charge:o1", "t1:charge:o2"}
    assert committed(group, topic) == {0: 4}


def test_payload_conflict_is_dead_lettered_and_the_original_record_is_untouched(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=1)
    produce(topic, [(b"o1", encode_charge("t1", "o1", "10.00"))])
    with InProcess(charge_app(db, topic, group)):
        wait_for(lambda: caught_up(group, topic), what="the first charge")
        before = db.record(KEY)
        conflicting = encode_charge("t1", "o1", "20.00")
        produce(topic, [(b"o1", conflicting), (b"o2", encode_charge("t1", "o2", "3.00"))])
        wait_for(lambda: caught_up(group, topic), what="the conflict to be dead-lettered")

    assert before is not None and before["status"] == "succeeded"
    assert db.record(KEY) == before  # hash, result, attempts, updated_at: all unchanged
    letters = dlq_records(topic)
    assert len(letters) == 1
    assert_dead_letter(letters[0], _source(topic, 1), kind="payload_conflict", attempts=1,
                       group=group, key=KEY)
    assert letters[0].value() == conflicting
    assert db.ledger_counts() == {KEY: 1, "t1:charge:o2": 1}
    assert db.balances() == {("t1", "EUR"): Decimal("13.00")}
    assert committed(group, topic) == {0: 3}


def test_unavailable_dlq_holds_the_offset_and_the_record_arrives_once_when_back(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=1, dlq=False)  # no DLQ topic, and the broker won't auto-create
    dlq = f"{topic}.dlq"
    produce(topic, [(b"o1", encode_charge("t1", "o1", "1.00")),
                    (b"o2", encode_charge("t1", "o2", "0")),  # Permanent: amount must be positive
                    (b"o3", encode_charge("t1", "o3", "3.00"))])
    app = charge_app(db, topic, group, kafka={"message.timeout.ms": 2000})
    with InProcess(app) as r:
        dlq_failed = r.runner.metrics.dlq_failures.labels(dlq)
        wait_for(lambda: dlq_failed._value.get() >= 2, timeout=60,
                 what="two failed dead-letter produces")
        # The permanent failure could not be dead-lettered: its offset, and every later
        # offset of the partition, stay uncommitted.
        assert committed(group, topic)[0] <= 1
        rec = db.record("t1:charge:o2")
        assert rec is not None and (rec["status"], rec["error_kind"]) == ("failed", "permanent")
        topics.create([dlq])
        wait_for(lambda: caught_up(group, topic), timeout=60,
                 what="the offset to advance once the DLQ exists")
    letters = dlq_records(topic, source_offset=1)
    assert len(letters) == 1
    assert len(dlq_records(topic)) == 1
    assert_dead_letter(letters[0], _source(topic, 1), kind="permanent", attempts=1, group=group,
                       key="t1:charge:o2", record=db.record("t1:charge:o2"))
    assert db.ledger_counts() == {"t1:charge:o1": 1, "t1:charge:o3": 1}


def test_restart_during_a_backoff_keeps_the_attempt_count_and_honours_the_delay(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=1)
    record_history(db)
    seed = seeded(4.0, at_least=3.5)

    def first_attempt_fails(msg: payments.ChargeRequested, ctx: Context) -> Any:
        if ctx.attempt == 1:  # were the count reset, every attempt would be "1" and fail
            raise Retryable("transient on the first attempt")
        return payments.charge(msg, ctx)

    def member() -> InProcess:
        policy = RetryPolicy(base=4.0, cap=4.0, max_attempts=5, rng=random.Random(seed))
        return InProcess(charge_app(db, topic, group, first_attempt_fails, retry=policy))

    produce(topic, [(b"o1", encode_charge("t1", "o1", "7.00"))])
    with member():
        wait_for(lambda: _status(db, KEY) == "retryable_failed", what="the first failure")
    # Stopped inside the backoff (the delay is >= 3.5 s by the seed).
    assert db.value("SELECT next_attempt_at > clock_timestamp() FROM kafka_idem.task_idempotency"
                    " WHERE idempotency_key = %s", (KEY,))
    assert committed(group, topic)[0] < 0
    with member():
        wait_for(lambda: caught_up(group, topic), what="the new member to finish the retry")

    rec = db.record(KEY)
    assert rec is not None and rec["status"] == "succeeded"
    assert rec["attempts"] == 2
    taken = claims(db, KEY)
    (failure,) = failures(db, KEY)
    assert [c["attempts"] for c in taken] == [1, 2]
    assert taken[1]["updated_at"] >= failure["next_attempt_at"], "retried before the backoff"
    assert db.ledger_counts() == {KEY: 1}


def test_a_retrying_key_stalls_neither_other_partitions_nor_its_partitions_other_keys(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=2)
    stuck = "t1:charge:p0-1"
    release = threading.Event()

    def stuck_until_released(msg: payments.ChargeRequested, ctx: Context) -> Any:
        if msg.order_id == "p0-1" and not release.is_set():
            raise Retryable("downstream not ready")
        return payments.charge(msg, ctx)

    produce(topic, [(f"p0-{i}".encode(), encode_charge("t1", f"p0-{i}", "1.00"))
                    for i in range(4)], partition=0)
    produce(topic, [(f"p1-{i}".encode(), encode_charge("t1", f"p1-{i}", "1.00"))
                    for i in range(30)], partition=1)
    policy = RetryPolicy(base=0.5, cap=1.5, max_attempts=1000)
    with InProcess(charge_app(db, topic, group, stuck_until_released, retry=policy)):
        wait_for(lambda: committed(group, topic)[1] == 30, what="partition 1 to be committed")
        wait_for(lambda: (db.record(stuck) or {}).get("attempts", 0) >= 2,
                 what="the stuck message to be retried")
        # Partition 0's other keys ran past its failing message, but its commit waits
        # at it (a crash now delivers it again, with what follows).
        wait_for(lambda: set(db.ledger_counts()) == (
            {f"t1:charge:p1-{i}" for i in range(30)} | {"t1:charge:p0-0", "t1:charge:p0-2",
                                                        "t1:charge:p0-3"}),
            what="partition 0's other keys")
        assert committed(group, topic)[0] in (-1001, 1)
        assert _status(db, stuck) in ("retryable_failed", "processing")
        release.set()
        wait_for(lambda: caught_up(group, topic), what="partition 0 to drain once released")
    assert committed(group, topic) == {0: 4, 1: 30}
    p0 = [row["order_id"] for row in db.ledger() if row["order_id"].startswith("p0-")]
    assert p0 == ["p0-0", "p0-2", "p0-3", "p0-1"]  # only the failing key waited
    assert set(db.ledger_counts().values()) == {1}


def _terminate_consumer_backends(db: DB) -> int:
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name LIKE 'kafka_idem:%%'"
            " AND pid <> pg_backend_pid()"
        ).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.parametrize("mode", ["local", "local-bulk", "leased"])
def test_database_outages_are_never_charged_to_messages(
    db: DB, topics: Topics, group: str, mode: str,
) -> None:
    """The members' sessions terminated four times mid-run: every message applied once,
    none charged an attempt. (On Citus a leased claim cut by the outage can commit on the
    worker unseen: the retry re-enters it by the token it was sent with.)"""
    topic = topics(partitions=2)
    n = 200
    produce(topic, [(f"o{i}".encode(), encode_charge("t1", f"o{i}", "1.00")) for i in range(n)])

    # Slowed down a little, so the run is long enough to be cut several times.
    def slowish(msg: payments.ChargeRequested, ctx: Context) -> Any:
        result = payments.charge(msg, ctx)
        threading.Event().wait(0.005)
        return result

    def slowish_bulk(batch: list[tuple[payments.ChargeRequested, Context]], tx: Any) -> Any:
        threading.Event().wait(0.005 * len(batch))
        return payments.charge_many(batch, tx)

    app = charge_app(db, topic, group, slowish, mode=mode.split("-")[0], batch_size=20,
                     lease_seconds=5, retry=RetryPolicy(base=0.1, cap=0.2, max_attempts=3))
    if mode == "local-bulk":  # the batch path's set-based handler, as payments.app runs
        app.handlers[topic].bulk_handler(slowish_bulk)
    terminated = []
    with InProcess(app) as r:
        for threshold in (20, 60, 100, 140):

            def done(t: int = threshold) -> bool:
                return db.status_counts().get("succeeded", 0) >= t

            wait_for(done, interval=0.02, what=f"{threshold} messages done")
            terminated.append(_terminate_consumer_backends(db))
        wait_for(lambda: caught_up(group, topic), timeout=90, what="the group to catch up")
        framework_errors = sum(
            s.value for metric in r.runner.metrics.framework_errors.collect()
            for s in metric.samples if s.name.endswith("_total"))
    assert all(t >= 1 for t in terminated), terminated
    assert framework_errors >= 1
    keys = {f"t1:charge:o{i}" for i in range(n)}
    assert db.ledger_counts() == dict.fromkeys(keys, 1)
    assert db.status_counts() == {"succeeded": n}
    assert {rec["attempts"] for rec in db.records()} == {1}  # outages are not attempts
    assert read_topic(f"{topic}.dlq") == []
    assert committed(group, topic) == end_offsets(topic)
