"""A code defect (``handler.CODE_DEFECTS``) is permanent by default, mappings first:
``Handler.classify``, ``Handler.code_defect`` and what the failure then records
(no Kafka, no PostgreSQL)."""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import psycopg
import pytest

from kafka_idem import App, Context, Permanent, Retryable, RetryPolicy
from kafka_idem.app import ErrorKind, Handler
from kafka_idem.consume.outcome import Finished
from kafka_idem.consume.paths.verdicts import CODE_DEFECT, Failing, Letters, after_failure, failing
from kafka_idem.errors import (
    DataRejected,
    FrameworkError,
    InternalError,
    ResultNotJSON,
    StoreError,
)
from kafka_idem.handler import CODE_DEFECTS
from kafka_idem.store import Claim, Failure, Outcome
from kafka_idem.testing import FakeMessage

KEY = "t1:order:o1"
LETTERS = Letters(dlq_topic="orders.dlq", group="orders", handler="place",
                  namespace="orders", message_max=64)
MSG = FakeMessage("orders", partition=0, offset=7, key=b"o1", value=b"{}", headers=[],
                  timestamp=1_700_000_000_000)
T0 = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)
RECORDED = Failure(attempts=1, next_attempt_at=None, first_failure_at=T0, last_failure_at=T0)


def claimed(attempts: int) -> Claim:
    return Claim(Outcome.CLAIMED, KEY, attempts=attempts, budget_used=attempts)


def handler(
    errors: dict[type[BaseException], ErrorKind] | None = None,
    app_errors: dict[type[BaseException], ErrorKind] | None = None,
) -> Handler[Any]:
    app = App("defects", errors=app_errors)

    @app.handler(topic="orders", key="{order_id}", hash_fields=("order_id",), errors=errors)
    def place(msg: dict[str, Any], ctx: Context) -> None:
        return None

    return place


def unbound_local() -> UnboundLocalError:
    try:
        exec("def f():\n    x\n    x = 1\nf()", {})
    except UnboundLocalError as exc:
        return exc
    raise AssertionError("unreachable")


DEFECTS = [TypeError("x"), AttributeError("x"), NameError("x"), unbound_local(),
           NotImplementedError("x"), ResultNotJSON("x")]


def test_the_code_defects_are_exactly_these() -> None:
    assert set(CODE_DEFECTS) == {TypeError, AttributeError, NameError, NotImplementedError}


@pytest.mark.parametrize("exc", DEFECTS, ids=lambda e: type(e).__name__)
def test_a_code_defect_is_permanent_by_default(exc: BaseException) -> None:
    h = handler()
    assert (h.classify(exc), h.code_defect(exc)) == ("permanent", True)


@pytest.mark.parametrize("exc", [KeyError("x"), ValueError("x"), IndexError("x"),
                                 LookupError("x"), AssertionError("x"), RuntimeError("x")],
                         ids=lambda e: type(e).__name__)
def test_data_or_timing_dependent_errors_stay_retryable(exc: BaseException) -> None:
    h = handler()
    assert (h.classify(exc), h.code_defect(exc)) == ("retryable", False)


@pytest.mark.parametrize(("errors", "app_errors", "kind"), [
    ({TypeError: "retryable"}, None, "retryable"),  # the documented opt-back
    (None, {TypeError: "retryable"}, "retryable"),  # per app too
    ({Exception: "unknown_outcome"}, None, "unknown_outcome"),  # a broader mapping wins
    ({TypeError: "permanent"}, {TypeError: "retryable"}, "permanent"),  # handler beats app
])
def test_mappings_are_checked_before_the_code_defect_rule(
    errors: dict[type[BaseException], ErrorKind] | None,
    app_errors: dict[type[BaseException], ErrorKind] | None, kind: ErrorKind,
) -> None:
    h = handler(errors, app_errors)
    assert h.classify(TypeError("x")) == kind
    assert h.code_defect(TypeError("x")) == (kind == "permanent")
    assert handler().classify(TypeError("x")) == "permanent"  # mappings are per handler/app


def test_an_opt_back_keeps_the_other_defects_permanent() -> None:
    h = handler({TypeError: "retryable"})
    assert h.classify(ResultNotJSON("x")) == "retryable"  # a TypeError
    assert h.classify(AttributeError("x")) == "permanent"


@pytest.mark.parametrize("exc", [Permanent("x"), DataRejected("x")],
                         ids=lambda e: type(e).__name__)
def test_other_permanent_errors_are_not_called_code_defects(exc: BaseException) -> None:
    h = handler()
    assert (h.classify(exc), h.code_defect(exc)) == ("permanent", False)
    assert handler().classify(Retryable("x")) == "retryable"


def test_framework_errors_are_not_code_defects() -> None:
    # They never reach classify on the message path (re-raised first, never charged);
    # InternalError is how a defect of kafka_idem's own completion leaves.
    assert issubclass(InternalError, FrameworkError)
    assert not issubclass(InternalError, CODE_DEFECTS)
    assert not issubclass(StoreError, CODE_DEFECTS)
    assert not handler().code_defect(InternalError("x"))


# --- what the failure records -----------------------------------------------------------

POLICY = RetryPolicy(base=0.5, cap=60.0, max_attempts=3)


def test_a_code_defect_fails_at_once_and_its_message_says_so() -> None:
    f = failing("permanent", claim=claimed(1), policy=POLICY, defect=True)
    assert (f.status, f.kind, f.exhausted, f.defect) == ("failed", "permanent", False, True)
    assert f.stored_message("'NoneType' object has no attribute 'id'", 200) == (
        f"{CODE_DEFECT}: 'NoneType' object has no attribute 'id'")
    assert f.stored_message("x" * 300, 60).startswith(CODE_DEFECT)
    assert len(f.stored_message("x" * 300, 60).encode()) <= 60
    plain = failing("permanent", claim=claimed(1), policy=POLICY)
    assert plain.stored_message("card declined", 200) == "card declined"


def test_a_code_defects_dead_letter_and_log_line_say_it_was_not_retried() -> None:
    f = Failing("failed", "permanent", reason=CODE_DEFECT, defect=True)
    stored = f.stored_message("bad operand", 64)
    v = after_failure(f, RECORDED, letters=LETTERS, msg=MSG, key=KEY, claim=claimed(1),
                      error_class="TypeError", message=stored)
    assert isinstance(v.result, Finished) and v.result.letter is not None
    headers = {k: v for k, v in v.result.letter.headers(64)}
    assert headers["idem.error.kind"] == b"permanent"
    assert headers["idem.error.class"] == b"TypeError"
    assert headers["idem.error.message"] == f"{CODE_DEFECT}: bad operand".encode()
    assert (v.note.action, v.note.level) == ("failed", logging.WARNING)
    assert v.note.text % v.note.args == (
        f"dead-lettering (permanent): TypeError: {CODE_DEFECT}: bad operand")


def test_a_call_psycopg_refused_itself_is_a_code_defect_a_servers_refusal_is_not() -> None:
    """No SQLSTATE: psycopg refused the call before sending it (a wrong number of
    parameters, ``commit()`` inside the attempt's transaction): permanent, a code
    defect. The server's ``ProgrammingError`` (an undefined table, perhaps a migration
    not run yet) keeps its SQLSTATE and stays retryable; a mapping still comes first."""
    h = handler()
    client = psycopg.ProgrammingError("Explicit commit() forbidden within a Transaction context.")
    server = psycopg.errors.UndefinedTable('relation "shop.ledger" does not exist')
    assert client.sqlstate is None and server.sqlstate == "42P01"
    assert (h.classify(client), h.code_defect(client)) == ("permanent", True)
    assert (h.classify(server), h.code_defect(server)) == ("retryable", False)
    mapped = handler(errors={psycopg.ProgrammingError: "retryable"})
    assert (mapped.classify(client), mapped.code_defect(client)) == ("retryable", False)
