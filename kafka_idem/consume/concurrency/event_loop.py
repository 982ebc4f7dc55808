"""The member's event loop for ``async def`` handlers (:class:`EventLoop`), and how its
tasks end (:func:`settle`); they meet futures of other threads through
:mod:`~kafka_idem.consume.paths.futures`.

Where an ``async def`` message runs: the loop thread's dispatch starts a job
(:mod:`~kafka_idem.consume.concurrency.keyed_units`), a task submitted here. Its every
step then runs on this loop, on the loop's async connections
(:mod:`~kafka_idem.consume.paths.async_connections`):
:class:`~kafka_idem.consume.paths.async_leased_path.AsyncLeasedPath` claims its key
(alone, or in its dispatch round's statement), waits for a slot of its handler, runs the
handler's transaction and, on a failure, records it. The loop runs on the member's
loop thread while it waits (``pumped``, the default), or on a thread of its own
(``event_loop_thread``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from kafka_idem.consume.paths.futures import start_here

T = TypeVar("T")
log = logging.getLogger(__name__)
# How long an app's ``on_loop_close`` functions may take, all together, when a loop
# closes: within the stop's grace beyond ``drain_seconds``.
LOOP_CLOSE_SECONDS = 1.0


class EventLoop:
    """An asyncio loop for the member's ``async def`` handlers; :meth:`submit` from
    any thread.

    Threaded (the default here): the loop runs on a thread of its own. ``pumped``
    (the member's default): no thread; the loop runs on the caller's thread while it
    waits (:meth:`run_for`), so the member's loop thread and the tasks are not two
    threads taking turns at the GIL."""

    def __init__(self, name: str = "kafka-idem-async", *, pumped: bool = False) -> None:
        self.loop = asyncio.new_event_loop()
        self.pumped = pumped
        self._owner = threading.get_ident()  # pumped: the one thread that runs the loop
        self._wake: asyncio.Future[None] | None = None
        self._thread: threading.Thread | None = None
        if not pumped:
            self._thread = threading.Thread(target=self.loop.run_forever, name=name,
                                            daemon=True)
            self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        if self._here():
            return start_here(self.loop, coro)
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def _here(self) -> bool:
        """Pumped, and called by the thread that runs the loop: the loop can be used
        directly, without the thread-safe hand-off (a write to its wake-up pipe, and
        one more round before anything happens)."""
        return self.pumped and threading.get_ident() == self._owner

    @property
    def pending(self) -> bool:
        """Pumped: tasks that have not ended (abandoned ones rolling back too)."""
        return self.pumped and bool(asyncio.all_tasks(self.loop))

    def poke(self) -> None:
        """From any thread: a pumped :meth:`run_for` checks its condition again."""
        if self.pumped and not self.loop.is_closed():
            if self._here():  # a job ending on the loop: no hand-off
                self._woken()
                return
            with contextlib.suppress(RuntimeError):  # closed meanwhile: nobody waits
                self.loop.call_soon_threadsafe(self._woken)

    def _woken(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def run_for(self, timeout: float, until: Callable[[], bool] | None = None) -> None:
        """Pumped: run the loop here for one round of what is ready, then until
        ``until()`` holds (checked when :meth:`poke` is called) or ``timeout`` ends.
        Only the thread that made the loop runs it."""
        assert threading.get_ident() == self._owner, "a pumped loop runs on its own thread"
        pump = self.loop.create_task(self._run_for(max(timeout, 0.0), until))
        _PUMPS.add(pump)  # not one of the member's tasks: settle() does not wait for it
        self.loop.run_until_complete(pump)

    async def _run_for(self, timeout: float, until: Callable[[], bool] | None) -> None:
        loop = self.loop
        end = loop.time() + timeout
        await asyncio.sleep(0)
        while not (until is not None and until()) and (left := end - loop.time()) > 0:
            self._wake = loop.create_future()
            timer = loop.call_later(left, self._woken)
            try:
                await self._wake
            finally:
                timer.cancel()
                self._wake = None

    def result(self, future: Future[T], timeout: float) -> T:
        """``future``'s result, running the loop meanwhile when it is pumped."""
        if self.pumped:
            future.add_done_callback(lambda _f: self.poke())
            self.run_for(timeout, until=future.done)
            return future.result(timeout=0)
        return future.result(timeout)

    def stop(self, timeout: float) -> None:
        """Stop the loop (its tasks were waited for or cancelled by the caller)."""
        if self._thread is None:
            self.loop.close()
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


_PUMPS: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()  # EventLoop.run_for's tasks


async def settle(timeout: float) -> None:
    """Wait up to ``timeout`` for the loop's other tasks to end (cancelled ones
    rolling back and releasing their leases) before the loop stops."""
    others = asyncio.all_tasks() - {asyncio.current_task()} - set(_PUMPS)
    if others:
        await asyncio.wait(others, timeout=timeout)


async def run_closers(closers: Sequence[Callable[[], Awaitable[None]]],
                      timeout: float = LOOP_CLOSE_SECONDS) -> None:
    """Await the app's ``on_loop_close`` functions on this loop, in the order they were
    registered, within ``timeout`` for all; one that raises or overruns is logged (it
    is the app's code: the stop goes on) and the next one runs."""
    deadline = time.monotonic() + timeout
    for closer in closers:
        name = getattr(closer, "__qualname__", repr(closer))
        try:
            await asyncio.wait_for(closer(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            log.warning("on_loop_close %s did not finish within %.1f s; the loop closes",
                        name, timeout, extra={"action": "loop_close_timeout"})
        except Exception as exc:  # the app's code: logged, never stops the stop
            log.warning("on_loop_close %s raised %s: %s", name, type(exc).__name__, exc,
                        extra={"action": "loop_close_error"})
