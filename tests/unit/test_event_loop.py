"""The member's event loop run by the thread that waits on it (``pumped``)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import pytest

from kafka_idem.consume.concurrency.event_loop import EventLoop, settle
from kafka_idem.consume.paths.futures import settled


def test_a_pumped_loop_runs_its_tasks_only_while_the_caller_waits_on_it() -> None:
    loop = EventLoop(pumped=True)
    ran: list[str] = []

    async def job() -> str:
        ran.append("started")
        await asyncio.sleep(0.01)
        return "done"

    future = loop.submit(job())
    time.sleep(0.05)
    assert ran == [] and not future.done()  # nobody ran the loop
    assert loop.pending  # made at once (submitted by the loop's own thread)
    assert loop.result(future, timeout=5.0) == "done"
    assert ran == ["started"] and not loop.pending
    loop.stop(1.0)
    assert loop.loop.is_closed()


def test_run_for_returns_when_its_condition_holds_after_a_poke_from_another_thread() -> None:
    loop = EventLoop(pumped=True)
    flag = threading.Event()

    def later() -> None:
        time.sleep(0.05)
        flag.set()
        loop.poke()

    threading.Thread(target=later).start()
    began = time.monotonic()
    loop.run_for(30.0, until=flag.is_set)
    assert flag.is_set()
    assert time.monotonic() - began < 25.0  # the poke ended it, not the timeout
    loop.stop(1.0)


def test_run_for_ends_at_its_timeout_and_keeps_unfinished_tasks_for_the_next_round() -> None:
    loop = EventLoop(pumped=True)
    release = asyncio.Event()

    async def waits() -> int:
        await release.wait()
        return 7

    future = loop.submit(waits())
    loop.run_for(0.05, until=future.done)
    assert not future.done() and loop.pending
    loop.loop.call_soon_threadsafe(release.set)
    assert loop.result(future, timeout=5.0) == 7
    loop.stop(1.0)


def test_a_threaded_loop_runs_its_tasks_on_its_own_thread() -> None:
    loop = EventLoop()
    names: list[str] = []

    async def job() -> int:
        names.append(threading.current_thread().name)
        return 1

    assert loop.result(loop.submit(job()), timeout=5.0) == 1
    assert names == ["kafka-idem-async"] and not loop.pending
    loop.stop(5.0)


def test_settle_on_a_pumped_loop_waits_for_the_members_tasks_not_for_its_own_pump() -> None:
    """At a stop, ``settle`` waits for cancelled tasks to roll back; the pass of the
    loop that runs it is not one of them (else every stop would wait its timeout)."""
    loop = EventLoop(pumped=True)
    began = time.monotonic()
    loop.result(loop.submit(settle(30.0)), timeout=40.0)
    assert time.monotonic() - began < 25.0
    ended: list[str] = []

    async def rolls_back() -> None:
        try:
            await asyncio.sleep(600)
        except asyncio.CancelledError:
            await asyncio.sleep(0.01)  # its rollback and lease release
            ended.append("released")
            raise

    task = loop.submit(rolls_back())
    loop.run_for(0.0)  # started
    task.cancel()
    loop.result(loop.submit(settle(30.0)), timeout=40.0)
    assert ended == ["released"] and not loop.pending
    loop.stop(1.0)


def test_a_pumped_loops_own_thread_submits_without_a_hand_off_and_keeps_the_outcomes() -> None:
    """Submitted by the loop's thread, a task is made at once; its result, its error
    and its cancellation reach the concurrent future; cancelling that future cancels
    the task. Another thread's submission still goes through the thread-safe way."""
    loop = EventLoop(pumped=True)
    hand_offs: list[str] = []
    original = loop.loop.call_soon_threadsafe

    def counted(*args: object, **kwargs: object) -> object:
        hand_offs.append("threadsafe")
        return original(*args, **kwargs)  # type: ignore[arg-type]

    loop.loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

    async def value() -> int:
        await asyncio.sleep(0)
        return 3

    async def fails() -> None:
        raise ValueError("boom")

    async def forever() -> None:
        await asyncio.sleep(600)

    assert loop.result(loop.submit(value()), timeout=5.0) == 3
    with pytest.raises(ValueError, match="boom"):
        loop.result(loop.submit(fails()), timeout=5.0)
    assert hand_offs == []  # submitted, ended and waited for on the loop's own thread
    stuck = loop.submit(forever())
    loop.run_for(0.0)
    assert stuck.cancel()
    loop.run_for(0.05)
    assert not loop.pending  # the task itself was cancelled
    from_elsewhere: list[Future[int]] = []
    t = threading.Thread(target=lambda: from_elsewhere.append(loop.submit(value())))
    t.start()
    t.join()
    assert loop.result(from_elsewhere[0], timeout=5.0) == 3
    assert "threadsafe" in hand_offs
    loop.stop(1.0)


def test_settled_wakes_for_a_future_ended_on_the_loop_or_on_another_thread() -> None:
    loop = EventLoop(pumped=True)
    here: Future[int] = Future()
    there: Future[int] = Future()

    async def waits() -> str:
        loop.loop.call_later(0.01, here.set_result, 1)
        await settled(here)
        threading.Timer(0.01, there.set_exception, (RuntimeError("x"),)).start()
        await settled(there)  # ended with an error: settled, the error left to the caller
        return "both"

    assert loop.result(loop.submit(waits()), timeout=5.0) == "both"
    loop.stop(1.0)


def test_a_poke_between_two_runs_does_not_end_the_next_one_early() -> None:
    """A job ending on the loop's thread pokes at once; with no run_for running, that
    poke must not stop the next one before its condition or its timeout."""
    loop = EventLoop(pumped=True)
    loop.poke()
    began = time.monotonic()
    loop.run_for(0.2, until=lambda: False)
    assert time.monotonic() - began >= 0.15
    loop.stop(1.0)
