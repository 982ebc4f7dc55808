"""A leased attempt's transaction waits for the server once: ``BEGIN``, the handler's
statements, the fenced completion and ``COMMIT`` answer at one pipeline sync
(:meth:`kafka_idem.consume.paths.steps.Steps._run_pipelined` and its ``async def`` twin).

Every wait for results psycopg makes inside an attempt's transaction is counted (a
context variable per thread or task, so concurrent attempts never mix their counts).
Errors of the handler's own statements, which now surface at that sync behind the
queued completion, are judged as the handler's: a data error is permanent, a class
the handler maps is what it says, and nothing the attempt wrote is committed.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import Counter
from collections.abc import Generator
from typing import Any

import psycopg
import psycopg._pipeline_base as pipeline_base
import pytest

from consumers import payments
from consumers.payments import encode_charge
from kafka_idem import App, AsyncContext, Context, RetryPolicy
from kafka_idem.consume.paths import async_leased_path as aio
from kafka_idem.consume.paths import steps
from tests.conftest import (
    DB,
    InProcess,
    Topics,
    app_settings,
    caught_up,
    committed,
    produce,
    wait_for,
)
from tests.integration.support import migrate_app

WAITS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("waits", default=None)
TABLE = "kafka_idem.task_idempotency"
MARK = "INSERT INTO payments.ledger (tenant_id, order_id, amount, currency, idempotency_key)" \
       " VALUES (%s, %s, %s, %s, %s)"


class SyncCounter:
    """The number of waits for results of each attempt's transaction (psycopg's
    fetches with answers still pending)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.per_attempt: list[int] = []
        fetch = pipeline_base.BasePipeline._fetch_gen
        run = steps.Steps._run_pipelined
        run_async = aio.AsyncLeasedPath._transaction

        def counted_fetch(pipe: Any, *, flush: bool) -> Generator[Any, Any, Any]:
            waits = WAITS.get()
            if waits is not None and pipe.result_queue:
                waits[0] += 1
            return (yield from fetch(pipe, flush=flush))

        def counted_run(self_: Any, *args: Any, **kwargs: Any) -> Any:
            token = WAITS.set([0])
            try:
                return run(self_, *args, **kwargs)
            finally:
                self.per_attempt.append(WAITS.get()[0])  # type: ignore[index]
                WAITS.reset(token)

        async def counted_run_async(self_: Any, *args: Any, **kwargs: Any) -> Any:
            token = WAITS.set([0])  # this task's own context
            try:
                return await run_async(self_, *args, **kwargs)
            finally:
                self.per_attempt.append(WAITS.get()[0])  # type: ignore[index]
                WAITS.reset(token)

        monkeypatch.setattr(pipeline_base.BasePipeline, "_fetch_gen", counted_fetch)
        monkeypatch.setattr(steps.Steps, "_run_pipelined", counted_run)
        monkeypatch.setattr(aio.AsyncLeasedPath, "_transaction", counted_run_async)


def leased_app(db: DB, topic: str, group: str, fn: Any, *, concurrency: int,
               errors: dict[type[BaseException], str] | None = None) -> App:
    app = App("onesync", **app_settings(db, group_id=group, schemas_dir=payments.SCHEMAS_DIR))
    app.migration(payments.create_tables)
    app.handler(
        topic=topic, model=payments.ChargeRequested, key="{tenant_id}:charge:{order_id}",
        hash_fields=("amount", "currency"), schema=payments.SCHEMA, mode="leased",
        concurrency=concurrency, errors=errors,
        retry=RetryPolicy(base=0.05, cap=0.05, max_attempts=3),
    )(fn)
    migrate_app(db, app)
    return app


def writes(msg: payments.ChargeRequested, key: str) -> list[tuple[str, tuple[Any, ...]]]:
    """Two statements whose results the handler never reads."""
    return [(MARK, (msg.tenant_id, msg.order_id, msg.amount, msg.currency, key)),
            (payments.BALANCE_UPSERT, (msg.tenant_id, msg.currency, msg.amount))]


def charge_sync(msg: payments.ChargeRequested, ctx: Context) -> Any:
    for sql, params in writes(msg, ctx.idempotency_key):
        ctx.tx.execute(sql, params)
    return payments.result_of(msg)


async def charge_async(msg: payments.ChargeRequested, ctx: AsyncContext) -> Any:
    await asyncio.sleep(0.005)  # the remote call
    for sql, params in writes(msg, ctx.idempotency_key):
        await ctx.tx.execute(sql, params)
    return payments.result_of(msg)


@pytest.mark.parametrize(("use_async", "concurrency"), [(False, 1), (False, 4), (True, 4)],
                         ids=["sync", "sync-keyed", "async"])
def test_each_attempt_waits_for_the_server_once_and_takes_effect_once(
    db: DB, topic: str, group: str, monkeypatch: pytest.MonkeyPatch, use_async: bool,
    concurrency: int,
) -> None:
    counter = SyncCounter(monkeypatch)
    produce(topic, [(f"t{i % 5}".encode(), encode_charge(f"t{i % 5}", f"o{i}", "2.00"))
                    for i in range(30)])
    keys = {f"t{i % 5}:charge:o{i}" for i in range(30)}
    app = leased_app(db, topic, group, charge_async if use_async else charge_sync,
                     concurrency=concurrency)
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), timeout=120, what="the topic to drain")
    # 30 attempts, each waiting once at most (not at all when every answer came in
    # while its last statements were being sent); before, most waited twice.
    assert len(counter.per_attempt) == 30 and set(counter.per_attempt) <= {0, 1}
    recs = {r["idempotency_key"]: (r["status"], r["attempts"], r["completed_token"] is not None)
            for r in db.rows(f"SELECT * FROM {TABLE}")}
    assert recs == dict.fromkeys(keys, ("succeeded", 1, True))
    assert db.ledger_counts() == dict.fromkeys(keys, 1)
    assert committed(group, topic) == {0: 30}


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_statement_error_seen_only_at_the_sync_is_the_handlers_and_commits_nothing(
    db: DB, topic: str, topics: Topics, group: str, monkeypatch: pytest.MonkeyPatch,
    use_async: bool,
) -> None:
    """``o-bad`` divides by zero in a statement it never reads (a data error: permanent
    by default); ``o-flaky`` does the same on its first attempt, and its handler maps
    ``DivisionByZero`` to retryable. Both write a ledger row before, in the same
    transaction: only ``o-flaky``'s second attempt's is committed."""
    counter = SyncCounter(monkeypatch)
    seen: Counter[str] = Counter()

    def bad_statement(msg: payments.ChargeRequested, key: str) -> bool:
        seen[key] += 1
        return msg.order_id == "o-bad" or (msg.order_id == "o-flaky" and seen[key] == 1)

    def sync_fn(msg: payments.ChargeRequested, ctx: Context) -> Any:
        ctx.tx.execute(*writes(msg, ctx.idempotency_key)[0])
        if bad_statement(msg, ctx.idempotency_key):
            ctx.tx.execute("SELECT 1 / 0")
        return payments.result_of(msg)

    async def async_fn(msg: payments.ChargeRequested, ctx: AsyncContext) -> Any:
        await ctx.tx.execute(*writes(msg, ctx.idempotency_key)[0])
        if bad_statement(msg, ctx.idempotency_key):
            await ctx.tx.execute("SELECT 1 / 0")
        return payments.result_of(msg)

    app = leased_app(db, topic, group, async_fn if use_async else sync_fn, concurrency=2)
    produce(topic, [(b"t1", encode_charge("t1", "o-bad", "1.00")),
                    (b"t1", encode_charge("t1", "o-ok", "1.00"))])
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), timeout=120, what="the first topic")
    bad = db.record("t1:charge:o-bad")
    assert bad is not None
    assert (bad["status"], bad["error_kind"], bad["attempts"]) == ("failed", "permanent", 1)
    assert "22012" in bad["error_message"] or "division by zero" in bad["error_message"]
    assert db.ledger_counts() == {"t1:charge:o-ok": 1}  # o-bad's row rolled back

    second = topics(partitions=1)
    mapped = leased_app(db, second, group, async_fn if use_async else sync_fn,
                        concurrency=2, errors={psycopg.errors.DivisionByZero: "retryable"})
    produce(second, [(b"t2", encode_charge("t2", "o-flaky", "1.00"))])
    with InProcess(mapped):
        wait_for(lambda: caught_up(group, second), timeout=120, what="the flaky charge")
    flaky = db.record("t2:charge:o-flaky")
    assert flaky is not None
    assert (flaky["status"], flaky["attempts"]) == ("succeeded", 2)
    assert db.ledger_counts() == {"t1:charge:o-ok": 1, "t2:charge:o-flaky": 1}
    assert set(counter.per_attempt) <= {0, 1}  # every attempt, failed or not: one sync
