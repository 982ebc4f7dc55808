"""Messages set aside in their partition while they wait for a retry, so that the
partition's other keys go on. No Kafka calls, no threads, no I/O: unit-tested on stubs.

A prefix-run partition (:class:`~kafka_idem.consume.partitions.PartitionState`) used to
wait, whole, for a message's next attempt: one failing key stalled every key of its
partition for as long as its backoff lasted. Now the message is *parked*: it leaves the
queue with its *lanes* (its idempotency key and, when the handler has one, its
ordering key), and the queue runs on. A later message that shares a lane with a parked
one is parked behind it, in offset order (a lane is a line); it runs when it is first
in all its lanes, as :mod:`~kafka_idem.consume.concurrency.keyed_state` runs key-ordered
handlers. So each key, and each ordering key, keeps its order; different keys do not
wait for each other.

The committed offset never passes a parked message (the partition's commit stops at
the lowest one), so a crash or a rebalance delivers it again, and with it every later
message: those that finished are answered from the store (their records replay, the
handler is not called again). How much that is, and how much is held in memory, is
bounded by the partition's look-ahead (``retry_lookahead``): it stops fetching once that
many messages past its oldest parked one were queued, until that one finishes.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kafka_idem.consume.outcome import Prepared
from kafka_idem.handler import Handler
from kafka_idem.keys import check_key

Lanes = tuple[str, ...]


def lanes(handler: Handler[Any], prep: Prepared, key_max_bytes: int) -> Lanes:
    """A decoded message's lanes: its idempotency key, and its ordering key when its
    handler has one (raises the :class:`~kafka_idem.errors.MessageError` of an ordering
    key that cannot be built)."""
    out: Lanes = ("k:" + prep.key,)
    if handler.ordering is not None:
        order = check_key(handler.ordering.build(prep.model), key_max_bytes,
                          escaped=handler.ordering.escapes)
        out += ("o:" + order,)
    return out


@dataclass(slots=True, eq=False)
class Parked:
    """A message waiting in its lanes: for its next attempt (a head), or for the
    messages before it in its lanes (behind)."""

    msg: Any
    lanes: Lanes
    not_before: float = 0.0  # a head's next attempt (monotonic time)
    running: bool = False  # taken into a unit, its result not applied yet

    @property
    def offset(self) -> int:
        return int(self.msg.offset())


class Parking:
    """One partition's parked messages and their lanes."""

    def __init__(self) -> None:
        self._entries: dict[int, Parked] = {}  # by offset
        self._lanes: dict[str, list[int]] = {}  # lane -> its parked offsets, in offset order
        self._low: list[int] = []  # heap of parked offsets (finished ones left until seen)
        self._heads: set[int] = set()  # first in all their lanes: kept as lanes change

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, offset: int) -> bool:
        return offset in self._entries

    def lowest(self) -> int | None:
        """The lowest parked offset: where the partition's commit stops. Not the first
        parked: a message deferred in a unit is parked after later ones of a parked lane
        the queue's check set aside before it ran."""
        low = self._low
        while low and low[0] not in self._entries:
            heapq.heappop(low)
        return low[0] if low else None

    def holds(self, lanes: Lanes) -> bool:
        """Whether a message with ``lanes`` must wait behind a parked one."""
        return any(lane in self._lanes for lane in lanes)

    def park(self, msg: Any, lanes: Lanes, not_before: float) -> None:
        """Set ``msg`` aside: first in its lanes, it runs at ``not_before``; behind
        others (lower offsets of one of its lanes), when those finished. A lane stays in
        offset order whatever order its messages are parked in."""
        entry = Parked(msg, lanes, not_before)
        self._entries[entry.offset] = entry
        heapq.heappush(self._low, entry.offset)
        for lane in lanes:
            line = self._lanes.setdefault(lane, [])
            bisect.insort(line, entry.offset)
            if line[0] == entry.offset and len(line) > 1:
                self._heads.discard(line[1])  # no longer first in this lane
        if self._first(entry):
            self._heads.add(entry.offset)

    def _first(self, entry: Parked) -> bool:
        return all(self._lanes[lane][0] == entry.offset for lane in entry.lanes)

    def heads(self) -> Iterator[Parked]:
        """The parked messages first in all their lanes and not running (few: the keys
        that wait for an attempt, not the messages behind them)."""
        for offset in self._heads:
            entry = self._entries[offset]
            if not entry.running:
                yield entry

    def due(self, now: float) -> bool:
        return any(e.not_before <= now for e in self.heads())

    def take(self, now: float) -> list[Parked]:
        """The heads due now, lowest offset first (they run once :meth:`start` says so)."""
        return sorted((e for e in self.heads() if e.not_before <= now), key=lambda e: e.offset)

    def start(self, offset: int) -> None:
        """A head went into a unit: running until :meth:`finished`, :meth:`deferred` or
        :meth:`unstarted`."""
        entry = self._entries.get(offset)
        if entry is not None:
            entry.running = True

    def deadline(self) -> float | None:
        """When the next head is due (None: none waits for a time)."""
        return min((e.not_before for e in self.heads()), default=None)

    def finished(self, offset: int) -> None:
        """A parked message is done: it leaves its lanes, and the next of each runs
        when first in all of its own (at once: its wait was for this one)."""
        entry = self._entries.pop(offset)
        self._heads.discard(offset)
        for lane in entry.lanes:
            line = self._lanes[lane]
            line.remove(offset)  # the first, as it ran first in its lanes
            if not line:
                del self._lanes[lane]
            elif self._first(nxt := self._entries[line[0]]):
                self._heads.add(nxt.offset)

    def deferred(self, offset: int, not_before: float) -> None:
        """A parked message ran and must wait again (it stays first in its lanes)."""
        entry = self._entries[offset]
        entry.running = False
        entry.not_before = not_before

    def unstarted(self, offset: int) -> None:
        """A taken message did not run (its unit stopped before it): it may again."""
        entry = self._entries.get(offset)
        if entry is not None:
            entry.running = False
