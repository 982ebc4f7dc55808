"""Per-partition bookkeeping of one member, with no Kafka calls and no threads.

For each partition it has fetched from, the loop keeps the messages not finished
yet (in order), when the partition may run again after a deferral, whether it is
paused or part of a unit in flight, the live claim tokens of deferred messages,
and the offset after its finished prefix that is not committed yet. A
:class:`PartitionState` owns those fields: only its methods change them.
:class:`Partitions` is the table of them and the decisions taken over all
partitions at once (what is due, how long the loop may wait, what to pause and
resume, what is pending to commit). The loop turns those decisions into Kafka
calls; nothing here needs a broker, so it runs on stub messages in unit tests.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from kafka_idem.consume.outcome import Deferred, Finished, Result
from kafka_idem.consume.rate_limit import RateLimits

TP = tuple[str, int]


class Message(Protocol):
    """What the bookkeeping needs of a fetched message (a delivered one, not an error)."""

    def topic(self) -> str: ...

    def partition(self) -> int: ...

    def offset(self) -> int: ...


class Committable:
    """What may be committed of one partition: the offset after its finished prefix
    not acknowledged yet, and the asynchronous commit in flight. Both kinds of
    partition state (this module's prefix one, :mod:`~kafka_idem.consume.concurrency.keyed_state`'s
    key-ordered one) keep it the same way, for :mod:`~kafka_idem.consume.offsets`."""

    def __init__(self, *, jitter: Callable[[float, float], float] = random.uniform) -> None:
        self.to_commit: int | None = None  # next offset to commit, not yet acknowledged
        self.committing: int | None = None  # the offset of an asynchronous commit in flight
        self.paused = False
        self.framework_failures = 0  # consecutive deferrals that were our own fault
        self._jitter = jitter

    def commit_sent(self, offset: int) -> None:
        self.committing = offset

    def commit_not_sent(self) -> None:
        self.committing = None

    def committed(self, offset: int) -> None:
        """A synchronous commit of ``offset`` succeeded."""
        if self.to_commit == offset:
            self.to_commit = None

    def acknowledged(self, offset: int, *, failed: bool) -> None:
        """The broker answered an asynchronous commit of ``offset``."""
        if self.committing == offset:
            self.committing = None  # the next round sends the newest offset, if any
        if not failed and self.to_commit == offset:
            self.to_commit = None

    def delay(self, res: Deferred) -> float:
        """How long a deferred message waits: its own delay, or when our surroundings
        failed, a jittered growing wait (never charged to the message)."""
        if res.reason == "config":
            # Waiting will not fix it (consume/config_hold.py): 1 s, 2 s, 4 s ... up to a minute.
            self.framework_failures += 1
            return float(min(60, 2 ** min(self.framework_failures - 1, 6)))
        if res.reason in ("framework", "dlq"):
            self.framework_failures += 1
            return self._jitter(0.1, min(10.0, 0.2 * 2 ** min(self.framework_failures, 6)))
        return res.delay

    # What the loop asks of every kind of state.

    def add(self, msg: Message, now: float) -> None:
        raise NotImplementedError

    def first_offset(self) -> int | None:
        raise NotImplementedError

    def deadline(self, linger: float) -> float | None:
        """When the loop must look at this partition again (None: nothing to wait for)."""
        raise NotImplementedError

    def pause_if(self, now: float, full: int) -> bool:
        raise NotImplementedError

    def resume_if(self, now: float, low: int) -> bool:
        raise NotImplementedError


class PartitionState(Committable):
    """One partition's queue of unfinished messages and the decisions that hang on it,
    run as prefixes: one unit at a time, in offset order."""

    def __init__(
        self, *, jitter: Callable[[float, float], float] = random.uniform,
        prepare: Callable[[Any], object | None] | None = None,
    ) -> None:
        super().__init__(jitter=jitter)
        self.queue: deque[Any] = deque()
        # offset -> what ``prepare`` made of a queued message, until a unit takes it
        self.ahead: dict[int, Any] = {}
        self._prepare = prepare
        self.not_before = 0.0  # deferred: not run again before this (monotonic) time
        self.tokens: dict[int, Any] = {}  # offset -> our live claim token
        self.last_queued = -1
        self.busy = False  # part of a unit in flight
        self.since = 0.0  # when the queued messages started to wait for a batch

    # --- fetched -------------------------------------------------------------

    def add(self, msg: Message, now: float) -> None:
        if msg.offset() <= self.last_queued:
            return  # already queued (a re-fetch after a rewind)
        if not self.queue:
            self.since = now
        self.queue.append(msg)
        self.last_queued = msg.offset()
        if self._prepare is not None and (got := self._prepare(msg)) is not None:
            self.ahead[msg.offset()] = got

    # --- run -----------------------------------------------------------------

    def due(self, now: float) -> bool:
        return bool(self.queue) and not self.busy and self.not_before <= now

    def prefix(self, n: int | None = None) -> list[Any]:
        """The first ``n`` queued messages (all without ``n``); they stay queued until
        their results apply."""
        return list(self.queue if n is None else itertools.islice(self.queue, n))

    def take_prepared(self, msgs: Sequence[Any]) -> dict[int, Any]:
        """What ``prepare`` made of ``msgs``, by offset, taken out: one unit uses it once
        (a message run again is decoded again, as every attempt of it is)."""
        ahead = self.ahead
        return {o: ahead.pop(o) for m in msgs if (o := m.offset()) in ahead} if ahead else {}

    def first_offset(self) -> int | None:
        return self.queue[0].offset() if self.queue else None

    def enter_unit(self) -> None:
        self.busy = True

    def leave_unit(self) -> None:
        self.busy = False

    def apply(self, results: Sequence[Result], now: float) -> list[str]:
        """Pop the finished prefix (its offsets become committable) and schedule the first
        deferred message; return the outcome names to count."""
        outcomes: list[str] = []
        self.since = now  # what is left waits anew for its batch (a deferral: below)
        for res in results:
            msg = self.queue[0]
            if isinstance(res, Finished):
                self.queue.popleft()
                self.tokens.pop(msg.offset(), None)
                self.framework_failures = 0
                self.to_commit = msg.offset() + 1
                outcomes.append(res.outcome)
                continue
            self.not_before = now + self.delay(res)
            self.since = 0.0  # due at once when its delay ends
            if res.token is not None:
                self.tokens[msg.offset()] = res.token
            if res.reason in ("busy", "retry"):
                outcomes.append("busy" if res.reason == "busy" else "retried")
            break
        return outcomes

    # --- flow control ----------------------------------------------------------

    def deadline(self, linger: float) -> float | None:
        """A backoff's end, or a partly filled batch's ``linger`` from its oldest message.
        Without either the partition runs at once, or when a unit in flight finishes
        (which wakes the loop by itself): no time to wake for."""
        if not self.queue or self.busy:
            return None
        end = max(self.not_before, self.since + linger)
        return end if end > self.since else None

    def waiting(self, now: float) -> bool:
        """Holding messages that may not run yet (a deferral's backoff)."""
        return bool(self.queue) and not self.busy and self.not_before > now

    def pause_if(self, now: float, full: int) -> bool:
        if self.paused or not (self.waiting(now) or len(self.queue) >= full):
            return False
        self.paused = True
        return True

    def resume_if(self, now: float, low: int) -> bool:
        if not self.paused or self.waiting(now) or len(self.queue) > low:
            return False
        self.paused = False
        return True


class Partitions:
    """The member's partitions: the table of their states by (topic, partition).

    A partition's state is a :class:`PartitionState` (run as prefixes), or what
    ``make`` builds for its topic (a key-ordered one,
    :mod:`~kafka_idem.consume.concurrency.keyed_state`).
    """

    def __init__(
        self, *, jitter: Callable[[float, float], float] = random.uniform,
        make: Callable[[str, Callable[[float, float], float]], Committable | None] | None = None,
        prepare: Callable[[Any], object | None] | None = None,
    ) -> None:
        self._states: dict[TP, Committable] = {}
        self._jitter = jitter
        self._make = make
        self.prepare = prepare  # decode ahead as messages are queued (None: never)
        self.limits: RateLimits | None = None  # handlers' max_rate (None: no handler has one)

    def get(self, tp: TP) -> Committable | None:
        return self._states.get(tp)

    def items(self) -> Iterable[tuple[TP, Committable]]:
        return self._states.items()

    def values(self) -> Iterable[Committable]:
        return self._states.values()

    def add(self, msg: Message, now: float) -> None:
        tp = (msg.topic(), msg.partition())
        st = self._states.get(tp)
        if st is None:
            made = self._make(tp[0], self._jitter) if self._make is not None else None
            st = self._states[tp] = (
                PartitionState(jitter=self._jitter, prepare=self.prepare)
                if made is None else made)
        st.add(msg, now)

    def due(self, now: float) -> list[tuple[TP, PartitionState]]:
        """The prefix partitions that may run now."""
        return [(tp, st) for tp, st in self._states.items()
                if isinstance(st, PartitionState) and st.due(now)]

    def wait_time(self, now: float, max_wait: float, linger: float = 0.0) -> float:
        """Until the next backoff ends, a partly filled batch has lingered ``linger`` or a
        handler held back by its ``max_rate`` has a token, and never more than ``max_wait``."""
        deadlines = [
            d for st in self._states.values() if (d := st.deadline(linger)) is not None
        ]
        if self.limits is not None and (d := self.limits.wake_at()) is not None:
            deadlines.append(d)
        wait_s = max_wait
        if deadlines:
            wait_s = min(wait_s, max(min(deadlines) - now, 0.0))
        return max(wait_s, 0.001)

    def apply(self, results: dict[TP, list[Result]], now: float) -> Counter[tuple[str, str]]:
        """Apply units' results; return how many of each (topic, outcome) they hold."""
        counts: Counter[tuple[str, str]] = Counter()
        for tp, rs in results.items():
            st = self._states.get(tp)
            if not isinstance(st, PartitionState):
                continue  # revoked meanwhile
            counts.update((tp[0], outcome) for outcome in st.apply(rs, now))
        return counts

    def pending_commits(
        self, *, in_flight_too: bool, of: Iterable[TP] | None = None
    ) -> list[tuple[TP, int]]:
        """Each partition's (or each of ``of``'s) offset after its finished prefix, not
        acknowledged yet. Without ``in_flight_too``, not a partition with an asynchronous
        commit in flight: during a rebalance the broker holds commits, and piling them
        up only multiplies the failures."""
        out = []
        for tp in self._states if of is None else of:
            st = self._states.get(tp)
            if st is None or st.to_commit is None:
                continue
            if in_flight_too or st.committing is None:
                out.append((tp, st.to_commit))
        return out

    def pause_resume(self, now: float, batch_size: int) -> tuple[list[TP], list[TP]]:
        """Which partitions to pause and which to resume. Pause one that waits on a
        backoff, or whose queue holds two batches (memory stays bounded while its units
        run); resume it when it is due and down to one batch."""
        pause, resume = [], []
        for tp, st in self._states.items():
            if st.pause_if(now, 2 * batch_size):
                pause.append(tp)
            elif st.resume_if(now, batch_size):
                resume.append(tp)
        return pause, resume

    def forget(self, tps: Iterable[TP]) -> None:
        """Drop revoked or lost partitions (a later assignment starts afresh)."""
        for tp in tps:
            self._states.pop(tp, None)
