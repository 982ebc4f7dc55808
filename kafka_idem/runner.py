"""The consumer loop of one group member.

Each round:

1. ``consume()`` a batch (rebalance callbacks run in here, on the loop thread) and
   append each message to its partition's in-memory queue.
2. Harvest the work units that finished (below): produce their dead-letter
   records and wait for the acks (a record not acknowledged turns its message
   back into a deferred one); then, per partition, pop the finished prefix of
   the queue and note the offset after it: offsets only advance over messages
   whose effect is durable, replayed or dead-lettered, and never past a
   message still pending (that would lose it on a crash).
3. Dispatch the partitions that are due (not waiting on a backoff) and not
   already in flight as units of work. Leased mode: one partition per unit,
   on a pool of ``leased_workers`` threads (one database connection each), so
   commit waits and remote calls overlap while the loop goes on consuming.
   Local mode: one batch (one database transaction) of all due partitions,
   run in the loop thread and harvested at once (``local_workers = 0``, the
   default: consume() filled the batch, librdkafka prefetches meanwhile); or
   up to ``local_workers`` batches over disjoint partitions on threads, each
   dispatched when full or when its oldest message has waited
   ``batch_max_wait_seconds``. A partition is in at most one unit at a time,
   and a unit stops at the partition's first deferred message, so each
   partition stays in order.
4. Commit the noted offsets (asynchronously; acknowledged in ``on_commit``).
5. Pause partitions that wait on a backoff or whose queue is full (polling
   goes on, so ``max.poll.interval.ms`` is never exceeded and the member is not evicted);
   resume them when they are due and drained.

A revoke, a loss or a close first waits for the units in flight and applies
their results, so callbacks never race with processing of the partitions they
hand over. Paused partitions keep their fetched messages in our queue:
librdkafka purges its own prefetch on pause and resumes after the last message
it handed out.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import signal
import threading
import time
from collections import Counter, deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from kafka_idem.app import App
from kafka_idem.codec import AvroCodec
from kafka_idem.dlq import DeadLetterer
from kafka_idem.errors import BrokerError
from kafka_idem.lease import LeaseKeeper
from kafka_idem.metrics import Metrics, Sampler
from kafka_idem.processing import Deferred, Finished, Processor, Result
from kafka_idem.store import Store, connect

log = logging.getLogger(__name__)

TP = tuple[str, int]

# Commit errors that mean "this member no longer owns the partition" (a rebalance
# or an eviction).
_OWNERSHIP_LOST = {
    KafkaError.ILLEGAL_GENERATION,
    KafkaError.UNKNOWN_MEMBER_ID,
    KafkaError.REBALANCE_IN_PROGRESS,
    KafkaError._STATE,
    KafkaError._ASSIGNMENT_LOST,
    KafkaError.FENCED_INSTANCE_ID,
}


@dataclass
class PartitionState:
    queue: deque[Any] = field(default_factory=deque)
    not_before: float = 0.0
    paused: bool = False
    framework_failures: int = 0
    tokens: dict[int, Any] = field(default_factory=dict)  # offset -> our live claim token
    last_queued: int = -1
    to_commit: int | None = None  # next offset to commit, not yet acknowledged
    committing: int | None = None  # the offset of an asynchronous commit in flight
    busy: bool = False  # part of a unit in flight
    since: float = 0.0  # when the queued messages started to wait for a batch


@dataclass
class Unit:
    """Work in flight on a worker thread: some partitions' queued prefixes."""

    future: Future[dict[TP, list[Result]]]
    states: dict[TP, PartitionState]  # the states it was taken from (identity checked)
    cancel: threading.Event  # set on revoke/close: a leased unit stops between messages


class Runner:
    """One consumer group member running ``app``'s handlers until stopped."""

    def __init__(self, app: App, *, metrics: Metrics | None = None) -> None:
        self.app = app
        self.settings = app.settings
        self.metrics = metrics or Metrics()
        self.store = Store(
            schema=self.settings.schema_name, table=self.settings.table, namespace=app.namespace
        )
        self.codec = AvroCodec.from_dir(
            self.settings.schemas_dir, registry_url=self.settings.schema_registry_url
        )
        self.leases: LeaseKeeper | None = None
        if any(h.mode == "leased" for h in app.handlers.values()):
            self.leases = LeaseKeeper(self.store, self.settings.dsn, self.settings.lease_seconds)
        self.processor = Processor(
            app, store=self.store, codec=self.codec, metrics=self.metrics, leases=self.leases
        )
        self.parts: dict[TP, PartitionState] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._local_pool: ThreadPoolExecutor | None = None
        self.units: list[Unit] = []
        self._thread_local = threading.local()
        self._processors: list[Processor] = []
        self._processors_lock = threading.Lock()
        self.newly_assigned: list[TopicPartition] = []
        self.stopping = threading.Event()
        self.consumer: Consumer | None = None
        self.producer: Producer | None = None
        self.dlq: DeadLetterer | None = None
        self._fatal: str | None = None
        self._last_lag = 0.0
        self.sampler = Sampler(
            self.metrics, self._sample_store, interval=self.settings.metrics_sample_seconds
        )

    # --- lifecycle -----------------------------------------------------------

    def install_signal_handlers(self) -> None:
        def stop(signum: int, _frame: FrameType | None) -> None:
            log.info("stopping", extra={"action": "stopping", "kind": signal.Signals(signum).name})
            self.stopping.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)

    def start(self) -> None:
        s = self.settings
        self.app.check_topics()
        self._check_schema()
        conf = s.consumer_config(self.app.group_id)
        conf["error_cb"] = self._on_error
        conf["on_commit"] = self._on_commit
        self.consumer = Consumer(conf)
        self.producer = Producer({**s.producer_config(), "error_cb": self._on_error})
        self.dlq = DeadLetterer(self.producer, header_limit=s.error_message_max)
        if self.leases is not None:
            self.leases.start()
        self.sampler.start()
        self.consumer.subscribe(
            self.app.topics,
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        log.info(
            "consumer started",
            extra={"action": "started", "topic": ",".join(self.app.topics)},
        )

    def _check_schema(self) -> None:
        """Refuse to run on a store older than this code (deploy-before-migrate)."""
        from kafka_idem.errors import ConfigError
        from kafka_idem.migrate import applied_versions, migrations
        from kafka_idem.namespaces import refuse_unassigned

        s = self.settings
        conn = connect(s.dsn, application_name=f"kafka_idem:{self.app.name}")
        try:
            have = set(applied_versions(conn, s.schema_name))
            missing = [m for m in migrations() if m.version not in have]
            if missing:
                names = ", ".join(f"{m.version:04d}_{m.name}" for m in missing)
                raise ConfigError(
                    f"store schema {s.schema_name!r} lacks migrations {names}: "
                    "run `kafka-idem migrate`",
                    setting="schema_name",
                )
            # records of this app's handlers from before namespaces: adopt them first
            refuse_unassigned(conn, self.store, self.app)
        finally:
            conn.close()

    def run(self, *, max_seconds: float | None = None) -> int:
        """Run until stopped (SIGTERM/SIGINT or :meth:`stop`); return the exit code."""
        self.start()
        deadline = time.monotonic() + max_seconds if max_seconds else None
        try:
            while not self.stopping.is_set():
                if deadline and time.monotonic() >= deadline:
                    break
                self.step()
                if self._fatal:
                    raise BrokerError(self._fatal)
        finally:
            self.close()
        return 0

    def stop(self) -> None:
        self.stopping.set()

    def close(self) -> None:
        self._drain()
        if self.consumer is not None:
            self._commit_pending(sync=True)
            try:
                self.consumer.close()  # leaves the group: partitions move at once
            except (KafkaException, RuntimeError):
                log.warning("consumer close failed", exc_info=True, extra={"action": "close"})
            self.consumer = None
        if self.producer is not None:
            self.producer.flush(10)
            self.producer = None
        for pool in (self._pool, self._local_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._local_pool = None
        for proc in self._processors:
            proc.close()
        if self.leases is not None:
            self.leases.stop()
        self.sampler.stopped.set()
        self.processor.close()
        log.info("consumer stopped", extra={"action": "stopped"})

    # --- one round -------------------------------------------------------------

    def step(self) -> None:
        assert self.consumer is not None
        if self.newly_assigned:
            # A partition paused before a revoke can come back paused.
            self.consumer.resume(self.newly_assigned)
            self.newly_assigned = []
        msgs = self.consumer.consume(
            num_messages=self.settings.batch_size,
            timeout=0.0 if self.units else self._wait_time(),
        )
        if self.units and not msgs:
            # Nothing to fetch right now: wait for a unit rather than spin.
            wait([u.future for u in self.units], timeout=min(self._wait_time(), 0.05),
                 return_when=FIRST_COMPLETED)
        self._ingest(msgs)
        self._harvest()
        self._dispatch()
        self._harvest()  # what ran in the loop thread (local_workers = 0) applies at once
        self._commit_pending()
        self._pause_resume()
        self._observe_lag()

    def _wait_time(self) -> float:
        """Until the next backoff ends or a partly filled batch has waited long enough."""
        max_wait = self.settings.batch_max_wait_seconds
        deadlines = [
            max(st.not_before, st.since + max_wait) for st in self.parts.values()
            if st.queue and not st.busy
        ]
        wait_s = max_wait
        if deadlines:
            wait_s = min(wait_s, max(min(deadlines) - time.monotonic(), 0.0))
        return max(wait_s, 0.001)

    def _ingest(self, msgs: list[Any]) -> None:
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                if err.fatal():
                    self._fatal = f"fatal consumer error: {err}"
                log.warning("consumer error: %s", err, extra={"action": "consumer_error"})
                continue
            tp = (msg.topic(), msg.partition())
            st = self.parts.setdefault(tp, PartitionState())
            if msg.offset() <= st.last_queued:
                continue  # already queued (a re-fetch after a rewind)
            if not st.queue:
                st.since = time.monotonic()
            st.queue.append(msg)
            st.last_queued = msg.offset()

    # --- units of work ---------------------------------------------------------

    def _dispatch(self) -> None:
        """Step 3: hand due partitions that are not in flight to the workers."""
        now = time.monotonic()
        due = [
            (tp, st) for tp, st in self.parts.items()
            if st.queue and not st.busy and st.not_before <= now
        ]
        if not due:
            return
        limit = self.settings.batch_size
        local: list[tuple[TP, PartitionState]] = []
        for tp, st in due:
            if self._mode(tp) == "leased":
                # Leased partitions run on the worker pool (one connection each), so
                # their commit waits and remote calls overlap.
                msgs = _prefix(st.queue, limit)
                cancel = threading.Event()
                future = self._workers().submit(
                    self._run_leased_partition, tp, msgs, dict(st.tokens), cancel
                )
                self._start(Unit(future, {tp: st}, cancel))
            else:
                local.append((tp, st))
        if local and self.settings.local_workers == 0:
            # In the loop thread, as one batch: consume() has already waited to fill it.
            done: Future[dict[TP, list[Result]]] = Future()
            try:
                done.set_result(self._run_local_batch([(tp, list(st.queue)) for tp, st in local]))
            except Exception as exc:  # a defect: _harvest defers the partitions
                done.set_exception(exc)
            self._start(Unit(done, dict(local), threading.Event()))
            return
        free = self.settings.local_workers - sum(
            1 for u in self.units if self._mode(next(iter(u.states))) == "local"
        )
        # Oldest first, each batch filled up to batch_size from whole partition
        # prefixes; a partly filled batch waits until its oldest message has waited
        # batch_max_wait (as consume() would have waited to fill it).
        local.sort(key=lambda item: item[1].since)
        while local and free > 0:
            parts: list[tuple[TP, list[Any]]] = []
            room = limit
            while local and room > 0:
                tp, st = local.pop(0)
                msgs = _prefix(st.queue, room)
                room -= len(msgs)
                parts.append((tp, msgs))
            oldest = min(self.parts[tp].since for tp, _ in parts)
            if room > 0 and now - oldest < self.settings.batch_max_wait_seconds:
                return  # the rest are younger still
            batch = self._local_workers().submit(self._run_local_batch, parts)
            self._start(Unit(batch, {tp: self.parts[tp] for tp, _ in parts}, threading.Event()))
            free -= 1

    def _start(self, unit: Unit) -> None:
        for st in unit.states.values():
            st.busy = True
        self.units.append(unit)

    def _harvest(self, *, wait_all: bool = False) -> None:
        """Step 2: apply the results of the units that finished (all of them, waiting,
        with ``wait_all``)."""
        done = [u for u in self.units if wait_all or u.future.done()]
        if not done:
            return
        results: dict[TP, list[Result]] = {}
        for unit in done:
            self.units.remove(unit)
            try:
                got = unit.future.result()
            except Exception:  # a defect, never a message's fault: retry the partitions
                log.exception(
                    "work unit failed; will retry %s",
                    ", ".join(f"{t}[{p}]@{st.queue[0].offset() if st.queue else '?'}"
                              for (t, p), st in unit.states.items()),
                    extra={"action": "unit_failed"},
                )
                got = {tp: [Deferred(0.0, "framework")] for tp in unit.states}
            for tp, st in unit.states.items():
                st.busy = False
                # A partition revoked and assigned again meanwhile has a new state.
                if self.parts.get(tp) is st and tp in got:
                    results[tp] = got[tp]
        self._dead_letter(results)
        self._apply(results, time.monotonic())  # delays count from the decision, not the round

    def _drain(self, partitions: list[TopicPartition] | None = None) -> None:
        """Wait for the units in flight (stopping leased units between messages when
        their partitions are leaving) and apply their results."""
        if not self.units:
            return
        leaving = None if partitions is None else {(p.topic, p.partition) for p in partitions}
        for unit in self.units:
            if leaving is None or leaving & unit.states.keys():
                unit.cancel.set()
        self._harvest(wait_all=True)

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
        proc: Processor | None = getattr(self._thread_local, "processor", None)
        if proc is None:
            proc = Processor(
                self.app, store=self.store, codec=self.codec, metrics=self.metrics,
                leases=self.leases,
            )
            self._thread_local.processor = proc
            with self._processors_lock:
                self._processors.append(proc)
        return proc

    def _run_local_batch(self, parts: list[tuple[TP, list[Any]]]) -> dict[TP, list[Result]]:
        """Local-mode partitions in one database transaction (on a batch worker)."""
        return self._worker_processor().run_local(parts)

    def _run_leased_partition(
        self, tp: TP, msgs: list[Any], tokens: dict[int, Any], cancel: threading.Event
    ) -> dict[TP, list[Result]]:
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

    def _dead_letter(self, results: dict[TP, list[Result]]) -> None:
        """Step 4: DLQ records acknowledged before their offsets may be committed."""
        todo = [
            (tp, i, r.letter)
            for tp, rs in results.items()
            for i, r in enumerate(rs)
            if isinstance(r, Finished) and r.letter is not None
        ]
        if not todo:
            return
        assert self.dlq is not None
        errors = self.dlq.send([letter for _, _, letter in todo])
        for (tp, i, letter), err in zip(todo, errors, strict=True):
            if err is None:
                self.metrics.dead_lettered.labels(
                    letter.source.topic(), letter.handler, letter.kind
                ).inc()
                continue
            self.metrics.dlq_failures.labels(letter.dlq_topic).inc()
            log.error(
                "dead-letter produce to %s failed (%s); the source offset stays "
                "uncommitted and the dead letter will be retried",
                letter.dlq_topic, err,
                extra={"action": "dlq_failed", "topic": tp[0], "partition": tp[1],
                       "offset": letter.source.offset(), "key": letter.idempotency_key},
            )
            rs = results[tp]
            if i < len(rs):
                del rs[i:]
                rs.append(Deferred(0.0, "dlq"))

    def _apply(self, results: dict[TP, list[Result]], now: float) -> None:
        """Step 5: pop the finished prefix of each queue; schedule the deferred message."""
        counts: Counter[tuple[str, str]] = Counter()  # (topic, outcome): one update per round
        for tp, rs in results.items():
            st = self.parts.get(tp)
            if st is None:
                continue  # revoked meanwhile
            st.since = now  # what is left waits anew for its batch (a deferral: below)
            for res in rs:
                msg = st.queue[0]
                if isinstance(res, Finished):
                    st.queue.popleft()
                    st.tokens.pop(msg.offset(), None)
                    st.framework_failures = 0
                    st.to_commit = msg.offset() + 1
                    counts[(tp[0], res.outcome)] += 1
                    continue
                st.not_before = now + self._delay(st, res)
                st.since = 0.0  # due at once when its delay ends
                if res.token is not None:
                    st.tokens[msg.offset()] = res.token
                if res.reason in ("busy", "retry"):
                    counts[(tp[0], "busy" if res.reason == "busy" else "retried")] += 1
                break
        for (topic, outcome), n in counts.items():
            self.metrics.outcome(topic, self.app.handlers[topic].name, outcome, n)

    def _delay(self, st: PartitionState, res: Deferred) -> float:
        if res.reason in ("framework", "dlq"):
            # Our own surroundings failed: wait with jittered growth, never charge the message.
            st.framework_failures += 1
            return random.uniform(0.1, min(10.0, 0.2 * 2 ** min(st.framework_failures, 6)))
        return res.delay

    def _commit_pending(self, *, sync: bool = False) -> None:
        """Commit each partition's finished prefix. Asynchronous in the loop (its
        acknowledgement arrives in :meth:`_on_commit`); synchronous when closing."""
        if self.consumer is None:
            return
        offsets = [
            TopicPartition(tp[0], tp[1], st.to_commit)
            for tp, st in self.parts.items()
            # One asynchronous commit in flight per partition: during a rebalance the
            # broker holds commits, and piling them up only multiplies the failures.
            if st.to_commit is not None and (sync or st.committing is None)
        ]
        if not offsets:
            return
        if not sync:
            for tp_ in offsets:
                self.parts[(tp_.topic, tp_.partition)].committing = tp_.offset
            try:
                self.consumer.commit(offsets=offsets, asynchronous=True)
            except KafkaException as exc:
                log.warning("commit failed, will retry: %s", exc, extra={"action": "commit"})
                for tp_ in offsets:
                    self.parts[(tp_.topic, tp_.partition)].committing = None
            return
        try:
            self.consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            err = exc.args[0]
            if err.code() in _OWNERSHIP_LOST:
                log.warning("commit refused, ownership lost: %s", err, extra={"action": "commit"})
            else:
                log.warning("commit failed, will retry: %s", err, extra={"action": "commit"})
            return
        for tp_ in offsets:
            st = self.parts.get((tp_.topic, tp_.partition))
            if st is not None and st.to_commit == tp_.offset:
                st.to_commit = None

    def _on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """Acknowledgement of a commit (runs inside consume())."""
        for tp_ in partitions:
            st = self.parts.get((tp_.topic, tp_.partition))
            if st is None:
                continue
            failed = err is not None or tp_.error is not None
            if st.committing == tp_.offset:
                st.committing = None  # the next round sends the newest offset, if any
            if not failed and st.to_commit == tp_.offset:
                st.to_commit = None
        if err is not None and err.code() != KafkaError._NO_OFFSET:
            log.warning("commit failed, will retry: %s", err, extra={"action": "commit"})

    def _pause_resume(self) -> None:
        """Step 5: pause a partition that waits on a backoff, or whose queue holds two
        batches (memory stays bounded while its units run); resume it when it is due
        and down to one batch."""
        assert self.consumer is not None
        now = time.monotonic()
        full = 2 * self.settings.batch_size
        pause, resume = [], []
        for (topic, part), st in self.parts.items():
            waiting = bool(st.queue) and not st.busy and st.not_before > now
            if not st.paused and (waiting or len(st.queue) >= full):
                pause.append(TopicPartition(topic, part))
                st.paused = True
            elif st.paused and not waiting and len(st.queue) <= self.settings.batch_size:
                resume.append(TopicPartition(topic, part))
                st.paused = False
        if pause:
            self.consumer.pause(pause)
        if resume:
            self.consumer.resume(resume)

    def _observe_lag(self) -> None:
        now = time.monotonic()
        if now - self._last_lag < 5.0 or self.consumer is None:
            return
        self._last_lag = now
        for (topic, part), st in self.parts.items():
            try:
                _low, high = self.consumer.get_watermark_offsets(
                    TopicPartition(topic, part), cached=True
                )
                # Lag counts what is not finished: messages waiting in our queue
                # (fetched but pending) as much as those not fetched yet.
                done = (
                    st.queue[0].offset()
                    if st.queue
                    else self.consumer.position([TopicPartition(topic, part)])[0].offset
                )
            except KafkaException:
                continue
            if high >= 0 and done >= 0:
                self.metrics.lag.labels(topic, str(part)).set(max(high - done, 0))

    def _forget(self, partitions: list[TopicPartition]) -> None:
        """Drop revoked or lost partitions' state and their lag series."""
        for tp_ in partitions:
            self.parts.pop((tp_.topic, tp_.partition), None)
            with contextlib.suppress(KeyError):
                self.metrics.lag.remove(tp_.topic, str(tp_.partition))

    def _sample_store(self) -> dict[str, Any]:
        """Database gauges for the sampler thread (its own short-lived connection)."""
        from kafka_idem import admin

        conn = connect(self.settings.dsn, application_name="kafka_idem:metrics")
        try:
            st = admin.status(
                conn, self.store, long_running_seconds=self.settings.long_running_seconds,
                namespace=self.store.namespace,
            )
        finally:
            conn.close()
        return {
            "by_status": st.by_status,
            "expired_leases": st.processing_expired,
            "long_running": st.long_running,
        }

    # --- rebalance callbacks (run inside consume(); short and total) -----------

    def _on_assign(self, _consumer: Any, partitions: list[TopicPartition]) -> None:
        log.info("assigned %s", _names(partitions), extra={"action": "assigned"})
        self.newly_assigned.extend(partitions)

    def _on_revoke(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        log.info("revoked %s", _names(partitions), extra={"action": "revoked"})
        self._drain(partitions)  # their work in flight finishes first, then their offsets
        offsets = []
        for tp_ in partitions:
            st = self.parts.get((tp_.topic, tp_.partition))
            if st is not None and st.to_commit is not None:
                offsets.append(TopicPartition(tp_.topic, tp_.partition, st.to_commit))
        self._forget(partitions)
        if offsets:
            try:
                consumer.commit(offsets=offsets, asynchronous=False)
            except KafkaException as exc:
                # The records are durable; the new owner replays them from the store.
                log.warning("commit on revoke failed: %s", exc, extra={"action": "commit"})

    def _on_lost(self, _consumer: Any, partitions: list[TopicPartition]) -> None:
        log.warning("lost %s", _names(partitions), extra={"action": "lost"})
        self._drain(partitions)  # fenced in the store; nothing of it is committed here
        self._forget(partitions)

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            # e.g. a second member with our group.instance.id fenced us (a zombie).
            self._fatal = f"fatal Kafka error: {err}"
        log.warning("kafka: %s", err, extra={"action": "kafka_error"})


def _prefix(queue: deque[Any], n: int) -> list[Any]:
    """The first ``n`` messages of ``queue`` (they stay queued until their results apply)."""
    return list(itertools.islice(queue, n))


def _names(partitions: list[TopicPartition]) -> str:
    return ",".join(f"{p.topic}[{p.partition}]" for p in partitions)
