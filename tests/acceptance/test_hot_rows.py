"""A busy group on shared rows keeps making progress: ``kafka-idem run`` members against
the real broker and database.

Found by a long chaos run: local-mode units held every row their earlier messages
locked (a tenant's balance, an event key's outbox slot) while later ones ran, so two
members on different partitions charging the same tenants in opposite orders
deadlocked from the first minute, retried the same units into the same cycles,
waited past their poll interval and were dropped from the group again and again.
Each message now commits on its own, and a lock wait is bounded.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient

from consumers.payments import encode_charge
from tests.conftest import (
    BOOTSTRAP,
    DB,
    ROOT,
    Members,
    Topics,
    caught_up,
    member_env,
    read_topic,
    wait_for,
)

APP = "tests.apps.hotrows:app"
POLL_MS = 10_000  # max.poll.interval.ms of the members (the chaos harness's)


def assigned(admin: AdminClient, group: str) -> int:
    """How many members of ``group`` hold a partition."""
    [desc] = admin.describe_consumer_groups([group], request_timeout=10).values()
    try:
        got = desc.result(timeout=10)
    except KafkaException:
        return 0
    return sum(1 for m in got.members if m.assignment.topic_partitions)


def setup(db: DB, topics: Topics, **extra: str) -> tuple[str, str, dict[str, str]]:
    tag = uuid.uuid4().hex[:8]
    source, events, prefix = topics(partitions=2, prefix="hot"), f"hot-ev-{tag}", f"h{tag}-"
    topics.created += [events, f"{prefix}kafka-idem-outbox.hotrows"]
    env = member_env(db, source, HOT_EVENTS=events, KAFKA_IDEM_NAME_PREFIX=prefix,
                     KAFKA_IDEM_MAX_POLL_INTERVAL_MS=str(POLL_MS), **extra)
    made = subprocess.run([sys.executable, "-m", "kafka_idem.cli", "topics", "create", APP],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    return source, events, env


def charge(producer: Producer, source: str, part: int, tenant: str, order: str) -> str:
    producer.produce(source, key=order.encode(), partition=part,
                     value=encode_charge(tenant, order, "1.00"))
    return f"{tenant}:charge:{order}"


def test_two_members_charging_the_same_tenants_in_opposite_orders_never_deadlock(
    db: DB, topics: Topics, members: Members, group: str, admin: AdminClient,
    tmp_path: Path,
) -> None:
    """Member A charges h1 then h2 (partition 0), member B h2 then h1 (partition 1),
    their first charges lined up so each holds its tenant's balance when the second
    comes: a cycle when a unit holds its earlier messages' rows (today's main
    deadlocked here). Then 300 more each way. Every charge once, every event once,
    no deadlock, no member dropped from its group."""
    block = tmp_path / "block"
    block.write_text("")
    source, events, env = setup(db, topics, HOT_BLOCK_FILE=str(block),
                                HOT_BLOCK_ORDERS="p0-0,p1-0")
    for _ in range(2):
        members.start(APP, env, group=group)
    wait_for(lambda: assigned(admin, group) == 2, timeout=60,
             what="each member holding a partition")
    producer = Producer({"bootstrap.servers": BOOTSTRAP})
    orders = []
    n = 300
    for i in range(n):  # partition 0: h1, h2, h1...; partition 1: h2, h1, h2...
        for part, tenants in ((0, ("h1", "h2")), (1, ("h2", "h1"))):
            orders.append(charge(producer, source, part, tenants[i % 2], f"p{part}-{i}"))
    assert producer.flush(30) == 0
    wait_for(lambda: Path(f"{block}.p0-0").exists() and Path(f"{block}.p1-0").exists(),
             timeout=60, what="both first charges holding their tenant's balance")
    block.unlink()
    wait_for(lambda: caught_up(group, source), timeout=180, interval=0.5,
             what="both partitions consumed")
    assert db.ledger_counts() == dict.fromkeys(orders, 1)
    assert {k[0]: v for k, v in db.balances().items()} == {"h1": n, "h2": n}
    logs = members.logs()
    assert "deadlock detected" not in logs, logs[-3000:]
    assert "_MAX_POLL_EXCEEDED" not in logs and "action=lost" not in logs, logs[-3000:]

    def published() -> list[Any] | None:
        got = read_topic(events, timeout=10)
        return got if len(got) >= len(orders) else None

    got = wait_for(published, timeout=90, interval=1.0, what="every event published")
    assert len(got) == len({m.value() for m in got}) == len(orders)


def test_a_member_waiting_on_a_row_lock_stays_in_its_group(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    """Another session holds a tenant's balance row for three poll intervals: the
    member's wait for it is bounded (lock_timeout, a fifth of the poll interval), so
    it keeps polling, stays in the group, and applies the charge once the row is
    free; the other tenant's charges go on meanwhile."""
    source, _events, env = setup(db, topics)
    producer = Producer({"bootstrap.servers": BOOTSTRAP})
    warm = charge(producer, source, 0, "h1", "warm")
    assert producer.flush(30) == 0
    members.start(APP, env, group=group)
    wait_for(lambda: caught_up(group, source), timeout=60, what="the first charge")
    with psycopg.connect(db.dsn) as holder:
        holder.execute("SELECT 1 FROM payments.balances WHERE tenant_id = 'h1' FOR UPDATE")
        held = charge(producer, source, 0, "h1", "held")
        others = [charge(producer, source, 1, "h2", f"o{i}") for i in range(5)]
        assert producer.flush(30) == 0
        wait_for(lambda: caught_up(group, source) is False and all(
            (db.record(k) or {}).get("status") == "succeeded" for k in others),
            timeout=60, what="the other tenant's charges")
        time.sleep(3 * POLL_MS / 1000)  # the fault: a lock held past three poll intervals
        assert db.record(held) is None or db.record(held)["status"] != "succeeded"  # type: ignore[index]
    wait_for(lambda: caught_up(group, source), timeout=60, what="the held charge")
    assert db.ledger_counts() == dict.fromkeys([warm, held, *others], 1)
    logs = members.logs()
    assert "_MAX_POLL_EXCEEDED" not in logs and "action=lost" not in logs, logs[-3000:]
    assert "lock timeout" in logs or "lock_not_available" in logs or "55P03" in logs, logs[-3000:]
