"""Key-ordered concurrency inside a partition (``concurrency=N``, ``ordering_key``,
``async def`` handlers), on real Kafka and PostgreSQL.

The evidence is durable: each attempt of the handler writes a ``span_start`` row
when it begins and a ``span_end`` row when it returns, each on its own autocommit
connection (so they stay even when the handler's transaction rolls back) and each
numbered by one database sequence. Two attempts overlap exactly when their
``[start, end]`` numbers interleave, so no clock or sleep decides a verdict.
Committed offsets are read from the broker, and every offset the member had
acknowledged is recorded through its commit callback.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from consumers import payments
from consumers.payments import encode_charge
from kafka_idem import App, AsyncContext, ConfigError, Context, Retryable, RetryPolicy
from kafka_idem.consume.runner import Runner
from tests.conftest import (
    DB,
    InProcess,
    Members,
    Topics,
    app_settings,
    caught_up,
    committed,
    member_env,
    produce,
    wait_for,
)
from tests.integration.support import migrate_app

SPANS_SQL = """
CREATE SEQUENCE public.span_seq;
CREATE TABLE public.spans (
    seq          bigint  NOT NULL DEFAULT nextval('public.span_seq') PRIMARY KEY,
    edge         text    NOT NULL,            -- 'start' or 'end'
    ordering     text    NOT NULL,            -- the ordering key (tenant) of the message
    order_id     text    NOT NULL,
    partition    integer NOT NULL,
    kafka_offset bigint  NOT NULL,
    attempt      integer NOT NULL
)
"""


class Spans:
    """Start/end rows per attempt, on one autocommit connection per thread."""

    def __init__(self, db: DB) -> None:
        self.dsn = db.dsn
        self._local = threading.local()
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            conn.execute(SPANS_SQL)

    def mark(self, edge: str, msg: payments.ChargeRequested, ctx: Context) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = psycopg.connect(self.dsn, autocommit=True)
        conn.execute(
            "INSERT INTO public.spans (edge, ordering, order_id, partition, kafka_offset,"
            " attempt) VALUES (%s, %s, %s, %s, %s, %s)",
            (edge, msg.tenant_id, msg.order_id, ctx.partition, ctx.offset, ctx.attempt))


def attempts(db: DB) -> list[dict[str, Any]]:
    """Every attempt: its ordering key, partition, offset, and start and end numbers
    (end None if it has not returned)."""
    rows = db.rows("SELECT * FROM public.spans ORDER BY seq")
    spans: dict[tuple[int, int, int], dict[str, Any]] = {}
    for r in rows:
        a = spans.setdefault((r["partition"], r["kafka_offset"], r["attempt"]), {
            "ordering": r["ordering"], "partition": r["partition"],
            "offset": r["kafka_offset"], "start": None, "end": None})
        a[r["edge"]] = r["seq"]
    return sorted(spans.values(), key=lambda a: a["start"])


def assert_one_at_a_time_in_offset_order(db: DB) -> dict[str, list[dict[str, Any]]]:
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for a in attempts(db):
        by_key[a["ordering"]].append(a)
    for key, spans in by_key.items():
        for before, after in itertools.pairwise(spans):
            assert before["end"] is not None and before["end"] < after["start"], (
                f"two messages of {key} overlapped: {before} and {after}")
            assert before["partition"] == after["partition"], (
                f"{key} is on two partitions: the test needs one per ordering key")
            assert before["offset"] <= after["offset"], (
                f"{key}: offset {after['offset']} started after {before['offset']}")
    return by_key


def overlaps(db: DB) -> int:
    """How many pairs of attempts (of different keys) ran at once."""
    spans = [a for a in attempts(db) if a["end"] is not None]
    return sum(1 for i, a in enumerate(spans) for b in spans[i + 1:] if b["start"] < a["end"])


def keyed_app(db: DB, topic: str, group: str, fn: Callable[..., Any], *,
              concurrency: int, ordering_key: str | None = "{tenant_id}",
              retry: RetryPolicy | None = None, reconcile: Callable[..., Any] | None = None,
              **settings: Any) -> App:
    app = App("keyed", **app_settings(db, group_id=group, schemas_dir=payments.SCHEMAS_DIR,
                                      **settings))
    app.migration(payments.create_tables)
    handler = app.handler(
        topic=topic, model=payments.ChargeRequested, key="{tenant_id}:charge:{order_id}",
        hash_fields=("amount", "currency"), schema=payments.SCHEMA, mode="leased",
        concurrency=concurrency, ordering_key=ordering_key, retry=retry,
    )(fn)
    if reconcile is not None:
        handler.reconciler(reconcile)
    migrate_app(db, app)
    return app


def commits_seen(runner: Runner) -> list[int]:
    """Every offset the broker acknowledged to ``runner`` (its commit callback)."""
    seen: list[int] = []
    inner = runner._on_commit

    def record(err: Any, partitions: list[Any]) -> None:
        seen.extend(p.offset for p in partitions if err is None and p.error is None)
        inner(err, partitions)

    runner._on_commit = record  # type: ignore[method-assign]
    return seen


def test_messages_of_one_key_never_overlap_and_keep_offset_order_while_keys_run_together(
    db: DB, topic: str, group: str
) -> None:
    spans = Spans(db)
    fails_once = {"t2:o5", "t3:o2"}  # a retry per key must hold its key's later messages

    def charge(msg: payments.ChargeRequested, ctx: Context) -> Any:
        spans.mark("start", msg, ctx)
        try:
            ctx.tx.execute("SELECT pg_sleep(0.01)")  # the remote call
            if f"{msg.tenant_id}:{msg.order_id}" in fails_once and ctx.attempt == 1:
                raise Retryable("gateway busy")
            return payments.charge(msg, ctx)
        finally:
            spans.mark("end", msg, ctx)

    # One partition, four accounts interleaved: each account's charges in offset order.
    records = [(f"t{i % 4}".encode(), encode_charge(f"t{i % 4}", f"o{i // 4}", "1.00"))
               for i in range(80)]
    produce(topic, records)
    app = keyed_app(db, topic, group, charge, concurrency=8,
                    retry=RetryPolicy(base=0.2, cap=0.2, max_attempts=5))
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), timeout=120, what="the topic to drain")
    by_key = assert_one_at_a_time_in_offset_order(db)
    assert sorted(by_key) == ["t0", "t1", "t2", "t3"]
    assert overlaps(db) > 0, "no two keys ever ran at once"
    assert db.ledger_counts() == {f"t{i % 4}:charge:o{i // 4}": 1 for i in range(80)}
    assert db.status_counts() == {"succeeded": 80}
    assert committed(group, topic) == {0: 80}
    retried = [a for a in attempts(db) if a["offset"] in (4 * 5 + 2, 4 * 2 + 3)]  # t2:o5, t3:o2
    assert len(retried) == 4  # each failed once, then succeeded


def test_a_slow_key_blocks_neither_other_keys_nor_lets_the_offset_pass_it(
    db: DB, topic: str, group: str
) -> None:
    spans = Spans(db)
    release = threading.Event()

    def charge(msg: payments.ChargeRequested, ctx: Context) -> Any:
        spans.mark("start", msg, ctx)
        if msg.tenant_id == "slow":
            assert release.wait(60)
        spans.mark("end", msg, ctx)
        return payments.charge(msg, ctx)

    # 0-4 fast, 5 slow, 6-29 fast (six more of them on the slow key's account).
    tenants = ["t0"] * 5 + ["slow"] + [f"t{i % 3}" for i in range(24)]
    produce(topic, [(t.encode(), encode_charge(t, f"o{i}", "1.00"))
                    for i, t in enumerate(tenants)])
    app = keyed_app(db, topic, group, charge, concurrency=4, ordering_key=None)
    with InProcess(app) as member:
        seen = commits_seen(member.runner)
        others = len(tenants) - 1
        wait_for(lambda: db.status_counts().get("succeeded") == others, timeout=60,
                 what="every other key to finish while the slow one runs")
        wait_for(lambda: committed(group, topic) == {0: 5}, timeout=30,
                 what="the prefix before the slow key to be committed")
        assert db.status_counts() == {"succeeded": others, "processing": 1}
        for _ in range(20):  # the broker's view, read again and again: never past it
            assert committed(group, topic) == {0: 5}
        assert max(seen) == 5
        release.set()
        wait_for(lambda: caught_up(group, topic), timeout=60, what="the topic to drain")
    assert db.status_counts() == {"succeeded": len(tenants)}
    assert db.ledger_counts() == {f"{t}:charge:o{i}": 1 for i, t in enumerate(tenants)}
    assert all(o <= 5 or o == len(tenants) for o in seen)


@pytest.mark.parametrize("loop_thread", [False, True], ids=["pumped", "loop_thread"])
def test_async_handlers_run_keys_together_on_an_async_connection(
    db: DB, topic: str, group: str, loop_thread: bool
) -> None:
    spans = Spans(db)

    async def charge(msg: payments.ChargeRequested, ctx: AsyncContext) -> Any:
        assert isinstance(ctx.tx, psycopg.AsyncConnection)
        await asyncio.to_thread(spans.mark, "start", msg, ctx)
        await asyncio.sleep(0.01)  # the remote call
        await ctx.tx.execute(
            "INSERT INTO payments.ledger (tenant_id, order_id, amount, currency, idempotency_key)"
            " VALUES (%s, %s, %s, %s, %s)",
            (msg.tenant_id, msg.order_id, msg.amount, msg.currency, ctx.idempotency_key))
        await asyncio.to_thread(spans.mark, "end", msg, ctx)
        return {"order_id": msg.order_id}

    records = [(f"t{i % 5}".encode(), encode_charge(f"t{i % 5}", f"o{i // 5}", "2.50"))
               for i in range(60)]
    # a duplicate (same intent sent again) and an undecodable record
    records += [(b"t0", encode_charge("t0", "o0", "2.50")), (b"x", b"\xff not a record")]
    produce(topic, records)
    app = keyed_app(db, topic, group, charge, concurrency=16, event_loop_thread=loop_thread)
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), timeout=120, what="the topic to drain")
    assert_one_at_a_time_in_offset_order(db)
    assert overlaps(db) > 0
    assert db.ledger_counts() == {f"t{i % 5}:charge:o{i // 5}": 1 for i in range(60)}
    assert db.status_counts() == {"succeeded": 60}
    assert committed(group, topic) == {0: 62}


def test_an_async_handler_that_raises_is_retried_and_its_reconciler_is_async(
    db: DB, topic: str, group: str
) -> None:
    from kafka_idem import Done, UnknownOutcome

    calls: list[str] = []

    async def charge(msg: payments.ChargeRequested, ctx: AsyncContext) -> Any:
        calls.append(f"charge:{msg.order_id}:{ctx.attempt}")
        if msg.order_id == "lost":
            raise UnknownOutcome("no answer")
        if msg.order_id == "flaky" and ctx.attempt == 1:
            raise Retryable("try again")
        await ctx.tx.execute("SELECT 1")
        return {"ok": msg.order_id}

    app = keyed_app(db, topic, group, charge, concurrency=4,
                    retry=RetryPolicy(base=0.1, cap=0.1, max_attempts=5))
    handler = app.handlers[topic]

    @handler.reconciler
    async def reconcile(msg: payments.ChargeRequested, ctx: AsyncContext) -> Done | None:
        calls.append(f"reconcile:{msg.order_id}:{ctx.attempt}")
        await ctx.tx.execute("SELECT 1")
        return Done({"found": msg.order_id})

    produce(topic, [(b"a", encode_charge("t1", o, "1.00")) for o in ("lost", "flaky", "fine")])
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), timeout=60, what="the topic to drain")
    rows = {r["idempotency_key"]: r for r in db.rows(
        "SELECT idempotency_key, status, result_json AS result FROM kafka_idem.task_idempotency")}
    assert {k: (r["status"], r["result"]) for k, r in rows.items()} == {
        "t1:charge:lost": ("succeeded", {"found": "lost"}),
        "t1:charge:flaky": ("succeeded", {"ok": "flaky"}),
        "t1:charge:fine": ("succeeded", {"ok": "fine"}),
    }
    assert calls.count("charge:lost:1") == 1 and "reconcile:lost:2" in calls
    assert "charge:lost:2" not in calls  # the reconciler answered: not charged again


def test_a_stop_abandons_work_still_running_after_drain_seconds_and_the_next_owner_finishes_it(
    db: DB, topic: str, group: str
) -> None:
    spans = Spans(db)
    release = threading.Event()

    def charge(msg: payments.ChargeRequested, ctx: Context) -> Any:
        spans.mark("start", msg, ctx)
        if msg.order_id == "stuck" and ctx.attempt == 1:
            release.wait(60)  # the first owner's attempt hangs past its stop
        spans.mark("end", msg, ctx)
        return payments.charge(msg, ctx)

    orders = ["a", "b", "stuck", "c", "d"]
    produce(topic, [(o.encode(), encode_charge("t1", o, "1.00")) for o in orders])
    settings = {"drain_seconds": 0.5, "lease_seconds": 2.0}
    first = keyed_app(db, topic, group, charge, concurrency=4, ordering_key=None, **settings)
    with InProcess(first):
        wait_for(lambda: db.status_counts().get("succeeded") == 4, timeout=60,
                 what="the other keys to finish")
    # The member stopped though its handler still hangs (bounded drain) ...
    assert not release.is_set()
    assert db.status_counts() == {"succeeded": 4, "processing": 1}
    assert committed(group, topic) == {0: 2}  # ... and committed nothing past it.
    second = keyed_app(db, topic, group, charge, concurrency=4, ordering_key=None, **settings)
    with InProcess(second):
        wait_for(lambda: caught_up(group, topic), timeout=60, what="the next owner to finish")
        release.set()  # the abandoned attempt returns now: its completion is fenced off
    assert db.status_counts() == {"succeeded": 5}
    assert db.ledger_counts() == {f"t1:charge:{o}": 1 for o in orders}


@pytest.mark.parametrize("loop_thread", [False, True], ids=["pumped", "loop_thread"])
def test_an_async_call_abandoned_by_a_stop_keeps_its_lease_until_it_runs_out(
    db: DB, topic: str, group: str, loop_thread: bool
) -> None:
    """An ``async def`` handler still in its call after ``drain_seconds`` is cancelled:
    its transaction rolls back, but its lease is left to run out (its request may
    still be in flight at the remote system, and nobody may call for this key before
    it is over): the next owner takes the key over then (attempt 2, one effect)."""
    started: list[int] = []

    async def charge(msg: payments.ChargeRequested, ctx: AsyncContext) -> Any:
        started.append(ctx.attempt)
        if msg.order_id == "stuck" and ctx.attempt == 1:
            await ctx.tx.execute("SELECT 1")  # in the attempt's transaction
            await asyncio.sleep(600)  # cancelled by the stop
        await ctx.tx.execute(
            "INSERT INTO payments.ledger (tenant_id, order_id, amount, currency,"
            " idempotency_key) VALUES (%s, %s, %s, %s, %s)",
            (msg.tenant_id, msg.order_id, msg.amount, msg.currency, ctx.idempotency_key))
        return {"attempt": ctx.attempt}

    produce(topic, [(o.encode(), encode_charge("t1", o, "1.00")) for o in ("a", "stuck")])
    settings = {"drain_seconds": 0.5, "lease_seconds": 6.0, "event_loop_thread": loop_thread}
    key = "t1:charge:stuck"
    with InProcess(keyed_app(db, topic, group, charge, concurrency=4, ordering_key=None,
                             **settings)):
        wait_for(lambda: db.status_counts() == {"succeeded": 1, "processing": 1},
                 timeout=60, what="a done, stuck running")
    [rec] = db.rows("SELECT status, attempts, attempt_base, owner_token,"
                    " lease_until > now() AS live FROM kafka_idem.task_idempotency"
                    " WHERE idempotency_key = %s", (key,))
    # renewed every 2 s while it ran: still live a moment after the stop, not ended
    assert (rec["status"], rec["attempts"], rec["attempt_base"], rec["live"]) == (
        "processing", 1, 0, True)
    assert committed(group, topic) == {0: 1}  # nothing past the abandoned message
    assert db.ledger_counts() == {"t1:charge:a": 1}  # its effect rolled back
    with InProcess(keyed_app(db, topic, group, charge, concurrency=4, ordering_key=None,
                             **settings)):
        wait_for(lambda: caught_up(group, topic), timeout=60, what="the takeover")
    record = db.record(key)
    assert record is not None
    assert (record["status"], record["attempts"], record["result_json"]) == (
        "succeeded", 2, {"attempt": 2})
    assert record["completed_token"] != rec["owner_token"]
    assert db.ledger_counts() == {"t1:charge:a": 1, key: 1}
    assert started.count(1) == 2 and started.count(2) == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_many_partitions_and_a_small_member_limit_still_process_everything_once(
    db: DB, topics: Topics, group: str, mode: str
) -> None:
    topic = topics(partitions=3)
    if mode == "sync":
        def charge(msg: payments.ChargeRequested, ctx: Context) -> Any:
            return payments.charge(msg, ctx)
    else:
        async def charge(msg: payments.ChargeRequested, ctx: AsyncContext) -> Any:  # type: ignore[misc]
            await ctx.tx.execute(
                "INSERT INTO payments.ledger (tenant_id, order_id, amount, currency,"
                " idempotency_key) VALUES (%s, %s, %s, %s, %s)",
                (msg.tenant_id, msg.order_id, msg.amount, msg.currency, ctx.idempotency_key))
            return {}

    orders = [f"o{i}" for i in range(150)]
    produce(topic, [(o.encode(), encode_charge("t1", o, "1.00")) for o in orders])
    app = keyed_app(db, topic, group, charge, concurrency=8, ordering_key=None,
                    max_concurrency=3, batch_size=10)
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), timeout=120, what="the topic to drain")
    assert db.ledger_counts() == {f"t1:charge:{o}": 1 for o in orders}
    assert sum(committed(group, topic).values()) == len(orders)


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_the_gateway_example_at_concurrency_charges_each_key_once_through_unknown_outcomes(
    db: DB, topic: str, group: str, use_async: bool
) -> None:
    from consumers import gateway as gateway_example

    with gateway_example.Gateway(latency=0.02) as gw:
        # Applied but unanswered (closed, reset): the next attempt reconciles by key.
        gw.faults(drop_after_apply=3, reset_after_apply=2, fail_before_apply=2)
        app = gateway_example.build_app(
            topic=topic, gateway_url=gw.url, timeout=1.0, concurrency=16,
            use_async=use_async, retry=RetryPolicy(base=0.1, cap=0.1, max_attempts=6),
            **app_settings(db, group_id=group))
        migrate_app(db, app)
        orders = [f"o{i}" for i in range(60)]
        produce(topic, [(o.encode(), encode_charge("t1", o, "3.00")) for o in orders])
        with InProcess(app):
            wait_for(lambda: caught_up(group, topic), timeout=120, what="the topic to drain")
        keys = {f"t1:charge:{o}" for o in orders}
        assert {c["idempotency_key"] for c in gw.charges()} == keys
        assert len(gw.charges()) == len(keys)  # the gateway charged each key once
        rows = db.rows("SELECT idempotency_key, count(*) AS n FROM payments.gateway_charges"
                       " GROUP BY 1")
        assert {r["idempotency_key"]: r["n"] for r in rows} == dict.fromkeys(keys, 1)
        assert db.status_counts() == {"succeeded": len(keys)}
        reconciled = {r["path"] for r in gw.requests(method="GET")
                      if r["path"].startswith("/charges/")}
        assert len(reconciled) >= 5  # the unanswered ones were asked for, not charged again


def test_sigterm_stops_a_member_whose_handler_hangs_within_drain_seconds_and_loses_nothing(
    db: DB, topic: str, group: str, members: Members
) -> None:
    """A real ``kafka-idem run`` process, key-ordered (concurrency 4): one charge
    hangs in its handler; SIGTERM stops the member anyway (the hung attempt is
    abandoned after ``drain_seconds``), nothing past it is committed, and the next
    member takes the key over when its lease ends: one effect per key."""
    import signal
    import subprocess

    # One tenant each: the hung attempt holds its tenant's balance row locked.
    orders = ["a", "b", "stuck", "c", "d", "e"]
    produce(topic, [(o.encode(), encode_charge(f"t-{o}", o, "1.00")) for o in orders])
    env = member_env(db, topic, PAYMENTS_MODE="leased", PAYMENTS_CONCURRENCY="4",
                     KAFKA_IDEM_DRAIN_SECONDS="1", KAFKA_IDEM_LEASE_SECONDS="3")
    hung = members.start("tests.apps.variants:app", {
        **env, "SLOW_ORDERS": "stuck", "SLOW_SECONDS": "600"}, group=group)
    wait_for(lambda: db.status_counts() == {"succeeded": 5, "processing": 1}, timeout=60,
             what="every key but the hung one to finish")
    hung.send_signal(signal.SIGTERM)
    try:
        code = hung.wait(timeout=60)  # a bound: drain_seconds is 1, the handler sleeps 600
    except subprocess.TimeoutExpired:
        pytest.fail("the member did not stop on SIGTERM while its handler hung")
    assert code == 0, members.logs()
    assert "abandoned 1 message(s)" in members.logs()
    assert committed(group, topic) == {0: 2}  # not past the hung message
    members.start("tests.apps.variants:app", env, group=group)
    wait_for(lambda: caught_up(group, topic), timeout=90, what="the next member to finish")
    assert db.status_counts() == {"succeeded": 6}
    assert db.ledger_counts() == {f"t-{o}:charge:{o}": 1 for o in orders}


def test_a_rebalance_mid_flight_keeps_each_key_in_order_and_every_effect_once(
    db: DB, topics: Topics, group: str
) -> None:
    """A second member joins while the first has many keys in flight: the revoked
    partition's work finishes (or is handed over) before it moves, and across the
    handover each account's charges still run one at a time in offset order."""
    topic = topics(partitions=2)
    spans = Spans(db)

    def charge(msg: payments.ChargeRequested, ctx: Context) -> Any:
        spans.mark("start", msg, ctx)
        ctx.tx.execute("SELECT pg_sleep(0.08)")  # long enough for the second member to join
        result = payments.charge(msg, ctx)
        spans.mark("end", msg, ctx)
        return result

    # The Kafka key is the account: each account's charges on one partition.
    records = [(f"t{i % 6}".encode(), encode_charge(f"t{i % 6}", f"o{i}", "1.00"))
               for i in range(240)]
    produce(topic, records)
    first = keyed_app(db, topic, group, charge, concurrency=8)
    second = keyed_app(db, topic, group, charge, concurrency=8)
    with InProcess(first):
        wait_for(lambda: (db.status_counts().get("succeeded") or 0) >= 30, timeout=60,
                 what="the first member to be under way")
        with InProcess(second) as joined:
            wait_for(lambda: caught_up(group, topic), timeout=120, what="the topic to drain")
            took_over = sum(
                sample.value for metric in joined.runner.metrics.messages.collect()
                for sample in metric.samples if sample.name.endswith("_total"))
    assert took_over > 0  # the second member got a partition the first had in flight
    assert_one_at_a_time_in_offset_order(db)
    assert db.ledger_counts() == {f"t{i % 6}:charge:o{i}": 1 for i in range(240)}
    assert db.status_counts() == {"succeeded": 240}
    assert sum(committed(group, topic).values()) == 240


class Calls:
    """Handler calls in progress now, the most at once, and the calls per order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.by_order: dict[str, int] = defaultdict(int)

    def enter(self, order_id: str) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
            self.by_order[order_id] += 1

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


def blocking_charge(calls: Calls, release: threading.Event, *, use_async: bool) -> Any:
    """A charge whose call waits for ``release`` (a remote system that is slow)."""
    insert = ("INSERT INTO payments.ledger (tenant_id, order_id, amount, currency,"
              " idempotency_key) VALUES (%s, %s, %s, %s, %s)")

    def row(msg: payments.ChargeRequested, ctx: Any) -> tuple[Any, ...]:
        return (msg.tenant_id, msg.order_id, msg.amount, msg.currency, ctx.idempotency_key)

    if use_async:
        async def charge_async(msg: payments.ChargeRequested, ctx: AsyncContext) -> Any:
            calls.enter(msg.order_id)
            try:
                while not release.is_set():
                    await asyncio.sleep(0.005)
                await ctx.tx.execute(insert, row(msg, ctx))
                return {}
            finally:
                calls.leave()
        return charge_async

    def charge(msg: payments.ChargeRequested, ctx: Context) -> Any:
        calls.enter(msg.order_id)
        try:
            assert release.wait(60)
            ctx.tx.execute(insert, row(msg, ctx))
            return {}
        finally:
            calls.leave()
    return charge


def processing_keys(db: DB) -> set[str]:
    return {r["idempotency_key"] for r in db.rows(
        "SELECT idempotency_key FROM kafka_idem.task_idempotency WHERE status = 'processing'")}


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_concurrency_bounds_the_calls_and_an_async_handler_claims_as_many_more_ahead(
    db: DB, topic: str, group: str, use_async: bool
) -> None:
    """``concurrency=4``: never more than 4 handler calls at once. While all 4 wait on
    the remote system, an ``async def`` handler's next 4 messages are claimed
    (``processing``, their calls not started) so that a freed slot is taken at once; a
    sync handler claims none ahead (each message in flight holds a thread and a
    connection). Released, every message ends once and everything is committed."""
    calls, release = Calls(), threading.Event()
    orders = [f"o{i}" for i in range(16)]
    produce(topic, [(o.encode(), encode_charge("t1", o, "1.00")) for o in orders])
    app = keyed_app(db, topic, group, blocking_charge(calls, release, use_async=use_async),
                    concurrency=4, ordering_key=None)
    claimed = 8 if use_async else 4
    with InProcess(app) as member:
        wait_for(lambda: calls.now == 4 and len(processing_keys(db)) == claimed, timeout=60,
                 what=f"4 calls running and {claimed} keys claimed")
        for _ in range(20):  # read again and again: no fifth call, no more keys claimed
            assert calls.now == 4
            assert processing_keys(db) == {f"t1:charge:o{i}" for i in range(claimed)}
        gauge = {s.labels["state"]: s.value
                 for family in member.runner.metrics.handler_calls.collect()
                 for s in family.samples}
        assert gauge == {"running": 4, "waiting": claimed - 4}  # what /metrics shows
        release.set()
        wait_for(lambda: caught_up(group, topic), timeout=60, what="the topic to drain")
    assert calls.most == 4
    assert dict(calls.by_order) == dict.fromkeys(orders, 1)
    assert db.ledger_counts() == {f"t1:charge:{o}": 1 for o in orders}
    assert db.status_counts() == {"succeeded": 16}
    assert committed(group, topic) == {0: 16}


def test_a_stop_withdraws_the_claims_whose_call_never_started_and_leaves_the_calls_leases(
    db: DB, topic: str, group: str
) -> None:
    """A stop while 4 calls hang and 4 more messages wait, claimed, for a slot: after
    ``drain_seconds`` all 8 are abandoned and rolled back, nothing is committed past
    them. The 4 whose call never started are withdrawn: lease ended, the claim not
    counted against the retry limit (``attempt_base`` 1), so the next owner takes them
    over at once, and asks the reconciler only for the 4 whose call may have been in
    flight. The 4 calls keep their leases until they run out. Each effect once."""
    calls, release = Calls(), threading.Event()
    reconciled: list[str] = []

    async def reconcile(msg: payments.ChargeRequested, ctx: AsyncContext) -> None:
        reconciled.append(ctx.idempotency_key)
        return None  # no effect found: the handler runs again
    orders = [f"o{i}" for i in range(12)]
    produce(topic, [(o.encode(), encode_charge("t1", o, "1.00")) for o in orders])
    settings = {"drain_seconds": 0.5, "lease_seconds": 6.0}
    first = keyed_app(db, topic, group, blocking_charge(calls, release, use_async=True),
                      concurrency=4, ordering_key=None, reconcile=reconcile, **settings)
    with InProcess(first):
        wait_for(lambda: calls.now == 4 and len(processing_keys(db)) == 8, timeout=60,
                 what="4 calls running and 4 more keys claimed ahead")
    assert calls.now == 0  # the stop cancelled the 4 calls
    called = {f"t1:charge:{o}" for o in calls.by_order}
    assert len(called) == 4
    rows = db.rows("SELECT idempotency_key AS key, attempts, attempt_base,"
                   " lease_until > now() AS live FROM kafka_idem.task_idempotency")
    assert {r["key"] for r in rows} == {f"t1:charge:o{i}" for i in range(8)}
    for r in rows:  # a call's lease is left live; a claim that never called is withdrawn
        expected = (1, 0, True) if r["key"] in called else (1, 1, False)
        assert (r["attempts"], r["attempt_base"], r["live"]) == expected, r
    marks = {r["idempotency_key"]: r["next_attempt_at"] is not None for r in db.records()}
    assert marks == {f"t1:charge:o{i}": f"t1:charge:o{i}" not in called for i in range(8)}
    assert committed(group, topic) == {0: -1001}  # none: nothing past an unfinished message
    assert db.ledger_counts() == {}  # the abandoned calls rolled back
    release.set()
    second = keyed_app(db, topic, group, blocking_charge(calls, release, use_async=True),
                       concurrency=4, ordering_key=None, reconcile=reconcile, **settings)
    with InProcess(second):
        wait_for(lambda: caught_up(group, topic), timeout=60, what="the next owner to finish")
    assert sorted(reconciled) == sorted(called)  # a withdrawn claim made no call to ask after
    assert db.ledger_counts() == {f"t1:charge:{o}": 1 for o in orders}
    assert db.status_counts() == {"succeeded": 12}
    budget = {r["idempotency_key"]: (r["attempts"], r["attempt_base"]) for r in db.records()}
    assert budget == {f"t1:charge:o{i}": (2, 0) if f"t1:charge:o{i}" in called
                      else (2, 1) if i < 8 else (1, 0) for i in range(12)}
    assert {o for o, n in calls.by_order.items() if n == 2} == {
        k.rsplit(":", 1)[1] for k in called}


def test_two_handlers_share_the_members_calls_and_the_gauge_counts_only_running_calls(
    db: DB, topics: Topics, group: str
) -> None:
    """Two ``async def`` handlers, ``concurrency=4`` each, on a member with
    ``max_concurrency=4``: at most 4 calls at once over both, and
    ``kafka_idem_handler_calls`` shows 4 running in all, the other claimed messages
    waiting (one holding its handler's slot while the member's are taken waits too)."""
    calls, release = Calls(), threading.Event()
    first, second = topics(partitions=1), topics(partitions=1)
    app = App("keyed", **app_settings(db, group_id=group, schemas_dir=payments.SCHEMAS_DIR,
                                      max_concurrency=4))
    app.migration(payments.create_tables)
    for topic, name in ((first, "charge_a"), (second, "charge_b")):
        app.handler(topic=topic, model=payments.ChargeRequested, name=name,
                    key="{tenant_id}:charge:{order_id}", hash_fields=("amount", "currency"),
                    schema=payments.SCHEMA, mode="leased", concurrency=4,
                    )(blocking_charge(calls, release, use_async=True))
    migrate_app(db, app)
    produce(first, [(f"a{i}".encode(), encode_charge("ta", f"a{i}", "1.00"))
                    for i in range(10)])
    produce(second, [(f"b{i}".encode(), encode_charge("tb", f"b{i}", "1.00"))
                     for i in range(10)])
    with InProcess(app) as member:
        wait_for(lambda: calls.now == 4 and len(processing_keys(db)) == 8, timeout=60,
                 what="4 calls running and 4 more keys claimed")

        def gauge() -> dict[str, float]:
            out: dict[str, float] = defaultdict(float)
            for family in member.runner.metrics.handler_calls.collect():
                for sample in family.samples:
                    out[sample.labels["state"]] += sample.value
            return dict(out)

        for _ in range(20):
            assert calls.now == 4
            assert gauge() == {"running": 4, "waiting": 4}
        release.set()
        wait_for(lambda: caught_up(group, first) and caught_up(group, second), timeout=60,
                 what="both topics to drain")
    assert calls.most == 4
    assert db.status_counts() == {"succeeded": 20}
    assert sum(db.ledger_counts().values()) == 20


def test_a_stop_starts_no_call_and_withdraws_the_claims_of_messages_waiting_for_a_slot(
    db: DB, topics: Topics, group: str
) -> None:
    """An ``async def`` and a sync handler share ``max_concurrency=4``; the async calls
    hang, holding the member's 4 slots, and 4 sync messages are claimed and wait for
    one. A stop starts none of their calls (not when the drain frees the slots
    either): their claims are withdrawn at once (lease ended, ``attempt_base`` 1); the
    hanging calls keep their leases. The next owner runs every message once."""
    async_calls, sync_calls, release = Calls(), Calls(), threading.Event()
    slow, quick = topics(partitions=1), topics(partitions=1)
    settings = {"drain_seconds": 0.5, "lease_seconds": 6.0, "max_concurrency": 4}

    def build() -> App:
        app = App("keyed", **app_settings(db, group_id=group,
                                          schemas_dir=payments.SCHEMAS_DIR, **settings))
        app.migration(payments.create_tables)
        for topic, name, fn in (
                (slow, "slow", blocking_charge(async_calls, release, use_async=True)),
                (quick, "quick", blocking_charge(sync_calls, release, use_async=False))):
            app.handler(topic=topic, model=payments.ChargeRequested, name=name,
                        key="{tenant_id}:charge:{order_id}",
                        hash_fields=("amount", "currency"), schema=payments.SCHEMA,
                        mode="leased", concurrency=4)(fn)
        return app

    first = build()
    migrate_app(db, first)
    produce(slow, [(f"a{i}".encode(), encode_charge("ta", f"a{i}", "1.00")) for i in range(4)])
    quick_keys = {f"tq:charge:q{i}" for i in range(4)}
    with InProcess(first):
        wait_for(lambda: async_calls.now == 4, timeout=60, what="4 async calls hanging")
        produce(quick, [(f"q{i}".encode(), encode_charge("tq", f"q{i}", "1.00"))
                        for i in range(4)])
        wait_for(lambda: processing_keys(db) >= quick_keys, timeout=60,
                 what="the sync messages claimed, waiting for the member's slots")
        assert sync_calls.most == 0
    assert sync_calls.most == 0  # the drain freed the slots; no sync call started
    rows = {r["idempotency_key"]: r for r in db.rows(
        "SELECT idempotency_key, attempts, attempt_base, lease_until > now() AS live"
        " FROM kafka_idem.task_idempotency")}
    for key in quick_keys:
        assert (rows[key]["attempts"], rows[key]["attempt_base"], rows[key]["live"]) == (
            1, 1, False), rows[key]
    for i in range(4):
        r = rows[f"ta:charge:a{i}"]
        assert (r["attempts"], r["attempt_base"], r["live"]) == (1, 0, True), r
    release.set()
    with InProcess(build()):
        wait_for(lambda: caught_up(group, slow) and caught_up(group, quick), timeout=60,
                 what="the next owner to finish")
    assert db.status_counts() == {"succeeded": 8}
    assert dict(sync_calls.by_order) == {f"q{i}": 1 for i in range(4)}
    assert sum(db.ledger_counts().values()) == 8


def test_on_loop_close_releases_what_handlers_made_on_the_members_loop(
    db: DB, topic: str, group: str
) -> None:
    """A client shared by the ``async def`` handlers of one event loop is closed by
    ``app.on_loop_close`` at the member's stop: on that loop, after every message, once;
    a closer that raises is logged and the next one still runs."""
    clients: dict[asyncio.AbstractEventLoop, dict[str, Any]] = {}
    closed: list[dict[str, Any]] = []

    async def charge(msg: payments.ChargeRequested, ctx: AsyncContext) -> Any:
        client = clients.setdefault(asyncio.get_running_loop(), {"calls": 0, "open": True})
        assert client["open"]
        client["calls"] += 1
        await ctx.tx.execute(
            "INSERT INTO payments.ledger (tenant_id, order_id, amount, currency, idempotency_key)"
            " VALUES (%s, %s, %s, %s, %s)",
            (msg.tenant_id, msg.order_id, msg.amount, msg.currency, ctx.idempotency_key))
        return {"order_id": msg.order_id}

    app = keyed_app(db, topic, group, charge, concurrency=4)

    @app.on_loop_close
    async def close_client() -> None:
        client = clients.pop(asyncio.get_running_loop())
        client["open"] = False
        closed.append(client)

    @app.on_loop_close
    async def broken() -> None:
        raise RuntimeError("a closer of the app that fails")

    @app.on_loop_close
    async def after_it() -> None:
        closed.append({"after": True})

    produce(topic, [(f"t{i}".encode(), encode_charge(f"t{i}", f"o{i}", "1.00"))
                    for i in range(6)])
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), timeout=60, what="the topic to drain")
        assert closed == []  # nothing closes while the member runs
    assert closed == [{"calls": 6, "open": False}, {"after": True}]
    assert clients == {}
    assert db.status_counts() == {"succeeded": 6}


def test_on_loop_close_takes_an_async_def_only() -> None:
    app = App("keyed")

    def not_async() -> None:
        return None

    with pytest.raises(ConfigError, match=r"app\.on_loop_close takes an async def") as caught:
        app.on_loop_close(not_async)  # type: ignore[arg-type]
    assert caught.value.context["setting"] == "on_loop_close"
