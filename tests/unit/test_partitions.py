"""Per-partition bookkeeping on stub messages: queues, results, backoff, pause/resume.

No Kafka, no PostgreSQL: :mod:`kafka_idem.consume.partitions` only decides, and
these tests check its decisions (what is committable after which results, when
a partition is due again, what to pause and resume, what a revoke forgets).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from kafka_idem.consume.outcome import Deferred, Finished
from kafka_idem.consume.partitions import Partitions, PartitionState
from kafka_idem.testing import FakeMessage

T = "orders"
TP0 = (T, 0)
TP1 = (T, 1)


def msg(topic: str, partition: int, offset: int) -> FakeMessage:
    return FakeMessage(topic, partition=partition, offset=offset)


def upper(low: float, high: float) -> float:
    """A jitter that always picks the top of its range (deterministic growth)."""
    return high


def filled(*offsets: int, partition: int = 0, now: float = 0.0) -> Partitions:
    parts = Partitions(jitter=upper)
    for o in offsets:
        parts.add(msg(T, partition, o), now)
    return parts


def offsets_of(parts: Partitions, tp: tuple[str, int]) -> list[int]:
    st = parts.get(tp)
    assert st is not None
    return [m.offset() for m in st.queue]


def test_messages_queue_in_order_and_a_refetch_is_not_queued_twice() -> None:
    parts = filled(5, 6, 7)
    parts.add(msg(T, 0, 6), 1.0)  # a re-fetch after a rewind
    parts.add(msg(T, 0, 8), 1.0)
    parts.add(msg(T, 1, 0), 1.0)
    assert offsets_of(parts, TP0) == [5, 6, 7, 8]
    assert offsets_of(parts, TP1) == [0]


def test_a_finished_prefix_becomes_the_offset_after_it() -> None:
    parts = filled(10, 11, 12, 13)
    counts = parts.apply({TP0: [Finished("succeeded"), Finished("replayed")]}, now=1.0)
    assert offsets_of(parts, TP0) == [12, 13]
    assert parts.pending_commits(in_flight_too=False) == [(TP0, 12)]
    assert counts == {(T, "succeeded"): 1, (T, "replayed"): 1}


def test_nothing_is_committable_past_a_deferred_message() -> None:
    parts = filled(0, 1, 2, 3)
    # A result list never holds anything after a deferral; even if it did, it is ignored.
    parts.apply({TP0: [Finished("succeeded"), Deferred(2.0, "busy"), Finished("succeeded")]},
                now=10.0)
    assert offsets_of(parts, TP0) == [1, 2, 3]
    assert parts.pending_commits(in_flight_too=False) == [(TP0, 1)]


def test_a_partition_deferred_first_has_nothing_to_commit() -> None:
    parts = filled(0, 1)
    counts = parts.apply({TP0: [Deferred(1.0, "retry")]}, now=5.0)
    assert parts.pending_commits(in_flight_too=True) == []
    assert counts == {(T, "retried"): 1}


def test_a_deferred_partition_is_due_again_only_after_its_delay() -> None:
    parts = filled(0, 1)
    parts.apply({TP0: [Deferred(2.0, "busy")]}, now=10.0)
    assert parts.due(11.9) == []
    assert [tp for tp, _ in parts.due(12.0)] == [TP0]
    # The loop may sleep until then, and no longer.
    assert parts.wait_time(10.5, max_wait=5.0) == pytest.approx(1.5)


def test_the_claim_token_of_a_deferred_message_is_kept_until_it_finishes() -> None:
    parts = filled(0, 1)
    token = uuid.uuid4()
    parts.apply({TP0: [Deferred(0.0, "busy", token)]}, now=1.0)
    st = parts.get(TP0)
    assert st is not None
    assert st.tokens == {0: token}
    parts.apply({TP0: [Finished("succeeded")]}, now=2.0)
    assert st.tokens == {}


def test_our_own_failures_back_off_with_growth_and_a_success_resets_it() -> None:
    parts = filled(0, 1)
    delays = []
    now = 0.0
    for _ in range(8):
        parts.apply({TP0: [Deferred(0.0, "framework")]}, now=now)
        st = parts.get(TP0)
        assert st is not None
        delays.append(round(st.not_before - now, 6))
        now += 100.0
    # Doubling from 0.4 s, the exponent capped at 6 (12.8 s), then the 10 s ceiling.
    assert delays == [0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0, 10.0]
    parts.apply({TP0: [Finished("succeeded"), Deferred(0.0, "dlq")]}, now=now)
    assert st.not_before - now == pytest.approx(0.4)  # counting starts again
    # A retry or busy deferral waits what the store decided, and is not our failure.
    parts.apply({TP0: [Deferred(3.0, "retry")]}, now=now)
    assert st.not_before - now == pytest.approx(3.0)


def test_partitions_are_due_in_the_order_of_their_deadlines() -> None:
    parts = Partitions(jitter=upper)
    for p in (0, 1, 2):
        parts.add(msg(T, p, 0), 100.0)
    parts.apply({(T, 0): [Deferred(3.0, "busy")], (T, 1): [Deferred(1.0, "busy")],
                 (T, 2): [Deferred(2.0, "busy")]}, now=100.0)
    due_at = {t: [tp[1] for tp, _ in parts.due(100.0 + t)] for t in (0.5, 1.0, 2.0, 3.0)}
    assert due_at == {0.5: [], 1.0: [1], 2.0: [1, 2], 3.0: [0, 1, 2]}
    # A deferred partition is due when its delay ends, not a batch wait later.
    assert parts.wait_time(100.0, max_wait=5.0) == pytest.approx(1.0)


def test_a_partition_in_a_unit_is_not_due_and_does_not_shorten_the_wait() -> None:
    parts = filled(0, now=0.0)
    st = parts.get(TP0)
    assert st is not None
    st.enter_unit()
    assert parts.due(100.0) == []
    assert parts.wait_time(0.0, max_wait=0.25) == 0.25
    st.leave_unit()
    assert [tp for tp, _ in parts.due(0.0)] == [TP0]


def test_a_partly_filled_batch_waits_at_most_its_linger_from_its_oldest_message() -> None:
    parts = filled(0, now=10.0)
    assert parts.wait_time(10.1, max_wait=0.5, linger=0.3) == pytest.approx(0.2)
    assert parts.wait_time(11.0, max_wait=0.5, linger=0.3) == 0.001  # overdue: poll
    # Without a linger it runs at once (or when a unit finishes): no time to wake for.
    assert parts.wait_time(10.1, max_wait=0.5) == 0.5


def test_a_partition_waiting_on_a_backoff_is_paused_then_resumed_when_due() -> None:
    parts = filled(0, 1)
    parts.apply({TP0: [Deferred(2.0, "busy")]}, now=0.0)
    assert parts.pause_resume(1.0, batch_size=10) == ([TP0], [])
    assert parts.pause_resume(1.5, batch_size=10) == ([], [])  # paused once, not again
    assert parts.pause_resume(2.0, batch_size=10) == ([], [TP0])
    assert parts.pause_resume(2.5, batch_size=10) == ([], [])


def test_a_full_queue_pauses_until_it_is_down_to_one_batch() -> None:
    parts = filled(*range(20))
    assert parts.pause_resume(0.0, batch_size=10) == ([TP0], [])
    parts.apply({TP0: [Finished("succeeded")] * 9}, now=0.0)  # 11 left: still above a batch
    assert parts.pause_resume(0.0, batch_size=10) == ([], [])
    parts.apply({TP0: [Finished("succeeded")]}, now=0.0)  # 10 left
    assert parts.pause_resume(0.0, batch_size=10) == ([], [TP0])


def test_a_partition_in_a_unit_with_a_short_queue_is_neither_paused_nor_resumed() -> None:
    parts = filled(0, 1)
    st = parts.get(TP0)
    assert st is not None
    parts.apply({TP0: [Deferred(5.0, "busy")]}, now=0.0)
    st.enter_unit()  # not waiting on its backoff while in a unit
    assert parts.pause_resume(1.0, batch_size=10) == ([], [])


def test_a_forgotten_partition_drops_its_queue_and_ignores_late_results() -> None:
    parts = filled(0, 1)
    parts.add(msg(T, 1, 7), 0.0)
    parts.apply({TP0: [Finished("succeeded")]}, now=0.0)
    parts.forget([TP0])
    assert parts.get(TP0) is None
    assert parts.apply({TP0: [Finished("succeeded")]}, now=1.0) == {}
    assert parts.pending_commits(in_flight_too=True) == []
    assert offsets_of(parts, TP1) == [7]
    # Assigned again: it starts afresh, re-fetched messages queue again.
    parts.add(msg(T, 0, 0), 2.0)
    assert offsets_of(parts, TP0) == [0]


def test_pending_commits_skip_a_partition_with_a_commit_in_flight_unless_asked() -> None:
    parts = Partitions(jitter=upper)
    for p in (0, 1):
        parts.add(msg(T, p, 0), 0.0)
    parts.apply({TP0: [Finished("succeeded")], TP1: [Finished("succeeded")]}, now=0.0)
    st = parts.get(TP0)
    assert st is not None
    st.commit_sent(1)
    assert parts.pending_commits(in_flight_too=False) == [(TP1, 1)]
    assert parts.pending_commits(in_flight_too=True) == [(TP0, 1), (TP1, 1)]
    assert parts.pending_commits(in_flight_too=True, of=[TP1, ("other", 0)]) == [(TP1, 1)]


def test_a_partition_held_on_a_configuration_error_waits_longer_each_time_up_to_a_minute() -> None:
    parts = Partitions(jitter=upper)
    parts.add(msg(T, 0, 0), now=0.0)
    delays, now = [], 0.0
    for _ in range(9):
        parts.apply({TP0: [Deferred(0.0, "config")]}, now=now)
        st = parts.get(TP0)
        assert st is not None
        delays.append(st.not_before - now)
        now = st.not_before
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    parts.apply({TP0: [Finished("succeeded")]}, now=now)
    assert parts.get(TP0).framework_failures == 0  # type: ignore[union-attr]


def test_what_is_prepared_ahead_is_made_once_per_queued_message_and_taken_once() -> None:
    made: list[int] = []

    def prepare(m: Any) -> object | None:
        made.append(m.offset())
        return None if m.offset() == 7 else f"prepared {m.offset()}"

    parts = Partitions(jitter=upper, prepare=prepare)
    for o in (5, 6, 7, 6):  # 6 again: a re-fetch, not queued, not prepared again
        parts.add(msg(T, 0, o), 0.0)
    assert made == [5, 6, 7]
    st = parts.get(TP0)
    assert isinstance(st, PartitionState)
    assert st.take_prepared(st.prefix(2)) == {5: "prepared 5", 6: "prepared 6"}
    assert st.take_prepared(st.prefix()) == {}  # taken: a second attempt decodes again
    assert st.ahead == {}
