"""Pausing a handler (``kafka-idem pause``), honoured by members run in-process against
the real broker and database (the CLI over three member processes:
``tests/acceptance/test_cli_pause.py``).

"No call while paused" is asserted by counting the calls that took effect
(``pausable.calls``) after every member acknowledged the pause (its gauge
``kafka_idem_handler_paused`` at 1: nothing of the handler runs or starts there), while
the other handler, fed after the paused one, finishes all of its messages: had the
pause not held, the paused handler's messages, produced first, would have run too.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import psycopg
import pytest

from kafka_idem import App
from kafka_idem.admin import pauses
from kafka_idem.consume.pause_watch import PauseWatch
from kafka_idem.store import Store
from tests.apps import pausable
from tests.conftest import DB, InProcess, Topics, app_settings, produce, wait_for


def make_app(db: DB, a: str, b: str, group: str, *, concurrency: int = 1) -> App:
    with psycopg.connect(db.dsn) as conn:
        pausable.create_tables(conn)
    return pausable.build(a, b, concurrency=concurrency, **app_settings(db, group_id=group))


def feed(topic: str, start: int, n: int) -> None:
    produce(topic, [(str(i).encode(), json.dumps({"id": str(i)}).encode())
                    for i in range(start, start + n)])


def calls(db: DB, handler: str) -> int:
    return int(db.value("SELECT count(*) FROM pausable.calls WHERE handler = %s", (handler,)))


def act(db: DB, app: App, handler: str, *, paused: bool) -> pauses.Change:
    store = Store(schema="kafka_idem", table="task_idempotency", namespace=app.namespace)
    with psycopg.connect(db.dsn) as conn:
        if paused:
            return pauses.pause(conn, store, handler=handler, actor="tester", reason="incident")
        return pauses.resume(conn, store, handler=handler, actor="tester")


def held(member: InProcess, handler: str) -> bool:
    value = member.runner.metrics.registry.get_sample_value(
        "kafka_idem_handler_paused", {"handler": handler})
    return value == 1.0


@pytest.mark.parametrize("concurrency", [1, 4], ids=["units", "key-ordered"])
def test_a_paused_handler_calls_nothing_while_the_other_goes_on_and_resume_brings_it_back(
        db: DB, topics: Topics, group: str, concurrency: int) -> None:
    a, b = topics(partitions=2), topics(partitions=2)
    app = make_app(db, a, b, group, concurrency=concurrency)
    with InProcess(app) as member:
        feed(a, 0, 4)
        feed(b, 0, 4)
        wait_for(lambda: calls(db, "alpha") == 4 and calls(db, "beta") == 4, timeout=30,
                 what="both handlers running")
        assert act(db, app, "alpha", paused=True).changed
        wait_for(lambda: held(member, "alpha"), timeout=5, what="the pause acknowledged")
        before = calls(db, "alpha")
        feed(a, 100, 20)
        feed(b, 100, 20)  # after alpha's: when these are done, alpha's would have been
        wait_for(lambda: calls(db, "beta") == 24, timeout=30, what="beta going on")
        assert calls(db, "alpha") == before == 4
        ready = member.runner.health.ready()
        assert ready.ok and ready.body["paused_handlers"] == {"alpha": "incident"}
        assert "alpha" in ready.body["note"]
        assert not held(member, "beta")
        assert act(db, app, "alpha", paused=False).changed
        wait_for(lambda: calls(db, "alpha") == 24, timeout=5, what="alpha called again")
        assert not held(member, "alpha")
        assert "paused_handlers" not in member.runner.health.ready().body


def test_a_pause_outlives_a_restart_and_the_rebalances_of_its_group(
        db: DB, topics: Topics, group: str) -> None:
    a, b = topics(partitions=4), topics(partitions=4)
    app = make_app(db, a, b, group)
    act(db, app, "alpha", paused=True)  # before any member starts: a restart, as it sees it
    feed(a, 0, 8)
    with InProcess(app) as first:
        feed(b, 0, 8)
        wait_for(lambda: calls(db, "beta") == 8, timeout=30, what="beta running")
        assert held(first, "alpha") and calls(db, "alpha") == 0
        with InProcess(app) as second:  # a rebalance: partitions move to the new member
            wait_for(lambda: len(second.runner.assigned) > 0, timeout=30,
                     what="the second member assigned")
            wait_for(lambda: held(second, "alpha"), timeout=10, what="second member holds")
            feed(a, 100, 8)
            feed(b, 100, 8)
            wait_for(lambda: calls(db, "beta") == 16, timeout=30, what="beta on both")
            assert calls(db, "alpha") == 0
        # the second left: its partitions came back to the first, still paused
        feed(b, 200, 8)
        wait_for(lambda: calls(db, "beta") == 24, timeout=30, what="beta after the leave")
        assert calls(db, "alpha") == 0
        act(db, app, "alpha", paused=False)
        wait_for(lambda: calls(db, "alpha") == 16, timeout=10, what="alpha after the resume")
    rows = db.rows("SELECT action, actor, reason, selection FROM kafka_idem.admin_audit "
                   "ORDER BY id")
    assert [(r["action"], r["actor"], r["selection"]["handler"]) for r in rows] == [
        ("pause", "tester", "alpha"), ("resume", "tester", "alpha")]


def test_pausing_twice_or_resuming_what_is_not_paused_changes_nothing(
        db: DB, topics: Topics) -> None:
    app = make_app(db, "x", "y", "g")
    assert act(db, app, "beta", paused=True).changed
    again = act(db, app, "beta", paused=True)
    assert not again.changed and again.pause is not None and again.pause.reason == "incident"
    assert act(db, app, "beta", paused=False).changed
    assert not act(db, app, "beta", paused=False).changed
    assert db.value("SELECT count(*) FROM kafka_idem.admin_audit") == 2


def test_a_pause_lets_the_running_message_finish_and_starts_none_of_those_queued(
        db: DB, topics: Topics, group: str) -> None:
    a, b = topics(partitions=1), topics(partitions=1)
    app = make_app(db, a, b, group)
    entered, release = threading.Event(), threading.Event()
    alpha = next(h for h in app.handlers.values() if h.name == "alpha")
    record = alpha.fn

    def slow(msg: dict[str, Any], ctx: Any) -> Any:
        if msg["id"] == "slow":
            entered.set()
            release.wait(30)
        return record(msg, ctx)

    alpha.fn = slow
    with InProcess(app) as member:
        produce(a, [(b"k", json.dumps({"id": i}).encode()) for i in ["slow", "1", "2", "3"]])
        wait_for(entered.is_set, timeout=30, what="the slow message running")
        act(db, app, "alpha", paused=True)
        wait_for(lambda: "alpha" in member.runner.hold.held, timeout=5, what="the pause seen")
        assert not held(member, "alpha")  # not acknowledged while its message runs
        release.set()
        wait_for(lambda: held(member, "alpha"), timeout=10, what="the pause acknowledged")
        feed(b, 0, 5)
        wait_for(lambda: calls(db, "beta") == 5, timeout=30, what="beta going on")
        assert calls(db, "alpha") == 1  # the one that ran finished; the queued ones wait
        act(db, app, "alpha", paused=False)
        wait_for(lambda: calls(db, "alpha") == 4, timeout=5, what="the queued ones after resume")


def test_the_watch_keeps_the_last_pauses_it_read_while_the_database_is_gone(
        db: DB, caplog: pytest.LogCaptureFixture) -> None:
    app = make_app(db, "x", "y", "g")
    act(db, app, "alpha", paused=True)
    store = Store(schema="kafka_idem", table="task_idempotency", namespace=app.namespace)
    watch = PauseWatch(db.dsn, store, poll_seconds=0.2)
    watch.start()
    try:
        assert list(watch.current()) == ["alpha"]
        watch.dsn = "postgresql://nobody@127.0.0.1:1/gone?connect_timeout=1"
        with psycopg.connect(db.dsn, autocommit=True) as conn:  # its connection dies
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE application_name = 'kafka_idem-pauses'"
                         " AND datname = current_database()")
        wait_for(lambda: "cannot read the paused handlers" in caplog.text, timeout=10,
                 what="the watch failing")
        assert list(watch.current()) == ["alpha"]
        watch.dsn = db.dsn
        act(db, app, "alpha", paused=False)
        wait_for(lambda: watch.current() == {}, timeout=10, what="the watch back")
    finally:
        watch.stop()
