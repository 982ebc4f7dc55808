"""The steps every path shares: decode a message (a base of :class:`Steps`:
:mod:`~kafka_idem.consume.paths.decoding`), claim its key, build the handler's
context, run the handler with its fenced completion, record a failure.

The claim and the failure record have twins for an ``async def`` handler's message
(:meth:`Steps.claim_async`, :meth:`Steps.record_failure_async`, run by
:mod:`~kafka_idem.consume.paths.async_leased_path` on the event loop's connections):
the same arguments, tracing, decisions
(:mod:`~kafka_idem.consume.paths.failure_record`), metrics and verdicts; only the
store's call is its async twin (``Store.claim_async``, ``Store.fail_async``: the same
statements, from the same plans).

A step that a batch may later roll back (:meth:`Steps.undecodable`,
:meth:`Steps.not_claimed`, :meth:`Steps.record_failure`) returns a :class:`Verdict`
and logs nothing: the caller logs the note once the decision stands.
:meth:`Steps.execute` belongs to the per-message paths only, whose decisions stand
at once, so it logs what it decides itself.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from kafka_idem.app import App, Context, Done, Handler
from kafka_idem.consume.config_hold import ConfigHold
from kafka_idem.consume.outcome import (
    Deferred,
    Ended,
    Finished,
    Message,
    Parts,
    Prepared,
    Reason,
    Result,
    Results,
)
from kafka_idem.consume.paths.calls import context, delivery, own_code
from kafka_idem.consume.paths.database import Database
from kafka_idem.consume.paths.decoding import Decoding
from kafka_idem.consume.paths.failure_record import Recording, recording
from kafka_idem.consume.paths.lease_keeper import Hold
from kafka_idem.consume.paths.slots import Gate
from kafka_idem.consume.paths.verdicts import (
    Letters,
    Verdict,
    after_failure,
    last_chance_spent,
    not_claimed,
    reconcile_first,
    undecodable,
)
from kafka_idem.consume.tracing import Tracing
from kafka_idem.errors import (
    FrameworkError,
    MessageError,
    StaleOwner,
    TransientStoreError,
)
from kafka_idem.observe.metrics import Metrics
from kafka_idem.orm.causes import orm_cause
from kafka_idem.store import (
    AsyncConn,
    AttemptTransaction,
    Claim,
    Conn,
    Failure,
    HandlerBlock,
    Outcome,
    Store,
    classify_db_error,
    describe,
    raise_failed_attempt,
)

log = logging.getLogger(__name__)


class Steps(Decoding):
    def __init__(
        self, app: App, *, store: Store, metrics: Metrics, db: Database,
        tracing: Tracing | None = None,
        hold: ConfigHold | None = None,
    ) -> None:
        self.app = app
        self.settings = app.settings
        self.store = store
        self.metrics = metrics
        self.db = db
        self._letters: dict[str, Letters] = {}
        self.tracing = tracing or Tracing()
        self.hold = hold or ConfigHold(metrics)  # configuration errors: held, loudly
        self.emitter = app.outbox  # what ctx.emit writes through
        # While the per-message path runs a unit: the relays to wake once it ends (its
        # messages commit one by one, without a notification each).
        self.wake: set[str] | None = None

    def context(
        self, conn: Any, handler: Handler[Any], msg: Message, prep: Prepared, attempt: int,
        cls: type[Context] = Context, hold: Hold | None = None,
    ) -> Context:
        """:func:`context` (``attempt``: the claim's attempts), with this app's outbox for
        ``ctx.emit`` and ``hold``'s lease."""
        return context(conn, handler, msg, prep, attempt, cls, emitter=self.emitter, hold=hold,
                       sessions=self.app.sessions)

    def handler(self, msg: Message) -> Handler[Any]:
        return self.app.handlers[msg.topic()]

    # --- decoding (the rest: :class:`Decoding`) -----------------------------------

    def prepare_or_reject(self, handler: Handler[Any], msg: Message) -> Prepared | Result:
        """:meth:`prepare`, or for a message that can never be processed, its dead-letter
        result (logged here: the per-message paths' first step)."""
        try:
            return self.prepare(handler, msg)
        except MessageError as exc:
            verdict = self.undecodable(handler, msg, exc)
            verdict.note.write(log)
            return verdict.result

    # --- verdicts --------------------------------------------------------------------

    def letters(self, handler: Handler[Any]) -> Letters:
        """How ``handler``'s dead letters are addressed (made once per handler: every
        replay and conflict of a batch asks for it)."""
        letters = self._letters.get(handler.name)
        if letters is None:
            letters = self._letters[handler.name] = Letters(
                dlq_topic=self.app.dlq_topic(handler), group=self.app.group_id,
                handler=handler.name, namespace=self.store.namespace,
                message_max=self.settings.error_message_max)
        return letters

    def undecodable(
        self, handler: Handler[Any], msg: Message, exc: MessageError, key: str | None = None
    ) -> Verdict:
        return undecodable(self.letters(handler), msg, exc, key)

    def not_claimed(
        self, handler: Handler[Any], msg: Message, prep: Prepared, claim: Claim
    ) -> Verdict:
        if claim.outcome is Outcome.EXHAUSTED:  # counted as the claim moves it to failed
            self.metrics.exhausted.labels(msg.topic(), handler.name).inc()
        return not_claimed(claim, letters=self.letters(handler), msg=msg, prep=prep,
                           busy_retry_seconds=self.settings.busy_retry_seconds)

    def defer_all(self, parts: Parts, exc: BaseException) -> Results:
        """Every partition waits: the transaction failed and nothing was committed."""
        where = ", ".join(
            f"{msgs[0].topic()}[{msgs[0].partition()}]@{msgs[0].offset()}"
            for _, msgs in parts if msgs
        )
        log.warning(
            "batch transaction failed (%s); will retry %s",
            describe(exc), where,
            extra={"action": "batch_failed", "kind": type(exc).__name__},
        )
        self.metrics.framework_errors.labels(type(exc).__name__).inc()
        return {tp: [Deferred(0.0, Reason.FRAMEWORK)] for tp, _ in parts}

    # --- claim -----------------------------------------------------------------------

    def claim_new(
        self, conn: Conn, handler: Handler[Any], msg: Message, prep: Prepared,
        token: uuid.UUID | None = None,
    ) -> Claim | None:
        """A new key claimed and committed in one round trip (autocommit), or ``None``.
        ``token``: the owner token it takes (the caller's, to re-enter the claim if the
        answer is lost with the connection while the claim commits)."""
        conn.autocommit = True
        try:
            with self.tracing.step(msg, "claim"):
                return self.store.claim_new(
                    conn, key=prep.key, request_hash=prep.request_hash,
                    delivery=delivery(handler, msg), lease_seconds=self.settings.lease_seconds,
                    shard=prep.shard, token=token,
                )
        finally:
            if not conn.closed:
                conn.autocommit = False

    def claim(
        self, conn: Conn, handler: Handler[Any], msg: Message, prep: Prepared,
        reentrant: uuid.UUID | None = None, token: uuid.UUID | None = None,
    ) -> Claim:
        """The whole claim of ``msg``'s key (:meth:`Store.claim`), in the caller's
        transaction (``token``: as :meth:`claim_new`'s)."""
        args = self._claim_args(handler, msg, prep, reentrant) | {"token": token}
        with self.tracing.step(msg, "claim"):
            claim = self.store.claim(conn, **args)
        return self._claimed(handler, msg, prep, claim)

    async def claim_async(
        self, conn: AsyncConn, handler: Handler[Any], msg: Message, prep: Prepared,
        reentrant: uuid.UUID | None = None, token: uuid.UUID | None = None,
    ) -> Claim:
        """:meth:`claim` on an async connection (:meth:`Store.claim_async`, the same
        statements), in the caller's transaction: the same arguments and tracing."""
        args = self._claim_args(handler, msg, prep, reentrant) | {"token": token}
        with self.tracing.step(msg, "claim"):
            claim = await self.store.claim_async(conn, **args)
        return self._claimed(handler, msg, prep, claim)

    def _claim_args(
        self, handler: Handler[Any], msg: Message, prep: Prepared, reentrant: uuid.UUID | None
    ) -> dict[str, Any]:
        """What the claim is asked: the record's facts, the lease, the handler's retry
        policy, a re-entry's token."""
        policy = self.app.retry_policy(handler)
        return {"key": prep.key, "request_hash": prep.request_hash,
                "delivery": delivery(handler, msg), "lease_seconds": self.settings.lease_seconds,
                "max_attempts": policy.max_attempts, "max_elapsed_seconds": policy.max_elapsed,
                "reentrant_token": reentrant, "reconcile_first": handler.reconcile is not None,
                "shard": prep.shard}

    def _claimed(self, handler: Handler[Any], msg: Message, prep: Prepared,
                 claim: Claim) -> Claim:
        self.tracing.note(msg, handler=handler.name, key=prep.key, attempts=claim.attempts)
        return claim

    # --- the handler ------------------------------------------------------------------

    @contextmanager
    def handler_time(self, handler: Handler[Any]) -> Iterator[None]:
        """The one place the handler-time histogram is observed (every path's handler
        calls, bulk calls included, run inside it)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.metrics.handler_seconds.labels(handler.topic, handler.name).observe(
                time.perf_counter() - started
            )

    def execute(
        self, conn: Conn, handler: Handler[Any], msg: Message, prep: Prepared, claim: Claim,
        hold: Hold | None = None, pipelined: bool = False, gate: Gate | None = None,
    ) -> Result:
        """Run the handler and the fenced completion in one transaction (a savepoint
        in local mode); on an error, record the failure. ``pipelined`` (leased mode):
        see :meth:`_run_pipelined`. ``gate``: the handler slot the call holds (taken
        here, given back as the call returns; key-ordered handlers)."""
        assert claim.token is not None
        gate = gate if gate is not None else Gate()
        with gate:
            return self._execute(conn, handler, msg, prep, claim, hold, pipelined, gate)

    def _execute(
        self, conn: Conn, handler: Handler[Any], msg: Message, prep: Prepared, claim: Claim,
        hold: Hold | None, pipelined: bool, gate: Gate,
    ) -> Result:
        ctx = self.context(conn, handler, msg, prep, claim.attempts, hold=hold)
        run = self._run_pipelined if pipelined else self._run_in_transaction
        with self.handler_time(handler):
            try:
                how = run(conn, handler, msg, prep, claim, ctx, hold, gate)
            except (FrameworkError, StaleOwner):
                raise
            except Exception as exc:
                if hold is not None:
                    hold.release()  # the attempt is over; its failure is recorded next
                return self._failed(conn, handler, msg, prep, claim, exc)
        log.debug(how, extra={"action": how, "key": prep.key, "attempts": claim.attempts})
        return Finished(Ended.SUCCEEDED, key=prep.key)

    def _run_in_transaction(
        self, conn: Conn, handler: Handler[Any], msg: Message, prep: Prepared, claim: Claim,
        ctx: Context, hold: Hold | None, gate: Gate,
    ) -> str:
        """The handler and the completion in a transaction of their own (a savepoint of
        the caller's, local mode), rolled back alone on failure; ``commit()`` inside
        raises, and ``psycopg.Rollback`` is the handler's error (not swallowed)."""
        with HandlerBlock(conn):
            try:
                result, how = self.handler_step(handler, msg, prep, claim, ctx)
            finally:
                gate.leave()
            self._complete_step(conn, msg, prep, claim, ctx, result, hold)
        return how

    def _run_pipelined(
        self, conn: Conn, handler: Handler[Any], msg: Message, prep: Prepared, claim: Claim,
        ctx: Context, hold: Hold | None, gate: Gate,
    ) -> str:
        """Leased mode, in one round trip: ``BEGIN``, the handler's statements, its
        events, the fenced completion and ``COMMIT`` share the pipeline's one sync, on
        leaving it (a handler that reads a result syncs there too). ``BEGIN`` and
        ``COMMIT`` are only queued, to travel with the statements after them
        (:class:`~kafka_idem.store.attempt.AttemptTransaction`, on the autocommit
        connection); inside, ``ctx.tx.commit()`` raises. A stale completion fails on
        the server (KI002), so the ``COMMIT`` after it cannot commit the handler's
        writes: it leaves here as :class:`StaleOwner`. Any other error of the
        transaction is the attempt's (:func:`attempt_error`). Any error rolls the
        attempt back."""
        conn.autocommit = True
        completing = False
        try:
            with conn.pipeline(), AttemptTransaction(conn):  # BEGIN, queued
                try:
                    result, how = self.handler_step(handler, msg, prep, claim, ctx)
                finally:
                    gate.leave()  # the call's slot: what follows is ours, not the handler's
                completing = True  # errors from here on may be any statement's
                self._complete_step(conn, msg, prep, claim, ctx, result, hold, wait=False)
            # COMMIT was queued as the block ended, and sent with the pipeline's one sync
        except BaseException as exc:
            with contextlib.suppress(psycopg.Error):
                conn.rollback()  # an aborted or open transaction (no-op when none is)
            raise_failed_attempt(exc, completing=completing, key=prep.key)
        finally:
            if not conn.closed:
                conn.autocommit = False
        return how

    def handler_step(
        self, handler: Handler[Any], msg: Message, prep: Prepared, claim: Claim, ctx: Context,
    ) -> tuple[Any, str]:
        """The handler (or its reconciler, when the claim asks it first) called on
        ``ctx``, traced: ``(result, "succeeded" or "reconciled")``."""
        self.tracing.note(msg, handler=handler.name, key=prep.key, attempts=claim.attempts)
        with self.tracing.step(msg, "handler"):
            return self._call(handler, prep, ctx, claim)

    def _complete_step(
        self, conn: Conn, msg: Message, prep: Prepared, claim: Claim, ctx: Context,
        result: Any, hold: Hold | None, wait: bool = True,
    ) -> None:
        assert claim.token is not None
        with own_code(prep.key):
            with self.tracing.step(msg, "complete"):
                self.emitter.flush(conn, ctx, wake=self.wake)  # its events, in this tx
                if self.store.distributed:
                    self.store.refuse_local_writes(conn, ctx.handler)
                self.store.complete(conn, key=prep.key, token=claim.token, result=result,
                                    wait=wait, shard=prep.shard)
            if hold is not None:
                hold.release()  # before the commit (see LeaseKeeper.hold)

    def _failed(
        self, conn: Conn, handler: Handler[Any], msg: Message, prep: Prepared, claim: Claim,
        exc: Exception,
    ) -> Result:
        self.db.raise_if_gone(exc)
        if classify_db_error(exc) is TransientStoreError:
            # Deadlocks and serialization failures come from contention between
            # transactions (batches), not from the message: retried, not charged.
            raise TransientStoreError(str(exc), key=prep.key) from exc
        with conn.transaction():  # a savepoint in local mode, its own commit in leased
            verdict = self.record_failure(conn, handler, msg, prep, claim, exc)
        verdict.note.write(log)
        return verdict.result

    def _call(
        self, handler: Handler[Any], prep: Prepared, ctx: Context, claim: Claim
    ) -> tuple[Any, str]:
        """The reconciler or the handler, then its ORM session flushed (``ctx.session``:
        a flush error is the handler's, judged as its psycopg cause)."""
        try:
            called = self._reconcile_or_handle(handler, prep, ctx, claim)
            ctx.settle_session()
        except BaseException as exc:
            ctx.discard_session()
            cause = orm_cause(exc)
            if cause is None:
                raise
            raise cause from exc
        return called

    def _reconcile_or_handle(
        self, handler: Handler[Any], prep: Prepared, ctx: Context, claim: Claim
    ) -> tuple[Any, str]:
        if handler.reconcile is not None and reconcile_first(claim, reconciler=True):
            done = handler.reconcile(prep.model, ctx)
            if isinstance(done, Done):
                log.info("reconciled", extra={"action": "reconciled", "key": prep.key})
                return done.result, "reconciled"
        spent = last_chance_spent(claim, prep.key)
        if spent is not None:
            raise spent
        return handler(prep.model, ctx), "succeeded"

    def record_failure(
        self, conn: Conn, handler: Handler[Any], msg: Message, prep: Prepared, claim: Claim,
        exc: BaseException,
    ) -> Verdict:
        """Record ``exc`` as the attempt's failure (retry later, or failed and
        dead-lettered), in the caller's transaction."""
        failure = self._failure(handler, claim, exc)
        recorded = self.store.fail(conn, **failure.fail_args(prep.key, claim.token),
                                       shard=prep.shard)
        return self._recorded(handler, msg, prep, claim, failure, recorded)

    async def record_failure_async(
        self, conn: AsyncConn, handler: Handler[Any], msg: Message, prep: Prepared,
        claim: Claim, exc: BaseException,
    ) -> Verdict:
        """:meth:`record_failure` on an async connection (:meth:`Store.fail_async`, the
        same statement), in the caller's transaction: the same decision and metrics."""
        failure = self._failure(handler, claim, exc)
        recorded = await self.store.fail_async(conn, **failure.fail_args(prep.key, claim.token),
                                       shard=prep.shard)
        return self._recorded(handler, msg, prep, claim, failure, recorded)

    def _failure(self, handler: Handler[Any], claim: Claim, exc: BaseException) -> Recording:
        return recording(handler, claim, exc, policy=self.app.retry_policy(handler),
                         message_max=self.settings.error_message_max)

    def _recorded(
        self, handler: Handler[Any], msg: Message, prep: Prepared, claim: Claim,
        failure: Recording, recorded: Failure,
    ) -> Verdict:
        """Counted, and what becomes of the message, once its failure is recorded."""
        f = failure.failing
        if f.exhausted:
            self.metrics.exhausted.labels(msg.topic(), handler.name).inc()
        elif f.status == "retryable_failed":
            self.metrics.retries.labels(msg.topic(), handler.name).inc()
        return after_failure(f, recorded, letters=self.letters(handler), msg=msg, key=prep.key,
                             claim=claim, error_class=failure.error_class,
                             message=failure.message)
