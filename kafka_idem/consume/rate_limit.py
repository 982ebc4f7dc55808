"""``max_rate``: a token bucket per handler in this member, consulted before a claim.

A handler registered with ``max_rate=R`` starts at most R messages a second *in this
member*, on average: its bucket holds up to one second's worth of tokens
(``max(1, R)``), starts full, and gains R a second on the monotonic clock. Each message
handed to a unit of work (local, leased) or started (key-ordered) takes a whole token;
a partition whose handler has none left keeps its queue and is not dispatched, and the
loop waits (:meth:`RateLimits.wake_at`, through
:meth:`~kafka_idem.consume.partitions.Partitions.wait_time`) until the next token
accrues instead of spinning. Its queue fills, and the usual flow control pauses it at
two batches, so a throttled partition is not read into memory; polling goes on.

A full bucket means a member under its limit waits for nothing: bursts up to a second's
worth pass at once. A message run again (a retry, a busy key, a unit stopped early) takes
a token again: the limit is on attempts, the upper bound that protects what the handler
calls. The group's rate is R times the members that hold partitions of the topic: each
member counts only its own (docs/how-to/handlers.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping


class Bucket:
    """One handler's tokens: ``rate`` a second, at most ``burst`` held, full at first
    (the clock is the caller's: every method that reads it takes ``now``, a monotonic
    time)."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = rate
        self.burst = max(1.0, rate) if burst is None else burst
        self.tokens = self.burst
        self.at = float("-inf")  # when ``tokens`` was counted

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now

    def take(self, want: int, now: float) -> int:
        """Up to ``want`` whole tokens, taken now."""
        self._refill(now)
        got = min(want, int(self.tokens))
        self.tokens -= got
        return got

    def give_back(self, n: int) -> None:
        """Tokens taken for messages that did not go after all."""
        self.tokens = min(self.burst, self.tokens + n)

    def ready_at(self) -> float:
        """When the next whole token is there (at or before ``at``: now)."""
        return self.at if self.tokens >= 1 else self.at + (1 - self.tokens) / self.rate


class RateLimits:
    """The member's buckets, by topic, for the handlers with ``max_rate``; and which of
    them held messages back in the last dispatch round (the loop wakes for their next
    token; the time they waited is counted by ``throttled``, in seconds, by topic)."""

    def __init__(self, rates: Mapping[str, float],
                 throttled: Callable[[str, float], None] | None = None) -> None:
        self.buckets = {topic: Bucket(rate) for topic, rate in rates.items()}
        self._throttled = throttled
        self._held: set[str] = set()
        self._round_at = 0.0

    def round(self, now: float) -> None:
        """A dispatch round starts: the topics held back since the last one waited until
        now; which are held is decided afresh by this round's :meth:`take` calls."""
        if self._throttled is not None:
            for topic in self._held:
                self._throttled(topic, now - self._round_at)
        self._held.clear()
        self._round_at = now

    def take(self, topic: str, want: int, now: float) -> int:
        """How many of ``want`` messages of ``topic`` may go now (all of them for a
        topic without a limit); the rest wait for tokens."""
        bucket = self.buckets.get(topic)
        if bucket is None:
            return want
        got = bucket.take(want, now)
        if got < want:
            self._held.add(topic)
        return got

    def give_back(self, topic: str, n: int) -> None:
        bucket = self.buckets.get(topic)
        if bucket is not None and n > 0:
            bucket.give_back(n)

    def wake_at(self) -> float | None:
        """When a topic held back in the last round has its next token (None: none held)."""
        return min((self.buckets[t].ready_at() for t in self._held), default=None)
