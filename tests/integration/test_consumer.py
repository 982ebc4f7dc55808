"""The consumer loop against the real broker and database: offsets, crashes, rebalances."""

from __future__ import annotations

import signal
import uuid
from collections import Counter
from decimal import Decimal
from typing import Any

from consumers.payments import build_app, encode_charge
from kafka_idem.store import Delivery, Store, connect
from tests.conftest import (
    DB,
    InProcess,
    Members,
    Topics,
    app_settings,
    caught_up,
    committed,
    end_offsets,
    member_env,
    produce,
    wait_for,
)

VARIANTS = "tests.apps.variants:app"


def intents(n: int, tenant: str = "t1") -> list[tuple[str, str, str]]:
    return [(tenant, f"o{i}", f"{(i % 7) + 1}.50") for i in range(n)]


def messages(items: list[tuple[str, str, str]]) -> list[tuple[bytes, bytes]]:
    return [(o.encode(), encode_charge(t, o, a)) for t, o, a in items]


def expected_balance(items: list[tuple[str, str, str]]) -> dict[tuple[str, str], Decimal]:
    total: Counter[tuple[str, str]] = Counter()
    for t, _o, a in items:
        total[(t, "EUR")] += Decimal(a)  # type: ignore[assignment]
    return dict(total)


def test_repeat_after_success_replays_and_changes_nothing(db: DB, topics: Topics,
                                                          group: str) -> None:
    topic = topics(partitions=3)
    items = intents(30)
    produce(topic, messages(items) + messages(items[:10]))  # producer retries: new request ids
    app = build_app(topic=topic, **app_settings(db, group_id=group))
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), what="the group to catch up")
    keys = {f"t1:charge:{o}" for _t, o, _a in items}
    assert db.ledger_counts() == dict.fromkeys(keys, 1)
    assert db.balances() == expected_balance(items)
    first = {r["idempotency_key"]: r for r in db.records()}
    assert {r["status"] for r in first.values()} == {"succeeded"}
    assert {r["attempts"] for r in first.values()} == {1}

    # The same intents again, later: replayed from the store, nothing written.
    produce(topic, messages(items))
    with InProcess(build_app(topic=topic, **app_settings(db, group_id=group))) as r:
        wait_for(lambda: caught_up(group, topic), what="the group to catch up again")
        replayed = r.runner.metrics.messages.labels(topic, "charge", "replayed")._value.get()
    assert replayed == len(items)
    assert db.ledger_counts() == dict.fromkeys(keys, 1)
    assert db.balances() == expected_balance(items)
    assert {r["idempotency_key"]: r for r in db.records()} == first
    assert committed(group, topic) == end_offsets(topic)


def test_killed_after_db_commit_before_offset_commit_is_redelivered_and_replayed(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    topic = topics(partitions=1)
    items = intents(20)
    produce(topic, messages(items))
    crasher = members.start(VARIANTS, member_env(db, topic, CRASH_BEFORE_OFFSET_COMMIT="1"),
                            group=group)
    assert crasher.wait(timeout=60) == -signal.SIGKILL
    done_before = db.status_counts().get("succeeded", 0)
    assert done_before > 0, "the crash point is after the database commit"
    assert committed(group, topic)[0] < 0, "no offset was committed before the crash"

    members.start(VARIANTS, member_env(db, topic), group=group)
    wait_for(lambda: caught_up(group, topic), what="the replacement to catch up")
    keys = {f"t1:charge:{o}" for _t, o, _a in items}
    assert db.ledger_counts() == dict.fromkeys(keys, 1)
    assert db.balances() == expected_balance(items)
    assert {r["attempts"] for r in db.records()} == {1}  # replayed, never re-run


def test_rebalance_while_messages_are_in_flight_loses_and_doubles_nothing(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    topic = topics(partitions=4)
    items = intents(240)
    produce(topic, messages(items))
    slow = {"SLOW_ORDERS": "*", "SLOW_SECONDS": "0.02", "SLOW_ATTEMPTS": "99"}
    first = members.start(VARIANTS, member_env(db, topic, **slow), group=group)
    wait_for(lambda: db.status_counts().get("succeeded", 0) >= 20, what="first progress")
    members.start(VARIANTS, member_env(db, topic, **slow), group=group)  # rebalance
    wait_for(lambda: db.status_counts().get("succeeded", 0) >= 100, what="progress with two")
    first.terminate()  # graceful leave: another rebalance while work is in flight
    assert first.wait(timeout=30) == 0
    members.start(VARIANTS, member_env(db, topic, **slow), group=group)
    wait_for(lambda: caught_up(group, topic), timeout=120, what="the group to catch up")
    keys = {f"t1:charge:{o}" for _t, o, _a in items}
    assert db.ledger_counts() == dict.fromkeys(keys, 1)
    assert db.balances() == expected_balance(items)
    assert db.status_counts() == {"succeeded": len(items)}


def test_offsets_never_pass_a_message_that_is_still_pending(db: DB, topics: Topics,
                                                            group: str) -> None:
    topic = topics(partitions=1)
    items = intents(4)
    produce(topic, messages(items))
    # Another owner holds o0's key with a live lease: o0 is busy; o1..o3 (other keys) run
    # on, but the committed offset stays before o0.
    store = Store(schema="kafka_idem", table="task_idempotency", namespace="payments")
    conn = connect(db.dsn)
    from kafka_idem.keys import request_hash

    with conn.transaction():
        foreign = store.claim(conn, key="t1:charge:o0",
                              request_hash=request_hash({"amount": Decimal("1.50"),
                                                         "currency": "EUR"}),
                              delivery=Delivery(topic, 0, 0, "elsewhere"), lease_seconds=600,
                              max_attempts=5, max_elapsed_seconds=3600)
    app = build_app(topic=topic, **app_settings(db, group_id=group, busy_retry_seconds=0.05))
    with InProcess(app) as r:
        busy = r.runner.metrics.messages.labels(topic, "charge", "busy")
        wait_for(lambda: busy._value.get() >= 5, what="o0 to be found busy several times")
        wait_for(lambda: len(db.ledger()) == 3, what="the other keys")
        assert committed(group, topic)[0] < 0
        assert [row["order_id"] for row in db.ledger()] == ["o1", "o2", "o3"]
        with conn.transaction():  # the other owner finishes
            conn.execute("INSERT INTO payments.ledger (tenant_id, order_id, amount, currency, "
                         "idempotency_key) VALUES ('t1', 'o0', 1.50, 'EUR', 't1:charge:o0')")
            conn.execute("UPDATE payments.balances SET balance = balance + 1.50 "
                         "WHERE tenant_id = 't1' AND currency = 'EUR'")
            assert foreign.token is not None
            store.complete(conn, key="t1:charge:o0", token=foreign.token, result={"x": 1})
        wait_for(lambda: caught_up(group, topic), what="the partition to drain")
    assert [row["order_id"] for row in db.ledger()] == ["o1", "o2", "o3", "o0"]
    assert committed(group, topic) == {0: 4}
    conn.close()


def _first_record(db: DB) -> Any:
    rows = db.records()
    return rows[0] if rows and rows[0]["status"] == "processing" else None


def test_sigkill_after_claim_lease_expires_and_a_new_member_takes_over(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    topic = topics(partitions=1)
    produce(topic, messages([("t1", "o1", "5.00")]))
    env = member_env(db, topic, PAYMENTS_MODE="leased", KAFKA_IDEM_LEASE_SECONDS="1.5")
    stuck = members.start(VARIANTS, {**env, "SLOW_ORDERS": "*", "SLOW_SECONDS": "120"},
                          group=group)
    claimed = wait_for(lambda: _first_record(db), what="the first member to claim")
    # The heartbeat keeps the lease alive while the handler runs.
    wait_for(lambda: db.value("SELECT lease_until > %s FROM kafka_idem.task_idempotency",
                              (claimed["lease_until"],)), what="a heartbeat to extend the lease")
    stuck.send_signal(signal.SIGKILL)
    assert stuck.wait(timeout=10) == -signal.SIGKILL

    members.start(VARIANTS, env, group=group)
    wait_for(lambda: caught_up(group, topic), timeout=90, what="the new member to finish")
    rec = db.records()[0]
    assert rec["status"] == "succeeded"
    assert rec["attempts"] == 2
    assert rec["completed_token"] != claimed["owner_token"]
    assert db.ledger_counts() == {"t1:charge:o1": 1}


def test_zombie_member_resumed_after_takeover_cannot_commit_its_write(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    topic = topics(partitions=1)
    produce(topic, messages([("t1", "o1", "5.00")]))
    env = member_env(db, topic, PAYMENTS_MODE="leased", KAFKA_IDEM_LEASE_SECONDS="1.5")
    zombie = members.start(VARIANTS, {**env, "SLOW_ORDERS": "*", "SLOW_SECONDS": "3"},
                           group=group)
    claimed = wait_for(lambda: _first_record(db), what="the first member to claim")
    zombie.send_signal(signal.SIGSTOP)  # stalled mid-handler, its ledger write uncommitted
    members.start(VARIANTS, env, group=group)
    wait_for(lambda: db.records()[0]["attempts"] == 2, timeout=90,
             what="the new member to take the expired lease over")
    # The new owner's writes wait on the zombie's open transaction (same balance row);
    # the zombie wakes, its fenced completion is refused, its transaction rolls back.
    zombie.send_signal(signal.SIGCONT)
    wait_for(lambda: db.records()[0]["status"] == "succeeded", timeout=60,
             what="the new owner to complete")
    zombie.terminate()
    assert zombie.wait(timeout=60) == 0
    rec = db.records()[0]
    assert rec["attempts"] == 2
    assert rec["completed_token"] != claimed["owner_token"]
    assert db.ledger_counts() == {"t1:charge:o1": 1}
    assert db.balances() == {("t1", "EUR"): Decimal("5.00")}
    wait_for(lambda: caught_up(group, topic), what="the offset to be committed")


def test_undecodable_and_invalid_messages_do_not_stall_the_partition(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=1)
    produce(topic, [(b"x", b"\x00garbage"), (b"y", b""),
                    (b"o1", encode_charge("t1", "o1", "0")),
                    (b"o2", encode_charge("t1", "o2", "3.00"))])
    app = build_app(topic=topic, **app_settings(db, group_id=group))
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), what="the partition to drain")
    assert db.ledger_counts() == {"t1:charge:o2": 1}
    rec = db.record("t1:charge:o1")
    assert rec is not None and rec["status"] == "failed" and rec["error_kind"] == "permanent"
    assert uuid  # keep import for type use


def test_a_group_without_committed_offsets_says_where_it_starts_once(
    db: DB, topics: Topics, group: str, caplog: Any
) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="kafka_idem")
    topic = topics(partitions=1)
    produce(topic, messages(intents(4)))
    app = build_app(topic=topic, **app_settings(db, group_id=group))

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if getattr(r, "action", None) == "start_offset"
                and (r.topic, r.partition) == (topic, 0)]  # its fields say where

    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), what="the group to catch up")
    assert said() == [f"group {group} has no committed offset on {topic}[0]: "
                      "starting at the earliest offset (auto.offset.reset=earliest)"]
    caplog.clear()
    with InProcess(build_app(topic=topic, **app_settings(db, group_id=group))):
        wait_for(lambda: any(getattr(r, "action", None) == "assigned" for r in caplog.records),
                 what="the assignment")
    assert said() == []  # committed now: it resumes there, nothing to say
