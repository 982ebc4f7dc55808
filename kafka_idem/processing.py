"""Runs messages through the protocol and says, per message, what became of it.

Two modes:

* **local**: for handlers whose effects live only in this database. A whole
  batch runs in *one* transaction; each message in its own SAVEPOINT (claim,
  handler, completion), so one failing message rolls back alone. One commit,
  one WAL flush, for the batch. A crash rolls everything back: nothing partial.
* **leased**: for handlers with effects elsewhere. Step 1, a short claim
  transaction commits ``processing`` with an owner token and a lease (kept
  alive by a heartbeat). Step 2, the handler's writes and the fenced
  completion commit together, or roll back together when the token lost.

The result is :class:`Finished` (the offset may advance, after the DLQ record
if any is acknowledged) or :class:`Deferred` (the partition waits; retry later).
Kafka is not touched here: the runner owns the consumer.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg

from kafka_idem.app import App, Context, Done, Handler
from kafka_idem.codec import AvroCodec
from kafka_idem.dlq import DeadLetter, bounded
from kafka_idem.errors import (
    DataRejected,
    FrameworkError,
    InvalidPayload,
    MessageError,
    RetryLimitReached,
    StaleOwner,
    StoreUnavailable,
    TransientStoreError,
    Undecodable,
)
from kafka_idem.keys import check_key, hash_payload
from kafka_idem.lease import Hold, LeaseKeeper
from kafka_idem.metrics import Metrics
from kafka_idem.retry import Exhausted
from kafka_idem.store import (
    Claim,
    Conn,
    Delivery,
    Outcome,
    Store,
    classify_db_error,
    connect,
    describe,
    is_data_error,
    rejected,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Finished:
    outcome: str  # succeeded | replayed | conflict | dead_lettered
    letter: DeadLetter | None = None
    key: str | None = None


@dataclass(frozen=True, slots=True)
class Deferred:
    delay: float
    reason: str  # busy | retry | framework | dlq
    token: uuid.UUID | None = None  # our still-live claim, re-entered on the next try


Result = Finished | Deferred


@dataclass(frozen=True, slots=True)
class Prepared:
    model: Any
    key: str
    request_hash: str


# Set while the batch path decides: its decisions are logged once, after its commit,
# never for an attempt that falls back (the per-message path then logs its own).
QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("kafka_idem_quiet", default=False)


def _say(level: int, text: str, extra: dict[str, Any], *args: Any) -> None:
    if not QUIET.get():
        log.log(level, text, *args, extra=extra)


def _fields(msg: Any) -> dict[str, Any]:
    return {"topic": msg.topic(), "partition": msg.partition(), "offset": msg.offset()}


def make_context(
    conn: Conn, handler: Handler[Any], msg: Any, prep: Prepared, claim: Claim
) -> Context:
    """What the handler gets for ``msg``: the open transaction and the message's facts."""
    ts_type, ts = msg.timestamp()
    return Context(
        tx=conn,
        idempotency_key=prep.key,
        request_hash=prep.request_hash,
        attempt=claim.attempts,
        handler=handler.name,
        topic=msg.topic(),
        partition=msg.partition(),
        offset=msg.offset(),
        timestamp=ts if ts_type else None,
        kafka_key=msg.key(),
        headers={k: v or b"" for k, v in (msg.headers() or [])},
    )


def _text_of(exc: BaseException) -> str:
    """``str(exc)``, which is the handler's code and may itself fail."""
    try:
        return str(exc)
    except Exception as err:
        return f"(the exception's text could not be made: {type(err).__name__})"


class Processor:
    def __init__(
        self,
        app: App,
        *,
        store: Store,
        codec: AvroCodec,
        metrics: Metrics,
        leases: LeaseKeeper | None = None,
    ) -> None:
        self.app = app
        self.settings = app.settings
        # the app's keys live in its namespace (a store built without one gets it here)
        self.store = store if store.namespace is not None else store.scoped(app.namespace)
        self.codec = codec
        self.metrics = metrics
        self.leases = leases
        self.group_id = app.group_id
        self._conn: Conn | None = None

    # --- connection --------------------------------------------------------

    def connection(self) -> Conn:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self.close()
            self._conn = connect(
                self.settings.dsn,
                application_name=f"kafka_idem:{self.app.name}",
                idle_in_transaction_timeout=self.settings.idle_in_transaction_timeout_seconds,
            )
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None

    @contextmanager
    def _store_unavailable(self) -> Iterator[None]:
        """psycopg errors that mean the connection is gone become StoreUnavailable."""
        try:
            yield
        except psycopg.Error as exc:
            cls = classify_db_error(exc)
            conn = self._conn
            if cls is StoreUnavailable or (conn is not None and (conn.closed or conn.broken)):
                self.close()
                raise StoreUnavailable(str(exc)) from exc
            raise

    # --- decoding ----------------------------------------------------------

    def prepare(self, handler: Handler[Any], msg: Any) -> Prepared:
        """Decode, validate, build key and hash; raise a MessageError when impossible."""
        model = handler.decode(msg.value())  # the handler's codec: bytes -> validated payload
        key = check_key(handler.key.build(model), self.settings.key_max_bytes,
                        escaped=handler.key.escapes)
        try:
            digest = hash_payload(model, handler.hash_fields)
        except (ValueError, TypeError, ArithmeticError) as exc:  # NaN, infinity, naive datetime
            raise InvalidPayload(f"the request hash cannot be computed: {exc}") from exc
        return Prepared(model, key, digest)

    def _letter(
        self,
        handler: Handler[Any],
        msg: Any,
        *,
        kind: str,
        exc_class: str,
        message: str,
        attempts: int,
        key: str | None,
        first: Any = None,
        last: Any = None,
    ) -> DeadLetter:
        return DeadLetter(
            dlq_topic=self.app.dlq_topic(handler),
            source=msg,
            kind=kind,
            error_class=exc_class,
            error_message=bounded(message, self.settings.error_message_max),
            attempts=attempts,
            consumer_group=self.group_id,
            handler=handler.name,
            idempotency_key=key,
            namespace=self.store.namespace,
            first_failure_at=first,
            last_failure_at=last,
        )

    def _undecodable(
        self, handler: Handler[Any], msg: Any, exc: MessageError, key: str | None = None
    ) -> Finished:
        """A message that can never be processed (bad bytes, payload or key; data the
        database refused before any record held it): dead-lettered, no record."""
        kind = "undecodable" if isinstance(exc, Undecodable) else "permanent"
        _say(logging.WARNING, "message cannot be processed: %s",
             {"action": "rejected", "kind": kind, "handler": handler.name, "key": key,
              **_fields(msg)}, exc)
        letter = self._letter(
            handler, msg, kind=kind, exc_class=type(exc).__name__, message=str(exc),
            attempts=0, key=key,
        )
        return Finished("dead_lettered", letter, key=key)

    def log_finished(self, handler: Handler[Any], msg: Any, result: Result) -> None:
        """The log line of a decision the batch path made (after its commit)."""
        if not isinstance(result, Finished):
            return
        extra = {"key": result.key, "handler": handler.name, **_fields(msg)}
        if result.outcome == "replayed":
            log.debug("replayed stored result", extra={"action": "replayed", **extra})
        elif result.outcome == "conflict":
            log.warning("payload conflict", extra={"action": "conflict", **extra})
        elif result.letter is not None:
            log.warning("dead-lettering", extra={"action": "dead_lettered",
                                                 "kind": result.letter.kind, **extra})

    # --- local mode: one transaction per batch -----------------------------

    def run_local(self, parts: Sequence[tuple[Any, Sequence[Any]]]) -> dict[Any, list[Result]]:
        """The batch path when it applies, else (or on fallback) the per-message path."""
        handlers = {self.app.handlers[tp[0]] for tp, _ in parts}
        if self.settings.batch_path and all(h.batch for h in handlers):
            from kafka_idem.batch import Fallback, run_batch

            try:
                return run_batch(self, parts)
            except Fallback as exc:
                log.debug("batch falls back: %s", exc, extra={"action": "batch_fallback"})
            except (FrameworkError, MessageError, psycopg.Error) as exc:
                # A message's data refused by the database (DataRejected) falls back too:
                # the per-message path isolates the one message it belongs to.
                if isinstance(exc, StoreUnavailable) or classify_db_error(exc) is StoreUnavailable:
                    return self._all_deferred(parts, exc)
                log.debug("batch falls back: %s", exc, extra={"action": "batch_fallback"})
            except Exception:
                # A defect of the optimisation must not take the member down: the
                # per-message path is the reference and decides the batch.
                log.exception("batch path failed; falling back", extra={"action": "batch_fallback"})
        return self.run_local_safe(parts)

    def _all_deferred(
        self, parts: Sequence[tuple[Any, Sequence[Any]]], exc: BaseException
    ) -> dict[Any, list[Result]]:
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
        return {tp: [Deferred(0.0, "framework")] for tp, _ in parts}

    def run_local_safe(
        self, parts: Sequence[tuple[Any, Sequence[Any]]]
    ) -> dict[Any, list[Result]]:
        """Process each partition's messages in order inside one transaction.

        A partition stops at its first deferred message. If the transaction
        itself fails (connection lost, commit refused), every message is
        deferred: nothing was committed, nothing is charged. If the commit was
        refused for a message's data (a deferred constraint of a business table),
        the batch runs again one message per transaction, so only that message is
        dead-lettered.
        """
        results: dict[Any, list[Result]] = {tp: [] for tp, _ in parts}
        try:
            with self._store_unavailable():
                conn = self.connection()
                with conn.transaction():
                    for tp, msgs in parts:
                        for msg in msgs:
                            result = self._local_one(conn, msg)
                            results[tp].append(result)
                            if isinstance(result, Deferred):
                                break
        except (FrameworkError, psycopg.Error) as exc:
            if is_data_error(exc):  # the commit was refused for a message's data
                if sum(len(msgs) for _, msgs in parts) > 1:
                    return self._one_by_one(parts)
                tp, msgs = next((tp, msgs) for tp, msgs in parts if msgs)
                handler = self.app.handlers[msgs[0].topic()]
                return {tp: [self._undecodable(handler, msgs[0], rejected(exc),
                                               key=self._key_of(handler, msgs[0]))]}
            return self._all_deferred(parts, exc)
        return results

    def _key_of(self, handler: Handler[Any], msg: Any) -> str | None:
        try:
            return self.prepare(handler, msg).key
        except (MessageError, FrameworkError):
            return None

    def _one_by_one(self, parts: Sequence[tuple[Any, Sequence[Any]]]) -> dict[Any, list[Result]]:
        """Each message in a transaction of its own (after a commit refused for data):
        the message whose commit is refused is dead-lettered alone."""
        log.warning("a commit was refused for a message's data; isolating the message",
                    extra={"action": "isolating"})
        results: dict[Any, list[Result]] = {tp: [] for tp, _ in parts}
        for tp, msgs in parts:
            for msg in msgs:
                got = self.run_local_safe([(tp, [msg])])[tp]
                results[tp].extend(got)
                if not got or isinstance(got[-1], Deferred):
                    break
        return results

    def _local_one(self, conn: Conn, msg: Any) -> Result:
        handler = self.app.handlers[msg.topic()]
        try:
            prep = self.prepare(handler, msg)
        except MessageError as exc:
            return self._undecodable(handler, msg, exc)
        try:
            with conn.transaction():  # SAVEPOINT: this message rolls back alone
                claim = self._claim(conn, handler, msg, prep)
                if claim.outcome is not Outcome.CLAIMED:
                    return self._not_claimed(handler, msg, prep, claim)
                return self._execute(conn, handler, msg, prep, claim)
        except MessageError as exc:  # the claim refused the message's data: no record
            return self._undecodable(handler, msg, exc, key=prep.key)
        except (TransientStoreError, StaleOwner) as exc:
            self._raise_if_gone(exc)
            log.info("transient store error (%s); will retry", describe(exc),
                     extra={"action": "deferred", "key": prep.key, **_fields(msg)})
            return Deferred(self.settings.busy_retry_seconds, "framework")

    # --- leased mode: claim, then fenced completion -------------------------

    def run_leased(self, msg: Any, *, reentrant: uuid.UUID | None = None) -> Result:
        handler = self.app.handlers[msg.topic()]
        try:
            prep = self.prepare(handler, msg)
        except MessageError as exc:
            return self._undecodable(handler, msg, exc)
        except FrameworkError as exc:  # e.g. the schema registry is down: not the message's fault
            self.metrics.framework_errors.labels(type(exc).__name__).inc()
            log.warning("cannot decode now (%s); will retry", describe(exc),
                        extra={"action": "deferred", **_fields(msg)})
            return Deferred(self.settings.busy_retry_seconds, "framework", token=reentrant)
        claim: Claim | None = None
        try:
            with self._store_unavailable():
                conn = self.connection()
                if reentrant is None:
                    claim = self._claim_new(conn, handler, msg, prep)
                if claim is None:
                    with conn.transaction():
                        claim = self._claim(conn, handler, msg, prep, reentrant=reentrant)
                if claim.outcome is not Outcome.CLAIMED:
                    return self._not_claimed(handler, msg, prep, claim)
                assert claim.token is not None
                if self.leases is None:
                    return self._execute(conn, handler, msg, prep, claim, pipelined=True)
                with self.leases.hold(claim.key, claim.token) as hold:
                    return self._execute(
                        conn, handler, msg, prep, claim, hold=hold, pipelined=True
                    )
        except MessageError as exc:  # the claim refused the message's data: no record
            return self._undecodable(handler, msg, exc, key=prep.key)
        except StaleOwner:
            return Deferred(self.settings.busy_retry_seconds, "busy")
        except (FrameworkError, psycopg.Error) as exc:
            # Our surroundings failed (database down, a store error): never charged.
            self.metrics.framework_errors.labels(type(exc).__name__).inc()
            log.warning(
                "store error (%s); will retry", describe(exc),
                extra={"action": "deferred", "key": prep.key, **_fields(msg)},
            )
            token = claim.token if claim is not None else reentrant
            return Deferred(self.settings.busy_retry_seconds, "framework", token=token)

    # --- shared steps --------------------------------------------------------

    def _claim_new(
        self, conn: Conn, handler: Handler[Any], msg: Any, prep: Prepared
    ) -> Claim | None:
        """A new key claimed and committed in one round trip (autocommit), or ``None``."""
        conn.autocommit = True
        try:
            return self.store.claim_new(
                conn,
                key=prep.key,
                request_hash=prep.request_hash,
                delivery=Delivery(msg.topic(), msg.partition(), msg.offset(), handler.name),
                lease_seconds=self.settings.lease_seconds,
            )
        finally:
            if not conn.closed:
                conn.autocommit = False

    def _claim(
        self,
        conn: Conn,
        handler: Handler[Any],
        msg: Any,
        prep: Prepared,
        reentrant: uuid.UUID | None = None,
    ) -> Claim:
        policy = self.app.retry_policy(handler)
        return self.store.claim(
            conn,
            key=prep.key,
            request_hash=prep.request_hash,
            delivery=Delivery(msg.topic(), msg.partition(), msg.offset(), handler.name),
            lease_seconds=self.settings.lease_seconds,
            max_attempts=policy.max_attempts,
            max_elapsed_seconds=policy.max_elapsed,
            reentrant_token=reentrant,
            reconcile_first=handler.reconcile is not None,
        )

    def _not_claimed(
        self, handler: Handler[Any], msg: Any, prep: Prepared, claim: Claim
    ) -> Result:
        extra = {"key": prep.key, "handler": handler.name, **_fields(msg)}
        if claim.outcome is Outcome.REPLAY:
            _say(logging.DEBUG, "replayed stored result", {"action": "replayed", **extra})
            return Finished("replayed", key=prep.key)
        if claim.outcome is Outcome.BUSY:
            wait = claim.retry_in if claim.backoff else min(
                claim.retry_in, self.settings.busy_retry_seconds
            )
            log.debug("key busy", extra={"action": "busy", "delay": wait, **extra})
            return Deferred(max(wait, 0.0), "busy")
        if claim.outcome is Outcome.CONFLICT:
            _say(logging.WARNING, "payload conflict", {"action": "conflict", **extra})
            letter = self._letter(
                handler, msg, kind="payload_conflict", exc_class="PayloadConflict",
                message=f"key {prep.key!r} was first used with a different payload "
                f"(request hash {prep.request_hash} differs from the stored one)",
                attempts=claim.attempts, key=prep.key,
            )
            return Finished("conflict", letter, key=prep.key)
        # DEAD (already failed) or EXHAUSTED (just moved to failed by the claim)
        kind = claim.error_kind or "permanent"
        if claim.outcome is Outcome.EXHAUSTED:
            self.metrics.exhausted.labels(msg.topic(), handler.name).inc()
        _say(logging.WARNING, "dead-lettering", {"action": "dead_lettered", "kind": kind, **extra})
        letter = self._letter(
            handler, msg, kind=kind, exc_class=claim.error_class or "Failed",
            message=claim.error_message or kind, attempts=claim.attempts, key=prep.key,
            first=claim.first_failure_at, last=claim.last_failure_at,
        )
        return Finished("dead_lettered", letter, key=prep.key)

    def _execute(
        self,
        conn: Conn,
        handler: Handler[Any],
        msg: Any,
        prep: Prepared,
        claim: Claim,
        hold: Hold | None = None,
        pipelined: bool = False,
    ) -> Result:
        """Run the handler and the fenced completion in one transaction (a savepoint
        in local mode). ``pipelined`` (leased mode) sends BEGIN, the handler's
        statements and the completion together: one sync after the handler, so its
        own errors are still told apart from the completion's."""
        assert claim.token is not None
        ctx = make_context(conn, handler, msg, prep, claim)
        if hold is not None:
            ctx._lease_lost = hold.lost
        started = time.perf_counter()
        try:
            with contextlib.ExitStack() as stack:
                pipe = stack.enter_context(conn.pipeline()) if pipelined else None
                stack.enter_context(conn.transaction())  # rolled back alone on failure
                result, how = self._call(handler, prep, ctx, claim)
                if pipe is not None:
                    pipe.sync()  # the handler's statements answer here
                self.store.complete(conn, key=prep.key, token=claim.token, result=result)
                if hold is not None:
                    hold.release()  # before the commit (see LeaseKeeper.hold)
        except (FrameworkError, StaleOwner):
            raise
        except Exception as exc:
            if hold is not None:
                hold.release()  # the attempt is over; its failure is recorded next
            self._raise_if_gone(exc)
            if classify_db_error(exc) is TransientStoreError:
                # Deadlocks and serialization failures come from contention between
                # transactions (batches), not from the message: retried, not charged.
                raise TransientStoreError(str(exc), key=prep.key) from exc
            with conn.transaction():  # a savepoint in local mode, its own commit in leased
                return self._record_failure(conn, handler, msg, prep, claim, exc)
        finally:
            self.metrics.handler_seconds.labels(msg.topic(), handler.name).observe(
                time.perf_counter() - started
            )
        log.debug(how, extra={"action": how, "key": prep.key, "attempts": claim.attempts})
        return Finished("succeeded", key=prep.key)

    def _call(
        self, handler: Handler[Any], prep: Prepared, ctx: Context, claim: Claim
    ) -> tuple[Any, str]:
        if handler.reconcile is not None and claim.previous_error_kind in (
            "unknown_outcome",
            "lease_expired",
        ):
            done = handler.reconcile(prep.model, ctx)
            if isinstance(done, Done):
                log.info("reconciled", extra={"action": "reconciled", "key": prep.key})
                return done.result, "reconciled"
        if claim.last_chance:
            raise RetryLimitReached(
                f"{claim.attempts} attempts used; the last one's outcome was unknown and "
                "reconcile found no effect",
                key=prep.key,
            )
        return handler(prep.model, ctx), "succeeded"

    def _raise_if_gone(self, exc: BaseException) -> None:
        conn = self._conn
        if classify_db_error(exc) is StoreUnavailable or (
            conn is not None and (conn.closed or conn.broken)
        ):
            self.close()
            raise StoreUnavailable(str(exc)) from exc

    def _record_failure(
        self,
        conn: Conn,
        handler: Handler[Any],
        msg: Any,
        prep: Prepared,
        claim: Claim,
        exc: BaseException,
    ) -> Result:
        assert claim.token is not None
        kind = handler.classify(exc)
        error_class = type(exc).__name__
        text = _text_of(exc) or error_class
        if is_data_error(exc) and not isinstance(exc, MessageError):
            # The database refused a value of the message (in the handler's own SQL): say
            # so by SQLSTATE, without psycopg's DETAIL/CONTEXT, which quote the values.
            error_class = DataRejected.__name__
            text = rejected(exc).message
        message = bounded(text, self.settings.error_message_max)
        extra = {"key": prep.key, "handler": handler.name, "attempts": claim.attempts,
                 **_fields(msg)}
        topic = msg.topic()
        fail = self.store.fail
        if kind == "permanent":
            f = fail(conn, key=prep.key, token=claim.token, status="failed", kind="permanent",
                     error_class=error_class, error_message=message)
            _say(logging.WARNING, "permanent failure", {"action": "failed", "kind": kind, **extra})
            return Finished("dead_lettered", self._letter(
                handler, msg, kind="permanent", exc_class=error_class, message=message,
                attempts=f.attempts, key=prep.key, first=f.first_failure_at,
                last=f.last_failure_at,
            ), key=prep.key)
        policy = self.app.retry_policy(handler)
        decision = (
            Exhausted("retry limit reached")
            if isinstance(exc, RetryLimitReached)
            else policy.decide(attempts=claim.budget_used, elapsed=claim.failing_for)
        )
        if isinstance(decision, Exhausted) and kind == "unknown_outcome" and handler.reconcile:
            # The effect may have happened: one more claim, which only reconciles
            # (Claim.last_chance), decides between succeeded and exhausted.
            decision = policy.delay(claim.budget_used)
        if isinstance(decision, Exhausted):
            text = bounded(f"{decision.reason}; last error: {message}",
                           self.settings.error_message_max)
            f = fail(conn, key=prep.key, token=claim.token, status="failed", kind="exhausted",
                     error_class=error_class, error_message=text)
            self.metrics.exhausted.labels(topic, handler.name).inc()
            log.warning("retries exhausted", extra={"action": "exhausted", **extra})
            return Finished("dead_lettered", self._letter(
                handler, msg, kind="exhausted", exc_class=error_class, message=text,
                attempts=f.attempts, key=prep.key, first=f.first_failure_at,
                last=f.last_failure_at,
            ), key=prep.key)
        fail(conn, key=prep.key, token=claim.token, status="retryable_failed", kind=kind,
             error_class=error_class, error_message=message, delay=decision.delay)
        self.metrics.retries.labels(topic, handler.name).inc()
        log.info("will retry (%s: %s)", error_class, message,
                 extra={"action": "retry_scheduled", "kind": kind,
                        "delay": round(decision.delay, 3), **extra})
        return Deferred(decision.delay, "retry")
