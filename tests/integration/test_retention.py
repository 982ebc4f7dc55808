"""Background retention (setting ``retention``, issue 35): outcomes in durable state.

A member with retention on removes its app's succeeded records older than the window,
in audited batches, and keeps everything else: records inside the window, live and
retryable ones, dead-lettered ones, other apps' records. One member purges at a time
(the advisory lock), a row a handler holds is skipped rather than waited on, a stop
ends a run between two batches, and a window shorter than a source topic's retention
refuses the start (the CLI's exit 2 is tests/acceptance/test_cli_retention.py's).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from consumers import payments
from kafka_idem.admin import retention
from kafka_idem.errors import ConfigError
from kafka_idem.store import Store, connect
from tests.conftest import DB, InProcess, Topics, app_settings, wait_for
from tools.old_records import fill

NS = "keeper"
DAY = 86400.0


def _store(ns: str = NS) -> Store:
    return Store(schema="kafka_idem", table="task_idempotency", namespace=ns)


def _app(db: DB, topic: str, **settings: Any) -> Any:
    return payments.build_app(topic=topic, name=NS, events=False,
                              **app_settings(db, group_id=f"g-{topic}", **settings))


def _count(db: DB, prefix: str, status: str = "succeeded", ns: str = NS) -> int:
    return int(db.value(
        "SELECT count(*) FROM kafka_idem.task_idempotency WHERE namespace = %s "
        "AND starts_with(idempotency_key, %s) AND status = %s", (ns, prefix, status)))


def _age(db: DB, prefix: str, status: str, seconds: float) -> None:
    """Records of ``prefix`` moved from processing to ``status`` (legal: by their
    owner), their last change ``seconds`` ago."""
    with connect(db.dsn) as conn, conn.transaction():
        conn.execute(
            "UPDATE kafka_idem.task_idempotency SET status = %s, owner_token = NULL, "
            "lease_until = NULL, next_attempt_at = clock_timestamp(), error_kind = 'permanent', "
            "updated_at = clock_timestamp() - make_interval(secs => %s) "
            "WHERE starts_with(idempotency_key, %s)", (status, seconds, prefix))


def _processing(db: DB, prefix: str, n: int, seconds: float) -> None:
    """``n`` records still processing (their lease long expired), ``seconds`` old."""
    with connect(db.dsn) as conn, conn.transaction():
        conn.execute(
            "INSERT INTO kafka_idem.task_idempotency (namespace, idempotency_key, request_hash, "
            "status, owner_token, lease_until, attempts, created_at, updated_at) "
            "SELECT %s, %s || g, 'v1:x', 'processing', gen_random_uuid(), "
            "clock_timestamp() - make_interval(secs => %s), 1, "
            "clock_timestamp() - make_interval(secs => %s), "
            "clock_timestamp() - make_interval(secs => %s) FROM generate_series(1, %s) g",
            (NS, prefix, seconds, seconds, seconds, n))


def _store_with_every_kind(db: DB) -> None:
    fill(db.dsn, n=2500, age_seconds=3 * DAY, prefix="old:", namespace=NS)
    fill(db.dsn, n=40, age_seconds=DAY, prefix="inside:", namespace=NS)
    fill(db.dsn, n=30, age_seconds=3 * DAY, prefix="other:", namespace="other-app")
    _processing(db, "live:", 5, 3 * DAY)
    _processing(db, "retry:", 5, 0)
    _age(db, "retry:", "retryable_failed", 3 * DAY)
    _processing(db, "dead:", 5, 0)
    _age(db, "dead:", "failed", 3 * DAY)


def test_a_member_purges_what_is_older_than_the_window_and_keeps_the_rest(
    db: DB, topics: Topics
) -> None:
    topic = topics(partitions=1)  # kept 24 hours by the local broker: a 2d window passes
    _store_with_every_kind(db)
    app = _app(db, topic, retention="2d", retention_interval_seconds=0.2)
    with InProcess(app) as member:
        wait_for(lambda: _count(db, "old:") == 0, timeout=60, what="the old records purged")
    # the member's close waited for its run to end (its last batch counted, its summary)
    assert member.runner.metrics.retention_purged._value.get() == 2500
    assert _count(db, "inside:") == 40  # every record inside the window kept
    assert _count(db, "other:", ns="other-app") == 30  # another app's records: not its own
    assert _count(db, "live:", "processing") == 5
    assert _count(db, "retry:", "retryable_failed") == 5
    assert _count(db, "dead:", "failed") == 5  # what a DLQ replay decides by
    batches = db.rows("SELECT * FROM kafka_idem.admin_audit WHERE action = 'purge' ORDER BY id")
    assert sum(b["counts"]["deleted"] for b in batches) == 2500
    assert all(b["counts"]["deleted"] <= retention.BATCH for b in batches)
    assert len(batches) >= 3  # small batches, each its own transaction and audit row
    assert {b["selection"]["retention"] for b in batches} == {"2d"}
    assert all(b["actor"].startswith("retention:") for b in batches)
    (summary,) = db.rows("SELECT * FROM kafka_idem.admin_audit WHERE action = 'retention'")
    assert summary["counts"] == {"deleted": 2500} and summary["namespace"] == NS
    with connect(db.dsn) as conn:
        last = retention.last_runs(conn, _store(), NS)
    assert last[NS]["removed"] == 2500 and last[NS]["retention"] == "2d"


def test_one_member_at_a_time_purges(db: DB) -> None:
    fill(db.dsn, n=1500, age_seconds=3 * DAY, prefix="old:", namespace=NS)
    store = _store()
    holder, other = connect(db.dsn), connect(db.dsn)
    try:
        assert store.retention_turn(holder, take=True)  # another member's run under way
        holder.commit()
        assert retention.run_once(other, store, window="2d", member="b", force=False,
                                  stopping=threading.Event()) is None
        assert _count(db, "old:") == 1500  # nothing removed: not its turn
        # another app's turn is its own
        assert retention.run_once(other, _store("other-app"), window="2d", member="b",
                                  force=False, stopping=threading.Event()) == 0
        store.retention_turn(holder, take=False)
        holder.commit()
        assert retention.run_once(other, store, window="2d", member="b", force=False,
                                  stopping=threading.Event()) == 1500
    finally:
        holder.close()
        other.close()
    assert _count(db, "old:") == 0


def test_a_row_a_handler_holds_is_skipped_not_waited_on(db: DB) -> None:
    fill(db.dsn, n=1200, age_seconds=3 * DAY, prefix="old:", namespace=NS)
    handler, purger = connect(db.dsn), connect(db.dsn)
    try:
        handler.execute("SELECT 1 FROM kafka_idem.task_idempotency WHERE namespace = %s "
                        "AND idempotency_key = 'old:7' FOR UPDATE", (NS,))  # a claim's lock
        started = time.monotonic()
        removed = retention.run_once(purger, _store(), window="2d", member="a", force=False,
                                     stopping=threading.Event())
        assert time.monotonic() - started < 5.0  # no wait on the handler's row lock
        assert removed == 1199
        assert db.record("old:7") is not None
        handler.rollback()
        assert retention.run_once(purger, _store(), window="2d", member="a", force=False,
                                  stopping=threading.Event()) == 1
    finally:
        handler.close()
        purger.close()


def test_a_stop_ends_a_run_between_two_batches(db: DB) -> None:
    fill(db.dsn, n=3500, age_seconds=3 * DAY, prefix="old:", namespace=NS)
    stopping = threading.Event()
    stopping.set()  # the member stops while the first batch runs
    with connect(db.dsn) as conn:
        removed = retention.run_once(conn, _store(), window="2d", member="a", force=False,
                                     stopping=stopping, batch=1000)
    assert removed == 1000
    assert _count(db, "old:") == 2500


def test_a_window_shorter_than_the_topics_retention_refuses_the_start(
    db: DB, topics: Topics
) -> None:
    topic = topics(partitions=1)  # 24 hours
    fill(db.dsn, n=10, age_seconds=3 * 3600, prefix="old:", namespace=NS)
    from kafka_idem.consume.runner import Runner

    runner = Runner(_app(db, topic, retention="2h"))
    with pytest.raises(ConfigError) as refused:
        runner.start()
    assert refused.value.context["setting"] == "retention"
    assert "retention=2h (KAFKA_IDEM_RETENTION)" in str(refused.value)
    assert f"topic {topic} keeps messages for 1d" in str(refused.value)
    assert runner.consumer is None  # refused before joining the group
    assert _count(db, "old:") == 10
    # forced, it runs, and purges the records older than its window
    forced = _app(db, topic, retention="2h", retention_force=True,
                  retention_interval_seconds=0.2)
    with InProcess(forced):
        wait_for(lambda: _count(db, "old:") == 0, timeout=60, what="the forced purge")
    (summary,) = db.rows("SELECT * FROM kafka_idem.admin_audit WHERE action = 'retention'")
    assert summary["selection"]["force"] is True


def test_outages_skip_a_run_and_never_stop_the_member(
    db: DB, caplog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broker that does not answer: the start goes on (said once), each run purges
    nothing until the topics' retention can be read. A database that does not answer:
    one warning, nothing raised; the next interval tries again."""
    from kafka_idem.consume import retention as member_retention
    from kafka_idem.consume.retention import Retention
    from kafka_idem.observe.metrics import Metrics
    from kafka_idem.settings import Settings

    monkeypatch.setattr(member_retention, "FIRST_RUN_SECONDS", 3600.0)  # runs: ours only
    fill(db.dsn, n=10, age_seconds=3 * DAY, prefix="old:", namespace=NS)
    metrics = Metrics()
    no_broker = Settings(database_url=db.dsn, bootstrap_servers="127.0.0.1:1", retention="2d",
                         retention_interval_seconds=3600)
    member = Retention(no_broker, _store(), metrics, ["orders"])
    member.start()  # not refused: the window could not be checked
    try:
        assert member.is_alive()
        assert member.once() is None
    finally:
        member.close(5.0)
    assert not member.is_alive()
    assert metrics.retention_errors.labels("unchecked")._value.get() == 1
    assert _count(db, "old:") == 10  # nothing purged unchecked
    no_database = Settings(database_url="postgresql://nobody@127.0.0.1:1/none",
                           retention="2d", retention_force=True)
    assert Retention(no_database, _store(), metrics, ["orders"]).once() is None
    assert metrics.retention_errors.labels("database")._value.get() == 1
    assert "retention run failed" in caplog.text


def test_two_members_running_at_once_leave_the_purge_to_one(db: DB) -> None:
    """Two members' runs started together: one takes the turn and removes everything;
    the other skips (or, started after, finds nothing): every batch is one member's."""
    from kafka_idem.consume.retention import Retention
    from kafka_idem.observe.metrics import Metrics
    from kafka_idem.settings import Settings

    fill(db.dsn, n=6000, age_seconds=3 * DAY, prefix="old:", namespace=NS)
    members = [Retention(Settings(database_url=db.dsn, retention="2d", retention_force=True,
                                  group_instance_id=name), _store(), Metrics(), ["orders"])
               for name in ("member-a", "member-b")]
    results: dict[str, int | None] = {}
    go = threading.Barrier(2)

    def run(member: Retention) -> None:
        go.wait()
        results[member.member] = member.once()

    threads = [threading.Thread(target=run, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == ["member-a", "member-b"]
    assert sum(n or 0 for n in results.values()) == 6000
    assert _count(db, "old:") == 0
    actors = {r["actor"] for r in db.rows(
        "SELECT actor FROM kafka_idem.admin_audit WHERE action IN ('purge', 'retention')")}
    assert len(actors) == 1 and actors <= {"retention:member-a", "retention:member-b"}
