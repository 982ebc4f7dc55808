"""The key-ordered path's thread pool: daemon threads that never hold the process."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class DaemonPool:
    """Up to ``size`` threads running submitted calls. Daemon threads, unlike a
    ``ThreadPoolExecutor``'s, never hold the process at exit: a stopped member does
    not wait for a handler it abandoned. A call never waits behind another while
    fewer than ``size`` threads run: a thread is started whenever the calls not yet
    taken outnumber the idle threads."""

    def __init__(self, size: int, name: str) -> None:
        self.size = size
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue())
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for a call (or started and not there yet)
        self._waiting = 0  # calls submitted and not taken by a thread yet
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            self._waiting += 1
            if self._waiting > self._idle and len(self._threads) < self.size:
                t = threading.Thread(target=self._work, daemon=True,
                                     name=f"{self.name}-{len(self._threads)}")
                self._threads.append(t)
                self._idle += 1
                t.start()
        self._jobs.put((future, fn))
        return future

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            with self._lock:
                self._idle -= 1
                if item is not None:
                    self._waiting -= 1
            if item is None:
                return
            future, fn = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)
            with self._lock:
                self._idle += 1

    def stop(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
