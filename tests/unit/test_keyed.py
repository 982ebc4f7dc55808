"""Key-ordered bookkeeping on stub messages: which messages may start, in what
order, and what may be committed after which results.

No Kafka, no PostgreSQL: :mod:`kafka_idem.consume.concurrency.keyed_state` only decides.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import pytest

from kafka_idem.consume.concurrency.keyed_state import KeyedState, NotNow
from kafka_idem.consume.outcome import Deferred, Finished
from kafka_idem.deadletters.dead_letter import DeadLetter


@dataclass(frozen=True)
class Msg:
    o: int
    key: str
    order: str | None = None

    def topic(self) -> str:
        return "t"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self.o


def lanes(msg: Any) -> tuple[tuple[str, ...], Any]:
    lanes_ = ("k:" + msg.key,) + (("o:" + msg.order,) if msg.order else ())
    return lanes_, f"job{msg.o}"


def upper(low: float, high: float) -> float:
    return high


OK = Finished("succeeded")


def state(*msgs: Msg) -> KeyedState:
    st = KeyedState(jitter=upper)
    for m in msgs:
        st.add(m, 0.0)
    st.admit(0.0, lanes)
    return st


def offsets(entries: list[Any]) -> list[int]:
    return [e.offset for e in entries]


def test_messages_of_one_key_start_one_after_another_in_offset_order() -> None:
    st = state(Msg(0, "a"), Msg(1, "a"), Msg(2, "a"))
    assert offsets(st.take(10, 0.0)) == [0]
    assert st.take(10, 0.0) == []  # 1 waits for 0, though there is room
    st.finish(0, OK, 0.0)
    assert offsets(st.take(10, 0.0)) == [1]
    st.finish(1, OK, 0.0)
    assert offsets(st.take(10, 0.0)) == [2]


def test_different_keys_start_together_lowest_offset_first_up_to_the_room_given() -> None:
    st = state(Msg(0, "a"), Msg(1, "b"), Msg(2, "a"), Msg(3, "c"), Msg(4, "d"))
    assert offsets(st.take(3, 0.0)) == [0, 1, 3]
    assert offsets(st.take(3, 0.0)) == [4]
    assert st.running == 4


def test_the_offset_never_passes_an_unfinished_message() -> None:
    st = state(Msg(0, "slow"), Msg(1, "b"), Msg(2, "c"))
    st.take(3, 0.0)
    st.finish(2, OK, 0.0)
    st.finish(1, OK, 0.0)
    assert st.to_commit is None  # 0 still runs: nothing is committable
    st.finish(0, OK, 0.0)
    assert st.to_commit == 3  # the whole finished run at once
    assert st.entries == {}


def test_a_key_backing_off_holds_its_own_later_messages_and_the_offset_not_other_keys() -> None:
    st = state(Msg(0, "a"), Msg(1, "a"), Msg(2, "b"), Msg(3, "c"))
    st.take(1, 0.0)
    assert st.finish(0, Deferred(5.0, "retry"), 0.0) == "retried"
    started = offsets(st.take(10, 1.0))
    assert started == [2, 3]  # other keys go on; 1 waits behind its key's backoff
    st.finish(2, OK, 1.0)
    st.finish(3, OK, 1.0)
    assert st.to_commit is None  # 0 is first and unfinished
    assert st.deadline(0.1) == 5.0  # the loop wakes for it
    assert st.take(10, 4.9) == []
    assert offsets(st.take(10, 5.0)) == [0]  # due again, before its successor
    st.finish(0, OK, 5.0)
    assert offsets(st.take(10, 5.0)) == [1]
    st.finish(1, OK, 5.0)
    assert st.to_commit == 4


def test_a_deferred_message_keeps_its_claim_token_for_the_next_try() -> None:
    st = state(Msg(0, "a"))
    st.take(1, 0.0)
    token = uuid.uuid4()
    st.finish(0, Deferred(0.0, "framework", token=token), 0.0)
    (again,) = st.take(1, 10.0)
    assert again.token == token


def test_an_ordering_key_serialises_different_idempotency_keys() -> None:
    st = state(Msg(0, "k1", "acct1"), Msg(1, "k2", "acct1"), Msg(2, "k3", "acct2"))
    assert offsets(st.take(10, 0.0)) == [0, 2]
    st.finish(0, OK, 0.0)
    assert offsets(st.take(10, 0.0)) == [1]


def test_a_message_waits_until_it_is_first_in_every_one_of_its_lanes() -> None:
    # 2 shares k1 with 0 and acct2 with 1: it needs both to finish.
    st = state(Msg(0, "k1", "acct1"), Msg(1, "k9", "acct2"), Msg(2, "k1", "acct2"))
    assert offsets(st.take(10, 0.0)) == [0, 1]
    st.finish(0, OK, 0.0)
    assert st.take(10, 0.0) == []
    st.finish(1, OK, 0.0)
    assert offsets(st.take(10, 0.0)) == [2]


def test_a_message_with_no_lanes_runs_at_once() -> None:
    st = KeyedState(jitter=upper)
    st.add(Msg(0, "a"), 0.0)
    st.add(Msg(1, "bad"), 0.0)
    st.admit(0.0, lambda m: ((), "dead letter") if m.key == "bad" else lanes(m))
    assert offsets(st.take(10, 0.0)) == [0, 1]


def test_admission_stops_in_offset_order_when_a_message_cannot_be_decoded_now() -> None:
    st = KeyedState(jitter=upper)
    for m in (Msg(0, "a"), Msg(1, "b"), Msg(2, "c")):
        st.add(m, 0.0)
    down = {1}

    def prepare(m: Any) -> tuple[tuple[str, ...], Any]:
        if m.o in down:
            raise NotNow("registry down")
        return lanes(m)

    st.admit(0.0, prepare)
    assert offsets(st.take(10, 0.0)) == [0]  # 2 is not admitted past 1
    assert st.blocked(0.0)
    assert st.pause_if(0.0, full=100)  # nothing after it can run: stop fetching
    st.admit(0.1, prepare)
    assert st.take(10, 0.1) == []  # still inside its wait
    down.clear()
    st.admit(10.0, prepare)
    assert offsets(st.take(10, 10.0)) == [1, 2]
    assert not st.blocked(10.0)
    assert st.resume_if(10.0, low=100)


def test_admission_decodes_only_as_many_as_may_start_and_the_rest_in_later_rounds() -> None:
    st = KeyedState(jitter=upper)
    for m in (Msg(0, "a"), Msg(1, "a"), Msg(2, "b"), Msg(3, "c"), Msg(4, "d"), Msg(5, "e")):
        st.add(m, 0.0)
    decoded: list[int] = []

    def prepare(m: Any) -> tuple[tuple[str, ...], Any]:
        decoded.append(m.o)
        return lanes(m)

    st.admit(0.0, prepare, want=2)
    # 1 waits behind 0 (same key), so 2 is decoded too: two may start, no more decoded
    assert decoded == [0, 1, 2]
    assert st.size == 6  # what is held stays counted for the pause
    assert offsets(st.take(10, 0.0)) == [0, 2]
    st.admit(0.0, prepare, want=2)
    assert decoded == [0, 1, 2, 3, 4]
    assert offsets(st.take(1, 0.0)) == [3]
    st.admit(0.0, prepare)  # no bound: the rest
    assert decoded == [0, 1, 2, 3, 4, 5]
    assert offsets(st.take(10, 0.0)) == [4, 5]
    assert [st.first_offset(), st.size] == [0, 6]


def test_a_partition_pauses_when_it_holds_too_many_unfinished_and_resumes_when_drained() -> None:
    st = state(*(Msg(i, f"k{i}") for i in range(6)))
    assert st.pause_if(0.0, full=6)  # six fetched, none finished
    st.take(6, 0.0)
    for i in range(1, 6):
        st.finish(i, OK, 0.0)  # finished, but 0 holds them uncommittable
    assert st.size == 6  # held, but not counted: only 0 is unfinished
    assert st.resume_if(0.0, low=3)
    st.finish(0, OK, 0.0)
    assert st.size == 0


def test_a_partition_pauses_once_it_took_in_the_lookahead_past_its_oldest_unfinished() -> None:
    st = KeyedState(lookahead=4)
    for i in range(6):
        st.add(Msg(i, f"k{i}"), 0.0)
    st.admit(0.0, lanes)
    st.take(6, 0.0)
    for i in range(1, 6):
        st.finish(i, OK, 0.0)
    assert offsets(list(st.entries.values())) == [0, 1, 2, 3, 4]  # 5: too far past 0
    assert st.pause_if(0.0, full=100)  # took in 5 past offset 0, which still runs
    assert not st.resume_if(0.0, low=50)
    st.finish(0, OK, 0.0)
    assert st.resume_if(0.0, low=50) and st.to_commit == 5


def test_a_refetched_message_is_not_queued_twice() -> None:
    st = state(Msg(0, "a"), Msg(1, "b"))
    st.add(Msg(1, "b"), 0.0)
    st.admit(0.0, lanes)
    assert offsets(st.take(10, 0.0)) == [0, 1]
    assert st.size == 2


def test_a_result_for_a_message_not_running_is_ignored() -> None:
    st = state(Msg(0, "a"))
    assert st.finish(0, OK, 0.0) is None
    assert st.to_commit is None


def test_a_message_taken_but_not_started_may_start_again() -> None:
    st = state(Msg(0, "a"), Msg(1, "a"))
    st.take(1, 0.0)
    st.unstarted(0)
    assert st.running == 0
    assert offsets(st.take(10, 0.0)) == [0]


def test_a_dead_lettered_message_finishes_its_key() -> None:
    st = state(Msg(0, "a"), Msg(1, "a"))
    st.take(1, 0.0)
    letter: Any = object.__new__(DeadLetter)
    assert st.finish(0, Finished("dead_lettered", letter), 0.0) == "dead_lettered"
    assert st.to_commit == 1
    assert offsets(st.take(1, 0.0)) == [1]


def test_our_own_outages_wait_longer_each_time() -> None:
    st = state(Msg(0, "a"))
    waits = []
    now = 0.0
    for _ in range(4):
        (_e,) = st.take(1, now)
        st.finish(0, Deferred(0.0, "framework"), now)
        waits.append(st.deadline(0.1) - now)  # type: ignore[operator]
        now += 100.0
    assert waits == sorted(waits) and waits[0] < waits[-1]


@pytest.mark.parametrize("n", [1, 7])
def test_many_keys_run_and_finish_in_any_order_and_everything_is_committed(n: int) -> None:
    import random

    rng = random.Random(n)
    msgs = [Msg(i, f"k{rng.randrange(5)}") for i in range(200)]
    st = state(*msgs)
    last_done: dict[str, int] = {}
    running: list[Any] = []
    while st.entries:
        running += st.take(n - len(running), 0.0)
        keys = [e.msg.key for e in running]
        assert len(keys) == len(set(keys))  # never two of one key at once
        e = running.pop(rng.randrange(len(running)))
        assert last_done.get(e.msg.key, -1) < e.offset  # each key in offset order
        last_done[e.msg.key] = e.offset
        st.finish(e.offset, OK, 0.0)
        unfinished = [o for o, x in st.entries.items() if not x.done]
        if st.to_commit is not None and unfinished:
            assert st.to_commit <= min(unfinished)
    assert st.to_commit == 200
