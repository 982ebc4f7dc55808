"""Database errors become :mod:`kafka_idem.errors` classes here, and only here.

Decided by SQLSTATE, never by message text (which changes between versions and
locales): whose fault an error is decides whether a message is retried, charged,
or dead-lettered (see docs/PROTOCOL.md, invariant 7).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import psycopg

from kafka_idem.errors import (
    ConfigError,
    DataRejected,
    IllegalTransition,
    KafkaIdemError,
    StaleOwner,
    StoreError,
    StoreUnavailable,
    TransientStoreError,
)
from kafka_idem.observe.redact import redact

# SQLSTATEs, never message text (message text changes
# between versions and locales).
TRANSIENT_SQLSTATES = frozenset(
    {
        "40001",  # serialization_failure
        "40P01",  # deadlock_detected
        "55P03",  # lock_not_available
        "57014",  # query_canceled (statement/lock timeout)
        "53300",  # too_many_connections
    }
)
UNAVAILABLE_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "08000", "08003", "08006"})
ILLEGAL_TRANSITION = "KI001"
STALE_OWNER = "KI002"


# Errors caused by the data a message brought, not by the database's state: retrying
# the same message can never succeed, so it is dead-lettered (DataRejected). Class 22
# is "data exception" (invalid byte sequence, NUL in jsonb, numeric overflow, value
# too long), class 23 "integrity constraint violation" (check, not-null, foreign key);
# 54000 is "program limit exceeded" (an index entry over PostgreSQL's B-tree limit).
DATA_SQLSTATE_CLASSES = ("22", "23")
DATA_SQLSTATES = frozenset({"54000"})


def is_data_error(exc: BaseException) -> bool:
    """True when ``exc`` is the database (or psycopg, before sending) refusing a value.

    psycopg itself refuses a NUL in text and a string it cannot encode, with no SQLSTATE.
    """
    if isinstance(exc, UnicodeEncodeError | DataRejected):
        return True
    if not isinstance(exc, psycopg.Error):
        return False
    state = exc.sqlstate or ""
    if state:
        return state[:2] in DATA_SQLSTATE_CLASSES or state in DATA_SQLSTATES
    return isinstance(exc, psycopg.DataError)


def data_error_text(exc: BaseException) -> str:
    """What the database said about the value, without the value itself: the SQLSTATE
    and primary message (never DETAIL/CONTEXT, which may quote the parameters)."""
    if isinstance(exc, psycopg.Error):
        primary = exc.diag.message_primary or str(exc).splitlines()[0]
        state = exc.sqlstate or "client-side"
        return f"SQLSTATE {state}: {primary}"
    return f"{type(exc).__name__}: {exc.reason if isinstance(exc, UnicodeEncodeError) else exc}"


def rejected(exc: BaseException, **context: Any) -> DataRejected:
    """``exc``, a data error of the database (:func:`is_data_error`), as the message's
    own :class:`DataRejected` (an existing one is returned as it is)."""
    if isinstance(exc, DataRejected):
        return exc
    return DataRejected(
        f"the database rejected the message's data ({data_error_text(exc)})", **context)


def storable(text: str) -> str:
    """``text`` as PostgreSQL ``text`` can hold it: NUL removed, lone surrogates
    replaced (error messages quote handler exceptions, which may quote payloads)."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def describe(exc: BaseException) -> str:
    """One line about ``exc`` for a log: a database error's SQLSTATE and primary
    message (also when it is the ``__cause__`` of one of ours), else the class and
    the first line of its text."""
    cause = exc if isinstance(exc, psycopg.Error) else exc.__cause__
    if isinstance(cause, psycopg.Error) and cause.sqlstate:
        return f"{type(exc).__name__}: SQLSTATE {cause.sqlstate}: {cause.diag.message_primary}"
    lines = str(exc).strip().splitlines()
    # A connection error can quote its connection string.
    return redact(f"{type(exc).__name__}: {lines[0]}") if lines else type(exc).__name__


def classify_db_error(exc: BaseException) -> type[KafkaIdemError] | None:
    """The kafka_idem error class for a psycopg error, by SQLSTATE (never by message
    text); ``None`` if not a database error."""
    if is_data_error(exc):
        return DataRejected
    if not isinstance(exc, psycopg.Error):
        return None
    state = exc.sqlstate or ""
    if state == ILLEGAL_TRANSITION:
        return IllegalTransition
    if state == STALE_OWNER:
        return StaleOwner
    if state in TRANSIENT_SQLSTATES:
        return TransientStoreError
    if state in UNAVAILABLE_SQLSTATES or state.startswith("08"):
        return StoreUnavailable
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError) and not state:
        return StoreUnavailable  # connection lost, no server answer
    return StoreError


@contextmanager
def translate_errors(**context: Any) -> Iterator[None]:
    """The one place psycopg errors become kafka_idem errors (``__cause__`` kept)."""
    try:
        yield
    except (psycopg.Error, UnicodeEncodeError) as exc:
        raise translated(exc, **context) from exc


def translated(exc: psycopg.Error | UnicodeEncodeError, **context: Any) -> KafkaIdemError:
    """``exc`` as the kafka_idem error it means (raise it ``from exc``)."""
    cls = classify_db_error(exc) or StoreError
    if cls is DataRejected:
        return rejected(exc, **context)
    summary = (cls.__doc__ or "").strip().splitlines()[0]
    return cls(redact(f"{summary}: {exc}"), **context)


def raise_attempt_error(exc: BaseException, **context: Any) -> NoReturn:
    """Raise what an error of a leased attempt's transaction means once its completion
    was queued behind the handler's statements, all answering at one sync.

    The framework's own SQLSTATEs (KI002: the lease was lost; KI001) are the
    completion's: raised translated (:class:`StaleOwner`). Any other database error
    may be any statement's, the handler's own seen only now, so it goes on raw, to be
    judged as the handler's error would be (data errors permanent, transient and
    lost-connection errors never charged). A translated error whose cause is such an
    error (seen while the completion or its events were being sent) goes on as that
    cause."""
    raw = exc
    if (isinstance(exc, KafkaIdemError) and not isinstance(exc, StaleOwner | IllegalTransition)
            and isinstance(exc.__cause__, psycopg.Error)):
        raw = exc.__cause__
    if isinstance(raw, psycopg.Error) and raw.sqlstate in (STALE_OWNER, ILLEGAL_TRANSITION):
        raise translated(raw, **context) from raw
    raise raw


def local_write_error(handler: str, tables: list[str], records: str) -> ConfigError:
    """The handler wrote tables local to the Citus coordinator: what to do about it."""
    return ConfigError(
        f"handler {handler!r} wrote {', '.join(tables)}, local to the Citus coordinator: "
        "those writes would not commit atomically with the message's record (on a worker). "
        f"Distribute {'them' if len(tables) > 1 else 'it'} by the shard key with "
        f"create_distributed_table(..., colocate_with => '{records}'), or "
        "make it a reference table (docs/CITUS.md)", setting="shard_key")
