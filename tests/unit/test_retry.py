"""Retry decisions: exponential backoff, full jitter, cap, and the two stop conditions."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kafka_idem import retry
from kafka_idem.retry import Exhausted, Retry, RetryPolicy, no_wait

POLICY = RetryPolicy(base=0.5, cap=60.0, max_attempts=100, max_elapsed=3600.0)


@pytest.mark.parametrize(
    ("attempts", "bound"),
    [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 8.0), (6, 16.0), (7, 32.0), (8, 60.0),
     (9, 60.0), (10, 60.0)],
)
def test_bounds_double_from_the_base_up_to_the_cap(attempts: int, bound: float) -> None:
    assert POLICY.bound(attempts) == bound


def test_bound_never_overflows_for_huge_attempt_counts() -> None:
    assert POLICY.bound(10_000) == 60.0
    assert POLICY.bound(0) == 0.5


@given(st.integers(min_value=1, max_value=99), st.integers(min_value=0, max_value=2**32))
def test_delays_are_always_within_zero_and_the_bound(attempts: int, seed: int) -> None:
    decision = POLICY.decide(attempts=attempts, elapsed=0.0, rng=random.Random(seed))
    assert isinstance(decision, Retry)
    assert 0.0 <= decision.delay <= POLICY.bound(attempts)


def test_delays_over_many_seeds_stay_in_bounds_and_fill_them() -> None:
    for attempts in range(1, 11):
        bound = POLICY.bound(attempts)
        delays = [
            POLICY.decide(attempts=attempts, elapsed=0.0, rng=random.Random(seed)).delay  # type: ignore[union-attr]
            for seed in range(500)
        ]
        assert all(0.0 <= d <= bound for d in delays)
        # Full jitter: uniform over [0, bound], so both ends of the range are used.
        assert min(delays) < 0.1 * bound
        assert max(delays) > 0.9 * bound


def test_jitter_varies_across_seeds_and_repeats_for_a_seed() -> None:
    delays = {
        POLICY.decide(attempts=3, elapsed=0.0, rng=random.Random(seed)).delay  # type: ignore[union-attr]
        for seed in range(50)
    }
    assert len(delays) == 50
    again = POLICY.decide(attempts=3, elapsed=0.0, rng=random.Random(7))
    assert again == POLICY.decide(attempts=3, elapsed=0.0, rng=random.Random(7))


def test_without_an_rng_the_module_random_is_used() -> None:
    delays = {POLICY.decide(attempts=5, elapsed=0.0).delay for _ in range(20)}  # type: ignore[union-attr]
    assert len(delays) > 1
    assert all(0.0 <= d <= 8.0 for d in delays)


def test_exhausted_by_attempts() -> None:
    policy = RetryPolicy(base=0.5, cap=60, max_attempts=5, max_elapsed=3600)
    assert isinstance(policy.decide(attempts=4, elapsed=0.0), Retry)
    decision = policy.decide(attempts=5, elapsed=0.0)
    assert decision == Exhausted("5 attempts reached the limit of 5")
    assert isinstance(policy.decide(attempts=6, elapsed=0.0), Exhausted)


def test_exhausted_by_elapsed_time() -> None:
    policy = RetryPolicy(base=0.5, cap=60, max_attempts=5, max_elapsed=120)
    assert isinstance(policy.decide(attempts=1, elapsed=119.9), Retry)
    decision = policy.decide(attempts=1, elapsed=120.0)
    assert isinstance(decision, Exhausted)
    assert "120s since the first failure" in decision.reason


def test_a_single_attempt_policy_never_retries() -> None:
    assert isinstance(RetryPolicy(max_attempts=1).decide(attempts=1, elapsed=0.0), Exhausted)


def test_no_wait_gives_zero_delays_and_restores_afterwards() -> None:
    rng = random.Random(1)
    with no_wait():
        assert POLICY.decide(attempts=7, elapsed=0.0, rng=rng) == Retry(0.0)
        # Stop conditions stay real in test mode.
        assert isinstance(RetryPolicy(max_attempts=2).decide(attempts=2, elapsed=0.0), Exhausted)
        with no_wait():  # nesting keeps it on
            pass
        assert POLICY.decide(attempts=7, elapsed=0.0) == Retry(0.0)
    assert retry._NO_WAIT is False
    delays = {POLICY.decide(attempts=7, elapsed=0.0, rng=random.Random(s)).delay  # type: ignore[union-attr]
              for s in range(5)}
    assert len(delays) == 5 and max(delays) > 0.0


def test_no_wait_restores_after_an_exception() -> None:
    with pytest.raises(RuntimeError), no_wait():
        raise RuntimeError("boom")
    assert retry._NO_WAIT is False
    assert POLICY.decide(attempts=9, elapsed=0.0, rng=random.Random(3)) != Retry(0.0)


def test_a_seeded_policy_rng_makes_the_jitter_reproducible() -> None:
    def delays(policy: RetryPolicy) -> list[float]:
        return [policy.decide(attempts=n, elapsed=0.0).delay for n in range(1, 8)]  # type: ignore[union-attr]

    a = RetryPolicy(base=0.5, cap=60, max_attempts=100, rng=random.Random(42))
    b = RetryPolicy(base=0.5, cap=60, max_attempts=100, rng=random.Random(42))
    c = RetryPolicy(base=0.5, cap=60, max_attempts=100, rng=random.Random(43))
    assert delays(a) == delays(b)
    assert delays(a) != delays(c)
    # An rng given to decide() wins over the policy's own.
    assert a.decide(attempts=3, elapsed=0.0, rng=random.Random(1)) == POLICY.decide(
        attempts=3, elapsed=0.0, rng=random.Random(1)
    )
