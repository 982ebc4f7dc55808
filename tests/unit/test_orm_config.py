"""``ctx.session``'s configuration (``app.sqlalchemy``, the missing extra) and how an
ORM error is judged: as its psycopg cause (no database needed)."""

from __future__ import annotations

import sys
from typing import Any

import psycopg
import pytest
import sqlalchemy.exc
from sqlalchemy import MetaData
from sqlalchemy.orm.exc import StaleDataError

from kafka_idem import App, Context
from kafka_idem.app import ErrorKind, Handler
from kafka_idem.errors import ConfigError, TransientStoreError
from kafka_idem.orm.causes import orm_cause
from kafka_idem.orm.sessions import Sessions
from kafka_idem.store.errors import classify_db_error


def context(sessions: Sessions) -> Context:
    return Context(tx=None, idempotency_key="k", request_hash="h",  # type: ignore[arg-type]
                   attempt=1, handler="h", topic="t", partition=0, offset=0, timestamp=None,
                   kafka_key=None, sessions=sessions)


def assert_names_the_extra(exc: ConfigError) -> None:
    assert "kafka-idem[sqlalchemy]" in str(exc)
    assert exc.context["setting"] == "sqlalchemy"


def test_without_sqlalchemy_ctx_session_and_app_sqlalchemy_name_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As if the extra were not installed: SQLAlchemy cannot be imported, nor the
    # modules of kafka_idem that import it (imported again, as in a fresh process).
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    for name in ("kafka_idem.orm.engines", "kafka_idem.orm.handler_session"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ConfigError) as session_error:
        _ = context(Sessions()).session
    assert_names_the_extra(session_error.value)
    with pytest.raises(ConfigError) as configure_error:
        App("orm").sqlalchemy()
    assert_names_the_extra(configure_error.value)


def test_app_sqlalchemy_is_configured_once() -> None:
    app = App("orm")
    app.sqlalchemy(metadata=MetaData())
    with pytest.raises(ConfigError, match="twice") as exc:
        app.sqlalchemy()
    assert exc.value.context["setting"] == "sqlalchemy"
    assert len(app.migrations) == 1  # the first call's tables only


@pytest.mark.parametrize(("options", "named"), [
    ({"engine_options": {"poolclass": object, "echo": True}}, "poolclass"),
    ({"engine_options": {"isolation_level": "SERIALIZABLE"}}, "isolation_level"),
    ({"session_options": {"bind": object(), "autoflush": False}}, "bind"),
    ({"session_options": {"join_transaction_mode": "create_savepoint"}},
     "join_transaction_mode"),
])
def test_options_the_framework_owns_are_refused_by_name(options: dict[str, Any],
                                                         named: str) -> None:
    app = App("orm")
    with pytest.raises(ConfigError, match=named) as exc:
        app.sqlalchemy(**options)
    assert exc.value.context["setting"] == "sqlalchemy"
    assert not app.sessions.configured
    app.sqlalchemy(engine_options={"echo": False}, session_options={"autoflush": False})


def handler(errors: dict[type[BaseException], ErrorKind] | None = None) -> Handler[Any]:
    app = App("orm")

    @app.handler(topic="deposits", key="{order_id}", hash_fields=("order_id",), errors=errors)
    def deposit(msg: dict[str, Any], ctx: Context) -> None:
        return None

    return deposit


def wrapped(cause: psycopg.Error) -> sqlalchemy.exc.DBAPIError:
    """SQLAlchemy's wrapper of ``cause``, as a flush raises it (statement, parameters)."""
    wrapper = sqlalchemy.exc.DBAPIError.instance(
        "INSERT INTO entry (order_id) VALUES (%(order_id)s)", {"order_id": "o-secret"},
        cause, psycopg.Error)
    assert isinstance(wrapper, sqlalchemy.exc.DBAPIError)
    return wrapper


def judged(exc: sqlalchemy.exc.DBAPIError) -> BaseException:
    """What the steps judge for an ORM error: its psycopg cause, raised from it."""
    cause = orm_cause(exc)
    assert cause is not None
    try:
        raise cause from exc
    except psycopg.Error as raised:
        return raised


@pytest.mark.parametrize("cause", [psycopg.errors.SerializationFailure("x"),
                                   psycopg.errors.DeadlockDetected("x")],
                         ids=lambda c: type(c).__name__)
def test_orm_contention_is_the_transient_path_not_a_charged_retry(
    cause: psycopg.Error,
) -> None:
    wrapper = wrapped(cause)
    assert isinstance(wrapper, sqlalchemy.exc.OperationalError)
    raised = judged(wrapper)
    assert raised is cause and raised.__cause__ is wrapper
    # Steps: a TransientStoreError (retried, not charged) before any classification.
    assert classify_db_error(raised) is TransientStoreError
    assert handler().classify(raised) == "retryable"


def test_orm_errors_are_judged_as_their_causes_and_mappings_may_name_either() -> None:
    unique = judged(wrapped(psycopg.errors.UniqueViolation("dup")))
    assert isinstance(unique.__cause__, sqlalchemy.exc.IntegrityError)
    assert handler().classify(unique) == "permanent"
    assert handler({sqlalchemy.exc.IntegrityError: "retryable"}).classify(unique) == "retryable"
    assert handler({psycopg.errors.UniqueViolation: "retryable"}).classify(unique) == "retryable"
    assert "o-secret" not in str(unique)
    # Not a driver error: judged as it is (retryable, charged; a re-run reads afresh).
    assert orm_cause(StaleDataError("0 rows matched")) is None
    assert handler().classify(StaleDataError("0 rows matched")) == "retryable"
    assert handler().classify(sqlalchemy.exc.ArgumentError("bad")) == "permanent"
