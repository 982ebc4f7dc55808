"""Retry decisions: exponential backoff with full jitter, capped (retries in lock step
would hammer a recovering service together).

The policy only *decides*; the consumer loop performs the wait (by pausing the
partition) and the store keeps the count, so restarts never reset it.

Delay before attempt ``n + 1`` after ``n`` failed attempts::

    delay = random.uniform(0, min(cap, base * 2 ** (n - 1)))

With ``base=0.5`` s and ``cap=60`` s the upper bounds are 0.5, 1, 2, 4, 8, 16,
32, 60, 60 ... seconds for n = 1, 2, 3 ...; the actual delay is uniform below
the bound ("full jitter"), so members that failed together don't retry together.

Stop conditions: ``attempts >= max_attempts`` or the time since the first
failure ``>= max_elapsed``; then the key is *exhausted*.

    >>> policy = RetryPolicy(base=0.5, cap=60, max_attempts=5, max_elapsed=3600)
    >>> policy.decide(attempts=1, elapsed=0.0)
    Retry(delay=0.31...)
    >>> policy.decide(attempts=5, elapsed=0.0)
    Exhausted(reason='5 attempts reached the limit of 5')
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

_NO_WAIT = False


@dataclass(frozen=True, slots=True)
class Retry:
    delay: float


@dataclass(frozen=True, slots=True)
class Exhausted:
    reason: str


Decision = Retry | Exhausted


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """When a failed key runs again, and when it is exhausted: exponential backoff with
    full jitter, ``base`` doubling per attempt up to ``cap`` seconds; exhausted after
    ``max_attempts`` attempts or ``max_elapsed`` seconds since its first failure."""

    base: float = 0.5
    cap: float = 60.0
    max_attempts: int = 5
    max_elapsed: float = 3600.0
    rng: random.Random | None = None  # a seeded generator makes the jitter reproducible

    def bound(self, attempts: int) -> float:
        """Upper bound of the delay after ``attempts`` failed attempts."""
        exponent = min(max(attempts - 1, 0), 62)
        return float(min(self.cap, self.base * (2**exponent)))

    def decide(
        self, *, attempts: int, elapsed: float, rng: random.Random | None = None
    ) -> Decision:
        """After ``attempts`` failed attempts, ``elapsed`` seconds since the first one:
        :class:`Retry` with a random delay below :meth:`bound`, or :class:`Exhausted`
        saying which limit was reached."""
        if attempts >= self.max_attempts:
            return Exhausted(f"{attempts} attempts reached the limit of {self.max_attempts}")
        if elapsed >= self.max_elapsed:
            return Exhausted(
                f"{elapsed:.0f}s since the first failure reached {self.max_elapsed:.0f}s"
            )
        return self.delay(attempts, rng=rng)

    def delay(self, attempts: int, *, rng: random.Random | None = None) -> Retry:
        """The jittered wait after ``attempts`` failed attempts, whatever the limits."""
        if _NO_WAIT:
            return Retry(0.0)
        return Retry((rng or self.rng or random).uniform(0.0, self.bound(attempts)))


@contextmanager
def no_wait() -> Iterator[None]:
    """Test mode: every retry is due at once (the decisions and counts stay real).

    >>> with no_wait():
    ...     RetryPolicy().decide(attempts=1, elapsed=0).delay
    0.0
    """
    global _NO_WAIT
    previous, _NO_WAIT = _NO_WAIT, True
    try:
        yield
    finally:
        _NO_WAIT = previous
