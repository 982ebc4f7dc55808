"""Local mode on a store distributed on Citus (``kafka_idem.consume.paths.worker_groups``):
a unit's messages run in one transaction per Citus worker, each one-phase on its worker;
whatever a group cannot decide at once it hands to the per-message path, and the other
groups commit regardless.

A real :class:`Processor` on the payments example (records and tables by tenant) runs
units built in the test; what each worker committed in one transaction is read from the
workers' own row versions (every row a transaction writes carries its id, ``xmin``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from consumers import payments
from consumers.payments import encode_charge
from kafka_idem import Retryable
from kafka_idem.admin.migrate import distribute_store, migrate
from kafka_idem.consume.outcome import Deferred, Ended, Finished, Result
from kafka_idem.consume.paths.processor import Processor
from kafka_idem.observe.metrics import Metrics
from kafka_idem.store import Delivery, Store
from kafka_idem.testing import FakeMessage
from tools import citus as citus_db

TOPIC = "groups.charge-requested"
TENANTS = [f"t{i}" for i in range(8)]


@pytest.fixture
def citus_db_dsn(citus: str) -> Iterator[str]:
    name = f"kafka_idem_groups_{uuid.uuid4().hex[:10]}"
    dsn = citus_db.create_database(citus, name)
    migrate(dsn, "kafka_idem", "task_idempotency")
    assert distribute_store(dsn, "kafka_idem", "task_idempotency", citus=None)
    app = payments.build_app(topic=TOPIC, database_url=dsn, events=False)
    with psycopg.connect(dsn) as conn:
        for fn in app.migrations:  # the tables, then co-located by tenant
            fn(conn)
    yield dsn
    citus_db.drop_database(citus, name)


class Units:
    """Units of charges at increasing offsets of partitions 0 and 1, through one
    Processor on the distributed store."""

    def __init__(self, dsn: str, **settings: Any) -> None:
        self.app = payments.build_app(topic=TOPIC, database_url=dsn, events=False, **settings)
        self.proc = Processor(self.app, store=Store(
            schema="kafka_idem", table="task_idempotency", namespace=self.app.namespace,
            distributed=True), metrics=Metrics())
        self.offsets = [0, 0]
        self.per_message: list[int] = []  # the messages each per-message run was given
        local = self.proc.local_path
        run = local.run

        def counted(parts: Any) -> Any:
            self.per_message.append(sum(len(msgs) for _tp, msgs in parts))
            return run(parts)

        local.run = counted  # type: ignore[method-assign]

    def run(self, *charges: tuple[int, str, str, str]) -> dict[int, list[Result]]:
        """``(partition, tenant, order, amount)`` each; the results by partition."""
        parts: dict[int, list[FakeMessage]] = {}
        for partition, tenant, order, amount in charges:
            parts.setdefault(partition, []).append(FakeMessage(
                TOPIC, partition=partition, offset=self.offsets[partition],
                key=order.encode(), value=encode_charge(tenant, order, amount)))
            self.offsets[partition] += 1
        results = self.proc.run_local([((TOPIC, p), msgs) for p, msgs in parts.items()])
        return {tp[1]: r for tp, r in results.items()}


@pytest.fixture
def units(citus_db_dsn: str) -> Iterator[Units]:
    u = Units(citus_db_dsn)
    yield u
    u.proc.close()


def ended(results: list[Result]) -> list[Ended | str]:
    return [r.outcome if isinstance(r, Finished) else "deferred" for r in results]


def transactions(dsn: str, table: str) -> dict[int, set[str]]:
    """``{worker port: the ids of the transactions that wrote table's rows there}``."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            f"SELECT nodeport, result FROM run_command_on_placements('{table}', "
            "$$SELECT coalesce(string_agg(DISTINCT xmin::text, ','), '') FROM %s$$)").fetchall()
    out: dict[int, set[str]] = {}
    for port, result in rows:
        out.setdefault(int(port), set()).update(x for x in result.split(",") if x)
    return {port: xids for port, xids in out.items() if xids}


def balances(dsn: str) -> dict[str, Decimal]:
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute("SELECT tenant_id, balance FROM payments.balances").fetchall())


def test_a_unit_commits_once_per_worker_each_message_once(units: Units,
                                                           citus_db_dsn: str) -> None:
    charges = [(i % 2, TENANTS[i % 8], f"o{i}", "2.00") for i in range(40)]
    results = units.run(*charges)
    assert {p: ended(r) for p, r in results.items()} == {
        0: [Ended.SUCCEEDED] * 20, 1: [Ended.SUCCEEDED] * 20}
    assert balances(citus_db_dsn) == {t: Decimal("10.00") for t in TENANTS}
    records = transactions(citus_db_dsn, "kafka_idem.task_idempotency")
    ledger = transactions(citus_db_dsn, "payments.ledger")
    # the tenants on both workers; each worker's records and ledger rows: one transaction
    assert len(records) == 2 and all(len(x) == 1 for x in records.values()), records
    assert ledger == records
    # a redelivery of the whole unit: every message replays its record, nothing is written
    again = Units(citus_db_dsn)
    try:
        assert {p: ended(r) for p, r in again.run(*charges).items()} == {
            0: [Ended.REPLAYED] * 20, 1: [Ended.REPLAYED] * 20}
    finally:
        again.proc.close()
    assert balances(citus_db_dsn) == {t: Decimal("10.00") for t in TENANTS}
    assert transactions(citus_db_dsn, "kafka_idem.task_idempotency") == records


def test_a_key_twice_in_a_unit_replays_and_a_changed_payload_conflicts(
        units: Units, citus_db_dsn: str) -> None:
    results = units.run((0, "t1", "o1", "3.00"), (0, "t1", "o1", "3.00"),
                        (0, "t1", "o1", "4.00"), (1, "t2", "o2", "1.00"))
    assert ended(results[0]) == [Ended.SUCCEEDED, Ended.REPLAYED, Ended.CONFLICT]
    conflict = results[0][2]
    assert isinstance(conflict, Finished) and conflict.letter is not None
    assert ended(results[1]) == [Ended.SUCCEEDED]
    assert balances(citus_db_dsn) == {"t1": Decimal("3.00"), "t2": Decimal("1.00")}
    assert units.per_message == []


def test_a_failing_message_is_recorded_in_its_group_which_stays_careful(
        units: Units, citus_db_dsn: str) -> None:
    """A permanent failure (a negative amount) in one worker's group: the group runs
    again with a savepoint per handler, the failure recorded and dead-lettered in it, its
    neighbours applied; the other worker's group commits too. The processor stays
    careful while groups fail, and drops it after a clean one. (Rows written in a
    savepoint carry its subtransaction's id: no one-id-per-worker count here.)"""
    placement = workers_of_tenants(citus_db_dsn)
    bad = TENANTS[0]
    other = next(t for t in TENANTS if placement[t] != placement[bad])
    near = next(t for t in TENANTS if t != bad and placement[t] == placement[bad])
    results = units.run((0, bad, "o1", "1.00"), (0, bad, "o2", "-1.00"),
                        (0, near, "o3", "2.00"), (1, other, "o4", "5.00"),
                        (1, other, "o5", "5.00"))
    assert ended(results[0]) == [Ended.SUCCEEDED, Ended.DEAD_LETTERED, Ended.SUCCEEDED]
    letter = results[0][1]
    assert isinstance(letter, Finished) and letter.letter is not None
    assert ended(results[1]) == [Ended.SUCCEEDED, Ended.SUCCEEDED]
    assert balances(citus_db_dsn) == {bad: Decimal("1.00"), near: Decimal("2.00"),
                                      other: Decimal("10.00")}
    assert statuses(citus_db_dsn) == {
        f"{bad}:charge:o1": "succeeded", f"{bad}:charge:o2": "failed",
        f"{near}:charge:o3": "succeeded", f"{other}:charge:o4": "succeeded",
        f"{other}:charge:o5": "succeeded"}
    assert units.proc.worker_groups.careful  # the last group met an error
    assert units.per_message == []  # every group decided in its transaction
    assert ended(units.run((0, near, "o6", "1.00"))[0]) == [Ended.SUCCEEDED]
    assert not units.proc.worker_groups.careful


def test_a_retry_stops_its_partition_in_the_group_and_a_rejected_write_rolls_back_alone(
        units: Units, citus_db_dsn: str) -> None:
    """Careful from the start: a handler's retryable error waits (its partition's later
    message in the group is not run), and a handler whose statement the database refuses
    (a balance past numeric(18,2)) is dead-lettered with nothing of it written, its
    savepoint rolled back; the rest of the group commits."""
    placement = workers_of_tenants(citus_db_dsn)
    a = TENANTS[0]
    b = next(t for t in TENANTS if t != a and placement[t] == placement[a])
    handler = units.app.handlers[TOPIC]
    charge = handler.fn

    def flaky(msg: Any, ctx: Any) -> Any:
        if msg.order_id == "o2":
            raise Retryable("o2 fails once")
        return charge(msg, ctx)

    handler.fn = flaky
    units.proc.worker_groups.careful = True
    most = "9999999999999999.00"
    results = units.run((0, a, "o1", "1.00"), (0, a, "o2", "1.00"), (0, a, "o3", "1.00"),
                        (1, b, "o4", most), (1, b, "o5", "5.00"))
    assert ended(results[0])[:1] == [Ended.SUCCEEDED]
    assert isinstance(results[0][1], Deferred) and len(results[0]) == 2
    assert ended(results[1]) == [Ended.SUCCEEDED, Ended.DEAD_LETTERED]
    assert balances(citus_db_dsn) == {a: Decimal("1.00"), b: Decimal(most)}
    with psycopg.connect(citus_db_dsn) as conn:
        ledger = conn.execute("SELECT order_id FROM payments.ledger ORDER BY 1").fetchall()
    assert ledger == [("o1",), ("o4",)]  # o5's ledger row went with its savepoint
    assert statuses(citus_db_dsn) == {
        f"{a}:charge:o1": "succeeded", f"{a}:charge:o2": "retryable_failed",
        f"{b}:charge:o4": "succeeded", f"{b}:charge:o5": "failed"}  # o3: not run
    assert units.per_message == []


def test_a_handler_savepoint_of_its_own_runs_in_the_group(units: Units,
                                                           citus_db_dsn: str) -> None:
    """``ctx.tx.transaction()`` in a handler is a savepoint of the group's transaction
    (not a BEGIN of its own): the group commits without falling back."""
    handler = units.app.handlers[TOPIC]
    charge = handler.fn

    def nested(msg: Any, ctx: Any) -> Any:
        ctx.tx.execute("SELECT 1").fetchone()
        with ctx.tx.transaction():
            return charge(msg, ctx)

    handler.fn = nested
    results = units.run(*[(i % 2, TENANTS[i % 8], f"o{i}", "1.00") for i in range(16)])
    assert {p: ended(r) for p, r in results.items()} == {
        0: [Ended.SUCCEEDED] * 8, 1: [Ended.SUCCEEDED] * 8}
    assert balances(citus_db_dsn) == {t: Decimal("2.00") for t in TENANTS}
    assert units.per_message == [] and not units.proc.worker_groups.careful


def test_contention_sends_units_message_by_message_for_a_while(units: Units,
                                                                citus_db_dsn: str) -> None:
    """A group that meets a deadlock (another member's group holding rows it needs) is
    rolled back and its messages run one by one, with the unit's other group (on the
    other worker); the next units too, for CONTENDED_SECONDS, then groups again. The
    deadlock is never the message's: nothing is charged."""
    placement = workers_of_tenants(citus_db_dsn)
    other = next(t for t in TENANTS if placement[t] != placement["t1"])
    handler = units.app.handlers[TOPIC]
    charge = handler.fn
    raised: list[str] = []

    def contended(msg: Any, ctx: Any) -> Any:
        if not raised:  # the first handler called: its group meets the deadlock
            raised.append(msg.order_id)
            raise psycopg.errors.DeadlockDetected("deadlock detected (a test's)")
        return charge(msg, ctx)

    handler.fn = contended
    first = units.run((0, "t1", "o1", "1.00"), (0, "t1", "o2", "1.00"),
                      (1, other, "o9", "1.00"))
    assert ended(first[0]) == [Ended.SUCCEEDED, Ended.SUCCEEDED]
    assert ended(first[1]) == [Ended.SUCCEEDED]
    assert units.per_message == [3]  # both groups, message by message
    assert units.run((0, "t1", "o3", "1.00"))[0][0].outcome is Ended.SUCCEEDED  # type: ignore[union-attr]
    assert units.per_message == [3, 1]  # still contended: no group tried
    groups = units.proc.worker_groups
    assert groups.contended_until > 0
    groups.contended_until = 0.0  # the window over
    assert ended(units.run((0, "t1", "o4", "1.00"))[0]) == [Ended.SUCCEEDED]
    assert units.per_message == [3, 1]  # a group again
    assert {k: v for k, v in statuses(citus_db_dsn).items()} == {
        f"t1:charge:o{i}": "succeeded" for i in range(1, 5)} | {
        f"{other}:charge:o9": "succeeded"}
    with psycopg.connect(citus_db_dsn) as conn:
        attempts = conn.execute("SELECT max(attempts) FROM kafka_idem.task_idempotency")
        assert attempts.fetchone() == (1,)
    assert balances(citus_db_dsn) == {"t1": Decimal("4.00"), other: Decimal("1.00")}


def statuses(dsn: str) -> dict[str, str]:
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute("SELECT idempotency_key, status FROM "
                                 "kafka_idem.task_idempotency").fetchall())


def test_a_busy_key_stops_its_partition_there_and_the_rest_comes_again(
        units: Units, citus_db_dsn: str) -> None:
    """A key claimed by someone else (a live lease): its message waits, its partition's
    results stop there; a later message of that partition on another worker may have
    committed already, and replays when it comes again."""
    placement = workers_of_tenants(citus_db_dsn)
    busy = TENANTS[0]
    other = next(t for t in TENANTS if placement[t] != placement[busy])
    first = FakeMessage(TOPIC, key=b"o1", value=encode_charge(busy, "o1", "1.00"))
    prep = units.proc.prepare(units.app.handlers[TOPIC], first)
    with psycopg.connect(citus_db_dsn) as conn:  # another member's claim, its lease live
        claim = units.proc.store.claim_new(
            conn, key=prep.key, request_hash=prep.request_hash,
            delivery=Delivery(TOPIC, 0, 0, "charge"), lease_seconds=60, shard=busy)
        assert claim is not None
    results = units.run((0, busy, "o1", "1.00"), (0, other, "o2", "2.00"),
                        (1, other, "o3", "3.00"))
    assert isinstance(results[0][0], Deferred) and len(results[0]) == 1
    assert ended(results[1]) == [Ended.SUCCEEDED]
    assert balances(citus_db_dsn).get(busy) is None
    assert units.per_message == []


def workers_of_tenants(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        return {t: int(conn.execute(  # type: ignore[index]
            "SELECT nodeport FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid) "
            "WHERE p.shardid = get_shard_id_for_distribution_column("
            "'kafka_idem.task_idempotency', %s::text)", (t,)).fetchone()[0]) for t in TENANTS}
