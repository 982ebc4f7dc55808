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
import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from types import TracebackType


class _Waiter:
    """A thread's event, or a task's future on its loop; ``handed`` once it has a slot
    (a wake without one is an interruption: its gate closed)."""

    __slots__ = ("event", "future", "handed", "loop")

    def __init__(self, event: threading.Event | None = None,
                 loop: asyncio.AbstractEventLoop | None = None,
                 future: asyncio.Future[bool] | None = None) -> None:
        self.event = event
        self.loop = loop
        self.future = future
        self.handed = False


Register = Callable[["Slots", _Waiter], bool]
"""Told of a wait before it blocks (so that it can be interrupted); False: do not wait."""


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

    def acquire(self, register: Register | None = None) -> bool:
        """Take a slot, blocking this thread until one is free: True. False when the
        wait was interrupted (:meth:`interrupt`, or ``register`` refused it): no slot."""
        with self._lock:
            if self._take_now():
                return True
            waiter = _Waiter(event=threading.Event())
            self._waiters.append(waiter)
        if register is not None and not register(self, waiter):
            return self._give_up(waiter)
        assert waiter.event is not None
        waiter.event.wait()
        with self._lock:
            return waiter.handed

    async def acquire_async(self, register: Register | None = None) -> bool:
        """Take a slot, waiting in this task until one is free: True; False when the
        wait was interrupted. Cancelled while waiting, it takes none (a slot handed to
        it meanwhile goes on to the next)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._take_now():
                return True
            future: asyncio.Future[bool] = loop.create_future()
            waiter = _Waiter(loop=loop, future=future)
            self._waiters.append(waiter)
        if register is not None and not register(self, waiter):
            return self._give_up(waiter)
        try:
            return await future
        except asyncio.CancelledError:
            with self._lock:
                handed = waiter.handed
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            if handed and not future.cancelled():
                self.release()  # handed, then cancelled before it woke: pass it on
            raise

    def _give_up(self, waiter: _Waiter) -> bool:
        """A wait refused before it blocked: out of the queue (True if a slot was
        handed to it meanwhile: the caller holds it)."""
        with self._lock:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            return waiter.handed

    def interrupt(self, waiter: _Waiter) -> None:
        """End ``waiter``'s wait without a slot (from any thread); nothing when it has
        one already or is gone."""
        with self._lock:
            if waiter not in self._waiters:
                return
            self._waiters.remove(waiter)
            self._wake(waiter, handed=False)

    def release(self) -> None:
        """Give a slot back: to the first waiter still waiting, else to the pool."""
        with self._lock:
            while self._waiters:
                waiter = self._waiters.popleft()
                if self._wake(waiter, handed=True):
                    return
            self._free += 1

    def _wake(self, waiter: _Waiter, *, handed: bool) -> bool:
        """Wake ``waiter``, with the slot or without (under the lock); False if it is
        gone."""
        if waiter.event is not None:
            waiter.handed = handed
            waiter.event.set()
            return True
        future, loop = waiter.future, waiter.loop
        assert future is not None and loop is not None
        if _on_loop_thread(loop):
            if future.done():  # cancelled while waiting
                return False
            waiter.handed = handed
            future.set_result(handed)
            return True
        waiter.handed = handed
        try:
            loop.call_soon_threadsafe(self._deliver, future, handed)
        except RuntimeError:  # its loop is closed: nobody waits there
            waiter.handed = False
            return False
        return True

    def _deliver(self, future: asyncio.Future[bool], handed: bool) -> None:
        """On the waiter's loop: wake it, or pass a slot on if it was cancelled."""
        if not future.done():
            future.set_result(handed)
        elif handed:
            self.release()


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


class CallNotStarted(Exception):
    """The message's gate closed before its call started (its partition is leaving
    or the member stopping): the call never starts."""


class Gate:
    """One message's way into its handler's call: a slot of its handler, then one
    of the member's (always in that order: no two messages wait for each other's).
    :meth:`leave` gives both back as soon as the call returns; it is idempotent, so
    the caller's ``finally`` can call it again. :meth:`close` (a revoke or a stop)
    ends a wait for a slot, and a message whose call has not started then never
    starts it: :meth:`enter` raises :class:`CallNotStarted`."""

    def __init__(self, *slots: Slots, tally: Tally | None = None) -> None:
        self._slots = slots
        self._held: list[Slots] = []
        self._tally = tally
        self._in = False  # every slot taken, not given back yet
        self._lock = threading.Lock()  # closed and the wait, between close() and enter
        self._waiting: tuple[Slots, _Waiter] | None = None
        self.closed = False
        self.called = False  # the call has started: its effects may be under way

    def calling(self) -> None:
        """The call starts now (its slots are held)."""
        self.called = True

    def close(self) -> None:
        """From any thread: a call not started yet never starts; a wait ends now."""
        with self._lock:
            self.closed = True
            waiting, self._waiting = self._waiting, None
        if waiting is not None:
            waiting[0].interrupt(waiting[1])

    def _register(self, slots: Slots, waiter: _Waiter) -> bool:
        with self._lock:
            if self.closed:
                return False
            self._waiting = (slots, waiter)
            return True

    def _took(self, slots: Slots, got: bool) -> None:
        """After one acquire: what it holds counts; a closed gate goes no further."""
        with self._lock:
            self._waiting = None
        if got:
            self._held.append(slots)
        if not got or self.closed:
            raise CallNotStarted

    def enter(self) -> Gate:
        with self._entering():
            for s in self._slots:
                self._took(s, s.acquire(self._register))
        return self

    async def enter_async(self) -> Gate:
        with self._entering():
            for s in self._slots:
                self._took(s, await s.acquire_async(self._register))
        return self

    @contextlib.contextmanager
    def _entering(self) -> Iterator[None]:
        """Around the acquires of :meth:`enter` and :meth:`enter_async` (the same
        decisions; only the wait differs): waiting counted, and on any failure
        (closed, interrupted, cancelled) what was taken given back."""
        self._count(0, 1)
        try:
            if self.closed:
                raise CallNotStarted
            yield
        except BaseException:
            self._count(0, -1)
            self.leave()
            raise
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

