"""The outbox relay under faults (docs/OUTBOX.md): rows committed out of id order,
per-key order, a crash between the Kafka commit and the delete, a zombie fenced,
the database connection terminated mid-round, shards handed over between relays.
Every case: each row exactly once for read_committed readers, none skipped."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer

from kafka_idem.outbox.emit import shard_of, slot_of
from kafka_idem.outbox.relay import RelayHooks
from tests.conftest import BOOTSTRAP, DB, Topics, wait_for
from tests.integration.outbox_support import (
    SHARDS,
    RelayThread,
    outbox_app,
    outbox_rows,
    read_committed,
    values_by_key,
    wait_published,
    write_events,
)


def same_shard_keys() -> tuple[str, str]:
    """Two keys of one shard with different slots (their transactions do not wait
    for each other)."""
    first = "k0"
    for i in range(1, 1000):
        other = f"k{i}"
        a, b = slot_of(first.encode(), ""), slot_of(other.encode(), "")
        if a != b and shard_of(a, SHARDS) == shard_of(b, SHARDS):
            return first, other
    raise AssertionError("no two keys found")


def test_a_row_that_commits_after_a_higher_id_was_published_is_published_too(
    db: DB, topics: Topics, group: str
) -> None:
    app, events = outbox_app(db, topics, group)
    low_key, high_key = same_shard_keys()
    with psycopg.connect(db.dsn) as slow, psycopg.connect(db.dsn) as fast, RelayThread(app):
        write_events(slow, app, events, [(low_key, {"n": 1})], commit=False)  # the lower id
        write_events(fast, app, events, [(high_key, {"n": 2})])  # the higher id, first
        wait_for(lambda: not outbox_rows(db), what="the higher id published and deleted")
        assert list(values_by_key(events)) == [high_key]
        slow.commit()
        wait_published(db, events, 2)
    assert values_by_key(events) == {low_key: [{"n": 1}], high_key: [{"n": 2}]}


def test_events_of_one_key_are_published_in_the_order_their_transactions_committed(
    db: DB, topics: Topics, group: str
) -> None:
    app, events = outbox_app(db, topics, group)
    committed: list[str] = []
    with psycopg.connect(db.dsn) as first, psycopg.connect(db.dsn) as second:
        write_events(first, app, events, [("k", {"tx": "first"})], commit=False)
        pid = second.info.backend_pid

        def second_tx() -> None:  # the higher id if nothing orders them: it would win
            write_events(second, app, events, [("k", {"tx": "second"})])
            committed.append("second")

        thread = threading.Thread(target=second_tx)
        thread.start()
        wait_for(lambda: committed or db.value(
            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)),
            what="the second transaction to commit or to wait for the first")
        first.commit()
        committed.append("first")
        thread.join(30)
    with RelayThread(app):
        wait_published(db, events, 2)
    assert [v["tx"] for v in values_by_key(events)["k"]] == committed


class CrashAfterCommit(RelayHooks):
    """The publisher dies once between the Kafka commit and the delete."""

    def __init__(self) -> None:
        self.crashed: list[int] = []

    def after_commit(self, shard: int, ids: Sequence[int]) -> None:
        if not self.crashed:
            self.crashed.extend(ids)
            raise SystemExit("crash between the Kafka commit and the delete")


def test_a_crash_between_the_kafka_commit_and_the_delete_never_republishes(
    db: DB, topics: Topics, group: str
) -> None:
    app, events = outbox_app(db, topics, group)
    with psycopg.connect(db.dsn) as conn:
        write_events(conn, app, events, [(f"k{i}", {"n": i}) for i in range(20)])
    hooks = CrashAfterCommit()
    with RelayThread(app, hooks=hooks):  # the shard's next publisher settles the marker
        wait_published(db, events, 20)
    assert hooks.crashed
    assert {k: len(v) for k, v in values_by_key(events).items()} == {f"k{i}": 1 for i in range(20)}


class PauseBeforeCommit(RelayHooks):
    """The first round stops before its commit until released (a paused zombie)."""

    def __init__(self) -> None:
        self.paused = threading.Event()
        self.release = threading.Event()
        self.shard: int | None = None
        self.ids: list[int] = []

    def before_commit(self, shard: int, ids: Sequence[int]) -> None:
        if self.shard is None:
            self.shard, self.ids = shard, list(ids)
            self.paused.set()
            self.release.wait(60)


def test_a_zombie_relay_is_fenced_and_publishes_nothing_more(
    db: DB, topics: Topics, group: str
) -> None:
    app, events = outbox_app(db, topics, group)
    with psycopg.connect(db.dsn) as conn:
        write_events(conn, app, events, [(f"k{i}", {"n": i}) for i in range(10)])
    hooks = PauseBeforeCommit()
    with RelayThread(app, hooks=hooks) as zombie:
        assert hooks.paused.wait(60)
        worker = zombie.relay.workers[hooks.shard]  # type: ignore[index]
        # A new owner of the shard: its init_transactions fences the paused one.
        owner = Producer({"bootstrap.servers": BOOTSTRAP,
                          "transactional.id": worker.transactional_id})
        owner.init_transactions(30)
        hooks.release.set()
        wait_for(lambda: worker.fenced and not worker.is_alive(), what="the zombie fenced")
        assert zombie.thread.is_alive()  # the relay carries on; only that shard stopped
        assert zombie.relay.metrics.outbox_relay_errors.labels("fenced")._value.get() == 1
        published = {h for m in read_committed(events)
                     for k, h in (m.headers() or []) if k == "idem.outbox.id"}
        assert not published & {str(i).encode() for i in hooks.ids}
        assert {r["id"] for r in outbox_rows(db)} >= set(hooks.ids)
    owner.close()
    with RelayThread(app):
        wait_published(db, events, 10)
    assert {k: len(v) for k, v in values_by_key(events).items()} == {f"k{i}": 1 for i in range(10)}


class TerminateBeforeCommit(RelayHooks):
    """The relay's database sessions are terminated mid-round, once."""

    def __init__(self, db: DB) -> None:
        self.db = db
        self.terminated = 0
        self.lock = threading.Lock()  # the shards' rounds call this concurrently

    def before_commit(self, shard: int, ids: Sequence[int]) -> None:
        with self.lock:
            if not self.terminated:
                self.terminated = self.db.value(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() "
                    "AND application_name = 'kafka_idem-relay'")


def test_the_database_connection_terminated_mid_round_loses_and_duplicates_nothing(
    db: DB, topics: Topics, group: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kafka_idem.outbox")
    app, events = outbox_app(db, topics, group)
    with psycopg.connect(db.dsn) as conn:
        write_events(conn, app, events, [(f"k{i}", {"n": i}) for i in range(20)])
    hooks = TerminateBeforeCommit(db)
    with RelayThread(app, hooks=hooks):
        wait_published(db, events, 20)
        with psycopg.connect(db.dsn) as conn:  # and after the reconnect, more
            write_events(conn, app, events, [(f"k{i}", {"n": i}) for i in range(20, 30)])
        wait_published(db, events, 30)
    assert hooks.terminated >= 1
    assert {k: len(v) for k, v in values_by_key(events).items()} == {f"k{i}": 1 for i in range(30)}
    # Said once per episode (per shard publisher, the listener), with the reason, and
    # once when it ends: for each of them, trouble and recovery alternate.
    said = [(r.getMessage().split(":")[0], r.action) for r in caplog.records  # type: ignore[attr-defined]
            if getattr(r, "action", None) in ("outbox_trouble", "outbox_recovered")]
    assert any(action == "outbox_trouble" for _, action in said)
    assert all("database" in r.getMessage() for r in caplog.records
               if getattr(r, "action", None) == "outbox_trouble")
    for who in {w for w, _ in said}:
        actions = [a for w, a in said if w == who]
        assert actions[::2] == ["outbox_trouble"] * len(actions[::2]), (who, actions)
        assert actions[1::2] == ["outbox_recovered"] * len(actions[1::2]), (who, actions)


def test_shards_handed_over_between_two_relays_keep_every_row_once_and_in_key_order(
    db: DB, topics: Topics, group: str
) -> None:
    app, events = outbox_app(db, topics, group)
    stop = threading.Event()
    written: list[int] = []

    def writer() -> None:  # one transaction at a time: seq order is commit order
        with psycopg.connect(db.dsn) as conn:
            n = 0
            while not stop.is_set() or n < 60:
                write_events(conn, app, events, [(f"k{n % 5}", {"seq": n})], n=n)
                written.append(n)
                n += 1
                stop.wait(0.02)

    thread = threading.Thread(target=writer)
    first = RelayThread(app).__enter__()
    thread.start()
    try:
        wait_for(lambda: len(written) >= 20, what="rows written")
        with RelayThread(app) as second:
            wait_for(lambda: second.relay.workers, what="the second relay to get shards")
            first.__exit__(None, None, None)  # the first leaves: its shards move
            wait_for(lambda: len(second.relay.workers) == SHARDS, what="every shard moved")
            stop.set()
            thread.join(60)
            wait_published(db, events, len(written))
    finally:
        stop.set()
        if first.thread.is_alive():
            first.__exit__(None, None, None)
    got = values_by_key(events)
    for k, values in got.items():
        seqs = [v["seq"] for v in values]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), (k, seqs)
    assert sorted(v["seq"] for vs in got.values() for v in vs) == written




def test_bytes_pass_through_and_none_is_a_tombstone(db: DB, topics: Topics, group: str) -> None:
    app, events = outbox_app(db, topics, group)
    with psycopg.connect(db.dsn) as conn:
        write_events(conn, app, events, [("k1", b"\x00raw"), ("k1", None)])
    with RelayThread(app):
        got = wait_published(db, events, 2)
    assert [(m.key(), m.value()) for m in got] == [(b"k1", b"\x00raw"), (b"k1", None)]


def test_the_database_unreachable_while_the_listener_reconnects_is_waited_out(
    db: DB, topics: Topics, group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The notifications' connection cannot be opened for a while (the database is
    down: ``connect`` raises StoreUnavailable, as it does for a refused connection):
    the relay says so and retries with backoff; it never stops, and once the database
    answers again everything is published once."""
    from kafka_idem.errors import StoreUnavailable
    from kafka_idem.outbox import relay as relay_module

    real, refused = relay_module.connect, []

    def connect(dsn: str, **kwargs: Any) -> Any:
        if kwargs.get("application_name") == "kafka_idem-relay" and len(refused) < 3:
            refused.append(dsn)
            raise StoreUnavailable("The database is unreachable: connection refused")
        return real(dsn, **kwargs)

    monkeypatch.setattr(relay_module, "connect", connect)
    app, events = outbox_app(db, topics, group)
    with psycopg.connect(db.dsn) as conn:
        write_events(conn, app, events, [(f"k{i}", {"n": i}) for i in range(10)])
    with RelayThread(app) as relay:
        wait_published(db, events, 10)
        assert relay.thread.is_alive() and relay.error is None
    assert len(refused) == 3
    assert {k: len(v) for k, v in values_by_key(events).items()} == {f"k{i}": 1 for i in range(10)}
