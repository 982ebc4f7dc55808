"""The transaction of a leased attempt, queued in its pipeline.

A leased attempt runs ``BEGIN``, the handler's statements, the fenced completion and
``COMMIT`` in one pipeline on an autocommit connection, with one sync when the
pipeline ends (:meth:`Steps._run_pipelined
<kafka_idem.consume.paths.steps.Steps._run_pipelined>`). ``conn.execute("BEGIN")`` would send
``BEGIN`` to the server at once, alone: one more packet for the client to write and
the server to wake for, and one more result to read, per message. A psycopg
transaction block, entered inside the pipeline, only *queues* its ``BEGIN`` (it
travels with the handler's first statement) and its ``COMMIT`` (with the sync).

``Connection.transaction()`` cannot be used for this: inside a pipeline it syncs
``BEGIN`` alone and once more on each side of the block. The :class:`psycopg.Transaction`
object, entered directly, does not. Two differences from psycopg's own: the block
never swallows an exception (``psycopg.Rollback`` from a handler is the attempt's
error, as any other), and it refuses a connection already inside a transaction
(the block would silently become a savepoint of it, and ``COMMIT`` would not be
sent): an :class:`~kafka_idem.errors.InternalError`, the framework's, never the
message's.

Inside the block psycopg knows a transaction is open: a handler's
``ctx.tx.transaction()`` is a savepoint, and ``ctx.tx.commit()`` raises
``ProgrammingError`` instead of committing the handler's writes without their
completion.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Literal, NoReturn

import psycopg
from psycopg.pq import TransactionStatus

from kafka_idem.errors import InternalError
from kafka_idem.store.errors import raise_attempt_error


def _check_idle(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Not a handler's fault if it fails (kafka_idem's own state): never charged."""
    status = conn.info.transaction_status
    if status != TransactionStatus.IDLE:
        raise InternalError(
            f"a leased attempt needs an idle connection; this one is {status.name}")


class HandlerBlock(psycopg.Transaction):
    """A psycopg transaction block (``BEGIN``, or a savepoint inside a transaction)
    that never swallows an exception: ``psycopg.Rollback`` from a handler is its error.
    Inside it ``commit()`` raises: what the framework runs handlers in."""

    def __exit__(
        self, exc_type: type[BaseException] | None, exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> Literal[False]:
        super().__exit__(exc_type, exc_val, exc_tb)
        return False


class AttemptTransaction(HandlerBlock):
    """``BEGIN`` ... ``COMMIT`` (or ``ROLLBACK`` on an error) queued in ``conn``'s
    pipeline; an error inside always propagates."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        _check_idle(conn)
        super().__init__(conn)

    def __enter__(self) -> AttemptTransaction:
        super().__enter__()
        _mark(self._conn, True)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> Literal[False]:
        _mark(self._conn, False)
        return super().__exit__(exc_type, exc_val, exc_tb)


class AsyncAttemptTransaction(psycopg.AsyncTransaction):
    """:class:`AttemptTransaction` on an async connection."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        _check_idle(conn)
        super().__init__(conn)

    async def __aenter__(self) -> AsyncAttemptTransaction:
        await super().__aenter__()
        _mark(self._conn, True)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> Literal[False]:
        _mark(self._conn, False)
        await super().__aexit__(exc_type, exc_val, exc_tb)
        return False


def _mark(conn: Any, open_: bool) -> None:
    """Tell a kafka_idem connection (:class:`~kafka_idem.store.connection.Connection`)
    that an attempt's ``BEGIN`` is queued in it: its ``transaction()`` then syncs first."""
    if hasattr(conn, "attempt_open"):
        conn.attempt_open = open_


def unmasked(exc: BaseException) -> BaseException:
    """The error behind psycopg's ``PipelineAborted``. That one only says an earlier
    statement of the pipeline failed; psycopg raises it in place of that statement's
    error when the failure is read as the pipeline ends (its ``finally`` reads the
    rest), so the real error is its ``__context__``. Anything else is returned as is."""
    seen: BaseException | None = exc
    while isinstance(seen, psycopg.errors.PipelineAborted):
        seen = seen.__context__
    return seen if isinstance(seen, psycopg.Error) else exc


def raise_failed_attempt(exc: BaseException, *, completing: bool, key: str) -> NoReturn:
    """Raise what ``exc``, met by a leased attempt's transaction, means: unmasked;
    once the completion was queued (``completing``), as :func:`raise_attempt_error`
    judges it, else as it is (the handler's own error, or the framework's)."""
    real = unmasked(exc)
    if completing:
        raise_attempt_error(real, key=key)
    if real is exc:
        raise exc
    raise real from None
