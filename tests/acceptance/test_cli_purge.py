"""``kafka-idem purge`` guards the dedup window, through the CLI against the real broker
and database: a window shorter than the longest ``retention.ms`` of the records' source
topics (any window when one keeps messages forever; under one hour when the retention
cannot be read) is refused without ``--force``, and then nothing is deleted or audited.

Outcomes are durable state: the records left in the idempotency table, the purge's
audit rows (and their selection), and the exit code.
"""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka.admin import AdminClient

from kafka_idem.store import Delivery, Store, connect
from tests.acceptance.conftest import Result, kafka_idem, set_topic_config
from tests.conftest import DB, Topics

CLOSED = "127.0.0.1:1"  # nothing listens on port 1 of this host: Kafka unreachable


def _records(db: DB, topic: str, *, succeeded: int = 3, failed: int = 1) -> None:
    """``succeeded`` succeeded and ``failed`` failed records whose messages came from
    ``topic``."""
    store = Store(schema="kafka_idem", table="task_idempotency", namespace="tests")
    conn = connect(db.dsn)
    try:
        for status, n in (("succeeded", succeeded), ("failed", failed)):
            for i in range(n):
                key = f"{status}:{i}"
                with conn.transaction():
                    c = store.claim(conn, key=key, request_hash="v1:x",
                                    delivery=Delivery(topic, 0, i, "h"), lease_seconds=600,
                                    max_attempts=5, max_elapsed_seconds=3600)
                    assert c.token is not None
                    if status == "succeeded":
                        store.complete(conn, key=key, token=c.token, result=i)
                    else:
                        store.fail(conn, key=key, token=c.token, status="failed",
                                   kind="permanent", error_class="E", error_message="m",
                                   delay=60)
    finally:
        conn.close()


def _age(db: DB, hours: int) -> None:
    """Make every record ``hours`` old (the transition guard refuses any update of a
    terminal record, so it is off for this one transaction)."""
    with connect(db.dsn) as conn, conn.transaction():
        conn.execute("ALTER TABLE kafka_idem.task_idempotency DISABLE TRIGGER guard_transitions")
        conn.execute("UPDATE kafka_idem.task_idempotency "
                     "SET updated_at = updated_at - make_interval(hours => %s)", (hours,))
        conn.execute("ALTER TABLE kafka_idem.task_idempotency ENABLE TRIGGER guard_transitions")


def _purge_audit(db: DB) -> list[dict[str, Any]]:
    return db.rows("SELECT * FROM kafka_idem.admin_audit WHERE action = 'purge' ORDER BY id")


def _refused(r: Result) -> str:
    """The one line of a refused purge (exit 1)."""
    assert r.code == 1, (r.out, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert lines[0].startswith("refused: purge --older-than "), lines[0]
    return lines[0]


def test_a_window_shorter_than_the_topic_retention_is_refused_and_nothing_is_deleted(
    db: DB, topics: Topics
) -> None:
    topic = topics(partitions=1)  # the local broker's default retention: 24 hours
    _records(db, topic)
    before = db.records()
    r = kafka_idem("purge", "--older-than", "0s", db=db)
    line = _refused(r)
    assert db.records() == before  # every record still there, unchanged
    assert _purge_audit(db) == []
    assert f"topic {topic} keeps messages for 1d (retention.ms=86400000)" in line
    assert "--older-than 1d or longer, or --force" in line
    assert r.out == ""


def test_force_purges_a_short_window_and_the_audit_says_so(db: DB, topics: Topics) -> None:
    topic = topics(partitions=1)
    _records(db, topic, succeeded=3, failed=1)
    r = kafka_idem("purge", "--older-than", "0s", "--force", "--batch-size", "2", db=db)
    assert r.code == 0, r.err
    assert "purged 3 records older than 0s" in r.out
    assert db.status_counts() == {"failed": 1}  # the old succeeded records are gone
    audit = _purge_audit(db)
    assert [a["counts"]["deleted"] for a in audit] == [2, 1]
    assert all(a["selection"]["force"] is True for a in audit), audit
    warnings = [ln for ln in r.err.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and topic in warnings[0], r.err


def test_a_window_longer_than_the_topic_retention_purges_without_force(
    db: DB, topics: Topics, admin: AdminClient
) -> None:
    topic = topics(partitions=1)
    set_topic_config(admin, topic, "retention.ms", str(3_600_000))  # 1 hour
    _records(db, topic, succeeded=3, failed=1)
    _age(db, 3)
    r = kafka_idem("purge", "--older-than", "2h", db=db)
    assert r.code == 0, r.err
    assert "purged 3 records older than 2h" in r.out
    assert db.status_counts() == {"failed": 1}
    [audit] = _purge_audit(db)
    assert audit["selection"]["force"] is False
    assert audit["counts"] == {"deleted": 3}
    # shorter than that hour: refused again
    _records(db, topic, succeeded=1, failed=0)
    _age(db, 3)
    line = _refused(kafka_idem("purge", "--older-than", "30m", db=db))
    assert "retention.ms=3600000" in line and "--older-than 1h or longer" in line
    assert db.status_counts() == {"failed": 1, "succeeded": 1}


def test_a_topic_kept_forever_refuses_any_window_without_force(
    db: DB, topics: Topics, admin: AdminClient
) -> None:
    topic = topics(partitions=1)
    set_topic_config(admin, topic, "retention.ms", "-1")
    _records(db, topic)
    _age(db, 24 * 400)
    before = db.records()
    for window in ("0s", "30d", "3650d"):
        line = _refused(kafka_idem("purge", "--older-than", window, db=db))
        assert f"topic {topic} keeps messages forever (retention.ms=-1)" in line
        assert "no window is long enough" in line
    assert db.records() == before
    assert _purge_audit(db) == []
    r = kafka_idem("purge", "--older-than", "30d", "--force", db=db)
    assert r.code == 0, r.err
    assert db.status_counts() == {"failed": 1}
    assert {a["selection"]["force"] for a in _purge_audit(db)} == {True}


def test_a_dry_run_with_a_short_window_is_not_refused_and_says_why_it_is_risky(
    db: DB, topics: Topics
) -> None:
    topic = topics(partitions=1)
    _records(db, topic, succeeded=3, failed=1)
    before = db.records()
    r = kafka_idem("purge", "--older-than", "0s", "--dry-run", db=db)
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[0] == ("dry run: would purge 3 records older than 0s (succeeded 3); "
                        "nothing deleted")
    assert lines[1].startswith("dry run: a purge would be refused without --force: ")
    assert f"topic {topic} keeps messages for 1d (retention.ms=86400000)" in lines[1]
    assert db.records() == before
    assert _purge_audit(db) == []
    # a window long enough: the count alone
    r = kafka_idem("purge", "--older-than", "2d", "--dry-run", db=db)
    assert r.code == 0 and r.out.splitlines() == [
        "dry run: would purge 0 records older than 2d (succeeded 0); nothing deleted"]


def test_when_the_retention_cannot_be_read_the_floor_is_one_hour(db: DB, topics: Topics) -> None:
    topic = topics(partitions=1)
    _records(db, topic, succeeded=3, failed=1)
    _age(db, 3)
    before = db.records()
    unreachable = {"KAFKA_IDEM_BOOTSTRAP_SERVERS": CLOSED}
    started = time.monotonic()
    line = _refused(kafka_idem("purge", "--older-than", "30m", db=db, env=unreachable,
                               timeout=30))
    assert time.monotonic() - started < 15  # bounded: no waiting on a broker that is down
    assert f"the retention of topic {topic} could not be read (Kafka at {CLOSED}" in line
    assert "under the one-hour floor" in line and "--older-than 1h or longer" in line
    assert db.records() == before
    assert _purge_audit(db) == []
    # the dry run says the same, and deletes nothing
    dry = kafka_idem("purge", "--older-than", "30m", "--dry-run", db=db, env=unreachable,
                     timeout=30)
    assert dry.code == 0 and "could not be read" in dry.out, (dry.out, dry.err)
    assert db.records() == before
    # two hours: not under the floor, so it goes on
    r = kafka_idem("purge", "--older-than", "2h", db=db, env=unreachable, timeout=30)
    assert r.code == 0, r.err
    assert "purged 3 records older than 2h" in r.out
    assert db.status_counts() == {"failed": 1}
    [audit] = _purge_audit(db)
    assert audit["selection"]["force"] is False and audit["counts"] == {"deleted": 3}
