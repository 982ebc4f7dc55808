"""Concurrent futures and the event loop: a task started from the thread that runs its
loop (:func:`start_here`), and a wait for a concurrent future on the loop
(:func:`settled`), both without a hand-off between threads when none is needed."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def start_here(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> Future[T]:
    """``asyncio.run_coroutine_threadsafe`` for the thread that runs ``loop``: the
    task is made now (its first step runs at the loop's next round) and its outcome
    copied into the returned future; cancelling that future cancels the task."""
    future: Future[T] = Future()
    task = loop.create_task(coro)

    def copy(done: asyncio.Task[T]) -> None:
        if done.cancelled():
            future.cancel()
            return
        if not future.set_running_or_notify_cancel():
            return  # cancelled first
        exc = done.exception()
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(done.result())

    def cancel(f: Future[T]) -> None:
        if f.cancelled() and not loop.is_closed():
            loop.call_soon_threadsafe(task.cancel)  # from whichever thread cancelled it

    task.add_done_callback(copy)
    future.add_done_callback(cancel)
    return future


async def settled(future: Future[Any]) -> None:
    """Wait for a concurrent ``future`` to end, without its outcome. Ended on this
    loop's own thread, its waiter wakes with no hand-off (``asyncio.wrap_future``
    always takes the thread-safe way, one per waiter); ended on another thread, through
    the loop's thread-safe call."""
    if future.done():
        return
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    here = threading.get_ident()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    def ended(_f: Future[Any]) -> None:
        if threading.get_ident() == here:
            wake()
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(wake)

    future.add_done_callback(ended)
    await waiter
