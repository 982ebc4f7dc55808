"""The message path's decisions (``kafka_idem.consume.paths.verdicts``), without Kafka or
PostgreSQL: a stub message, claims built by hand, a retry policy with a seeded
generator."""

from __future__ import annotations

import datetime as dt
import logging
import random

import psycopg
import pytest

from kafka_idem.consume.outcome import Deferred, Ended, Finished, Prepared, Reason
from kafka_idem.consume.paths.verdicts import (
    Failing,
    Letters,
    Verdict,
    after_failure,
    busy_wait,
    error_of,
    failing,
    not_claimed,
    undecodable,
)
from kafka_idem.errors import InvalidPayload, Undecodable
from kafka_idem.retry import RetryPolicy
from kafka_idem.store import Claim, Failure, Outcome
from kafka_idem.testing import FakeMessage

T0 = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)
T1 = T0 + dt.timedelta(minutes=5)
KEY = "t1:charge:o1"
PREP = Prepared(model=None, key=KEY, request_hash="v1:sha256:aa")
LETTERS = Letters(dlq_topic="payments.dlq", group="payments", handler="charge",
                  namespace="payments", message_max=64)
BUSY_CAP = 2.0


MSG = FakeMessage("payments", partition=3, offset=42, key=b"o1", value=b"\xc3\x01",
                  headers=[], timestamp=1_700_000_000_000)


def decide(claim: Claim) -> Verdict:
    return not_claimed(claim, letters=LETTERS, msg=MSG, prep=PREP, busy_retry_seconds=BUSY_CAP)


# --- a claim that did not give us the key -------------------------------------------------


def test_a_succeeded_key_replays_without_a_letter() -> None:
    v = decide(Claim(Outcome.REPLAY, KEY, attempts=1, result={"charged": "1"}))
    assert v.result == Finished(Ended.REPLAYED, None, key=KEY)
    assert (v.note.action, v.note.level) == ("replayed", logging.DEBUG)
    assert v.note.fields == {"key": KEY, "handler": "charge", "topic": "payments",
                             "partition": 3, "offset": 42}


@pytest.mark.parametrize(("retry_in", "wait"), [
    (30.0, BUSY_CAP),   # another owner's live lease: capped, asked again early
    (0.5, 0.5),         # a lease ending sooner than the cap: its own end
    (-0.1, 0.0),        # expired by the time we decide: at once, never negative
])
def test_a_live_lease_waits_at_most_busy_retry_seconds(retry_in: float, wait: float) -> None:
    v = decide(Claim(Outcome.BUSY, KEY, attempts=1, retry_in=retry_in))
    assert v.result == Deferred(wait, Reason.BUSY)
    assert v.note.action == "busy"


def test_a_backoff_not_due_waits_its_whole_delay_uncapped() -> None:
    claim = Claim(Outcome.BUSY, KEY, attempts=2, retry_in=30.0, backoff=True)
    assert busy_wait(claim, BUSY_CAP) == 30.0
    assert decide(claim).result == Deferred(30.0, Reason.BUSY)


def test_a_conflict_is_dead_lettered_as_payload_conflict() -> None:
    v = decide(Claim(Outcome.CONFLICT, KEY, attempts=3))
    assert isinstance(v.result, Finished) and v.result.outcome == Ended.CONFLICT
    letter = v.result.letter
    assert letter is not None
    assert (letter.kind, letter.error_class, letter.attempts) == (
        "payload_conflict", "PayloadConflict", 3)
    assert (letter.dlq_topic, letter.consumer_group, letter.handler, letter.namespace,
            letter.idempotency_key, letter.source) == (
        "payments.dlq", "payments", "charge", "payments", KEY, MSG)
    assert letter.error_message.startswith(f"key {KEY!r} was first used with a different")
    assert letter.error_message.endswith("...")  # bounded by Letters.message_max
    assert len(letter.error_message.encode()) <= LETTERS.message_max
    assert letter.first_failure_at is None  # the record is untouched: no failure times
    assert (v.note.action, v.note.level) == ("conflict", logging.WARNING)


@pytest.mark.parametrize("outcome", [Outcome.DEAD, Outcome.EXHAUSTED])
def test_a_failed_record_is_dead_lettered_again_with_its_story(outcome: Outcome) -> None:
    claim = Claim(outcome, KEY, attempts=4, error_kind="exhausted", error_class="Retryable",
                  error_message="no stock", first_failure_at=T0, last_failure_at=T1)
    v = decide(claim)
    assert isinstance(v.result, Finished) and v.result.outcome == Ended.DEAD_LETTERED
    letter = v.result.letter
    assert letter is not None
    assert (letter.kind, letter.error_class, letter.error_message, letter.attempts) == (
        "exhausted", "Retryable", "no stock", 4)
    assert (letter.first_failure_at, letter.last_failure_at) == (T0, T1)
    # a key failed before says dead_lettered; one the claim just exhausted, exhausted
    action = "exhausted" if outcome is Outcome.EXHAUSTED else "dead_lettered"
    assert (v.note.action, v.note.fields["kind"]) == (action, "exhausted")
    assert v.note.text % v.note.args == "dead-lettering (exhausted): Retryable: no stock"
    assert {k: v.note.fields[k] for k in ("kind", "error_class", "error_message")} == {
        "kind": "exhausted", "error_class": "Retryable", "error_message": "no stock"}


def test_a_failed_record_without_an_error_kind_is_permanent() -> None:
    v = decide(Claim(Outcome.DEAD, KEY, attempts=1))
    assert isinstance(v.result, Finished) and v.result.letter is not None
    assert (v.result.letter.kind, v.result.letter.error_class,
            v.result.letter.error_message) == ("permanent", "Failed", "permanent")


def test_a_claimed_key_has_no_verdict() -> None:
    with pytest.raises(ValueError, match="claimed"):
        decide(Claim(Outcome.CLAIMED, KEY, attempts=1))


@pytest.mark.parametrize(("exc", "kind"), [
    (Undecodable("bad magic"), "undecodable"),
    (InvalidPayload("amount: not a number"), "permanent"),
])
def test_a_message_that_cannot_be_processed_is_dead_lettered_without_attempts(
    exc: Undecodable | InvalidPayload, kind: str
) -> None:
    v = undecodable(LETTERS, MSG, exc)
    assert isinstance(v.result, Finished) and v.result.outcome == "dead_lettered"
    assert v.result.key is None and v.result.letter is not None
    assert (v.result.letter.kind, v.result.letter.attempts,
            v.result.letter.error_class) == (kind, 0, type(exc).__name__)
    assert (v.note.action, v.note.fields["kind"]) == ("rejected", kind)
    line = f"dead-lettering ({kind}): {type(exc).__name__}: {exc}"  # one wording
    assert v.note.text % v.note.args == line
    assert (v.note.fields["error_class"], v.note.fields["error_message"]) == (
        type(exc).__name__, str(exc))


# --- a handler's exception ----------------------------------------------------------------

POLICY = RetryPolicy(base=10.0, cap=100.0, max_attempts=3, max_elapsed=600.0,
                     rng=random.Random(7))


def claimed(budget_used: int = 1, failing_for: float = 0.0) -> Claim:
    return Claim(Outcome.CLAIMED, KEY, attempts=budget_used, budget_used=budget_used,
                 failing_for=failing_for)


def test_permanent_fails_at_once_whatever_the_budget() -> None:
    assert failing("permanent", claim=claimed(1), policy=POLICY) == Failing("failed", "permanent")


@pytest.mark.parametrize("budget_used", [1, 2])
def test_retryable_under_the_limit_retries_after_an_uncapped_backoff(budget_used: int) -> None:
    f = failing("retryable", claim=claimed(budget_used), policy=POLICY)
    assert (f.status, f.kind, f.exhausted, f.reason) == (
        "retryable_failed", "retryable", False, None)
    # Full jitter below the policy's bound; not cut to busy_retry_seconds (the record
    # says when the retry is due, and an earlier claim would only find it busy).
    assert 0.0 <= f.delay <= POLICY.bound(budget_used)
    many = [failing("retryable", claim=claimed(2), policy=POLICY).delay for _ in range(50)]
    assert max(many) > BUSY_CAP


def test_retryable_at_the_attempt_limit_is_exhausted() -> None:
    f = failing("retryable", claim=claimed(3), policy=POLICY)
    assert (f.status, f.kind, f.exhausted) == ("failed", "exhausted", True)
    assert f.reason == "3 attempts reached the limit of 3"
    assert f.stored_message("no stock", 200) == (
        "3 attempts reached the limit of 3; last error: no stock")
    assert f.stored_message("x" * 300, 40).endswith("...")


def test_retryable_past_the_time_limit_is_exhausted() -> None:
    f = failing("retryable", claim=claimed(1, failing_for=600.0), policy=POLICY)
    assert f.exhausted and f.reason is not None and "since the first failure" in f.reason


def test_unknown_outcome_at_the_limit_gets_one_reconcile_only_attempt_with_a_reconciler(
) -> None:
    f = failing("unknown_outcome", claim=claimed(3), policy=POLICY, reconciler=True)
    assert (f.status, f.kind, f.exhausted) == ("retryable_failed", "unknown_outcome", False)
    assert 0.0 <= f.delay <= POLICY.bound(3)


def test_unknown_outcome_at_the_limit_without_a_reconciler_is_exhausted() -> None:
    f = failing("unknown_outcome", claim=claimed(3), policy=POLICY, reconciler=False)
    assert (f.status, f.kind) == ("failed", "exhausted")


def test_unknown_outcome_under_the_limit_retries_as_unknown_outcome() -> None:
    f = failing("unknown_outcome", claim=claimed(1), policy=POLICY)
    assert (f.status, f.kind) == ("retryable_failed", "unknown_outcome")


def test_the_last_chance_that_reconciled_nothing_is_exhausted_even_under_the_limit() -> None:
    f = failing("retryable", claim=claimed(1), policy=POLICY, limit_reached=True)
    assert (f.status, f.kind, f.reason) == ("failed", "exhausted", "retry limit reached")


def test_the_error_text_is_bounded_and_data_errors_say_their_sqlstate_only() -> None:
    assert error_of(ValueError("x" * 100), 20) == ("ValueError", "x" * 17 + "...")
    assert error_of(ValueError(), 20) == ("ValueError", "ValueError")

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    assert error_of(Unprintable(), 200) == (
        "Unprintable", "(the exception's text could not be made: RuntimeError)")
    cls, text = error_of(psycopg.errors.StringDataRightTruncation("value 'secret' too long"),
                         200)
    assert cls == "DataRejected"
    assert text.startswith("the database rejected the message's data (SQLSTATE")


RECORDED = Failure(attempts=2, next_attempt_at=None, first_failure_at=T0, last_failure_at=T1)


def test_a_recorded_retry_defers_the_partition() -> None:
    f = Failing("retryable_failed", "retryable", delay=1.25)
    v = after_failure(f, RECORDED, letters=LETTERS, msg=MSG, key=KEY, claim=claimed(2),
                      error_class="Retryable", message="later")
    assert v.result == Deferred(1.25, Reason.RETRY)
    assert (v.note.action, v.note.level, v.note.args) == (
        "retry_scheduled", logging.INFO, ("Retryable", "later"))
    assert (v.note.fields["kind"], v.note.fields["delay"]) == ("retryable", 1.25)


@pytest.mark.parametrize(("f", "action", "line"), [
    (Failing("failed", "permanent"), "failed", "dead-lettering (permanent): Permanent: no"),
    (Failing("failed", "exhausted", reason="3 attempts"), "exhausted",
     "dead-lettering (exhausted): Permanent: no"),
])
def test_a_recorded_failure_is_dead_lettered_with_the_records_count_and_times(
    f: Failing, action: str, line: str
) -> None:
    v = after_failure(f, RECORDED, letters=LETTERS, msg=MSG, key=KEY, claim=claimed(2),
                      error_class="Permanent", message="no")
    assert isinstance(v.result, Finished) and v.result.letter is not None
    letter = v.result.letter
    assert (v.result.outcome, letter.kind, letter.attempts) == ("dead_lettered", f.kind, 2)
    assert (letter.first_failure_at, letter.last_failure_at) == (T0, T1)
    assert (v.note.action, v.note.text % v.note.args) == (action, line)


# --- the vocabulary -----------------------------------------------------------------------


def test_outcomes_and_reasons_still_equal_their_strings() -> None:
    assert Finished("replayed").outcome == "replayed" == Ended.REPLAYED
    assert Deferred(0.0, "busy").reason == "busy" == Reason.BUSY
    assert Deferred(0.0, "dlq") == Deferred(0.0, Reason.DLQ)
    assert f"{Reason.FRAMEWORK}" == "framework"
    with pytest.raises(ValueError):
        Deferred(0.0, "bussy")


def test_a_recorded_error_message_has_its_secrets_masked() -> None:
    """A handler's error text is recorded, dead-lettered and logged without the
    passwords it quotes (a connection string in a client library's error)."""
    exc = RuntimeError("upstream refused: password=hunter2 at postgresql://bob:s3cret@db/x")
    error_class, message = error_of(exc, 500)
    assert error_class == "RuntimeError"
    assert "hunter2" not in message and "s3cret" not in message
    assert message == ("upstream refused: password=********** at "
                       "postgresql://bob:**********@db/x")
