"""Work in flight: units of work, the thread pools they run on, and their results.

A unit is some partitions' queued prefixes handed to a processor. Leased mode:
one partition per unit, on a pool of ``leased_workers`` threads (one database
connection each), so commit waits and remote calls overlap while the loop goes
on consuming. Local mode: one batch (one database transaction) of all due
partitions, run in the loop thread (``local_workers = 0``, the default: the
batch is what consume() returned, librdkafka prefetches the next meanwhile); or
up to ``local_workers`` batches over disjoint partitions on threads, each
dispatched when a worker is free and the batch is full or its oldest message has
waited ``batch_linger_seconds`` (0 by default: at once). With workers, the loop
thread decodes a batch handler's messages as it queues them (``prepare``), so it
decodes batch N+1 while a worker waits for the database on batch N; the worker's
batch path uses that form (its fallback decodes afresh).

A partition is in at most one unit at a time, and a unit stops at the
partition's first deferred message, so each partition stays in order. Workers
get copies of what they need (the messages, the claim tokens); only the loop
thread touches the partition states. Key-ordered handlers (``concurrency > 1``,
``async def``) run one message per job instead (:mod:`~kafka_idem.consume.concurrency.keyed_units`).
A unit takes no more of a handler's messages than its ``max_rate`` lets go now
(:mod:`~kafka_idem.consume.rate_limit`); the rest wait, queued.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kafka_idem.app import App
from kafka_idem.consume.concurrency.keyed_units import KeyedResults, KeyedUnits
from kafka_idem.consume.config_hold import ConfigHold
from kafka_idem.consume.outcome import Ahead, Deferred, Prepared, Result
from kafka_idem.consume.parking import Lanes, lanes
from kafka_idem.consume.partitions import TP, LanesOf, Partitions, PartitionState
from kafka_idem.consume.paths.lease_keeper import LeaseKeeper
from kafka_idem.consume.paths.processor import Processor
from kafka_idem.consume.paths.steps import Steps
from kafka_idem.consume.rate_limit import RateLimits
from kafka_idem.errors import FrameworkError, MessageError
from kafka_idem.handler import Handler
from kafka_idem.observe.metrics import Metrics
from kafka_idem.store import Store

log = logging.getLogger(__name__)

Results = dict[TP, list[Result]]


@dataclass
class Unit:
    """Work in flight on a worker thread: some partitions' queued prefixes."""

    future: Future[Results]
    states: dict[TP, PartitionState]  # the states it was taken from (identity checked)
    cancel: threading.Event  # set on revoke/close: a leased unit stops between messages


class Units:
    """The units in flight, and the pools and per-thread processors that run them."""

    def __init__(
        self,
        app: App,
        parts: Partitions,
        *,
        store: Store,
        metrics: Metrics,
        leases: LeaseKeeper | None,
        stopping: threading.Event,
    ) -> None:
        self.app = app
        self.settings = app.settings
        self.parts = parts
        self.store = store
        self.metrics = metrics
        self.leases = leases
        self.stopping = stopping
        self.in_flight: list[Unit] = []
        self._pool: ThreadPoolExecutor | None = None
        self._local_pool: ThreadPoolExecutor | None = None
        self._thread_local = threading.local()
        self._processors: list[Processor] = []
        self._processors_lock = threading.Lock()
        self.hold = ConfigHold(metrics)  # one rate limit for all of the member's threads
        self.keyed = KeyedUnits(app, parts, store=store, metrics=metrics, leases=leases,
                                stopping=stopping, hold=self.hold)
        self._ahead_steps: Steps | None = None
        if self.settings.local_workers > 0 and self.settings.batch_path:
            parts.prepare = self._prepare_ahead
        self.limits = parts.limits = self._rate_limits()
        self.keyed.limits = self.limits
        parts.make = self.keyed.make_state  # key-ordered handlers' partitions
        parts.lanes = self._lanes_for
        parts.lookahead = self.settings.retry_lookahead
        parts.sift = self.settings.batch_size

    def _rate_limits(self) -> RateLimits | None:
        """The buckets of the handlers with ``max_rate`` (:mod:`~kafka_idem.consume.rate_limit`);
        None when no handler has one, so that dispatch pays nothing for them."""
        rates = {t: h.max_rate for t, h in self.app.handlers.items() if h.max_rate is not None}
        if not rates:
            return None
        metrics = self.metrics
        for topic, rate in rates.items():
            metrics.max_rate.labels(topic, self.app.handlers[topic].name).set(rate)

        def throttled(topic: str, seconds: float) -> None:
            metrics.throttled.labels(topic, self.app.handlers[topic].name).inc(seconds)

        return RateLimits(rates, throttled)

    def _loop_steps(self) -> Steps:
        """Steps to decode with in the loop thread (it never connects for that)."""
        if self._ahead_steps is None:
            self._ahead_steps = self._worker_processor().steps
        return self._ahead_steps

    def _lanes_for(self, topic: str) -> LanesOf | None:
        """How the partitions of ``topic`` learn a message's lanes, to park its retries
        (None: ``retry_blocks_partition``, its retries hold the partition)."""
        handler = self.app.handlers.get(topic)
        if handler is None or handler.retry_blocks_partition:
            return None
        return lambda msg: self._lanes_of(handler, msg)

    def _lanes_of(self, handler: Handler[Any], msg: Any) -> Lanes | None:
        """``msg``'s lanes, decoded in the loop thread: ``()`` when it can never be
        decoded (it runs, to its dead letter), None when it cannot be now."""
        try:
            prep = self._loop_steps().prepare(handler, msg)
        except FrameworkError:
            return None
        except Exception:  # its own fault (or its codec's): the path says what it is
            return ()
        try:
            return lanes(handler, prep, self.settings.key_max_bytes)
        except MessageError:  # an ordering key that cannot be built: its key's lane only
            return ("k:" + prep.key,)

    def _prepare_ahead(self, msg: Any) -> Prepared | MessageError | None:
        """Decode a batch handler's message in the loop thread as it is queued, so that
        it overlaps a worker's wait for the database (``local_workers > 0``)."""
        handler = self.app.handlers.get(msg.topic())
        if handler is None or handler.mode != "local" or not handler.batch:
            return None
        return self._loop_steps().prepare_ahead(handler, msg)

    @property
    def busy(self) -> bool:
        """Any work in flight (units or key-ordered jobs)."""
        return bool(self.in_flight or self.keyed.in_flight or self.keyed.pending)

    def running_topics(self) -> set[str]:
        """The topics some work in flight (a unit, a key-ordered job) belongs to."""
        return ({tp[0] for u in self.in_flight for tp in u.states}
                | {job.tp[0] for job in self.keyed.in_flight})

    # --- dispatch ----------------------------------------------------------------

    def dispatch(self, now: float, *, keyed: bool = True) -> None:
        """Hand the due partitions that are not in flight to the workers, and start
        the key-ordered messages that may run (not with ``keyed=False``)."""
        if self.limits is not None:
            self.limits.round(now)
        if keyed:
            self.keyed.dispatch(now)
        due = self.parts.due(now)
        if not due:
            return
        local: list[tuple[TP, PartitionState]] = []
        for tp, st in due:
            if self._mode(tp) == "leased":
                self._dispatch_leased(tp, st, now)
            else:
                local.append((tp, st))
        if local and self.settings.local_workers == 0:
            self._run_inline(local, now)
        elif local:
            self._dispatch_local(local, now)

    def _dispatch_leased(self, tp: TP, st: PartitionState, now: float) -> None:
        # Leased partitions run on the worker pool (one connection each), so their
        # commit waits and remote calls overlap.
        msgs = self._prefix(tp, st, now, self.settings.batch_size)
        if not msgs:
            return  # waits for its handler's max_rate
        cancel = threading.Event()
        future = self._workers().submit(
            self._run_leased_partition, tp, msgs, dict(st.tokens), cancel,
        )
        self._start(Unit(future, {tp: st}, cancel))

    def _run_inline(self, local: list[tuple[TP, PartitionState]], now: float) -> None:
        """In the loop thread, as one batch: what consume() returned (it lingered to
        fill it if ``batch_linger_seconds`` says so)."""
        parts = [(tp, msgs) for tp, st in local if (msgs := self._prefix(tp, st, now))]
        if len(parts) < len(local):  # those held back by their max_rate wait
            taken = {tp for tp, _ in parts}
            local = [(tp, st) for tp, st in local if tp in taken]
        if not local:
            return
        done: Future[Results] = Future()
        try:
            done.set_result(self._run_local_batch(parts))
        except Exception as exc:  # a defect: harvest defers the partitions
            done.set_exception(exc)
        self._start(Unit(done, dict(local), threading.Event()))

    def _dispatch_local(self, local: list[tuple[TP, PartitionState]], now: float) -> None:
        free = self.settings.local_workers - sum(
            1 for u in self.in_flight if self._mode(next(iter(u.states))) == "local"
        )
        # Oldest first, each batch filled up to batch_size from whole partition
        # prefixes; a partly filled batch waits until its oldest message has waited
        # batch_linger (as consume() lingers to fill an inline batch).
        local.sort(key=lambda item: item[1].since)
        while local and free > 0:
            taken: list[tuple[TP, PartitionState]] = []
            parts: list[tuple[TP, list[Any]]] = []
            room = self.settings.batch_size
            while local and room > 0:
                tp, st = local.pop(0)
                msgs = self._prefix(tp, st, now, room)
                if not msgs:
                    continue  # waits for its handler's max_rate
                room -= len(msgs)
                taken.append((tp, st))
                parts.append((tp, msgs))
            if not taken:
                return
            oldest = min(st.since for _, st in taken)
            if room > 0 and now - oldest < self.settings.batch_linger_seconds:
                if self.limits is not None:  # their tokens wait with them
                    for tp, msgs in parts:
                        self.limits.give_back(tp[0], len(msgs))
                return  # the rest are younger still
            ahead = {tp: st.take_prepared(msgs)
                     for (tp, st), (_, msgs) in zip(taken, parts, strict=True)}
            batch = self._local_workers().submit(self._run_local_batch, parts, ahead)
            self._start(Unit(batch, dict(taken), threading.Event()))
            free -= 1

    def _prefix(self, tp: TP, st: PartitionState, now: float, n: int | None = None) -> list[Any]:
        """What a unit takes of a partition: its parked messages due now and up to ``n``
        queued ones, and only as many as the handler's ``max_rate`` lets go now (none:
        the partition waits for tokens)."""
        msgs = st.prefix(n, now)
        if self.limits is not None and msgs:
            got = self.limits.take(tp[0], len(msgs), now)
            if got < len(msgs):
                msgs = st.cut(got)
        return msgs

    def _start(self, unit: Unit) -> None:
        for st in unit.states.values():
            st.enter_unit()
        self.keyed.notify_when_done(unit.future)
        self.in_flight.append(unit)

    # --- results -------------------------------------------------------------------

    def wait_any(self, timeout: float) -> None:
        """Block until a unit or a key-ordered job finishes (since the last call) or
        ``timeout`` passes. Each sets one event as it finishes, so a round costs one
        wait however many are in flight (``concurrent.futures.wait`` would install and
        remove a waiter on every one of them, each round). Cleared before the caller
        harvests: one finishing meanwhile sets it again, and the next call returns at
        once."""
        self.keyed.wait_any(timeout)
        self.keyed.finished.clear()

    def cancel(self, leaving: set[TP] | None) -> None:
        """Stop leased units between two messages when their partitions are leaving
        (all of them with ``None``: the member is closing)."""
        for unit in self.in_flight:
            if leaving is None or leaving & unit.states.keys():
                unit.cancel.set()
        self.keyed.cancel(leaving)

    def harvest(
        self, *, wait_all: bool = False, leaving: set[TP] | None = None
    ) -> tuple[Results, KeyedResults] | None:
        """The results of the units that finished (all of them, waiting, with
        ``wait_all``), for the partitions still assigned to the states they ran from,
        and of the key-ordered jobs (:meth:`KeyedUnits.harvest`); None when nothing
        finished."""
        keyed = self.keyed.harvest(wait_all=wait_all, leaving=leaving)
        results = self._harvest_units(wait_all=wait_all)
        if results is None and not keyed:
            return None
        return results or {}, keyed

    def _harvest_units(self, *, wait_all: bool) -> Results | None:
        done = [u for u in self.in_flight if wait_all or u.future.done()]
        if not done:
            return None
        results: Results = {}
        for unit in done:
            self.in_flight.remove(unit)
            try:
                got = unit.future.result()
            except Exception:  # a defect, never a message's fault: retry the partitions
                log.exception(
                    "work unit failed; will retry %s",
                    ", ".join(f"{t}[{p}]@{'?' if (o := st.first_offset()) is None else o}"
                              for (t, p), st in unit.states.items()),
                    extra={"action": "unit_failed"},
                )
                got = {tp: [Deferred(0.0, "framework")] for tp in unit.states}
            for tp, st in unit.states.items():
                st.leave_unit()
                # A partition revoked and assigned again meanwhile has a new state.
                if self.parts.get(tp) is st and tp in got:
                    results[tp] = got[tp]
        return results

    # --- the workers -----------------------------------------------------------------

    def _workers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self.settings.leased_workers, thread_name_prefix="kafka-idem-worker"
            )
        return self._pool

    def _local_workers(self) -> ThreadPoolExecutor:
        if self._local_pool is None:
            self._local_pool = ThreadPoolExecutor(
                max_workers=self.settings.local_workers, thread_name_prefix="kafka-idem-batch"
            )
        return self._local_pool

    def _worker_processor(self) -> Processor:
        """This thread's processor (its own database connection)."""
        proc: Processor | None = getattr(self._thread_local, "processor", None)
        if proc is None:
            proc = Processor(
                self.app, store=self.store, metrics=self.metrics,
                leases=self.leases, hold=self.hold,
            )
            self._thread_local.processor = proc
            with self._processors_lock:
                self._processors.append(proc)
        return proc

    def _run_local_batch(
        self, parts: list[tuple[TP, list[Any]]], ahead: Ahead | None = None
    ) -> Results:
        """Local-mode partitions in one database transaction (on a batch worker)."""
        return self._worker_processor().run_local(parts, ahead)

    def _run_leased_partition(
        self, tp: TP, msgs: list[Any], tokens: dict[int, Any], cancel: threading.Event
    ) -> Results:
        """One partition's due messages, in order, stopping at the first deferred one
        (or between two messages, when the partition is leaving or the member stops)."""
        proc = self._worker_processor()
        out: list[Result] = []
        for msg in msgs:
            if cancel.is_set() or self.stopping.is_set():
                break
            res = proc.run_leased(msg, reentrant=tokens.get(msg.offset()))
            out.append(res)
            if isinstance(res, Deferred):
                break
        return {tp: out}

    def _mode(self, tp: TP) -> str:
        return self.app.handlers[tp[0]].mode

    def close(self) -> None:
        """Wait for the pools' threads and close every thread's connection."""
        for pool in (self._pool, self._local_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._local_pool = None
        for proc in self._processors:
            proc.close()
        self.keyed.close()
