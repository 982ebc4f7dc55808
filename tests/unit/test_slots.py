"""Handler slots (``consume/paths/slots.py``): how many key-ordered handler calls run at
once, first come first served, for threads and for tasks alike."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kafka_idem.consume.paths.slots import CallNotStarted, Gate, Slots, Tally


def test_a_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="size >= 1"):
        Slots(0)


def test_threads_wait_for_a_slot_and_get_it_in_the_order_they_asked() -> None:
    slots = Slots(1)
    slots.acquire()
    order: list[int] = []
    asked = [threading.Event() for _ in range(3)]

    def take(i: int) -> None:
        asked[i].set()
        slots.acquire()
        order.append(i)
        slots.release()

    threads = []
    for i in range(3):  # each asks only once the one before it waits
        t = threading.Thread(target=take, args=(i,))
        t.start()
        assert asked[i].wait(5)
        wait_until(lambda n=i + 1: len(slots._waiters) == n)
        threads.append(t)
    assert order == [] and slots.held == 1
    slots.release()
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2]
    assert slots.held == 0


def test_a_released_slot_goes_to_the_waiting_task_not_to_a_newcomer() -> None:
    async def main() -> list[str]:
        slots = Slots(1)
        await slots.acquire_async()
        got: list[str] = []

        async def take(name: str) -> None:
            await slots.acquire_async()
            got.append(name)

        waiting = asyncio.create_task(take("waiting"))
        await asyncio.sleep(0)  # it is queued now
        slots.release()  # handed to it, though it has not run yet
        newcomer = asyncio.create_task(take("newcomer"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert got == ["waiting"]  # the newcomer found the slot taken
        assert not newcomer.done()
        slots.release()
        await asyncio.wait_for(newcomer, 5)
        await waiting
        return got

    assert asyncio.run(main()) == ["waiting", "newcomer"]


def test_a_task_cancelled_while_waiting_takes_no_slot() -> None:
    async def main() -> None:
        slots = Slots(1)
        await slots.acquire_async()
        cancelled = asyncio.create_task(slots.acquire_async())
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        slots.release()
        assert slots.held == 0
        await asyncio.wait_for(slots.acquire_async(), 5)  # free, not lost to it
        assert slots.held == 1

    asyncio.run(main())


def test_a_slot_handed_to_a_task_that_is_then_cancelled_passes_on() -> None:
    async def main() -> None:
        slots = Slots(1)
        await slots.acquire_async()
        first = asyncio.create_task(slots.acquire_async())
        second = asyncio.create_task(slots.acquire_async())
        await asyncio.sleep(0)
        slots.release()  # handed to first, which has not woken yet ...
        first.cancel()  # ... and is cancelled before it does
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.wait_for(second, 5)  # the slot went on to the next waiter
        assert slots.held == 1

    asyncio.run(main())


def test_a_slot_released_by_a_thread_wakes_a_task_on_its_loop_and_the_reverse() -> None:
    slots = Slots(1)
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        slots.acquire()  # this thread holds it
        took = asyncio.run_coroutine_threadsafe(slots.acquire_async(), loop)
        wait_until(lambda: len(slots._waiters) == 1)
        assert not took.done()
        slots.release()  # from this thread: the task wakes on its loop's thread
        took.result(5)
        assert slots.held == 1
        done = threading.Event()

        def take() -> None:
            slots.acquire()
            done.set()

        t = threading.Thread(target=take)
        t.start()
        wait_until(lambda: len(slots._waiters) == 1)
        loop.call_soon_threadsafe(slots.release)  # from the loop: the thread wakes
        assert done.wait(5)
        t.join(5)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()


def test_a_gate_takes_its_handlers_slot_then_the_members_and_gives_both_back_once() -> None:
    handler, member = Slots(2), Slots(1)
    gate = Gate(handler, member)
    with gate:
        assert (handler.held, member.held) == (1, 1)
        gate.leave()  # as the call returns ...
        assert (handler.held, member.held) == (0, 0)
    assert (handler.held, member.held) == (0, 0)  # ... and not again on the way out


async def waiting_for_the_members_slot() -> tuple[Slots, Slots, Tally, asyncio.Task[Gate]]:
    """A gate that took its handler's slot and waits for the member's, which another
    handler's call holds."""
    handler, member, tally = Slots(2), Slots(1), Tally()
    await member.acquire_async()
    entering = asyncio.create_task(Gate(handler, member, tally=tally).enter_async())
    await asyncio.sleep(0)
    return handler, member, tally, entering


def test_a_gate_cancelled_while_waiting_for_the_members_slot_gives_back_its_handlers() -> None:
    async def main() -> None:
        handler, member, tally, entering = await waiting_for_the_members_slot()
        assert handler.held == 1  # it holds its handler's slot while it waits
        entering.cancel()
        with pytest.raises(asyncio.CancelledError):
            await entering
        assert (handler.held, member.held, tally.waiting, tally.running) == (0, 1, 0, 0)

    asyncio.run(main())


def test_a_call_waiting_for_the_members_slot_counts_as_waiting_not_running() -> None:
    """What ``kafka_idem_handler_calls`` shows: a message holding its handler's slot
    while another handler's calls hold the member's is waiting, not running."""

    async def main() -> None:
        handler, member, tally, entering = await waiting_for_the_members_slot()
        assert (handler.held, tally.running, tally.waiting) == (1, 0, 1)
        member.release()
        gate = await asyncio.wait_for(entering, 5)
        assert (tally.running, tally.waiting) == (1, 0)
        gate.leave()
        gate.leave()
        assert (tally.running, tally.waiting) == (0, 0)

    asyncio.run(main())


def test_a_closed_gate_ends_a_threads_wait_and_its_call_never_starts() -> None:
    handler, member, tally = Slots(1), Slots(1), Tally()
    member.acquire()  # another handler's call holds the member's only slot
    gate = Gate(handler, member, tally=tally)
    outcome: list[str] = []

    def enter() -> None:
        try:
            gate.enter()
            outcome.append("entered")
        except CallNotStarted:
            outcome.append("not started")

    t = threading.Thread(target=enter)
    t.start()
    wait_until(lambda: len(member._waiters) == 1)
    gate.close()  # a revoke or a stop
    t.join(5)
    assert outcome == ["not started"]
    assert (handler.held, member.held, tally.waiting, tally.running) == (0, 1, 0, 0)
    member.release()
    assert member.held == 0  # the slot went back to the pool, not to the gone waiter
    with pytest.raises(CallNotStarted):
        gate.enter()  # closed: never again


def test_a_closed_gate_ends_a_tasks_wait_and_a_slot_handed_meanwhile_goes_back() -> None:
    async def main() -> None:
        slots = Slots(1)
        await slots.acquire_async()
        gate = Gate(slots)
        entering = asyncio.create_task(gate.enter_async())
        await asyncio.sleep(0)
        gate.close()
        with pytest.raises(CallNotStarted):
            await entering
        assert slots.held == 1  # still the first holder's
        raced = Gate(slots)
        racing = asyncio.create_task(raced.enter_async())
        await asyncio.sleep(0)
        slots.release()  # handed to it ...
        raced.close()  # ... and closed before it woke: it gives the slot back
        with pytest.raises(CallNotStarted):
            await racing
        assert slots.held == 0

    asyncio.run(main())


def wait_until(cond: object, timeout: float = 5.0) -> None:
    """Spin until ``cond()`` (a thread reached its wait): bounded, no sleep decides."""
    import time

    assert callable(cond)
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)
