"""Decisions with no I/O: what a claim that was not ours, an undecodable message or a
handler's exception means for the message.

Nothing here touches the database, Kafka, metrics or logs, so every rule is testable
with a fake claim and a stub message (``tests/unit/test_verdicts.py``). A decision
returns the :class:`Result` and the :class:`Note` it wants logged; the caller logs it
when the decision stands (the per-message path at once; the batch path never logs a
decision of an attempt that may still fall back).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from kafka_idem.codecs.base import validation_reasons
from kafka_idem.consume.outcome import Deferred, Ended, Finished, Message, Prepared, Reason, Result
from kafka_idem.deadletters.dead_letter import DeadLetter, bounded
from kafka_idem.errors import DataRejected, MessageError, RetryLimitReached, Undecodable
from kafka_idem.handler import ErrorKind
from kafka_idem.observe.redact import redact
from kafka_idem.retry import Exhausted, RetryPolicy
from kafka_idem.store import Claim, Failure, Outcome, is_data_error, rejected


@dataclass(frozen=True, slots=True)
class Note:
    """A log line a decision asks for (``action`` is the stable field log readers use)."""

    level: int
    text: str
    action: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    args: tuple[Any, ...] = ()

    def write(self, log: logging.Logger) -> None:
        log.log(self.level, self.text, *self.args, extra={"action": self.action, **self.fields})


def letter_note(letter: DeadLetter, action: str, fields: Mapping[str, Any]) -> Note:
    """The one log line of a dead letter, on every path and for every kind:
    ``dead-lettering (KIND): CLASS: MESSAGE``, the error as the letter's
    ``idem.error.*`` headers carry it (bounded to ``error_message_max``; never the
    payload). ``kind``, ``error_class`` and ``error_message`` are also fields, next to
    where the message came from; ``action`` keeps telling the decisions apart:
    rejected, failed, exhausted, dead_lettered, conflict."""
    error = {"kind": letter.kind, "error_class": letter.error_class,
             "error_message": letter.error_message}
    return Note(logging.WARNING, "dead-lettering (%s): %s: %s", action, {**fields, **error},
                (letter.kind, letter.error_class, letter.error_message))


@dataclass(frozen=True, slots=True)
class Verdict:
    result: Result
    note: Note


def where(msg: Message) -> dict[str, Any]:
    """The log fields that say where a message came from."""
    return {"topic": msg.topic(), "partition": msg.partition(), "offset": msg.offset()}


@dataclass(frozen=True, slots=True)
class Letters:
    """How one handler's dead letters are addressed and bounded."""

    dlq_topic: str
    group: str
    handler: str
    namespace: str | None
    message_max: int  # bytes of error text a letter carries

    def letter(
        self, msg: Message, *, kind: str, error_class: str, message: str, attempts: int,
        key: str | None, failure: Failure | Claim | None = None,
    ) -> DeadLetter:
        """``failure`` (what the store recorded, or a claim that found a failed record)
        gives the failure times; without one the letter says "now"."""
        return DeadLetter(
            dlq_topic=self.dlq_topic,
            source=msg,
            kind=kind,
            error_class=error_class,
            error_message=bounded(message, self.message_max),
            attempts=attempts,
            consumer_group=self.group,
            handler=self.handler,
            idempotency_key=key,
            namespace=self.namespace,
            first_failure_at=failure.first_failure_at if failure is not None else None,
            last_failure_at=failure.last_failure_at if failure is not None else None,
        )


def undecodable(
    letters: Letters, msg: Message, exc: MessageError, key: str | None = None
) -> Verdict:
    """A message that can never be processed (bad bytes, payload or key; data the
    database refused before any record held it): dead-lettered, no record."""
    kind = "undecodable" if isinstance(exc, Undecodable) else "permanent"
    letter = letters.letter(msg, kind=kind, error_class=type(exc).__name__, message=str(exc),
                            attempts=0, key=key)
    note = letter_note(letter, "rejected", {"handler": letters.handler, "key": key, **where(msg)})
    return Verdict(Finished(Ended.DEAD_LETTERED, letter, key=key), note)


def busy_wait(claim: Claim, busy_retry_seconds: float) -> float:
    """How long to wait before trying a busy key again.

    Another owner's lease may end early (its commit), so its wait is capped and the
    key asked again; a backoff is a decision already recorded, so its wait is kept
    whole (asking earlier would only find it busy again)."""
    return claim.retry_in if claim.backoff else min(claim.retry_in, busy_retry_seconds)


def not_claimed(
    claim: Claim, *, letters: Letters, msg: Message, prep: Prepared, busy_retry_seconds: float
) -> Verdict:
    """The result of a claim that did not give us the key."""
    fields = {"key": prep.key, "handler": letters.handler, **where(msg)}
    if claim.outcome is Outcome.REPLAY:
        return Verdict(Finished(Ended.REPLAYED, key=prep.key),
                       Note(logging.DEBUG, "replayed stored result", "replayed", fields))
    if claim.outcome is Outcome.BUSY:
        wait = busy_wait(claim, busy_retry_seconds)
        return Verdict(Deferred(max(wait, 0.0), Reason.BUSY),
                       Note(logging.DEBUG, "key busy", "busy", {"delay": wait, **fields}))
    if claim.outcome is Outcome.CONFLICT:
        letter = letters.letter(
            msg, kind="payload_conflict", error_class="PayloadConflict",
            message=f"key {prep.key!r} was first used with a different payload "
            f"(request hash {prep.request_hash} differs from the stored one)",
            attempts=claim.attempts, key=prep.key,
        )
        return Verdict(Finished(Ended.CONFLICT, letter, key=prep.key),
                       letter_note(letter, "conflict", fields))
    if claim.outcome is Outcome.CLAIMED:
        raise ValueError(f"claim of {prep.key!r} was claimed: run it, there is no verdict")
    # DEAD (already failed) or EXHAUSTED (just moved to failed by the claim)
    kind = claim.error_kind or "permanent"
    letter = letters.letter(
        msg, kind=kind, error_class=claim.error_class or "Failed",
        message=claim.error_message or kind, attempts=claim.attempts, key=prep.key,
        failure=claim,
    )
    action = "exhausted" if claim.outcome is Outcome.EXHAUSTED else "dead_lettered"
    return Verdict(Finished(Ended.DEAD_LETTERED, letter, key=prep.key),
                   letter_note(letter, action, fields))


# --- a handler's exception ---------------------------------------------------------


def text_of(exc: BaseException) -> str:
    """``str(exc)``, which is the handler's code and may itself fail."""
    try:
        return str(exc)
    except Exception as err:
        return f"(the exception's text could not be made: {type(err).__name__})"


def error_of(exc: BaseException, message_max: int) -> tuple[str, str]:
    """The error class and bounded message recorded for ``exc`` (in the record, the dead
    letter's headers and the log), its secrets masked (``password=...``, a URL's
    password: :func:`~kafka_idem.observe.redact.redact`)."""
    error_class = type(exc).__name__
    if isinstance(exc, ValidationError):
        # pydantic's text quotes the input values (a payload's, a secret's): a
        # validation error a handler lets escape is recorded by field paths only
        text = f"{exc.error_count()} validation error(s) for {exc.title}: " \
            f"{validation_reasons(exc)}"
        return error_class, bounded(text, message_max)
    text = text_of(exc) or error_class
    if is_data_error(exc) and not isinstance(exc, MessageError):
        # The database refused a value of the message (in the handler's own SQL): say
        # so by SQLSTATE, without psycopg's DETAIL/CONTEXT, which quote the values.
        error_class = DataRejected.__name__
        text = rejected(exc).message
    return error_class, bounded(redact(text), message_max)


@dataclass(frozen=True, slots=True)
class Failing:
    """What to record for a failed attempt."""

    status: Literal["failed", "retryable_failed"]
    kind: str  # permanent | exhausted | retryable | unknown_outcome
    delay: float = 0.0  # until the retry is due (retryable_failed only)
    reason: str | None = None  # why the key is exhausted, or was not retried
    defect: bool = False  # permanent as a code defect (handler.CODE_DEFECTS)

    @property
    def exhausted(self) -> bool:
        return self.kind == "exhausted"

    def stored_message(self, message: str, message_max: int) -> str:
        """The error message to store: an exhausted key says why, then its last error;
        a code defect says it was not retried, then the error."""
        if self.reason is None:
            return message
        joint = "; last error: " if self.exhausted else ": "
        return bounded(f"{self.reason}{joint}{message}", message_max)


CODE_DEFECT = "a code defect, not retried"
"""How a code defect's stored error message (and its dead letter's
``idem.error.message``) begins."""


def failing(
    kind: ErrorKind, *, claim: Claim, policy: RetryPolicy, limit_reached: bool = False,
    reconciler: bool = False, defect: bool = False,
) -> Failing:
    """``kind`` is the handler's classification of the exception; ``limit_reached``
    says the attempt was the reconcile-only last chance (``Claim.last_chance``);
    ``defect`` that ``kind`` is permanent because the exception is a code defect
    (:meth:`~kafka_idem.handler.Handler.code_defect`)."""
    if kind == "permanent":
        if defect:
            return Failing("failed", "permanent", reason=CODE_DEFECT, defect=True)
        return Failing("failed", "permanent")
    decision = (
        Exhausted("retry limit reached")
        if limit_reached
        else policy.decide(attempts=claim.budget_used, elapsed=claim.failing_for)
    )
    if isinstance(decision, Exhausted) and kind == "unknown_outcome" and reconciler:
        # The effect may have happened: one more claim, which only reconciles
        # (Claim.last_chance), decides between succeeded and exhausted.
        decision = policy.delay(claim.budget_used)
    if isinstance(decision, Exhausted):
        return Failing("failed", "exhausted", reason=decision.reason)
    return Failing("retryable_failed", kind, delay=decision.delay)


def after_failure(
    f: Failing, recorded: Failure, *, letters: Letters, msg: Message, key: str,
    claim: Claim, error_class: str, message: str,
) -> Verdict:
    """The result of a failure the store recorded (``message`` as it was stored)."""
    fields = {"key": key, "handler": letters.handler, "attempts": claim.attempts, **where(msg)}
    if f.status == "retryable_failed":
        return Verdict(Deferred(f.delay, Reason.RETRY), Note(
            logging.INFO, "will retry (%s: %s)", "retry_scheduled",
            {"kind": f.kind, "delay": round(f.delay, 3), **fields}, (error_class, message)))
    letter = letters.letter(msg, kind=f.kind, error_class=error_class, message=message,
                            attempts=recorded.attempts, key=key, failure=recorded)
    note = letter_note(letter, "exhausted" if f.exhausted else "failed", fields)
    return Verdict(Finished(Ended.DEAD_LETTERED, letter, key=key), note)


def reconcile_first(claim: Claim, *, reconciler: bool) -> bool:
    """Ask the reconciler before the handler: the last attempt's outcome is unknown
    (it raised UnknownOutcome, or its lease expired mid-flight)."""
    return reconciler and claim.previous_error_kind in ("unknown_outcome", "lease_expired")


def last_chance_spent(claim: Claim, key: str) -> RetryLimitReached | None:
    """The reconcile-only last attempt found no effect: the handler may not run again."""
    if not claim.last_chance:
        return None
    return RetryLimitReached(
        f"{claim.attempts} attempts used; the last one's outcome was unknown and "
        "reconcile found no effect",
        key=key,
    )
