"""Key-ordered concurrency inside one partition: which messages may run now, and
what may be committed. No Kafka calls, no threads, no I/O: unit-tested on stubs.

A handler registered with ``concurrency > 1`` (or an ``async def`` one) has its
partitions kept as a :class:`KeyedState` instead of a prefix queue. Each message,
once *admitted* (decoded by the caller, in offset order), holds a place in one
*lane* per key it has: its idempotency key and its ordering key. A message may
start only when it is first in every one of its lanes, so the messages of one key
run one after another in offset order, and messages of different keys run side by
side, lowest offset first, as many as the caller has room for.

A message deferred (busy key, retry backoff, our own outage) stays first in its
lanes until it finishes: later messages of its keys wait for it, other keys go
on. The committable offset is the end of the contiguous run of finished messages
at the front of the partition, so it never passes a message that is running,
waiting or backing off, however many later ones have finished. Memory: the
loop pauses a partition whose unfinished messages (fetched or admitted) reach its
bound, or that took in ``retry_lookahead`` messages past its oldest unfinished one
(:meth:`KeyedState.pause_if`), so a slow key at the front stops fetching, never holds
an unbounded queue, and a crash delivers at most that many messages again (finished
ones replay from the store).
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kafka_idem.consume.committable import Committable, Message
from kafka_idem.consume.outcome import Deferred, Finished, Reason, Result

Prepare = Callable[[Any], tuple[tuple[str, ...], Any]]
"""The caller's admission of a message: its lanes and the job a worker gets; raises
:class:`NotNow` when the message cannot be decoded yet (our surroundings failed)."""


class NotNow(Exception):
    """A message cannot be admitted yet (e.g. the schema registry is down): admission
    stops at it, in offset order, and is tried again after a growing wait."""


@dataclass(slots=True, eq=False)
class Entry:
    """An admitted message: its lanes, the caller's job, and where it stands."""

    msg: Any
    lanes: tuple[str, ...]
    job: Any
    token: Any = None  # our live claim from a deferred try, re-entered next time
    running: bool = False
    done: bool = False
    not_before: float = field(default=0.0)

    @property
    def offset(self) -> int:
        return int(self.msg.offset())


class KeyedState(Committable):
    """One partition of a key-ordered handler."""

    def __init__(self, *, jitter: Callable[[float, float], float] = random.uniform,
                 lookahead: int = 10_000) -> None:
        super().__init__(jitter=jitter)
        self._lookahead = lookahead
        self._done = 0  # admitted entries finished, not yet out of the committable prefix
        self.fetched: deque[Any] = deque()  # not admitted yet, in offset order
        self.entries: dict[int, Entry] = {}  # admitted, in offset order (dict order)
        self._order: deque[int] = deque()  # the admitted offsets, for the finished prefix
        self._lanes: dict[str, deque[int]] = {}  # lane -> its unfinished offsets, in order
        self._ready: list[int] = []  # heap: first in all their lanes, due, not running
        self._sleeping: dict[int, float] = {}  # first in their lanes, deferred until
        self.running = 0
        self.last_queued = -1
        self.admit_not_before = 0.0

    # --- fetched and admitted --------------------------------------------------------

    def add(self, msg: Message, now: float) -> None:
        if msg.offset() <= self.last_queued:
            return  # already queued (a re-fetch after a rewind)
        self.fetched.append(msg)
        self.last_queued = msg.offset()

    def admit(self, now: float, prepare: Prepare, *, want: int | None = None) -> None:
        """Admit the fetched messages in offset order (``prepare`` decodes each one)
        until one cannot be decoded now: it and those after it wait. ``want``: stop
        once that many may start (the caller's room for them), leaving the rest to a
        later round: decoding a whole fetched batch at once holds up everything else
        the caller's thread runs, and they would only wait."""
        if not self.fetched or now < self.admit_not_before:
            return
        while self.fetched and (want is None or len(self._ready) < want):
            msg = self.fetched[0]
            if self._order and msg.offset() - self._order[0] > self._lookahead:
                break  # no further past the oldest unfinished message than the look-ahead
            try:
                lanes, job = prepare(msg)
            except NotNow:
                self.admit_not_before = now + self.delay(Deferred(0.0, Reason.FRAMEWORK))
                return
            self.fetched.popleft()
            entry = Entry(msg, lanes, job)
            offset = entry.offset
            self.entries[offset] = entry
            self._order.append(offset)
            first = True
            for lane in lanes:
                queue = self._lanes.get(lane)
                if queue is None:
                    queue = self._lanes[lane] = deque()
                first = first and not queue
                queue.append(offset)
            if first:
                heapq.heappush(self._ready, offset)
        self.admit_not_before = 0.0

    # --- run ---------------------------------------------------------------------------

    def take(self, n: int, now: float) -> list[Entry]:
        """Up to ``n`` messages that may start now, lowest offset first; they are
        running until :meth:`finish`."""
        if self._sleeping:
            for offset, when in list(self._sleeping.items()):
                if when <= now:
                    del self._sleeping[offset]
                    heapq.heappush(self._ready, offset)
        out: list[Entry] = []
        while self._ready and len(out) < n:
            entry = self.entries[heapq.heappop(self._ready)]
            entry.running = True
            out.append(entry)
        self.running += len(out)
        return out

    def can_take(self, now: float) -> bool:
        return bool(self._ready) or any(when <= now for when in self._sleeping.values())

    def finish(self, offset: int, result: Result, now: float) -> str | None:
        """Apply a running message's result; return the outcome name to count. A
        finished message leaves its lanes (the next of each may start) and the
        finished prefix becomes committable; a deferred one stays first in its lanes
        and waits for its delay."""
        entry = self.entries.get(offset)
        if entry is None or not entry.running:
            return None  # not ours (a stale result)
        entry.running = False
        self.running -= 1
        if isinstance(result, Deferred):
            if result.token is not None:
                entry.token = result.token
            entry.not_before = now + self.delay(result)
            if entry.not_before <= now:
                heapq.heappush(self._ready, offset)
            else:
                self._sleeping[offset] = entry.not_before
            if result.reason in (Reason.BUSY, Reason.RETRY):
                return "busy" if result.reason is Reason.BUSY else "retried"
            return None
        entry.done = True
        entry.token = None
        self._done += 1
        self.framework_failures = 0
        self._leave_lanes(entry)
        while self._order and self.entries[self._order[0]].done:
            first = self._order.popleft()
            del self.entries[first]
            self._done -= 1
            self.to_commit = first + 1
        return str(result.outcome) if isinstance(result, Finished) else None

    def unstarted(self, offset: int) -> None:
        """A taken message did not start (its partition was leaving): it may again."""
        entry = self.entries.get(offset)
        if entry is not None and entry.running:
            entry.running = False
            self.running -= 1
            heapq.heappush(self._ready, offset)

    def _leave_lanes(self, entry: Entry) -> None:
        nexts: set[int] = set()
        for lane in entry.lanes:
            queue = self._lanes[lane]
            assert queue[0] == entry.offset  # it could only run first in its lanes
            queue.popleft()
            if queue:
                nexts.add(queue[0])
            else:
                del self._lanes[lane]
        for offset in sorted(nexts):
            nxt = self.entries[offset]
            if all(self._lanes[lane][0] == offset for lane in nxt.lanes):
                heapq.heappush(self._ready, offset)

    # --- what the loop asks --------------------------------------------------------------

    @property
    def size(self) -> int:
        """Messages held: fetched, admitted, running and finished-not-committable."""
        return len(self.fetched) + len(self.entries)

    def unfinished(self) -> Iterator[Entry]:
        return (e for e in self.entries.values() if not e.done)

    def first_offset(self) -> int | None:
        if self._order:
            return self._order[0]
        return self.fetched[0].offset() if self.fetched else None

    def deadline(self, linger: float) -> float | None:
        times = list(self._sleeping.values())
        if self.fetched and self.admit_not_before:
            times.append(self.admit_not_before)
        return min(times) if times else None

    def blocked(self, now: float) -> bool:
        """Admission waits on our surroundings: nothing after it can run."""
        return bool(self.fetched) and self.admit_not_before > now

    def far_ahead(self) -> bool:
        """Took in ``retry_lookahead`` messages past its oldest unfinished one."""
        first = self.first_offset()
        return first is not None and self.last_queued - first >= self._lookahead

    def pause_if(self, now: float, full: int) -> bool:
        if self.paused or not (self.blocked(now) or self.size - self._done >= full
                               or self.far_ahead()):
            return False
        self.paused = True
        return True

    def resume_if(self, now: float, low: int) -> bool:
        if (not self.paused or self.blocked(now) or self.size - self._done > low
                or self.far_ahead()):
            return False
        self.paused = False
        return True
