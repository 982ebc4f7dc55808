"""Handler slots: how many key-ordered handler calls run at once.

``concurrency=N`` bounds a handler's *calls* (the user's code: the remote call it
waits on), and ``max_concurrency`` all of a member's. A message's claim before the
call and its completion after it are the framework's work, not the handler's: they
run outside the slot, so a slot freed by a call that returned is taken at once by
a message already claimed and waiting (:class:`Gate`), on the event loop or the
thread that released it, without waiting for the loop thread's next round.

:class:`Slots` is one counting semaphore for both kinds of waiter, first come first
served: a thread (a sync handler's job) blocks on an event; a task (an ``async
def`` handler's) awaits a future of its event loop. A slot released goes straight
to the first waiter, so a late arrival never overtakes it.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from types import TracebackType


class _Waiter:
    """A thread's event, or a task's future on its loop."""

    __slots__ = ("event", "future", "loop")

    def __init__(self, event: threading.Event | None = None,
                 loop: asyncio.AbstractEventLoop | None = None,
                 future: asyncio.Future[None] | None = None) -> None:
        self.event = event
        self.loop = loop
        self.future = future


class Slots:
    """Up to ``size`` holders at once, first come first served, for threads and for
    tasks alike (a task's loop may run on any thread)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"Slots need a size >= 1, not {size}")
        self.size = size
        self._free = size
        self._lock = threading.Lock()
        self._waiters: deque[_Waiter] = deque()

    @property
    def held(self) -> int:
        """Slots taken now (a slot handed to a waiter not yet awake counts)."""
        with self._lock:
            return self.size - self._free

    def _take_now(self) -> bool:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return True
        return False

    def acquire(self) -> None:
        """Take a slot, blocking this thread until one is free."""
        with self._lock:
            if self._take_now():
                return
            waiter = _Waiter(event=threading.Event())
            self._waiters.append(waiter)
        assert waiter.event is not None
        waiter.event.wait()

    async def acquire_async(self) -> None:
        """Take a slot, waiting in this task until one is free. Cancelled while
        waiting, it takes none (a slot handed to it meanwhile goes on to the next)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._take_now():
                return
            future: asyncio.Future[None] = loop.create_future()
            waiter = _Waiter(loop=loop, future=future)
            self._waiters.append(waiter)
        try:
            await future
        except asyncio.CancelledError:
            with self._lock:
                queued = waiter in self._waiters
                if queued:
                    self._waiters.remove(waiter)
            if not queued and future.done() and not future.cancelled():
                self.release()  # handed, then cancelled before it woke: pass it on
            raise

    def release(self) -> None:
        """Give a slot back: to the first waiter still waiting, else to the pool."""
        with self._lock:
            while self._waiters:
                waiter = self._waiters.popleft()
                if self._hand(waiter):
                    return
            self._free += 1

    def _hand(self, waiter: _Waiter) -> bool:
        """Wake ``waiter`` with the slot (under the lock); False if it is gone."""
        if waiter.event is not None:
            waiter.event.set()
            return True
        future, loop = waiter.future, waiter.loop
        assert future is not None and loop is not None
        if _on_loop_thread(loop):
            if future.done():  # cancelled while waiting
                return False
            future.set_result(None)
            return True
        try:
            loop.call_soon_threadsafe(self._deliver, future)
        except RuntimeError:  # its loop is closed: nobody waits there
            return False
        return True

    def _deliver(self, future: asyncio.Future[None]) -> None:
        """On the waiter's loop: wake it, or pass the slot on if it was cancelled."""
        if future.done():
            self.release()
        else:
            future.set_result(None)


def _on_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class Tally:
    """One handler's calls running now, and its messages waiting to start one (for a
    slot of the handler's, or of the member's): what ``kafka_idem_handler_calls``
    shows."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.running = 0
        self.waiting = 0

    def add(self, running: int, waiting: int) -> None:
        with self._lock:
            self.running += running
            self.waiting += waiting


class Gate:
    """One message's way into its handler's call: a slot of its handler, then one
    of the member's (always in that order: no two messages wait for each other's).
    :meth:`leave` gives both back as soon as the call returns; it is idempotent, so
    the caller's ``finally`` can call it again."""

    def __init__(self, *slots: Slots, tally: Tally | None = None) -> None:
        self._slots = slots
        self._held: list[Slots] = []
        self._tally = tally
        self._in = False  # every slot taken, not given back yet
        self.called = False  # the call has started: its effects may be under way

    def calling(self) -> None:
        """The call starts now (its slots are held)."""
        self.called = True

    def enter(self) -> Gate:
        self._count(0, 1)
        try:
            for s in self._slots:
                s.acquire()
                self._held.append(s)
        except BaseException:
            self._count(0, -1)
            self.leave()
            raise
        self._entered()
        return self

    async def enter_async(self) -> Gate:
        self._count(0, 1)
        try:
            for s in self._slots:
                await s.acquire_async()
                self._held.append(s)
        except BaseException:
            self._count(0, -1)
            self.leave()
            raise
        self._entered()
        return self

    def _entered(self) -> None:
        self._in = True
        self._count(1, -1)

    def _count(self, running: int, waiting: int) -> None:
        if self._tally is not None:
            self._tally.add(running, waiting)

    def leave(self) -> None:
        if self._in:
            self._in = False
            self._count(-1, 0)
        held, self._held = self._held, []
        for s in reversed(held):
            s.release()

    def __enter__(self) -> Gate:
        return self.enter()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.leave()

