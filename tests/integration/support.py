"""Helpers for the failure tests: an app on the payments model with a chosen handler,
a history of every record state (a trigger in the per-test database), DLQ reading."""

from __future__ import annotations

import datetime as dt
import inspect
import random
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import psycopg
from psycopg.rows import dict_row

from consumers import payments
from kafka_idem import App, Context, RetryPolicy
from kafka_idem.app import ErrorKind
from kafka_idem.deadletters.dead_letter import REQUIRED_HEADERS
from kafka_idem.store import Delivery, connect
from tests.conftest import DB, app_settings, headers, read_topic

HANDLER = "charge"

HISTORY_SQL = """
CREATE TABLE public.record_history (
    id              bigserial PRIMARY KEY,
    op              text,
    idempotency_key text,
    status          text,
    attempts        integer,
    error_kind      text,
    owner_token     uuid,
    next_attempt_at timestamptz,
    last_failure_at timestamptz,
    updated_at      timestamptz,
    at              timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION public.record_history() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    INSERT INTO public.record_history (op, idempotency_key, status, attempts, error_kind,
                                       owner_token, next_attempt_at, last_failure_at, updated_at)
    VALUES (TG_OP, NEW.idempotency_key, NEW.status, NEW.attempts, NEW.error_kind,
            NEW.owner_token, NEW.next_attempt_at, NEW.last_failure_at, NEW.updated_at);
    RETURN NULL;
END
$fn$;
"""
HISTORY_TRIGGER = """
CREATE TRIGGER zz_record_history AFTER INSERT OR UPDATE ON kafka_idem.task_idempotency
    FOR EACH ROW EXECUTE FUNCTION public.record_history();
"""


def record_history(db: DB) -> None:
    """Keep every committed state of every record in ``public.record_history``
    (an AFTER trigger: rolled-back states leave no trace, like the states themselves).

    On Citus the trigger fires on the worker that holds the record's shard, in that
    worker's part of the transaction: the history is a table local to each node (made
    there, none of Citus's), and :func:`history` reads every node's."""
    for node in db.nodes:
        with psycopg.connect(node) as conn:
            if db.flavour == "citus":
                conn.execute("SET citus.enable_ddl_propagation = off")
            conn.execute(HISTORY_SQL)
    with psycopg.connect(db.dsn) as conn:
        if db.flavour == "citus":  # as the store's guard: it reads and writes its node only
            conn.execute("SET citus.enable_unsafe_triggers = on")
        conn.execute(HISTORY_TRIGGER)


def history(db: DB, key: str) -> list[dict[str, Any]]:
    """``key``'s states in the order they committed (one node holds them all)."""
    rows: list[dict[str, Any]] = []
    for node in db.nodes:
        with psycopg.connect(node, row_factory=dict_row) as conn:
            rows += conn.execute("SELECT * FROM public.record_history WHERE "
                                 "idempotency_key = %s ORDER BY id", (key,)).fetchall()
    return rows


def claims(db: DB, key: str) -> list[dict[str, Any]]:
    """One row per claim that committed (a new owner token on a processing record)."""
    seen: set[Any] = set()
    out = []
    for row in history(db, key):
        if row["status"] == "processing" and row["owner_token"] not in seen:
            seen.add(row["owner_token"])
            out.append(row)
    return out


def failures(db: DB, key: str, status: str = "retryable_failed") -> list[dict[str, Any]]:
    return [r for r in history(db, key) if r["status"] == status]


def migrate_app(db: DB, app: App) -> None:
    """Run the app's own migrations (the template only has the payments tables)."""
    with psycopg.connect(db.dsn) as conn:
        for fn in app.migrations:
            fn(conn)


def charge_app(
    db: DB,
    topic: str,
    group: str,
    fn: Callable[[payments.ChargeRequested, Context], Any] = payments.charge,
    *,
    mode: str = "local",
    retry: RetryPolicy | None = None,
    errors: Mapping[type[BaseException], ErrorKind] | None = None,
    **settings: Any,
) -> App:
    """An app on ``topic`` with the payments model/key/hash (and, on Citus, shard key)
    and ``fn`` as the handler."""
    app = App("failures", **app_settings(db, group_id=group, schemas_dir=payments.SCHEMAS_DIR,
                                         **settings))
    app.migration(payments.create_tables)

    def charge(msg: payments.ChargeRequested, ctx: Context) -> Any:
        return fn(msg, ctx)

    if inspect.iscoroutinefunction(fn):  # an async def handler stays one
        async def charge(msg: payments.ChargeRequested, ctx: Context) -> Any:  # type: ignore[misc]
            return await fn(msg, ctx)

    app.handler(
        topic=topic,
        model=payments.ChargeRequested,
        key="{tenant_id}:charge:{order_id}",
        # on Citus, as the payments example: the record with the tenant's rows (one
        # shard, one worker), not by its key apart from them (a two-phase commit each)
        shard_key="{tenant_id}" if db.flavour == "citus" else None,
        hash_fields=("amount", "currency"),
        schema=payments.SCHEMA,
        mode=mode,  # type: ignore[arg-type]
        retry=retry,
        errors=errors,
    )(charge)
    return app


def seeded(bound: float, *, at_least: float, at_most: float | None = None) -> int:
    """A seed whose first ``uniform(0, bound)`` draw lies in [at_least, at_most]: a
    reproducible jittered delay of a chosen size."""
    top = bound if at_most is None else at_most
    for seed in range(10_000):
        if at_least <= random.Random(seed).uniform(0.0, bound) <= top:
            return seed
    raise AssertionError("no seed found")


def dlq_records(topic: str, *, source_offset: int | None = None) -> list[Any]:
    """The records of ``<topic>.dlq`` (optionally only those for one source offset)."""
    out = read_topic(f"{topic}.dlq")
    if source_offset is not None:
        out = [m for m in out if headers(m).get("idem.original.offset") == str(source_offset)]
    return out


def parse_ts(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text)


def assert_dead_letter(
    letter: Any,
    source: Any,
    *,
    kind: str,
    attempts: int,
    group: str,
    handler: str = HANDLER,
    key: str | None,
    record: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Every header of the DLQ contract, with the right values; bytes untouched."""
    h = headers(letter)
    missing = [name for name in REQUIRED_HEADERS if name not in h]
    assert not missing, f"DLQ headers missing: {missing}"
    assert letter.key() == source.key()
    assert letter.value() == source.value()
    assert h["idem.original.topic"] == source.topic()
    assert h["idem.original.partition"] == str(source.partition())
    assert h["idem.original.offset"] == str(source.offset())
    assert h["idem.original.timestamp"] == str(source.timestamp()[1])
    assert h["idem.error.kind"] == kind
    assert h["idem.error.class"]
    assert h["idem.error.message"]
    assert h["idem.attempts"] == str(attempts)
    assert h["idem.consumer_group"] == group
    assert h["idem.handler"] == handler
    first, last = parse_ts(h["idem.first_failure_at"]), parse_ts(h["idem.last_failure_at"])
    assert first.tzinfo is not None and first <= last
    if key is None:
        assert "idem.key" not in h
    else:
        assert h["idem.key"] == key
    if record is not None:
        assert h["idem.error.class"] == record["error_class"]
        assert h["idem.error.message"] == record["error_message"]
        assert first == record["first_failure_at"]
        assert last == record["last_failure_at"]
    return h


def record_in(db: DB, status: str) -> str:
    """The key of a new record driven through legal transitions into ``status``."""
    store = db.store(namespace="tests")
    key = f"k:{uuid.uuid4().hex}"
    conn = connect(db.dsn)
    with conn.transaction():
        c = store.claim(conn, key=key, request_hash="v1:x", delivery=Delivery("t", 0, 0, "h"),
                        lease_seconds=30, max_attempts=5, max_elapsed_seconds=3600)
        assert c.token is not None
        if status == "succeeded":
            store.complete(conn, key=key, token=c.token, result=1)
        elif status in ("failed", "retryable_failed"):
            store.fail(conn, key=key, token=c.token, status=status, kind="permanent",
                       error_class="E", error_message="m", delay=60)
    conn.close()
    return key
