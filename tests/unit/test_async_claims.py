"""An ``async def`` handler's claim and failure record run on the event loop's own
connections (:mod:`kafka_idem.consume.paths.async_leased_path`), with the statements,
transactions and decisions of the sync leased path (:mod:`kafka_idem.consume.paths.
leased_path`): each step takes one connection and gives it back. No PostgreSQL: the
connections answer from a script (:mod:`tests.unit.scripted`)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import random
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import psycopg
import pytest

from kafka_idem import App, AsyncContext, Permanent, Retryable, RetryPolicy
from kafka_idem.consume.outcome import Prepared
from kafka_idem.consume.paths.async_leased_path import AsyncLeasedPath
from kafka_idem.consume.paths.calls import delivery
from kafka_idem.consume.paths.leased_path import LeasedPath
from kafka_idem.consume.paths.processor import Processor
from kafka_idem.consume.paths.round_claim import RoundClaim, Wanted
from kafka_idem.consume.paths.steps import Steps
from kafka_idem.consume.paths.verdicts import Verdict
from kafka_idem.errors import DataRejected, StoreUnavailable
from kafka_idem.observe.metrics import Metrics
from kafka_idem.store import Claim, Outcome, Store
from kafka_idem.testing import FakeMessage
from tests.unit.scripted import AsyncConns, Script, Sent, SyncConn

T = TypeVar("T")
STORE = Store(schema="kafka_idem", table="task_idempotency", namespace="ns")
TOPIC = "payments"
NOW = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)
FAILED = (2, NOW + dt.timedelta(seconds=1), NOW, NOW)  # what the fail statement returns


def app() -> App:
    app = App("aio")

    @app.handler(topic=TOPIC, key="{order_id}", hash_fields=("order_id",), mode="leased",
                 retry=RetryPolicy(max_attempts=3, rng=random.Random(7)))  # one jitter
    async def charge(msg: dict[str, Any], ctx: AsyncContext) -> None:
        return None

    return app


def parts() -> tuple[Steps, FakeMessage, Prepared]:
    steps = Processor(app(), store=STORE, metrics=Metrics()).steps  # no connection
    msg = FakeMessage(TOPIC, partition=0, offset=7, value=b'{"order_id": "o1"}',
                      timestamp=1_700_000_000_000)
    return steps, msg, steps.prepare(steps.handler(msg), msg)


def record(prep: Prepared, **changes: Any) -> dict[str, Any]:
    rec = {"idempotency_key": prep.key, "status": "retryable_failed",
           "request_hash": prep.request_hash, "attempts": 1, "attempt_base": 0,
           "result_json": None, "owner_token": uuid.uuid4(),
           "lease_until": NOW - dt.timedelta(seconds=1), "db_now": NOW,
           "next_attempt_at": None, "first_failure_at": NOW, "last_failure_at": NOW,
           "error_kind": "retryable", "error_class": "Boom", "error_message": "boom"}
    return {**rec, **changes}


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def aio(steps: Steps, script: Script) -> tuple[AsyncLeasedPath, AsyncConns]:
    conns = AsyncConns(script)
    return AsyncLeasedPath(steps.app, steps=steps, leases=None, conns=conns), conns  # type: ignore[arg-type]


def sync_claim(steps: Steps, rows: list[Any], msg: Any, prep: Prepared,
               reentrant: uuid.UUID | None) -> tuple[Claim, Script]:
    """The sync leased path's claim of ``msg`` (no round), on a scripted connection."""
    script = Script(STORE, rows)
    path = LeasedPath(steps, steps.db, None)
    return path._claim(SyncConn(script), msg, prep, reentrant), script  # type: ignore[arg-type]


def tokenless(claim: Claim, sent: list[Sent]) -> tuple[Claim, list[Sent]]:
    """The claim and what was sent, less the fresh owner tokens."""
    claim = dataclasses.replace(claim, token=None) if claim.token is not None else claim
    return claim, [(name, {k: v for k, v in params.items() if k != "token"}, dicts)
                   for name, params, dicts in sent]


def test_a_new_key_is_claimed_in_one_autocommit_statement_on_a_connection_given_back() -> None:
    steps, msg, prep = parts()
    script = Script(STORE, [(1,)])
    path, conns = aio(steps, script)
    claim = run(path._claim(msg, prep, None, None))
    assert claim.outcome is Outcome.CLAIMED and claim.token == script.sent[0][1]["token"]
    assert script.names_sent() == ["claim_insert"]
    assert (conns.out, conns.most) == (0, 1)


@pytest.mark.parametrize("reentrant", [False, True], ids=["existing", "reentrant"])
def test_a_key_that_exists_gets_the_sync_paths_whole_claim_in_a_transaction_of_its_own(
    reentrant: bool,
) -> None:
    steps, msg, prep = parts()
    token = uuid.uuid4() if reentrant else None
    rec = record(prep, **({"status": "processing", "owner_token": token,
                           "lease_until": NOW + dt.timedelta(seconds=9)} if reentrant else {}))
    rows = [None, rec, (2,)] if reentrant else [None, None, rec, (2,)]
    script = Script(STORE, rows)
    path, conns = aio(steps, script)
    claim = run(path._claim(msg, prep, token, None))
    sync, sync_script = sync_claim(steps, rows, msg, prep, token)
    assert tokenless(claim, script.sent) == tokenless(sync, sync_script.sent)
    assert script.names_sent() == [
        *([] if reentrant else ["claim_insert"]),  # the new key's statement, autocommit
        "BEGIN", "claim_insert", "claim_lock", "claim_take", "COMMIT"]
    assert claim.outcome is Outcome.CLAIMED and claim.charged is not reentrant
    assert conns.out == 0 and conns.most == 1  # one at a time, each given back


def test_a_claim_that_decides_busy_commits_its_transaction_and_says_so() -> None:
    steps, msg, prep = parts()
    rows = [None, None, record(prep, next_attempt_at=NOW + dt.timedelta(seconds=4))]
    script = Script(STORE, rows)
    path, _ = aio(steps, script)
    claim = run(path._claim(msg, prep, None, None))
    sync, sync_script = sync_claim(steps, rows, msg, prep, None)
    assert tokenless(claim, script.sent) == tokenless(sync, sync_script.sent)
    assert claim.outcome is Outcome.BUSY and claim.backoff
    assert script.names_sent()[-3:] == ["claim_insert", "claim_lock", "COMMIT"]


def wanted(steps: Steps, msg: Any, prep: Prepared) -> RoundClaim:
    return RoundClaim([Wanted(prep.key, prep.request_hash, delivery(steps.handler(msg), msg))])


def test_a_rounds_key_takes_its_token_from_the_rounds_one_statement_on_the_loop() -> None:
    steps, msg, prep = parts()
    token = uuid.uuid4()
    script = Script(STORE, [[(prep.key, token)]])
    path, conns = aio(steps, script)
    claim = run(path._claim(msg, prep, None, wanted(steps, msg, prep)))
    assert (claim.outcome, claim.token) == (Outcome.CLAIMED, token)
    assert script.names_sent() == ["batch_claim_insert"]
    assert conns.out == 0


def test_a_rounds_key_that_existed_gets_the_whole_claim_at_once() -> None:
    steps, msg, prep = parts()
    script = Script(STORE, [[], None, record(prep, status="succeeded", result_json=[1])])
    path, _ = aio(steps, script)
    claim = run(path._claim(msg, prep, None, wanted(steps, msg, prep)))
    assert claim.outcome is Outcome.REPLAY and claim.result == [1]
    assert script.names_sent() == ["batch_claim_insert", "BEGIN", "claim_insert",
                                   "claim_lock", "COMMIT"]


def test_a_round_whose_statement_failed_leaves_the_key_to_its_own_claim() -> None:
    steps, msg, prep = parts()
    gone = psycopg.OperationalError("the server closed the connection")
    script = Script(STORE, [gone, (1,)])
    path, conns = aio(steps, script)
    claim = run(path._claim(msg, prep, None, wanted(steps, msg, prep)))
    assert claim.outcome is Outcome.CLAIMED
    assert script.names_sent() == ["batch_claim_insert", "claim_insert"]
    assert conns.out == 0


def failure_verdicts(exc: Exception) -> tuple[Verdict, Verdict, Script, Steps, Steps]:
    """The verdict of ``exc`` recorded by the async path and by the sync one."""
    steps, msg, prep = parts()
    claim = Claim(Outcome.CLAIMED, prep.key, token=uuid.uuid4(), attempts=2, budget_used=2)
    handler = steps.handler(msg)
    script = Script(STORE, [FAILED])
    path, conns = aio(steps, script)
    got = run(path._record_failure(handler, msg, prep, claim, exc))
    assert conns.out == 0
    other, _, _ = parts()  # its own app: the same seeded jitter
    sync_script = Script(STORE, [FAILED])
    conn = SyncConn(sync_script)
    with conn.transaction():  # as Steps._failed records it
        want = other.record_failure(conn, other.handler(msg), msg, prep, claim,  # type: ignore[arg-type]
                                    exc)
    assert script.sent == sync_script.sent
    return got, want, script, steps, other


def test_a_failure_is_recorded_in_a_transaction_of_its_own_as_the_sync_path_records_it() -> None:
    got, want, script, steps, other = failure_verdicts(Retryable("try later"))
    assert got == want
    assert script.names_sent() == ["BEGIN", "fail", "COMMIT"]
    assert script.sent[1][1]["status"] == "retryable_failed"
    retries = [m.labels(TOPIC, "charge")._value.get() for m in (steps.metrics.retries,
                                                                  other.metrics.retries)]
    assert retries == [1.0, 1.0]


def test_a_permanent_failure_dead_letters_alike() -> None:
    got, want, script, _, _ = failure_verdicts(Permanent("bad"))
    assert got == want
    assert script.sent[1][1]["status"] == "failed"


def test_a_lost_connection_is_store_unavailable_and_the_connection_is_dropped() -> None:
    steps, _, _ = parts()
    path, conns = aio(steps, Script(STORE, []))

    async def lost() -> None:
        async with path._connection():
            raise psycopg.OperationalError("the server closed the connection")

    with pytest.raises(StoreUnavailable):
        run(lost())
    assert conns.out == 0 and conns.given[-1].closed

    async def refused() -> None:
        async with path._connection():
            raise psycopg.errors.StringDataRightTruncation("too long")

    with pytest.raises(psycopg.errors.StringDataRightTruncation):
        run(refused())
    assert conns.out == 0 and not conns.given[-1].closed


def test_a_refused_value_in_the_claim_is_the_messages_as_on_the_sync_path() -> None:
    steps, msg, prep = parts()
    script = Script(STORE, [psycopg.errors.StringDataRightTruncation("too long")])
    path, conns = aio(steps, script)
    with pytest.raises(DataRejected):
        run(path._claim(msg, prep, None, None))
    assert conns.out == 0
