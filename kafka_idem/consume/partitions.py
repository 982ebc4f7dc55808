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
from typing import Any

from kafka_idem.consume.committable import TP as TP  # the partitions' key, for importers
from kafka_idem.consume.committable import Committable, Message
from kafka_idem.consume.outcome import Deferred, Finished, Reason, Result
from kafka_idem.consume.parking import Lanes, Parking
from kafka_idem.consume.rate_limit import RateLimits

LanesOf = Callable[[Any], Lanes | None]
"""A queued message's lanes (its idempotency key, its ordering key), decoded in the loop
thread; ``()`` for one that can never be decoded (it runs, to its dead letter); None when
they cannot be known now (our surroundings failed: it waits, in order)."""


class PartitionState(Committable):
    """One partition's queue of unfinished messages and the decisions that hang on it,
    run as prefixes: one unit at a time, in offset order. A message that waits for a
    retry is parked (:mod:`~kafka_idem.consume.parking`) and the queue runs on, unless
    ``lanes`` is None (``retry_blocks_partition``): then the partition waits with it."""

    def __init__(
        self, *, jitter: Callable[[float, float], float] = random.uniform,
        prepare: Callable[[Any], object | None] | None = None,
        lanes: LanesOf | None = None, lookahead: int = 10_000, sift: int = 500,
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
        self.parking = Parking()
        self._lanes_of = lanes
        self._lookahead = lookahead  # messages queued past the lowest parked one, at most
        self._sift_limit = sift  # messages checked against the parked lanes per unit
        self._sifted = 0  # queued messages at the front checked against the parked lanes
        self._known: dict[int, Lanes] = {}  # offset -> lanes of a queued message, decoded
        self._ran: list[Any] = []  # the messages of the unit in flight, in its order
        self._heads_first = True  # parked messages went first in the last unit with some
        self._frontier = -1  # the highest offset made committable (or the first queued)

    # --- fetched -------------------------------------------------------------

    def add(self, msg: Message, now: float) -> None:
        if msg.offset() <= self.last_queued:
            return  # already queued (a re-fetch after a rewind)
        if not self.queue:
            self.since = now
        self.queue.append(msg)
        if self._frontier < 0:
            self._frontier = msg.offset()  # where it started: nothing to commit yet
        self.last_queued = msg.offset()
        if self._prepare is not None and (got := self._prepare(msg)) is not None:
            self.ahead[msg.offset()] = got

    # --- run -----------------------------------------------------------------

    def due(self, now: float) -> bool:
        if self.busy or self.not_before > now:
            return False
        if not self.parking:
            return bool(self.queue)
        self._sift(now)
        return self._sifted > 0 or self.parking.due(now)

    def _sift(self, now: float) -> None:
        """Check the queue's front against the parked lanes (up to a unit's worth): a
        message that shares one is parked behind it. One whose lanes cannot be known
        now (the schema registry down) stops the check; first in the queue, it holds
        the partition as our own failures do."""
        assert self._lanes_of is not None  # nothing is parked without
        low = self.parking.lowest()
        while self._sifted < min(len(self.queue), self._sift_limit):
            msg = self.queue[self._sifted]
            offset = msg.offset()
            if low is not None and offset - low > self._lookahead:
                return  # no further past the oldest parked message than the look-ahead
            lanes = self._known.get(offset)
            if lanes is None:
                lanes = self._lanes_of(msg)
                if lanes is None:
                    if self._sifted == 0:
                        self.not_before = now + self.delay(Deferred(0.0, Reason.FRAMEWORK))
                    return
                self._known[offset] = lanes
            if self.parking.holds(lanes):
                del self.queue[self._sifted]
                self.ahead.pop(offset, None)
                self._known.pop(offset, None)
                self.parking.park(msg, lanes, 0.0)
            else:
                self._sifted += 1

    def prefix(self, n: int | None = None, now: float = 0.0) -> list[Any]:
        """The messages of the next unit: the first ``n`` queued messages (all without
        ``n``) that no parked one holds back, and the parked ones due now. They stay
        where they are until their results apply. A unit stops at its first deferred
        message, so whichever comes first can hold the other up: parked ones still
        failing, the queue; new failures in the queue, the due retries. So they take
        turns at going first (they share no lane: either order keeps every lane's)."""
        if not self.parking:
            msgs = list(self.queue if n is None else itertools.islice(self.queue, n))
        else:
            room = self._sifted if n is None else min(n, self._sifted)
            heads = [entry.msg for entry in self.parking.take(now)]
            queued = list(itertools.islice(self.queue, room))
            if heads:
                self._heads_first = not self._heads_first
            msgs = heads + queued if heads and self._heads_first else queued + heads
        self._ran = msgs
        return msgs

    def cut(self, n: int) -> list[Any]:
        """Only the first ``n`` of what :meth:`prefix` last gave go into the unit."""
        self._ran = self._ran[:n]
        return self._ran

    def take_prepared(self, msgs: Sequence[Any]) -> dict[int, Any]:
        """What ``prepare`` made of ``msgs``, by offset, taken out: one unit uses it once
        (a message run again is decoded again, as every attempt of it is)."""
        ahead = self.ahead
        return {o: ahead.pop(o) for m in msgs if (o := m.offset()) in ahead} if ahead else {}

    def first_offset(self) -> int | None:
        """The lowest unfinished offset: where the partition's commit stops."""
        first = self.queue[0].offset() if self.queue else None
        low = self.parking.lowest()
        return first if low is None else low if first is None else min(low, first)

    def enter_unit(self) -> None:  # with what prefix (or cut) last gave
        self.busy = True
        if self.parking:
            for msg in self._ran:
                self.parking.start(msg.offset())

    def leave_unit(self) -> None:
        self.busy = False

    def apply(self, results: Sequence[Result], now: float) -> list[str]:
        """Apply the unit's results in its order: a finished message leaves (the
        queue's, or the parking's), the first deferred one is parked (a retry) or holds
        the partition (our surroundings); the unit stopped there. The offset before the
        lowest unfinished message becomes committable. Return the outcomes to count."""
        outcomes: list[str] = []
        self.since = now  # what is left waits anew for its batch (a deferral: below)
        ran, self._ran = self._ran, []
        if not ran:  # results for the queue's front, without a prefix taken (tests)
            ran = list(itertools.islice(self.queue, len(results)))
        for msg, res in zip(ran, results, strict=False):
            offset = msg.offset()
            if isinstance(res, Finished):
                self._finished(msg)
                outcomes.append(res.outcome)
                continue
            if res.token is not None:
                self.tokens[offset] = res.token
            if res.reason in (Reason.BUSY, Reason.RETRY):
                outcomes.append("busy" if res.reason == Reason.BUSY else "retried")
            if not (res.reason in (Reason.BUSY, Reason.RETRY)
                    and self._park(msg, now + self.delay(res))):
                self.not_before = now + self.delay(res)
                self.since = 0.0  # due at once when its delay ends
                if offset in self.parking:
                    self.parking.deferred(offset, now)
            break
        if self.parking:
            for msg in ran:
                self.parking.unstarted(msg.offset())  # taken, not run: it may run again
        self._advance()
        return outcomes

    def _finished(self, msg: Any) -> None:
        offset = msg.offset()
        if offset in self.parking:
            self.parking.finished(offset)
            if not self.parking:
                self._known.clear()
                self._sifted = 0
        else:
            first = self.queue.popleft()
            assert first is msg, "a unit's queued messages finish in queue order"
            self._known.pop(offset, None)
            self._sifted = max(self._sifted - 1, 0)
        self.tokens.pop(offset, None)
        self.framework_failures = 0

    def _park(self, msg: Any, not_before: float) -> bool:
        """Set a deferred message aside so that the queue runs on; False when it must
        hold the partition instead (parking is off, or its lanes cannot be known)."""
        offset = msg.offset()
        if offset in self.parking:
            self.parking.deferred(offset, not_before)
            return True
        if self._lanes_of is None:
            return False
        lanes = self._known.pop(offset, None)
        if lanes is None:
            lanes = self._lanes_of(msg)
        if not lanes:
            return False
        first = self.queue.popleft()
        assert first is msg, "a unit's first deferred queued message is the queue's first"
        self.ahead.pop(offset, None)
        self.parking.park(msg, lanes, not_before)
        self._sifted = 0  # what is queued is checked again, against the new lanes
        return True

    def _advance(self) -> None:
        """Make the offset of the lowest unfinished message committable, once it grew.
        Every offset below the queue's first was finished or parked."""
        nxt = self.queue[0].offset() if self.queue else self.last_queued + 1
        low = self.parking.lowest()
        frontier = nxt if low is None else min(low, nxt)
        if frontier > self._frontier:
            self._frontier = frontier
            self.to_commit = frontier

    # --- flow control ----------------------------------------------------------

    def deadline(self, linger: float) -> float | None:
        """A backoff's end, a parked message's next attempt, or a partly filled batch's
        ``linger`` from its oldest message. Without any the partition runs at once, or
        when a unit in flight finishes (which wakes the loop by itself)."""
        if self.busy:
            return None
        times = []
        if self.queue:
            end = max(self.not_before, self.since + linger)
            if end > self.since:
                times.append(end)
        if self.parking and (due := self.parking.deadline()) is not None:
            times.append(max(due, self.not_before))
        return min(times, default=None)

    def waiting(self, now: float) -> bool:
        """Holding messages that may not run yet (a deferral's backoff)."""
        return bool(self.queue) and not self.busy and self.not_before > now

    def far_ahead(self) -> bool:
        """Queued ``retry_lookahead`` messages past its lowest parked one: what a crash
        would deliver again, and what is held, stop growing until that one finishes."""
        low = self.parking.lowest()
        return low is not None and self.last_queued - low >= self._lookahead

    def pause_if(self, now: float, full: int) -> bool:
        if self.paused or not (self.waiting(now) or len(self.queue) >= full
                               or self.far_ahead()):
            return False
        self.paused = True
        return True

    def resume_if(self, now: float, low: int) -> bool:
        if (not self.paused or self.waiting(now) or len(self.queue) > low
                or self.far_ahead()):
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
        self.make = make  # a topic's own kind of state (None: run as prefixes)
        self.prepare = prepare  # decode ahead as messages are queued (None: never)
        # the topics of paused handlers (kafka-idem pause): nothing of them runs, and
        # flow control neither pauses nor resumes them (the pause holds them)
        self.held: frozenset[str] = frozenset()
        self.limits: RateLimits | None = None  # handlers' max_rate (None: no handler has one)
        # a topic's lanes (None: its retries hold the partition), how far a partition
        # runs past its lowest parked message, how many messages a unit checks
        self.lanes: Callable[[str], LanesOf | None] = lambda _topic: None
        self.lookahead = 10_000
        self.sift = 500

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
            made = self.make(tp[0], self._jitter) if self.make is not None else None
            st = self._states[tp] = (
                PartitionState(jitter=self._jitter, prepare=self.prepare,
                               lanes=self.lanes(tp[0]), lookahead=self.lookahead,
                               sift=self.sift)
                if made is None else made)
        st.add(msg, now)

    def due(self, now: float) -> list[tuple[TP, PartitionState]]:
        """The prefix partitions that may run now."""
        return [(tp, st) for tp, st in self._states.items()
                if isinstance(st, PartitionState) and st.due(now) and tp[0] not in self.held]

    def wait_time(self, now: float, max_wait: float, linger: float = 0.0) -> float:
        """Until the next backoff ends, a partly filled batch has lingered ``linger`` or a
        handler held back by its ``max_rate`` has a token, and never more than ``max_wait``
        (a held topic's partitions wait for no time: they run only after the resume)."""
        deadlines = [
            d for tp, st in self._states.items()
            if tp[0] not in self.held and (d := st.deadline(linger)) is not None
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
        run); resume it when it is due and down to one batch. A held topic's partitions
        are left as the handler's pause keeps them."""
        pause, resume = [], []
        for tp, st in self._states.items():
            if tp[0] in self.held:
                continue
            if st.pause_if(now, 2 * batch_size):
                pause.append(tp)
            elif st.resume_if(now, batch_size):
                resume.append(tp)
        return pause, resume

    def forget(self, tps: Iterable[TP]) -> None:
        """Drop revoked or lost partitions (a later assignment starts afresh)."""
        for tp in tps:
            self._states.pop(tp, None)
