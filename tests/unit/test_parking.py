"""Parking on stub messages: a message waiting for a retry leaves its partition's queue
with its lanes, later messages of its lanes wait behind it, the others run, and the
committable offset stays at the lowest parked message (kafka_idem.consume.parking and
PartitionState's use of it)."""

from __future__ import annotations

from kafka_idem.consume.outcome import Deferred, Finished
from kafka_idem.consume.parking import Parking
from kafka_idem.consume.partitions import PartitionState
from kafka_idem.testing import FakeMessage

T = "orders"


def msg(offset: int, key: str) -> FakeMessage:
    return FakeMessage(T, partition=0, offset=offset, value=key.encode())


def state(*keys: str, lookahead: int = 100, lanes_of: object = None) -> PartitionState:
    """A partition holding one message per key (offsets 0, 1, ...): a message's lanes
    are its value (an ordering key after a '/': ``"a/t1"``)."""
    def lanes(m: FakeMessage) -> tuple[str, ...] | None:
        text = (m.value() or b"").decode()
        if text == "?":
            return None  # cannot be decoded now
        key, _, order = text.partition("/")
        return ("k:" + key,) + (("o:" + order,) if order else ())

    st = PartitionState(jitter=lambda lo, hi: hi, lanes=lanes_of or lanes,  # type: ignore[arg-type]
                        lookahead=lookahead, sift=10)
    for i, k in enumerate(keys):
        st.add(msg(i, k), 0.0)
    return st


def run(st: PartitionState, now: float, *results: Finished | Deferred) -> list[int]:
    """Take the partition's next unit, apply ``results`` to it; the unit's offsets."""
    assert st.due(now)
    taken = st.prefix(None, now)
    st.enter_unit()
    st.leave_unit()
    st.apply(list(results), now)
    return [m.offset() for m in taken]


OK = Finished("succeeded")


def test_a_retried_message_is_parked_and_the_rest_of_its_partition_runs_on() -> None:
    st = state("a", "b", "c")
    assert run(st, 0.0, OK, Deferred(5.0, "retry")) == [0, 1, 2]
    assert st.to_commit == 1  # stops at the parked message
    assert 1 in st.parking and [m.offset() for m in st.queue] == [2]
    assert run(st, 0.1, OK) == [2]  # not held by the wait
    assert st.to_commit == 1
    assert st.deadline(0.0) == 5.0 and not st.due(4.9)
    assert run(st, 5.0, OK) == [1]  # due: its next attempt
    assert st.to_commit == 3 and not st.parking


def test_later_messages_of_a_parked_key_wait_behind_it_in_offset_order() -> None:
    st = state("a", "b", "a", "c", "a")
    assert run(st, 0.0, Deferred(5.0, "retry")) == [0, 1, 2, 3, 4]
    # The queue is checked against the new lane: both later "a"s park behind it.
    assert run(st, 0.0, OK, OK) == [1, 3]
    assert len(st.parking) == 3 and not st.queue and st.to_commit is None
    assert not st.due(4.0)
    assert run(st, 5.0, OK) == [0]
    assert run(st, 5.0, OK) == [2]  # the next of its lane, at once
    assert run(st, 5.0, OK) == [4]
    assert st.to_commit == 5


def test_an_ordering_key_is_a_lane_too() -> None:
    st = state("a/t1", "b/t1", "c/t2")
    assert run(st, 0.0, Deferred(1.0, "retry")) == [0, 1, 2]
    assert run(st, 0.0, OK) == [2]  # other tenant runs; b (same tenant) waits
    assert [e.offset for e in st.parking.heads()] == [0]
    assert run(st, 1.0, OK) == [0]
    assert run(st, 1.0, OK) == [1]


def test_a_parked_message_that_fails_again_waits_again() -> None:
    st = state("a", "b")
    run(st, 0.0, Deferred(1.0, "retry"))
    assert run(st, 1.0, OK, Deferred(2.0, "retry")) == [1, 0]  # the queue first
    assert not st.queue and st.to_commit is None
    assert st.deadline(0.0) == 3.0 and not st.due(2.9)
    assert run(st, 3.0, OK) == [0]
    assert st.to_commit == 2


def test_our_own_failure_holds_the_whole_partition_as_before() -> None:
    st = state("a", "b")
    run(st, 0.0, Deferred(0.0, "framework"))
    assert not st.parking and st.not_before > 0.0 and not st.due(0.0)


def test_without_lanes_a_retry_holds_the_partition() -> None:
    st = PartitionState(jitter=lambda lo, hi: hi)  # retry_blocks_partition
    for i in range(3):
        st.add(msg(i, "x"), 0.0)
    st.prefix(None, 0.0)
    st.apply([OK, Deferred(5.0, "retry")], 0.0)
    assert not st.parking and [m.offset() for m in st.queue] == [1, 2]
    assert not st.due(4.0) and st.due(5.0)


def test_a_message_whose_lanes_cannot_be_known_now_holds_the_queue_there() -> None:
    st = state("a", "?", "b")
    run(st, 0.0, Deferred(5.0, "retry"))
    # The registry is down for the next one: it is first, the partition waits.
    assert not st.due(0.0) and st.not_before > 0.0
    assert [m.offset() for m in st.queue] == [1, 2]


def test_the_lookahead_pauses_fetching_until_the_parked_message_finishes() -> None:
    st = state("a", "b", "c", "d", lookahead=3)
    run(st, 0.0, Deferred(5.0, "retry"))
    assert st.far_ahead() and st.pause_if(0.0, full=1000)
    run(st, 0.0, OK, OK, OK)
    assert not st.resume_if(0.0, low=500)  # still 3 past the parked one
    run(st, 5.0, OK)
    assert st.resume_if(5.0, low=500) and st.to_commit == 4


def test_a_unit_stopped_before_a_parked_head_leaves_it_due() -> None:
    st = state("a", "b", "c")
    run(st, 0.0, Deferred(1.0, "retry"))
    run(st, 0.0, Deferred(1.0, "retry"))  # b parks too
    assert run(st, 1.0) == [2, 0, 1]  # a unit cancelled before anything ran
    assert {e.offset for e in st.parking.heads()} == {0, 1}
    assert st.due(1.0)


def test_parking_lanes_and_heads() -> None:
    p = Parking()
    p.park(msg(3, "a"), ("k:a",), 2.0)
    p.park(msg(5, "b"), ("k:b", "o:t"), 1.0)
    p.park(msg(7, "c"), ("k:c", "o:t"), 0.0)  # behind b (same ordering key)
    assert p.lowest() == 3 and p.holds(("k:x", "o:t")) and not p.holds(("k:x",))
    assert [e.offset for e in p.take(1.5)] == [5]
    assert p.deadline() == 1.0
    p.finished(5)
    assert [e.offset for e in p.take(1.5)] == [7]
    p.finished(3)
    assert p.lowest() == 7


def test_the_commit_stops_at_the_lowest_parked_message_whatever_order_they_were_parked_in() -> None:
    # x fails; its later message (offset 3) is set aside behind it before y (offset 1)
    # runs and fails in turn: y is parked after 3, but the commit must stop at y.
    st = state("x", "y", "z", "x")
    run(st, 0.0, Deferred(1.0, "retry"))
    assert run(st, 0.0, Deferred(9.0, "retry")) == [1, 2]  # 3 went behind x
    assert st.parking.lowest() == 0
    assert run(st, 1.0, OK, OK) == [2, 0]  # z, then x (due)
    assert st.to_commit == 1  # y, though x's later message (3) was parked before it
    assert run(st, 1.0, OK) == [3]  # x's later message, at once
    assert st.parking.lowest() == 1 and st.to_commit == 1  # not past y
    assert not st.queue


def test_a_lane_keeps_offset_order_when_a_lower_offset_is_parked_later() -> None:
    # 3 ("x/t") waits behind x (0); then 1 ("y/t"), of the same tenant, fails: it goes
    # before 3 in the tenant's lane, so 3 runs after both.
    st = state("x/t0", "y/t", "z", "x/t")
    run(st, 0.0, Deferred(1.0, "retry"))
    run(st, 0.0, Deferred(5.0, "retry"))  # y fails; 3 was set aside behind x
    run(st, 0.0, OK)  # z
    assert run(st, 1.0, OK) == [0]  # x; 3 is now first of x's lane, not of the tenant's
    assert not st.due(1.0)
    assert run(st, 5.0, OK) == [1]
    assert run(st, 5.0, OK) == [3]
    assert st.to_commit == 4


def test_a_failing_parked_message_does_not_hold_up_the_queue() -> None:
    st = state("x", "a", "b")
    run(st, 0.0, Deferred(1.0, "retry"))
    st.add(msg(3, "c"), 0.0)
    # x is due again with the queue: the queue runs first, x last (it fails again).
    assert run(st, 1.0, OK, OK, OK, Deferred(1.0, "retry")) == [1, 2, 3, 0]
    assert not st.queue and st.to_commit is None and st.parking.lowest() == 0


def test_the_lookahead_is_a_bound_on_what_runs_past_the_parked_message() -> None:
    st = state("x", "a", "b", "c", "d", "e", lookahead=2)
    run(st, 0.0, Deferred(9.0, "retry"))
    assert run(st, 0.0, OK, OK) == [1, 2]  # 3 is further than 2 past x: not run
    assert not st.due(0.0) and st.far_ahead()


def test_the_heads_follow_the_lanes_as_messages_are_parked_and_finish() -> None:
    """Heads are kept as lanes change (not searched for): checked against a search."""
    import random as rnd

    gen = rnd.Random(7)
    p = Parking()
    order = list(range(60))
    gen.shuffle(order)
    for o in order[:40]:
        lanes = tuple(sorted({f"k{gen.randrange(8)}", f"o{gen.randrange(5)}"}))
        p.park(msg(o, "x"), lanes, 0.0)

    def searched() -> set[int]:
        return {o for o, e in p._entries.items()
                if all(p._lanes[lane][0] == o for lane in e.lanes)}

    while len(p):
        assert {e.offset for e in p.heads()} == searched()
        p.finished(gen.choice(sorted(searched())))
    assert list(p.heads()) == []


def test_due_retries_and_the_queue_take_turns_so_neither_holds_the_other_up() -> None:
    # x waits; every other queued message is a new key failing at its first attempt.
    st = state("x", "a", "f1", "b", "f2", "c", "f3")
    run(st, 0.0, Deferred(1.0, "retry"))
    # Due at 1.0: the queue first this time (a, then f1 fails: the unit stops) ...
    assert run(st, 1.0, OK, Deferred(5.0, "retry")) == [1, 2, 3, 4, 5, 6, 0]
    # ... the due retry first the next time, whatever the queue holds.
    assert run(st, 1.0, OK, OK, Deferred(5.0, "retry")) == [0, 3, 4, 5, 6]
    assert st.parking.lowest() == 2 and st.to_commit == 2
