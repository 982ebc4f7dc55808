"""The consumer loop of one group member: its lifecycle and its rounds.

Each round, in the order a message travels:

1. ``consume()`` a batch (rebalance callbacks run in here, on the loop thread) and
   queue each message on its partition (:mod:`~kafka_idem.consume.partitions`). A
   batch is what librdkafka holds, up to ``batch_size``; an idle round waits (at
   most ``batch_max_wait_seconds``) for the first message only, so batches close
   early when the input pauses (``batch_linger_seconds`` lets them fill).
2. Harvest the finished units of work (:mod:`~kafka_idem.consume.concurrency.units`): their
   dead letters are produced and acknowledged first
   (:mod:`~kafka_idem.consume.send_letters`), then each partition's finished prefix
   leaves its queue and the offset after it becomes committable. Offsets never
   pass a message still pending (that would lose it on a crash).
3. Dispatch the due partitions that are not in flight; a unit run in the loop
   thread (local mode, ``local_workers = 0``) applies at once.
4. Commit the committable offsets (:mod:`~kafka_idem.consume.offsets`).
5. Pause partitions that wait on a backoff or whose queue is full (polling
   goes on, so ``max.poll.interval.ms`` is never exceeded and the member is not
   evicted); resume them when they are due and drained. A paused handler's
   partitions (``kafka-idem pause``) stay paused: :mod:`~kafka_idem.consume.pause_watch`.

Handlers with ``concurrency > 1`` or ``async def`` ones keep their partitions key-ordered
(:mod:`~kafka_idem.consume.concurrency.keyed_state`): step 3 starts single messages, many
per partition, one at a time per key. A round that follows a stall of the process (e.g.
SIGSTOP) longer than half the session timeout starts no key-ordered message before the next
``consume()``, which delivers a loss of the partitions first (their order across ordering
keys depends on owning the partition). ``async def`` handlers' tasks run on an event loop
this thread runs whenever it waits (for a unit, a round of what is ready, a drain), or on a
thread of its own (``event_loop_thread``).

A revoke, a loss or a close first waits for the units in flight and applies their results,
so callbacks never race with processing of the partitions they hand over. Paused partitions
keep their fetched messages in our queue: librdkafka purges its own prefetch on pause and
resumes after the last message it handed out.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from kafka_idem.app import App
from kafka_idem.consume.committable import TP
from kafka_idem.consume.committable import names as _names
from kafka_idem.consume.committable import tps as _tps
from kafka_idem.consume.concurrency.keyed_units import KeyedResults
from kafka_idem.consume.concurrency.units import Units
from kafka_idem.consume.fatal_errors import ends_member, fatal_error
from kafka_idem.consume.lag import LAG_EVERY_SECONDS, Lag, Sampler, sample_store
from kafka_idem.consume.offsets import Offsets, say_where_they_start
from kafka_idem.consume.outcome import Result
from kafka_idem.consume.partitions import Partitions
from kafka_idem.consume.paths.lease_keeper import LeaseKeeper
from kafka_idem.consume.pause_watch import HandlerHold
from kafka_idem.consume.progress import Progress
from kafka_idem.consume.retention import Retention
from kafka_idem.consume.send_letters import send_letters
from kafka_idem.consume.shutdown import GRACE, Shutdown
from kafka_idem.consume.startup import absent_topics, check_schema, tune_gc, warn_missing
from kafka_idem.deadletters.dead_letter import DeadLetterer
from kafka_idem.errors import FrameworkError
from kafka_idem.observe import kafka_logs
from kafka_idem.observe.health import Health
from kafka_idem.observe.metrics import Metrics
from kafka_idem.outbox.relay import Relay, RelayThread
from kafka_idem.store import Store

log = logging.getLogger(__name__)

CLOSE_MARGIN = 0.5  # seconds a stop's bound keeps for what follows a bounded step


class Runner:
    """One consumer group member running ``app``'s handlers until stopped."""

    def __init__(self, app: App, *, metrics: Metrics | None = None,
                 topics_command: str | None = None, migrate_command: str | None = None,
                 ) -> None:
        self.app = app
        # what the missing-topics warning, and a start before `migrate`, tell to run
        self.topics_command = topics_command or "kafka-idem topics create MODULE:APP"
        self.migrate_command = migrate_command  # None: "kafka-idem migrate --app MODULE:APP"
        self.settings = s = app.settings
        self.metrics = metrics or Metrics()
        self.store = Store(schema=s.schema_name, table=s.table, namespace=app.namespace)
        app.bind_codecs()  # every handler's codec, checked now: a bad one fails the start
        self.leases: LeaseKeeper | None = None
        if any(h.mode == "leased" for h in app.handlers.values()):
            self.leases = LeaseKeeper(self.store, s.dsn, s.lease_seconds)
        self.stopping = threading.Event()
        self.parts = Partitions()  # Units tells it how to keep each topic's partitions
        self.offsets = Offsets(self.parts)
        self.units = Units(app, self.parts, store=self.store, metrics=self.metrics,
                           leases=self.leases, stopping=self.stopping)
        self.lag = Lag(self.metrics)
        self.newly_assigned: list[TopicPartition] = []
        self.assigned: set[TP] = set()  # as the rebalance callbacks last left it
        self.consumer: Consumer | None = None
        self._start_at = ("", "latest")  # group id and auto.offset.reset, set by start()
        self.producer: Producer | None = None
        self.dlq: DeadLetterer | None = None
        self._fatal: FrameworkError | None = None
        self.missing_topics: set[str] = set()  # warned about once; logged again when found
        self.progress = Progress(s.progress_seconds)
        # /livez and /readyz (served with /metrics): the loop reports its own progress.
        self.health = Health(liveness_seconds=s.liveness_seconds, max_lag=s.readiness_max_lag)
        self.metrics.health = self.health
        self._polled_at = time.monotonic()
        # A loop that did not poll for this long may have lost its partitions without
        # knowing yet: it starts no key-ordered message before it polls.
        self._stall_limit = min(s.session_timeout_ms, s.max_poll_interval_ms) / 2000
        self.sampler = Sampler(
            self.metrics, lambda: sample_store(s, self.store), interval=s.metrics_sample_seconds
        )
        self._shutdown: Shutdown | None = None  # install_signal_handlers (kafka-idem run)
        self.relay: RelayThread | None = None  # an app with event topics publishes its outbox
        self.hold = HandlerHold(app, self.store, self.parts, metrics=self.metrics,
                                health=self.health)  # paused handlers (kafka-idem pause)
        if s.outbox_relay and app.event_topics:
            self.relay = RelayThread(Relay(app, metrics=self.metrics, health=self.health))
        self.retention = Retention(s, self.store, self.metrics, app.topics)  # retention set

    # --- lifecycle -----------------------------------------------------------

    def install_signal_handlers(self) -> Shutdown:
        """SIGTERM/SIGINT stop the member (``kafka-idem run``; call in the main thread):
        it drains, commits and leaves the group; a stop still running ``drain_seconds``
        + 2 s later, or a second signal, ends the process at once (see
        :mod:`kafka_idem.consume.shutdown`)."""
        shutdown = Shutdown(on_stop=self.stop, bound=self.settings.drain_seconds + GRACE)
        shutdown.install()
        self._shutdown = shutdown
        return shutdown

    def start(self) -> None:
        """Check topics and store, subscribe, start the helper threads (:meth:`run` does)."""
        s = self.settings
        self.app.check_topics()
        check_schema(self.settings, self.store, self.app, migrate_command=self.migrate_command)
        self.retention.start()  # refuses a window shorter than the topics' retention
        conf = s.consumer_config(self.app.group_id)
        conf["error_cb"] = self._on_error
        conf["on_commit"] = self._on_commit
        conf["enable.partition.eof"] = True  # the lag of an idle partition (/readyz)
        self._start_at = (str(conf["group.id"]), str(conf.get("auto.offset.reset", "latest")))
        self.consumer = Consumer(conf)
        self.producer = Producer({**s.producer_config(), "error_cb": self._on_error})
        self.dlq = DeadLetterer(self.producer, header_limit=s.error_message_max,
                                signing_keys=s.signing_keys)
        self._warn_missing(absent_topics(self.settings, self.app))
        if self.leases is not None:
            self.leases.start()
        self.sampler.start()
        self.hold.start()
        if self.relay is not None:
            self.relay.start()
        self.consumer.subscribe(self.app.topics, on_assign=self._on_assign,
                                on_revoke=self._on_revoke, on_lost=self._on_lost)
        if s.gc_tuning:
            tune_gc()
        topics = ",".join(self.app.topics)
        log.info("consumer started", extra={"action": "started", "topic": topics})

    def _warn_missing(self, absent: list[str]) -> None:
        warn_missing(self.missing_topics, absent, self.topics_command, log)

    def run(self, *, max_seconds: float | None = None) -> int:
        """Run until stopped (SIGTERM/SIGINT or :meth:`stop`); return the exit code."""
        self.start()
        deadline = time.monotonic() + max_seconds if max_seconds else None
        try:
            while not self.stopping.is_set():
                if deadline and time.monotonic() >= deadline:
                    break
                self.step()
                if self.relay is not None and self.relay.error is not None:
                    self._fatal = self.relay.error
                if self._fatal:
                    raise self._fatal
        finally:
            self.close()
        return 0

    # --- one round -------------------------------------------------------------

    def step(self) -> None:
        """One round of the loop: consume, harvest, dispatch, commit, pause (see above)."""
        assert self.consumer is not None
        if self.newly_assigned:
            # A partition paused before a revoke can come back paused (a paused handler's stays).
            self.consumer.resume(self.hold.unheld(self.newly_assigned, self.consumer))
            self.newly_assigned = []
        busy = self.units.busy
        msgs = self._fetch(busy)
        self._polled_at = time.monotonic()
        if busy and not msgs:
            # Nothing to fetch right now: wait for a unit rather than spin.
            self.units.wait_any(min(self._wait_time(), 0.05))
        elif busy:
            self.units.keyed.pump()
        self._ingest(msgs)
        self._harvest()
        now = time.monotonic()
        self.units.dispatch(now, keyed=now - self._polled_at < self._stall_limit)
        self._harvest()  # what ran in the loop thread (local_workers = 0) applies at once
        self._commit_pending()
        self._pause_resume()
        ready = self.health.ready().ok
        lags = self.lag.observe(self.consumer, self.parts, self.health.assignment(),
                                every=LAG_EVERY_SECONDS if ready else 1.0)
        if lags is not None:
            self.health.observed(lags)
        self.health.round()
        self.progress.tick(time.monotonic())

    def _fetch(self, busy: bool) -> list[Any]:
        """This round's messages: what librdkafka already holds, up to ``batch_size``.
        Only an idle round (nothing held, no work in flight) blocks, and only until the
        first message, taking what came with it: a batch starts when the input pauses,
        not when it is full, and under a backlog it is full anyway (while one batch's
        transaction runs the next accumulates). ``batch_linger_seconds`` lets a batch
        wait to fill instead."""
        assert self.consumer is not None
        size = self.settings.batch_size
        msgs = self.consumer.consume(num_messages=size, timeout=0.0)
        if busy:
            return msgs
        if not msgs:
            msgs = self.consumer.consume(num_messages=1, timeout=self._wait_time())
            if msgs and size > 1:
                msgs += self.consumer.consume(num_messages=size - 1, timeout=0.0)
        if msgs and self.settings.batch_linger_seconds > 0:
            self._linger(msgs)
        return msgs

    def _linger(self, msgs: list[Any]) -> None:
        """Let a batch fill for ``batch_linger_seconds`` (not past a backoff's end).
        Partition-end events come back from consume() too: they do not count."""
        assert self.consumer is not None
        size = self.settings.batch_size
        deadline = time.monotonic() + min(self.settings.batch_linger_seconds, self._wait_time())
        have = sum(1 for m in msgs if m.error() is None)
        while have < size and (left := deadline - time.monotonic()) > 0:
            more = self.consumer.consume(num_messages=size - have, timeout=left)
            msgs += more
            have += sum(1 for m in more if m.error() is None)

    def _wait_time(self) -> float:
        s = self.settings
        return self.parts.wait_time(time.monotonic(), s.batch_max_wait_seconds,
                                    s.batch_linger_seconds)

    def _ingest(self, msgs: list[Any]) -> None:
        stale = 0
        for msg in msgs:
            err = msg.error()
            if err is None:
                if (msg.topic(), msg.partition()) not in self.assigned:
                    # Fetched before a revoke that ran inside this consume(): librdkafka
                    # can still return it. Its new owner starts from the committed offset;
                    # queued here it would run a second copy of the partition.
                    stale += 1
                    continue
                self.parts.add(msg, time.monotonic())
                continue
            if err.code() == KafkaError._PARTITION_EOF:
                self.lag.reached_end((msg.topic(), msg.partition()), msg.offset())
                continue
            if err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART and msg.topic():
                # said once, with the command that fixes it (not librdkafka's words again)
                self._warn_missing([msg.topic()])
                log.debug("consumer error: %s", err, extra={"action": "consumer_error"})
                continue
            if ends_member(err):
                self._fatal = fatal_error(err, self.settings, self.app.group_id)
                continue  # said once, as the member's exit line
            log.warning("consumer error: %s", err, extra={"action": "consumer_error"})
        if stale:
            log.info("dropped %d messages of partitions no longer assigned", stale,
                     extra={"action": "stale_messages"})

    def _harvest(self, *, wait_all: bool = False, leaving: set[TP] | None = None) -> None:
        """Apply the results of the units that finished (all of them, waiting, with
        ``wait_all``): dead letters acknowledged first, then the queues' prefixes."""
        harvested = self.units.harvest(wait_all=wait_all, leaving=leaving)
        if harvested is None:
            return
        results, keyed = harvested
        assert self.dlq is not None
        letters: dict[Any, list[Result]] = {**results, **keyed}
        send_letters(self.dlq, self.metrics, letters)
        self._apply(results, keyed, time.monotonic())  # delays count from the decision

    def _apply(
        self, results: dict[TP, list[Result]], keyed: KeyedResults, now: float
    ) -> None:
        """Pop each queue's finished prefix, schedule its deferred message, count outcomes."""
        counts = self.parts.apply(results, now) + self.units.keyed.apply(keyed, now)
        for (topic, outcome), n in counts.items():
            self.metrics.outcome(topic, self.app.handlers[topic].name, outcome, n)
        self.progress.add(counts)

    def _commit_pending(self, *, sync: bool = False) -> None:
        """Commit each partition's finished prefix (asynchronously in the loop,
        synchronously when closing)."""
        if self.consumer is not None:
            self.offsets.commit(self.consumer, sync=sync)

    def _pause_resume(self) -> None:
        assert self.consumer is not None
        flow = self.parts.pause_resume(time.monotonic(), self.settings.batch_size)
        pause, resume = self.hold.pause_resume(flow, self.assigned, self.units)
        if pause:
            self.consumer.pause(_positions(pause))
        if resume:
            self.consumer.resume(_positions(resume))
            self._fetch_now(resume)

    def _fetch_now(self, tps: list[TP]) -> None:
        """Have librdkafka fetch resumed partitions now. A resume alone does not wake
        the broker thread, which fetches them when it next wakes on its own, up to a
        second later: a partition paused because it held two batches would then run
        dry before its next batch arrives. A seek to where it resumes anyway (its
        position: after the last message handed out) wakes it, without a request."""
        assert self.consumer is not None
        try:
            positions = [p for p in self.consumer.position(_positions(tps)) if p.offset >= 0]
            for p in positions:
                self.consumer.seek(p)
        except KafkaException as exc:  # e.g. revoked meanwhile: it is fetched later anyway
            log.debug("no fetch wake-up after resume (%s)", exc, extra={"action": "resume"})

    # --- rebalance callbacks (run inside consume(); short and total) -----------

    def _on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        if partitions:
            log.info("assigned %s", _names(partitions), extra={"action": "assigned"})
            group, reset = self._start_at
            say_where_they_start(consumer, partitions, group=group, reset=reset)
        elif not self.assigned:  # a spare member: more members than partitions
            log.info("no partitions assigned (the group has more members than partitions, "
                     "or none of its topics exists yet)", extra={"action": "assigned"})
        else:  # a cooperative rebalance that gave this member nothing more
            log.debug("no new partitions assigned; keeping %s", _names(
                [TopicPartition(t, p) for t, p in sorted(self.assigned)]),
                extra={"action": "assigned"})
        self.health.assigned(_tps(partitions))
        self.newly_assigned.extend(partitions)
        self.assigned.update(_tps(partitions))
        found = sorted({p.topic for p in partitions} & self.missing_topics)
        if found:
            self.missing_topics.difference_update(found)
            log.info("topic %s exists now", ", ".join(found), extra={"action": "topics_found"})

    def _on_revoke(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        if partitions:  # a cooperative rebalance that took nothing says nothing
            log.info("revoked %s", _names(partitions), extra={"action": "revoked"})
        self.assigned.difference_update(_tps(partitions))
        self._drain(partitions)  # their work in flight finishes first, then their offsets
        tps = _tps(partitions)
        self.lag.forget(tps)
        self.health.revoked(tps)
        self.offsets.commit_leaving(consumer, tps)

    def _on_lost(self, _consumer: Any, partitions: list[TopicPartition]) -> None:
        log.warning("lost %s", _names(partitions), extra={"action": "lost"})
        self.assigned.difference_update(_tps(partitions))
        self._drain(partitions)  # fenced in the store; nothing of it is committed here
        tps = _tps(partitions)
        self.parts.forget(tps)
        self.lag.forget(tps)
        self.health.revoked(tps)

    def _on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        self.offsets.acknowledged(err, partitions)

    def _on_error(self, err: KafkaError) -> None:
        if ends_member(err):
            self._fatal = fatal_error(err, self.settings, self.app.group_id)
            return
        kafka_logs.error(err)  # deduplicated: with the broker down this repeats every 50 ms

    def _drain(self, partitions: list[TopicPartition] | None = None) -> None:
        """Wait for the units in flight (stopping leased units between messages when
        their partitions are leaving) and apply their results."""
        if not self.units.busy:
            return
        leaving = None if partitions is None else set(_tps(partitions))
        self.units.cancel(leaving)
        self._harvest(wait_all=True, leaving=leaving)

    # --- the end -----------------------------------------------------------------

    def _left(self, most: float) -> float:
        """What a closing step may wait: at most ``most`` seconds, and when a signal
        stopped the member, no later than the stop's bound (less a margin for the rest
        of the close), past which :class:`Shutdown` ends the process anyway."""
        since = self._shutdown.stopping_since if self._shutdown is not None else None
        if since is None:
            return most
        end = since + self._shutdown.bound - CLOSE_MARGIN  # type: ignore[union-attr]
        return max(min(most, end - time.monotonic()), 0.0)

    def stop(self) -> None:
        """Ask the member to stop (thread-safe; returns at once): the loop ends its
        round, drains, commits and leaves; the outbox relay takes no shard from now
        on and finishes its rounds meanwhile."""
        self.health.stopping()  # /readyz says so while the member drains
        self.stopping.set()
        if self.relay is not None:
            self.relay.stopping.set()

    def close(self) -> None:
        """Drain the work in flight, commit, leave the group and stop the helper threads."""
        self._drain()
        if self.consumer is not None:
            self._commit_pending(sync=True)
            try:
                self.consumer.close()  # leaves the group: partitions move at once
            except (KafkaException, RuntimeError):
                log.warning("consumer close failed", exc_info=True, extra={"action": "close"})
            self.consumer = None
        if self.producer is not None:
            self.producer.flush(self._left(10.0))
            self.producer = None
        self.units.close()
        if self.relay is not None:
            self.relay.close(self._left(60.0))
        if self.leases is not None:
            self.leases.stop()
        self.retention.close(self._left(5.0))
        self.sampler.stopped.set()
        self.hold.stop()
        self.progress.tick(time.monotonic(), final=True)
        log.info("consumer stopped", extra={"action": "stopped"})


def _positions(tps: list[TP]) -> list[TopicPartition]:
    return [TopicPartition(topic, part) for topic, part in tps]
