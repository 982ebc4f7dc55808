"""Key-ordered work in flight: one message per job, many per partition at once.

For handlers with ``concurrency > 1`` or ``async def`` ones. Each round the loop
admits the fetched messages of their partitions (decoding them here, in offset
order, to learn their keys: :meth:`KeyedState.admit
<kafka_idem.consume.concurrency.keyed_state.KeyedState.admit>`, only as many as may
start) and starts those that may run, taking one message from each partition in
turn: up to the handler's calls (``concurrency``, within the member's
``max_concurrency``) and, for an ``async def`` handler, as many more that claim their
keys ahead and wait for a call's slot (:mod:`~kafka_idem.consume.paths.slots`).
A sync handler's job runs on a thread of its own (one connection each,
:class:`~kafka_idem.consume.concurrency.daemon_pool.DaemonPool`); an ``async def``
handler's is a task on the member's event loop
(:mod:`~kafka_idem.consume.concurrency.event_loop`), every step of it on the loop's
connections (:mod:`~kafka_idem.consume.paths.async_leased_path`). The new keys of the
messages a round starts share one claim (:mod:`~kafka_idem.consume.paths.round_claim`).

A revoke or a stop waits up to ``drain_seconds`` for the jobs in flight; jobs not
started yet do not start (unless their round's claim, already sent, took their
key, in which case it claims, then withdraws its claim), a message claimed and
waiting for a call's slot stops waiting and withdraws its claim (the next owner
takes it over at once, uncharged), and calls still running when the wait is over
are abandoned: a task is cancelled (its transaction rolls back), a thread is left
to finish (its completion is fenced). A call's lease runs out on its own. Either
way the offset stays before them: the next owner finds the key ``processing``
under our lease and takes it over when it ends.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

from kafka_idem.app import App
from kafka_idem.consume.concurrency.daemon_pool import DaemonPool
from kafka_idem.consume.concurrency.event_loop import (
    LOOP_CLOSE_SECONDS,
    EventLoop,
    run_closers,
    settle,
)
from kafka_idem.consume.concurrency.keyed_state import Entry, KeyedState, NotNow
from kafka_idem.consume.config_hold import ConfigHold
from kafka_idem.consume.outcome import Deferred, Message, Prepared, Reason, Result
from kafka_idem.consume.parking import lanes as message_lanes
from kafka_idem.consume.partitions import TP, Partitions
from kafka_idem.consume.paths.async_connections import AsyncConnections, connection_limit
from kafka_idem.consume.paths.async_leased_path import AsyncLeasedPath
from kafka_idem.consume.paths.calls import delivery
from kafka_idem.consume.paths.lease_keeper import LeaseKeeper
from kafka_idem.consume.paths.processor import Processor
from kafka_idem.consume.paths.round_claim import RoundClaim, Wanted
from kafka_idem.consume.paths.slots import CallNotStarted, Gate, Slots, Tally
from kafka_idem.consume.rate_limit import RateLimits
from kafka_idem.errors import FrameworkError, MessageError
from kafka_idem.handler import Handler
from kafka_idem.observe.metrics import Metrics
from kafka_idem.store import Store, describe

log = logging.getLogger(__name__)

SETTLE_SECONDS = 2.0  # at a stop, for cancelled tasks to roll back and release their leases
KeyedResults = dict[tuple[TP, int], list[Result]]


@dataclass(eq=False)
class Job:
    """One message in flight: ``None`` as its result means it never started (its
    ``cancel`` was set first: its partition was leaving, or the member stopping)."""

    future: Future[Result | None]
    tp: TP
    state: KeyedState
    offset: int
    cancel: threading.Event
    thread: bool = False  # runs on a thread of the pool (a sync handler's)
    gate: Gate | None = None  # its way into the call (closed when it must not start one)


class KeyedUnits:
    """The key-ordered jobs in flight and what runs them."""

    def __init__(
        self, app: App, parts: Partitions, *, store: Store, metrics: Metrics,
        leases: LeaseKeeper | None, stopping: threading.Event,
        hold: ConfigHold | None = None,
    ) -> None:
        self.app = app
        self.hold = hold
        self.settings = app.settings
        self.parts = parts
        self.store = store
        self.metrics = metrics
        self.leases = leases
        self.stopping = stopping
        self.in_flight: dict[Job, None] = {}  # in start order; a dict: removed in O(1)
        self._ended: deque[Job] = deque()  # jobs whose futures ended, as they end
        self.finished = threading.Event()  # set as any job (or the member's unit) ends
        self.running: Counter[str] = Counter()  # jobs in flight by topic (handler)
        self._turn = 0
        self._abandoned = 0
        self._slots = Slots(self.settings.max_concurrency)  # the member's handler calls
        self._handler_slots: dict[str, tuple[Slots, Tally]] = {}  # each handler's, by topic
        self._sync_jobs = 0  # in flight, each on a thread with a connection of its own
        self._threads = DaemonPool(self.settings.max_concurrency, "kafka-idem-key")
        for h in app.handlers.values():
            if h.keyed and h.concurrency > self.settings.max_concurrency:
                log.warning(
                    "handler %r (topic %r): concurrency=%d is above max_concurrency=%d "
                    "(KAFKA_IDEM_MAX_CONCURRENCY): at most %d of its calls run at once in "
                    "this member", h.name, h.topic, h.concurrency,
                    self.settings.max_concurrency, self.settings.max_concurrency,
                    extra={"action": "config", "topic": h.topic})
        self._loop: EventLoop | None = None
        self._aio: AsyncLeasedPath | None = None
        self._conns: AsyncConnections | None = None
        self._local = threading.local()
        self._processors: list[Processor] = []
        self._processors_lock = threading.Lock()
        self.limits: RateLimits | None = None  # the handlers' max_rate (set by Units)

    def make_state(self, topic: str, jitter: Callable[[float, float], float]) -> KeyedState | None:
        """The state of a new partition of ``topic``: key-ordered for such a handler."""
        handler = self.app.handlers.get(topic)
        if handler is None or not handler.keyed:
            return None
        return KeyedState(jitter=jitter, lookahead=self.settings.retry_lookahead)

    # --- dispatch ----------------------------------------------------------------------

    def dispatch(self, now: float) -> None:
        states = [(tp, st) for tp, st in self.parts.items()
                  if isinstance(st, KeyedState) and tp[0] not in self.parts.held]
        if not states:
            return
        for tp, st in states:
            st.admit(now, self._admit, want=self.in_flight_limit(self.app.handlers[tp[0]]))
        limit = self.settings.max_concurrency
        free = 2 * limit - len(self.in_flight)  # calls, and as many claimed ahead (async)
        free_threads = limit - self._sync_jobs
        self._turn = (self._turn + 1) % len(states)
        states = states[self._turn:] + states[:self._turn]  # no partition always first
        picked: list[tuple[TP, KeyedState, Entry]] = []
        picking: Counter[str] = Counter()  # picked this round, by topic
        started = True
        while free > 0 and started:
            started = False
            for tp, st in states:
                handler = self.app.handlers[tp[0]]
                if (free <= 0 or self.running[tp[0]] + picking[tp[0]] >= self.in_flight_limit(
                        handler) or (not handler.is_async and free_threads <= 0)):
                    continue
                if self.limits is not None and not (
                        st.can_take(now) and self.limits.take(tp[0], 1, now)):
                    continue  # none may start, or its handler's max_rate has no token
                for entry in st.take(1, now):
                    picked.append((tp, st, entry))
                    picking[tp[0]] += 1
                    free -= 1
                    free_threads -= 0 if handler.is_async else 1
                    started = True
        shared = self._round([entry for _, _, entry in picked])
        for tp, st, entry in picked:
            self._start(tp, st, entry, shared)

    def in_flight_limit(self, handler: Handler[Any]) -> int:
        """How many of ``handler``'s messages may be in flight in this member: its calls
        (``concurrency``, at most ``max_concurrency``) and, for an ``async def``
        handler with ``concurrency > 1``, as many more claimed ahead, waiting for a
        slot (:mod:`slots <kafka_idem.consume.paths.slots>`). A sync handler's message holds a
        thread and a connection from its claim to its completion, so it claims none
        ahead; nor does ``concurrency=1``, one message at a time in offset order."""
        calls = min(handler.concurrency, self.settings.max_concurrency)
        return 2 * calls if handler.is_async and calls > 1 else calls

    def _round(self, entries: list[Entry]) -> RoundClaim | None:
        """One claim for the new keys started together (two or more) not yet ours, one
        per key; none on a distributed store (each claims alone there, on its shard)."""
        wanted: dict[str, Wanted] = {}
        for entry in entries:
            job = entry.job
            if isinstance(job, Prepared) and entry.token is None and job.key not in wanted:
                wanted[job.key] = Wanted(job.key, job.request_hash, delivery(
                    self.app.handlers[entry.msg.topic()], entry.msg), job.shard)
        distributed = self.store.distributed
        return RoundClaim(list(wanted.values())) if len(wanted) > 1 and not distributed else None

    def _admit(self, msg: Message) -> tuple[tuple[str, ...], Any]:
        """A message's lanes (its idempotency key, its ordering key) and its job: the
        decoded message, or the dead-letter result of one that can never run."""
        handler = self.app.handlers[msg.topic()]
        steps = self.processor().steps  # this thread's; decoding needs no connection
        key: str | None = None
        try:
            prep = steps.prepare(handler, msg)
            key = prep.key
            lanes = message_lanes(handler, prep, self.settings.key_max_bytes)
        except MessageError as exc:
            verdict = steps.undecodable(handler, msg, exc, key=key)
            verdict.note.write(log)
            return (), verdict.result
        except FrameworkError as exc:  # e.g. the schema registry is down: wait, in order
            self.metrics.framework_errors.labels(type(exc).__name__).inc()
            log.warning("cannot decode now (%s); will retry", describe(exc),
                        extra={"action": "deferred", "topic": msg.topic(),
                               "partition": msg.partition(), "offset": msg.offset()})
            raise NotNow(str(exc)) from exc
        return lanes, prep

    def _start(self, tp: TP, st: KeyedState, entry: Entry, shared: RoundClaim | None) -> None:
        handler = self.app.handlers[tp[0]]
        job, msg, token = entry.job, entry.msg, entry.token
        cancel = threading.Event()
        future: Future[Result | None]
        thread = False
        gate: Gate | None = None
        if not isinstance(job, Prepared):  # decided at admission (a dead letter)
            future = Future()
            future.set_result(job)
        elif handler.is_async:
            gate = self._gate(handler)
            future = self._event_loop().submit(
                self._run_async(msg, job, token, cancel, shared, gate))
        else:
            gate = self._gate(handler)
            sync_gate = gate
            future = self._threads.submit(
                lambda: self._run_sync(msg, job, token, cancel, shared, sync_gate))
            thread = True
            self._sync_jobs += 1
        self.running[tp[0]] += 1
        started = Job(future, tp, st, entry.offset, cancel, thread, gate)
        future.add_done_callback(lambda _f: self._ended.append(started))  # any thread
        self.notify_when_done(future)  # after it: a woken loop finds the job ended
        self.in_flight[started] = None

    def _gate(self, handler: Handler[Any]) -> Gate:
        """A message's way into its handler's call: a slot of the handler's, then one of
        the member's."""
        got = self._handler_slots.get(handler.topic)
        if got is None:
            size = min(handler.concurrency, self.settings.max_concurrency)
            got = self._handler_slots[handler.topic] = (Slots(size), Tally())
            tally = got[1]
            calls = self.metrics.handler_calls
            calls.labels(handler.topic, handler.name, "running").set_function(
                lambda: tally.running)
            calls.labels(handler.topic, handler.name, "waiting").set_function(
                lambda: tally.waiting)
        slots, tally = got
        return Gate(slots, self._slots, tally=tally)

    def notify_when_done(self, future: Future[Any]) -> None:
        """Set :attr:`finished` when ``future`` ends (at once if it has)."""
        future.add_done_callback(self._finished)

    def _finished(self, _future: Future[Any]) -> None:
        self.finished.set()
        if self._loop is not None:
            self._loop.poke()

    @property
    def pending(self) -> bool:
        """Tasks on the pumped event loop that have not ended."""
        return self._loop is not None and self._loop.pending

    def wait_any(self, timeout: float) -> None:
        """Block until a job finishes or ``timeout`` passes (running a pumped event
        loop meanwhile)."""
        if self._loop is not None and self._loop.pumped:
            self._loop.run_for(timeout, until=self.finished.is_set)
        else:
            self.finished.wait(timeout)

    def pump(self) -> None:
        """One round of what is ready on a pumped event loop."""
        if self._loop is not None and self._loop.pumped:
            self._loop.run_for(0.0)

    def _run_sync(
        self, msg: Message, prep: Prepared, token: uuid.UUID | None, cancel: threading.Event,
        shared: RoundClaim | None, gate: Gate,
    ) -> Result | None:
        if self._not_now(msg, prep, cancel, shared):
            return None
        try:
            return self.processor().run_leased(msg, reentrant=token, prepared=prep,
                                               round=shared, gate=gate)
        except CallNotStarted:  # its claim (if it made one) withdrawn
            return None

    async def _run_async(
        self, msg: Message, prep: Prepared, token: uuid.UUID | None, cancel: threading.Event,
        shared: RoundClaim | None, gate: Gate,
    ) -> Result | None:
        if self._not_now(msg, prep, cancel, shared):
            return None
        assert self._aio is not None
        try:
            return await self._aio.run(msg, prep, token, shared, gate)
        except CallNotStarted:  # its claim (if it made one) withdrawn
            return None

    def _not_now(
        self, msg: Message, prep: Prepared, cancel: threading.Event, shared: RoundClaim | None
    ) -> bool:
        """The job does not start (its partition is leaving, or the member stopping),
        unless its round's claim, already sent, covers its key: then it reads its token
        and withdraws the claim at its closed gate, its call never starting."""
        if not (cancel.is_set() or self.stopping.is_set()):
            return False
        return shared is None or shared.withdraw(
            prep.key, delivery(self.app.handlers[msg.topic()], msg))

    # --- results -------------------------------------------------------------------------

    def futures(self) -> list[Future[Result | None]]:
        return [j.future for j in self.in_flight]

    def cancel(self, leaving: set[TP] | None) -> None:
        """Jobs of leaving partitions (all, with ``None``) whose call has not started
        never start it: one not started yet does not start; one claimed and waiting for
        a slot stops waiting and withdraws its claim (so does one whose claim is still
        under way, once it has it)."""
        for job in self.in_flight:
            if leaving is None or job.tp in leaving:
                job.cancel.set()
                if job.gate is not None:
                    job.gate.close()

    def harvest(self, *, wait_all: bool = False, leaving: set[TP] | None = None) -> KeyedResults:
        """The results of the finished jobs, for partitions still on the states they
        ran from. ``wait_all``: wait up to ``drain_seconds`` first, then abandon what
        still runs of the leaving partitions (all with ``None``)."""
        if wait_all and self.in_flight:
            futures = self.futures()
            if self._loop is not None and self._loop.pumped:
                self._loop.run_for(self.settings.drain_seconds,
                                   until=lambda: all(f.done() for f in futures))
            else:
                wait(futures, timeout=self.settings.drain_seconds)
            self._abandon(leaving)
        out: KeyedResults = {}
        ended = self._ended
        while ended:
            job = ended.popleft()
            if job not in self.in_flight:
                continue  # abandoned before it ended
            self._forget(job)
            try:
                res = job.future.result()
            except Exception:  # a defect, never the message's fault: it runs again
                log.exception("work unit failed; will retry %s[%s]@%s", job.tp[0], job.tp[1],
                              job.offset, extra={"action": "unit_failed"})
                res = Deferred(0.0, Reason.FRAMEWORK)
            if self.parts.get(job.tp) is not job.state:
                continue  # revoked (and maybe assigned again) meanwhile
            if res is None:
                job.state.unstarted(job.offset)
                continue
            out[(job.tp, job.offset)] = [res]
        return out

    def apply(self, results: KeyedResults, now: float) -> Counter[tuple[str, str]]:
        counts: Counter[tuple[str, str]] = Counter()
        for (tp, offset), rs in results.items():
            st = self.parts.get(tp)
            if isinstance(st, KeyedState):
                outcome = st.finish(offset, rs[0], now)
                if outcome is not None:
                    counts[(tp[0], outcome)] += 1
        return counts

    def _abandon(self, leaving: set[TP] | None) -> None:
        stuck = [j for j in self.in_flight if not j.future.done()
                 and (leaving is None or j.tp in leaving)]
        for job in stuck:
            self._forget(job)
            job.cancel.set()  # one not started yet never starts
            job.future.cancel()  # a task is cancelled; a thread runs on, fenced
            self._abandoned += 1
        if stuck:
            log.warning(
                "abandoned %d message(s) still in flight after drain_seconds=%s: %s; their "
                "offsets are not committed; a call's lease runs out on its own (an async "
                "def one's task cancelled and rolled back, a sync one's thread left to "
                "finish, fenced), and a claim whose call had not started is withdrawn (the "
                "next owner takes it over at once, no attempt charged)",
                len(stuck), self.settings.drain_seconds,
                ", ".join(f"{j.tp[0]}[{j.tp[1]}]@{j.offset}" for j in stuck),
                extra={"action": "abandoned"},
            )

    def _forget(self, job: Job) -> None:
        del self.in_flight[job]
        self.running[job.tp[0]] -= 1
        self._sync_jobs -= job.thread

    # --- what runs the jobs ---------------------------------------------------------------

    def processor(self) -> Processor:
        """This thread's processor (its own database connection, opened when used)."""
        proc: Processor | None = getattr(self._local, "processor", None)
        if proc is None:
            proc = Processor(self.app, store=self.store, metrics=self.metrics,
                             leases=self.leases, hold=self.hold)
            self._local.processor = proc
            with self._processors_lock:
                self._processors.append(proc)
        return proc

    def _event_loop(self) -> EventLoop:
        if self._loop is None:
            self._loop = EventLoop(pumped=not self.settings.event_loop_thread)
            steps = Processor(self.app, store=self.store, metrics=self.metrics,
                              leases=self.leases, hold=self.hold).steps  # no connection
            self._conns = AsyncConnections(
                self.settings, application_name=f"kafka_idem:{self.app.name}",
                limit=connection_limit(self.settings.max_concurrency))
            self._aio = AsyncLeasedPath(self.app, steps=steps, leases=self.leases,
                                        conns=self._conns)
        return self._loop

    def close(self) -> None:
        """Stop the event loop and the threads; close the connections, except those of
        threads whose abandoned handler may still use them (they go with the process)."""
        if self._loop is not None and self._conns is not None:
            if self._abandoned:  # their cancelled tasks roll back and release first
                with contextlib.suppress(Exception):
                    self._loop.result(self._loop.submit(settle(SETTLE_SECONDS)),
                                      SETTLE_SECONDS + 1.0)
            with contextlib.suppress(Exception):  # the app's (bounded, logged), then ours
                self._loop.result(self._loop.submit(run_closers(self.app.loop_closers)),
                                  LOOP_CLOSE_SECONDS + 1.0)
            with contextlib.suppress(Exception):
                self._loop.result(self._loop.submit(self._conns.close()), 5.0)
            self._loop.stop(5.0)
            self._loop = None
        self._threads.stop()
        if self._abandoned:
            return
        for proc in self._processors:
            proc.close()
