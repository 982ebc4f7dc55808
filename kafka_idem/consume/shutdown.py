"""A stop that always ends: SIGTERM and SIGINT for ``kafka-idem run`` and ``relay``.

The first signal asks the process to stop (``on_stop``: the member drains, commits
and leaves its group; the relay finishes its rounds). If that has not ended the
process ``bound`` seconds later (``drain_seconds`` + :data:`GRACE` for a member), or
when a second signal comes, the process ends at once: ``os._exit``, after the stacks
of its threads and one log line (what was still running, so an operator can see why
it hung). Ending at once is what a crash does, and the protocol is built for
crashes: what was not committed is redelivered and answered by its record (a
leased key's lease runs out first); the outbox relay's work is fenced by its
transactional id.

Signals are watched by a thread of their own, woken through the interpreter's
wakeup file descriptor (:func:`signal.set_wakeup_fd`), not by the Python handler:
that one runs only when the main thread gets back to Python code, and a main
thread blocked in a call into librdkafka or libpq (a commit, a close, a lock wait)
would hold the stop back however long that call takes.

    shutdown = Shutdown(on_stop=runner.stop, bound=settings.drain_seconds + GRACE)
    shutdown.install()   # in the main thread, before the member starts
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

GRACE = 2.0  # what a stop may take beyond drain_seconds (docs/reference/cli-conventions.md: run)
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):  # an unflushable handler keeps nothing alive
            handler.flush()


class Shutdown:
    """Watches SIGTERM/SIGINT on a thread; see the module doc."""

    def __init__(self, *, on_stop: Callable[[], None], bound: float,
                 exit_code: int = 0) -> None:
        """``on_stop``: called once, on the watching thread, at the first signal (it must
        only ask: set events, never wait). ``bound``: seconds from the first signal to
        the forced end, whose exit code is ``exit_code`` (the stop was asked for: what
        it abandoned is a crash's)."""
        self.on_stop = on_stop
        self.bound = bound
        self.exit_code = exit_code
        self.stopping_since: float | None = None
        self._read = -1

    def install(self) -> None:
        """Take SIGTERM and SIGINT (in the main thread) and start watching them."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._read = read
        for signum in SIGNALS:
            signal.signal(signum, _noted)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="kafka-idem-signals", daemon=True).start()

    def _watch(self) -> None:
        deadline: float | None = None
        while True:
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready, _, _ = select.select([self._read], [], [], timeout)
            if not ready:
                self._overran()
                return
            for signum in os.read(self._read, 64):
                if signum not in SIGNALS:
                    continue
                name = signal.Signals(signum).name
                if deadline is not None:
                    log.warning("second %s: stopping at once", name,
                                extra={"action": "stopped_at_once", "kind": name})
                    _flush_logs()
                    os._exit(128 + signum)
                log.info("stopping", extra={"action": "stopping", "kind": name})
                self.stopping_since = time.monotonic()
                deadline = self.stopping_since + self.bound
                self.on_stop()

    def _overran(self) -> None:
        log.error("the stop did not end within %.1f s: ending at once (what was not "
                  "committed is redelivered); the threads' stacks follow", self.bound,
                  extra={"action": "stop_overran"})
        _flush_logs()
        with contextlib.suppress(Exception):  # stderr closed: nothing more to say
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(self.exit_code)


def _noted(_signum: int, _frame: object) -> None:
    """The Python-level handler: the watching thread does the work (the interpreter
    writes the signal to the wakeup descriptor before this runs)."""
