"""A key waiting for its next attempt holds only its own lanes (its idempotency key and
its ``ordering_key``), not its partition: the partition's other keys go on, the committed
offset stays at the waiting message, and a crash meanwhile changes nothing of the end
state. ``retry_blocks_partition=True`` keeps the old, strict partition order."""

from __future__ import annotations

import datetime as dt
import random
import signal
import threading
import time
from typing import Any

import psycopg
import pytest

from consumers import payments
from consumers.payments import encode_charge
from kafka_idem import App, Context, Retryable, RetryPolicy
from tests.conftest import (
    DB,
    InProcess,
    Members,
    Topics,
    app_settings,
    caught_up,
    committed,
    headers,
    member_env,
    produce,
    read_topic,
    wait_for,
)
from tests.integration.support import charge_app, failures, record_history

# Each test runs on one PostgreSQL and on Citus (the store distributed).
pytestmark = pytest.mark.both_stores

TRACE_SQL = """
CREATE TABLE public.trace (
    kafka_offset bigint      NOT NULL,
    tenant       text        NOT NULL,
    order_id     text        NOT NULL,
    sent_ms      bigint      NOT NULL,
    at           timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY ({key})
)
"""

BAD = "bad"
# The default policy's numbers (5 attempts, 0.5 s base, 60 s cap), with a generator seeded
# so that its four waits add up to a few seconds: long enough for other keys to arrive
# meanwhile, the same on every run.
DEFAULT = {"base": 0.5, "cap": 60.0, "max_attempts": 5}


def seed_waiting(low: float, high: float) -> int:
    policy = RetryPolicy(**DEFAULT)  # type: ignore[arg-type]
    for seed in range(10_000):
        rng = random.Random(seed)
        total = sum(policy.delay(n, rng=rng).delay for n in range(1, 5))
        if low <= total <= high:
            return seed
    raise AssertionError("no seed found")


def traced_app(db: DB, topic: str, group: str, *, mode: str, blocks: bool = False,
               **settings: Any) -> App:
    """The payments charge with a trace row per call (in its transaction) and ``BAD``
    failing retryably on every attempt; ordered by tenant."""
    app = App("lanes", **app_settings(db, group_id=group, schemas_dir=payments.SCHEMAS_DIR,
                                      **settings))
    app.migration(payments.create_tables)
    policy = RetryPolicy(**DEFAULT, rng=random.Random(seed_waiting(4.0, 7.0)))  # type: ignore[arg-type]

    def charge(msg: payments.ChargeRequested, ctx: Context) -> Any:
        if msg.order_id == BAD:
            raise Retryable(f"the bank is down (attempt {ctx.attempt})")
        ctx.tx.execute("INSERT INTO public.trace (kafka_offset, tenant, order_id, sent_ms) "
                       "VALUES (%s, %s, %s, %s)",
                       (ctx.offset, msg.tenant_id, msg.order_id, ctx.timestamp))
        return payments.charge(msg, ctx)

    app.handler(topic=topic, model=payments.ChargeRequested, key="{tenant_id}:charge:{order_id}",
                shard_key="{tenant_id}" if db.flavour == "citus" else None,  # as charge_app
                hash_fields=("amount", "currency"), schema=payments.SCHEMA,
                mode=mode, retry=policy, ordering_key="{tenant_id}",  # type: ignore[arg-type]
                retry_blocks_partition=blocks)(charge)
    return app


def with_trace(db: DB) -> None:
    """The trace table, and the records' history. On Citus the trace is distributed by
    tenant with the records (a handler's write to a table local to the coordinator is
    refused), so its primary key holds the tenant too."""
    with psycopg.connect(db.dsn) as conn:
        if db.flavour == "citus":
            conn.execute(TRACE_SQL.format(key="tenant, kafka_offset"))
            conn.execute("SELECT create_distributed_table('public.trace', 'tenant', "
                         "colocate_with => 'kafka_idem.task_idempotency')")
        else:
            conn.execute(TRACE_SQL.format(key="kafka_offset"))
    record_history(db)


def charge(tenant: str, order: str) -> tuple[bytes, bytes]:
    return order.encode(), encode_charge(tenant, order, "1.00")


def dead_lettered_at(db: DB, key: str) -> dt.datetime:
    (row,) = [r for r in failures(db, key, "failed")] or [None]
    assert row is not None, f"{key} was not dead-lettered"
    return row["at"]  # type: ignore[no-any-return]


@pytest.mark.exclusive("it asserts every other key finished within 5 s of being sent: a bound "
                       "that holds on a machine not shared with other tests")
@pytest.mark.parametrize("mode,settings,others", [
    ("local", {}, 1000),
    ("local", {"batch_path": False}, 1000),
    ("leased", {}, 300),
], ids=["batch", "per-message", "leased"])
def test_other_keys_of_the_partition_finish_while_one_key_waits_for_its_retries(
    db: DB, topics: Topics, group: str, mode: str, settings: dict[str, Any], others: int
) -> None:
    topic = topics(partitions=1)
    with_trace(db)
    # Before it, two that finish; then the failing key and two more of its tenant (its
    # ordering key: they wait for it); then the other keys, arriving in waves while it
    # waits, each wave with a few keys sent again (duplicates: answered, not re-run).
    produce(topic, [charge("t1", "pre0"), charge("t1", "pre1"), charge("tb", BAD),
                    charge("tb", "after0"), charge("tb", "after1")])
    waves = 10
    orders = [f"o{i}" for i in range(others)]
    with InProcess(traced_app(db, topic, group, mode=mode, **settings)):
        for w in range(waves):
            wave = orders[w * others // waves:(w + 1) * others // waves]
            produce(topic, [charge("t1", o) for o in wave + wave[:3]])
            time.sleep(0.3)  # arrivals spread over the retries, not a wait for an outcome
        wait_for(lambda: caught_up(group, topic), timeout=120, what="the topic to drain")
    key = f"tb:charge:{BAD}"
    dead = dead_lettered_at(db, key)
    rows = db.rows("SELECT * FROM public.trace ORDER BY kafka_offset")
    by_order = {r["order_id"]: r for r in rows}
    # Nothing lost, nothing doubled: one effect per key, the failing key none.
    assert sorted(by_order) == sorted(["pre0", "pre1", "after0", "after1", *orders])
    assert len(rows) == len(by_order)
    assert db.ledger_counts() == {f"{r['tenant']}:charge:{r['order_id']}": 1 for r in rows}
    statuses = {r["idempotency_key"]: r["status"] for r in db.records()}
    assert statuses.pop(key) == "failed"
    assert set(statuses.values()) == {"succeeded"}
    (letter,) = read_topic(f"{topic}.dlq")
    assert headers(letter)["idem.error.kind"] == "exhausted"
    assert headers(letter)["idem.attempts"] == "5"
    # The other keys did not wait for it: each finished within 5 s of being sent, and
    # many of them before it was dead-lettered (holding the partition, none would have).
    late = [r["order_id"] for r in rows if r["order_id"] in set(orders)
            and r["at"].timestamp() * 1000 - r["sent_ms"] > 5000]
    assert late == []
    assert sum(1 for o in orders if by_order[o]["at"] < dead) >= others // waves
    # Its ordering key's later messages waited for it, and ran in their order.
    assert dead < by_order["after0"]["at"] < by_order["after1"]["at"]
    # Every key's messages in offset order: the trace's offsets grow with its time, per
    # tenant (one lane each).
    for tenant in ("t1", "tb"):
        mine = [r for r in rows if r["tenant"] == tenant]
        assert [r["kafka_offset"] for r in sorted(mine, key=lambda r: r["at"])] == sorted(
            r["kafka_offset"] for r in mine)
    assert sum(committed(group, topic).values()) == 5 + others + waves * 3


def test_a_handler_that_asks_for_it_holds_its_partition_while_a_key_waits(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=1)
    with_trace(db)
    produce(topic, [charge("tb", BAD)] + [charge("t1", f"o{i}") for i in range(20)])
    with InProcess(traced_app(db, topic, group, mode="local", blocks=True)):
        wait_for(lambda: caught_up(group, topic), timeout=120, what="the topic to drain")
    dead = dead_lettered_at(db, f"tb:charge:{BAD}")
    rows = db.rows("SELECT * FROM public.trace ORDER BY kafka_offset")
    assert len(rows) == 20
    assert all(r["at"] > dead for r in rows)  # nothing after it ran before it ended
    assert [r["kafka_offset"] for r in sorted(rows, key=lambda r: r["at"])] == list(range(1, 21))


def test_a_member_killed_while_a_key_waits_ends_in_the_same_state(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    """SIGKILL while one key waits for its retries and later keys have finished: the
    committed offset never passed the waiting message, so the next member gets it again
    with everything after it; what finished replays from the store (no second effect),
    the waiting key keeps its attempt count and ends dead-lettered once."""
    topic = topics(partitions=1)
    record_history(db)
    pre = [f"pre{i}" for i in range(3)]
    after = [f"o{i}" for i in range(300)]
    produce(topic, [payments_charge(o) for o in pre] + [payments_charge(BAD)])
    env = member_env(db, topic, RETRYABLE_ORDERS=BAD, RETRYABLE_ATTEMPTS="99",
                     KAFKA_IDEM_BACKOFF_BASE_SECONDS="2", KAFKA_IDEM_BACKOFF_CAP_SECONDS="2")
    victim = members.start("tests.apps.variants:app", env, group=group)
    key = f"t1:charge:{BAD}"
    wait_for(lambda: len(failures(db, key)) >= 1, timeout=60, what="a first failure")
    produce(topic, [payments_charge(o) for o in after])
    wait_for(lambda: len(db.ledger_counts()) >= len(pre) + 100, timeout=60,
             what="later keys finishing while it waits")
    assert not failures(db, key, "failed")  # still waiting: killed mid-way
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(timeout=30) == -signal.SIGKILL
    assert committed(group, topic) == {0: len(pre)}  # never past the waiting message
    members.start("tests.apps.variants:app", env, group=group)
    wait_for(lambda: caught_up(group, topic), timeout=120, what="the topic to drain")
    assert db.ledger_counts() == {f"t1:charge:{o}": 1 for o in pre + after}
    (record,) = [r for r in db.records() if r["idempotency_key"] == key]
    assert (record["status"], record["attempts"]) == ("failed", 5)
    letters = read_topic(f"{topic}.dlq")
    assert [headers(m)["idem.key"] for m in letters] == [key]
    assert sum(committed(group, topic).values()) == len(pre) + 1 + len(after)


def payments_charge(order: str) -> tuple[bytes, bytes]:
    return charge("t1", order)


def test_the_commit_never_passes_a_waiting_key_when_another_key_and_its_later_message_finish(
    db: DB, topics: Topics, group: str
) -> None:
    """x fails once, y keeps failing; x's later message was set aside behind x before y
    failed. When x and that message finish, the committed offset must stop at y (the
    lowest waiting message), not at x's later one: past y, a crash would lose it."""
    topic = topics(partitions=1)
    release = threading.Event()

    def flaky(msg: payments.ChargeRequested, ctx: Context) -> Any:
        if msg.order_id == "x" and ctx.attempt == 1:
            raise Retryable("x fails once")
        if msg.order_id == "y" and not release.is_set():
            raise Retryable("y waits for the test")
        return payments.charge(msg, ctx)

    sent = [charge("t1", o) for o in ("x", "a1", "a2", "a3", "a4", "y", "b1", "b2", "b3",
                                       "b4", "b5", "x", "c1")]
    produce(topic, sent)
    policy = RetryPolicy(base=0.2, cap=0.5, max_attempts=1000)
    app = charge_app(db, topic, group, flaky, retry=policy)
    with InProcess(app):
        wait_for(lambda: len(db.ledger_counts()) == 11, timeout=60,
                 what="every key but y (x after its retry)")
        # Before x finished the commit stood at x (0); once x is done, at y, never past:
        # x's later message (11) is done too, and a commit past y would show instead.
        wait_for(lambda: committed(group, topic)[0] == 5, timeout=30,
                 what="the commit to reach y")
        assert (db.record("t1:charge:y") or {})["status"] == "retryable_failed"
        release.set()
        wait_for(lambda: caught_up(group, topic), timeout=60, what="y once released")
    assert db.ledger_counts() == {f"t1:charge:{o}": 1 for o in
                                  ("x", "a1", "a2", "a3", "a4", "y", "b1", "b2", "b3", "b4",
                                   "b5", "c1")}
    assert committed(group, topic) == {0: len(sent)}
