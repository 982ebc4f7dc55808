"""How handler failures are classified, on real Handlers, and what each
class does to the record when it goes through the real Processor and database
(no broker: the message is a stand-in with the fields the processor reads)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel, ValidationError

from consumers import payments
from consumers.payments import encode_charge
from kafka_idem import (
    App,
    Context,
    InvalidPayload,
    MissingKeyField,
    Permanent,
    Retryable,
    RetryPolicy,
    Undecodable,
    UnknownOutcome,
    no_wait,
)
from kafka_idem.app import ErrorKind, Handler
from kafka_idem.consume.outcome import Deferred, Finished, Result
from kafka_idem.consume.paths.processor import Processor
from kafka_idem.observe.metrics import Metrics
from kafka_idem.store import Store
from kafka_idem.testing import FakeMessage
from tests.conftest import DB
from tests.integration.support import charge_app

TOPIC = "classify.charge-requested"
KEY = "t1:charge:o1"


class Card(BaseModel):
    number: int


def validation_error() -> ValidationError:
    try:
        Card.model_validate({"number": "not a number"})
    except ValidationError as exc:
        return exc
    raise AssertionError("unreachable")


def handler(
    errors: dict[type[BaseException], ErrorKind] | None = None,
    app_errors: dict[type[BaseException], ErrorKind] | None = None,
) -> Handler[Any]:
    app = App("classify", errors=app_errors)
    return app.handler(topic=TOPIC, model=payments.ChargeRequested,
                       key="{tenant_id}:charge:{order_id}", hash_fields=("amount", "currency"),
                       schema=payments.SCHEMA, errors=errors)(payments.charge)


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (Retryable("x"), "retryable"),
        (Permanent("x"), "permanent"),
        (UnknownOutcome("x"), "unknown_outcome"),
        (validation_error(), "permanent"),
        (MissingKeyField("x"), "permanent"),
        (InvalidPayload("x"), "permanent"),
        (Undecodable("x"), "permanent"),
        (psycopg.errors.UniqueViolation("x"), "permanent"),
        (psycopg.errors.SerializationFailure("x"), "retryable"),
        (psycopg.errors.DeadlockDetected("x"), "retryable"),
        (psycopg.errors.LockNotAvailable("x"), "retryable"),
        (psycopg.errors.QueryCanceled("x"), "retryable"),
        (psycopg.OperationalError("connection lost"), "retryable"),
        (ValueError("unmapped"), "retryable"),
        (RuntimeError("unmapped"), "retryable"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v,
)
def test_default_classification(exc: BaseException, kind: str) -> None:
    assert handler().classify(exc) == kind


def test_mappings_override_the_defaults_handler_first_then_app() -> None:
    h = handler(errors={ValueError: "permanent", psycopg.errors.UniqueViolation: "retryable"},
                app_errors={ValueError: "retryable", KeyError: "permanent",
                            TimeoutError: "unknown_outcome"})
    assert h.classify(ValueError("x")) == "permanent"  # handler beats app
    assert h.classify(psycopg.errors.UniqueViolation("x")) == "retryable"  # handler beats default
    assert h.classify(KeyError("x")) == "permanent"  # app beats default
    assert h.classify(TimeoutError("x")) == "unknown_outcome"
    assert h.classify(RuntimeError("x")) == "retryable"
    assert handler().classify(ValueError("x")) == "retryable"  # mappings are per handler/app


# --- through the processor ----------------------------------------------------------------


def processor(db: DB, fn: Callable[[payments.ChargeRequested, Context], Any], *, mode: str,
              max_attempts: int = 3,
              errors: dict[type[BaseException], ErrorKind] | None = None) -> Processor:
    app = charge_app(db, TOPIC, "classify", fn, mode=mode, errors=errors,
                     retry=RetryPolicy(base=0.1, cap=0.1, max_attempts=max_attempts))
    return Processor(app, store=Store(schema="kafka_idem", table="task_idempotency",
                                      namespace=app.namespace),
                     metrics=Metrics())


def run_until_finished(proc: Processor, msg: FakeMessage, mode: str,
                       limit: int = 20) -> tuple[Finished, list[Deferred]]:
    """Process ``msg`` like the runner does (re-entering our own live claim) until decided."""
    deferred: list[Deferred] = []
    token = None
    tp = (msg.topic(), msg.partition())
    with no_wait():
        for _ in range(limit):
            res: Result
            if mode == "local":
                res = proc.run_local([(tp, [msg])])[tp][0]
            else:
                res = proc.run_leased(msg, reentrant=token)
            if isinstance(res, Finished):
                return res, deferred
            deferred.append(res)
            token = res.token
    raise AssertionError(f"not decided after {limit} tries: {deferred}")


def message(amount: str = "10.00", *, tenant: str = "t1") -> FakeMessage:
    return FakeMessage(TOPIC, offset=5, key=b"o1", value=encode_charge(tenant, "o1", amount))


@pytest.mark.parametrize("mode", ["local", "leased"])
@pytest.mark.parametrize("error", [psycopg.errors.SerializationFailure,
                                   psycopg.errors.DeadlockDetected])
def test_serialization_failures_and_deadlocks_are_retried_and_not_charged(
    db: DB, mode: str, error: type[psycopg.Error]
) -> None:
    calls = []

    def contended(msg: payments.ChargeRequested, ctx: Context) -> Any:
        calls.append(ctx.attempt)
        result = payments.charge(msg, ctx)
        if len(calls) <= 2:
            raise error("contention")
        return result

    proc = processor(db, contended, mode=mode, max_attempts=1)  # a charged retry would exhaust
    done, deferred = run_until_finished(proc, message(), mode)
    proc.close()
    assert done.outcome == "succeeded"
    # Deferred as the framework's own trouble (the partition waits), never as a retry
    # (the local batch path may run the handler once more before deferring).
    assert deferred and {d.reason for d in deferred} == {"framework"}
    assert len(calls) >= 3 and set(calls) == {1}  # every run was attempt 1: never charged
    rec = db.record(KEY)
    assert rec is not None and rec["status"] == "succeeded"
    assert rec["attempts"] == 1 and rec["error_kind"] is None
    assert db.ledger_counts() == {KEY: 1}


@pytest.mark.parametrize("mode", ["local", "leased"])
def test_unmapped_exception_is_retried_until_exhausted(db: DB, mode: str) -> None:
    def broken(msg: payments.ChargeRequested, ctx: Context) -> Any:
        payments.charge(msg, ctx)
        raise ValueError(f"bug on attempt {ctx.attempt}")

    proc = processor(db, broken, mode=mode, max_attempts=3)
    done, deferred = run_until_finished(proc, message(), mode)
    proc.close()
    assert [d.reason for d in deferred] == ["retry", "retry"]
    assert done.outcome == "dead_lettered" and done.letter is not None
    assert (done.letter.kind, done.letter.attempts, done.letter.error_class) == (
        "exhausted", 3, "ValueError")
    rec = db.record(KEY)
    assert rec is not None
    assert (rec["status"], rec["error_kind"], rec["attempts"]) == ("failed", "exhausted", 3)
    assert "bug on attempt 3" in rec["error_message"]
    assert db.ledger() == []


def _raise(exc: BaseException) -> Callable[[payments.ChargeRequested, Context], Any]:
    def fn(msg: payments.ChargeRequested, ctx: Context) -> Any:
        payments.charge(msg, ctx)
        raise exc

    return fn


@pytest.mark.parametrize("mode", ["local", "leased"])
@pytest.mark.parametrize(
    ("exc", "errors"),
    [
        (Permanent("declined"), None),
        (validation_error(), None),
        (MissingKeyField("no customer id"), None),
        (KeyError("customer"), {KeyError: "permanent"}),  # a per-handler mapping
    ],
    ids=["Permanent", "ValidationError", "MissingKeyField", "mapped-KeyError"],
)
def test_permanent_failures_are_dead_lettered_on_the_first_attempt(
    db: DB, mode: str, exc: BaseException, errors: dict[type[BaseException], ErrorKind] | None
) -> None:
    proc = processor(db, _raise(exc), mode=mode, max_attempts=5, errors=errors)
    done, deferred = run_until_finished(proc, message(), mode)
    proc.close()
    assert deferred == []
    assert done.outcome == "dead_lettered" and done.letter is not None
    assert (done.letter.kind, done.letter.attempts) == ("permanent", 1)
    assert done.letter.error_class == type(exc).__name__
    rec = db.record(KEY)
    assert rec is not None
    assert (rec["status"], rec["error_kind"], rec["attempts"]) == ("failed", "permanent", 1)
    assert db.ledger() == []


@pytest.mark.parametrize("mode", ["local", "leased"])
def test_a_message_without_its_key_fields_is_permanent_and_leaves_no_record(
    db: DB, mode: str
) -> None:
    proc = processor(db, payments.charge, mode=mode)
    done, deferred = run_until_finished(proc, message(tenant=" "), mode)
    proc.close()
    assert deferred == []
    assert done.letter is not None
    assert (done.letter.kind, done.letter.error_class) == ("permanent", "MissingKeyField")
    assert done.letter.idempotency_key is None
    assert db.records() == [] and db.ledger() == []

