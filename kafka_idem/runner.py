"""The consumer loop of one group member: its lifecycle and its rounds.

Each round, in the order a message travels:

1. ``consume()`` a batch (rebalance callbacks run in here, on the loop thread) and
   queue each message on its partition (:mod:`~kafka_idem.consume.partitions`). A
   batch is what librdkafka holds, up to ``batch_size``; an idle round waits (at
   most ``batch_max_wait_seconds``) for the first message only, so batches close
   early when the input pauses (``batch_linger_seconds`` lets them fill).
2. Harvest the finished units of work (:mod:`~kafka_idem.consume.units`): their
   dead letters are produced and acknowledged first
   (:mod:`~kafka_idem.consume.letters`), then each partition's finished prefix
   leaves its queue and the offset after it becomes committable. Offsets never
   pass a message still pending (that would lose it on a crash).
3. Dispatch the due partitions that are not in flight; a unit run in the loop
   thread (local mode, ``local_workers = 0``) applies at once.
4. Commit the committable offsets (:mod:`~kafka_idem.consume.offsets`).
5. Pause partitions that wait on a backoff or whose queue is full (polling
   goes on, so ``max.poll.interval.ms`` is never exceeded and the member is not
   evicted); resume them when they are due and drained.

Handlers with ``concurrency > 1`` or ``async def`` ones keep their partitions
key-ordered (:mod:`~kafka_idem.consume.keyed`): step 3 starts single messages,
many per partition, one at a time per key. A round that follows a stall of the
process (e.g. SIGSTOP) longer than half the session timeout starts no key-ordered
message before the next ``consume()``, which delivers a loss of the partitions
first (their order across ordering keys depends on owning the partition).
``async def`` handlers' tasks run on an event loop that this thread runs whenever
it waits: for a unit to finish (at most 50 ms while busy), for one round of what is
ready after a round that fetched, and while a revoke or a close drains
(:class:`~kafka_idem.consume.aio.EventLoop`, ``pumped``; ``event_loop_thread``
gives it a thread of its own).

A revoke, a loss or a close first waits for the units in flight and applies
their results, so callbacks never race with processing of the partitions they
hand over. Paused partitions keep their fetched messages in our queue:
librdkafka purges its own prefetch on pause and resumes after the last message
it handed out.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from kafka_idem import kafka_logs, topics
from kafka_idem.app import App
from kafka_idem.consume import log
from kafka_idem.consume.gauges import LAG_EVERY_SECONDS, Lag, sample_store
from kafka_idem.consume.keyed import KeyedState
from kafka_idem.consume.letters import send_letters
from kafka_idem.consume.offsets import Offsets, say_where_they_start
from kafka_idem.consume.ordered import KeyedResults
from kafka_idem.consume.outcome import Result
from kafka_idem.consume.partitions import TP, Partitions
from kafka_idem.consume.progress import Progress
from kafka_idem.consume.units import Units
from kafka_idem.dlq import DeadLetterer
from kafka_idem.errors import BrokerError, ConfigError, FrameworkError
from kafka_idem.health import Health
from kafka_idem.lease import LeaseKeeper
from kafka_idem.metrics import Metrics, Sampler
from kafka_idem.outbox.relay import Relay, RelayThread
from kafka_idem.shutdown import GRACE, Shutdown
from kafka_idem.store import Store, connect


class Runner:
    """One consumer group member running ``app``'s handlers until stopped."""

    def __init__(self, app: App, *, metrics: Metrics | None = None,
                 topics_command: str | None = None) -> None:
        self.app = app
        # what the missing-topics warning tells the operator to run
        self.topics_command = topics_command or "kafka-idem topics create MODULE:APP"
        self.settings = s = app.settings
        self.metrics = metrics or Metrics()
        self.store = Store(schema=s.schema_name, table=s.table, namespace=app.namespace)
        app.bind_codecs()  # every handler's codec, checked now: a bad one fails the start
        self.leases: LeaseKeeper | None = None
        if any(h.mode == "leased" for h in app.handlers.values()):
            self.leases = LeaseKeeper(self.store, s.dsn, s.lease_seconds)
        self.stopping = threading.Event()
        self.parts = Partitions(make=self._make_state)
        self.offsets = Offsets(self.parts)
        self.units = Units(
            app, self.parts, store=self.store, metrics=self.metrics,
            leases=self.leases, stopping=self.stopping,
        )
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
        if s.outbox_relay and app.event_topics:
            self.relay = RelayThread(Relay(app, metrics=self.metrics, health=self.health))

    def _make_state(self, topic: str, jitter: Any) -> KeyedState | None:
        handler = self.app.handlers.get(topic)
        return KeyedState(jitter=jitter) if handler is not None and handler.keyed else None

    # --- lifecycle -----------------------------------------------------------

    def install_signal_handlers(self) -> Shutdown:
        """SIGTERM/SIGINT stop the member (``kafka-idem run``; call in the main thread):
        it drains, commits and leaves the group; a stop still running ``drain_seconds``
        + 2 s later, or a second signal, ends the process at once (see
        :mod:`kafka_idem.shutdown`)."""
        shutdown = Shutdown(on_stop=self.stop, bound=self.settings.drain_seconds + GRACE)
        shutdown.install()
        self._shutdown = shutdown
        return shutdown

    def start(self) -> None:
        s = self.settings
        self.app.check_topics()
        self._check_schema()
        conf = s.consumer_config(self.app.group_id)
        conf["error_cb"] = self._on_error
        conf["on_commit"] = self._on_commit
        conf["enable.partition.eof"] = True  # the lag of an idle partition (/readyz)
        self._start_at = (str(conf["group.id"]), str(conf.get("auto.offset.reset", "latest")))
        self.consumer = Consumer(conf)
        self.producer = Producer({**s.producer_config(), "error_cb": self._on_error})
        self.dlq = DeadLetterer(self.producer, header_limit=s.error_message_max,
                                signing_keys=s.signing_keys)
        self._check_topics()
        if self.leases is not None:
            self.leases.start()
        self.sampler.start()
        if self.relay is not None:
            self.relay.start()
        self.consumer.subscribe(self.app.topics, on_assign=self._on_assign,
                                on_revoke=self._on_revoke, on_lost=self._on_lost)
        if s.gc_tuning:
            tune_gc()
        log.info("consumer started",
                 extra={"action": "started", "topic": ",".join(self.app.topics)})

    def _check_topics(self) -> None:
        """Say once, before joining, which topics the app needs that the cluster lacks
        (librdkafka would otherwise report each subscribed one as it notices it)."""
        # Its own client: a full metadata request on the consumer keeps librdkafka from
        # noticing a subscribed topic created later (until its 5-minute refresh).
        admin = AdminClient(self.settings.admin_config())
        try:
            absent = topics.missing(self.app, admin, timeout=5.0)
        except FrameworkError as exc:  # the broker is not answering yet: the loop will say
            log.debug("topic check skipped: %s", exc, extra={"action": "topics"})
            return
        self._warn_missing(absent)

    def _warn_missing(self, absent: list[str]) -> None:
        new = [t for t in absent if t not in self.missing_topics]
        if not new:
            return
        self.missing_topics.update(new)
        log.warning(
            "topic%s %s do%s not exist; create %s with: %s (this member starts consuming a "
            "topic as soon as it exists)", "s" if len(new) > 1 else "", ", ".join(new),
            "" if len(new) > 1 else "es", "them" if len(new) > 1 else "it",
            self.topics_command, extra={"action": "topics_missing", "topic": ",".join(new)})

    def _check_schema(self) -> None:
        """Refuse to run on a store older than this code (deploy-before-migrate), or
        while records of this app's handlers from before namespaces wait to be adopted."""
        from kafka_idem.migrate import require_current
        from kafka_idem.namespaces import refuse_unassigned

        conn = connect(self.settings.dsn, application_name=f"kafka_idem:{self.app.name}")
        try:
            require_current(conn, self.settings.schema_name)
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
                if self.relay is not None and self.relay.error is not None:
                    self._fatal = self.relay.error
                if self._fatal:
                    raise self._fatal
        finally:
            self.close()
        return 0

    # --- one round -------------------------------------------------------------

    def step(self) -> None:
        assert self.consumer is not None
        if self.newly_assigned:
            # A partition paused before a revoke can come back paused.
            self.consumer.resume(self.newly_assigned)
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
            if _ends_member(err):
                self._fatal = self._fatal_error(err)
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
        pause, resume = self.parts.pause_resume(time.monotonic(), self.settings.batch_size)
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
        if _ends_member(err):
            self._fatal = self._fatal_error(err)
            return
        kafka_logs.error(err)  # deduplicated: with the broker down this repeats every 50 ms

    def _fatal_error(self, err: KafkaError) -> FrameworkError:
        """The exception a fatal client error ends the member with. librdkafka reports a
        static member replaced by another with the same group.instance.id as a ``_FATAL``
        error (confluent-kafka does not expose the original FENCED_INSTANCE_ID code), so
        its text is the one place that says so: then it is the setting's fault (exit 2)."""
        if err.code() == KafkaError.INVALID_SESSION_TIMEOUT:
            return self._session_timeout_refused()
        fenced = err.code() == KafkaError.FENCED_INSTANCE_ID or "fenced" in err.str().lower()
        if fenced and self.settings.group_instance_id is not None:
            return ConfigError(
                f"another member of group {self.app.group_id!r} joined with this member's "
                f"group.instance.id {self.settings.group_instance_id!r} and replaced it: every "
                "member needs its own (KAFKA_IDEM_GROUP_INSTANCE_ID, or run --instance-id)",
                setting="group_instance_id")
        return BrokerError(f"fatal Kafka error: {err.str()}")

    def _session_timeout_refused(self) -> ConfigError:
        """The broker refused to let the member join with its ``session.timeout.ms``
        (librdkafka would retry the join forever): say the setting and the broker's
        bounds, read from its configuration when it answers."""
        admin = AdminClient(self.settings.admin_config())
        bounds = topics.broker_configs(admin, _SESSION_BOUNDS, timeout=5.0)
        low, high = (bounds.get(name, "?") for name in _SESSION_BOUNDS)
        return ConfigError(
            f"the broker refused session_timeout_ms={self.settings.session_timeout_ms} "
            f"(KAFKA_IDEM_SESSION_TIMEOUT_MS) when this member joined group "
            f"{self.app.group_id!r} (INVALID_SESSION_TIMEOUT): it must be within the broker's "
            f"group.min.session.timeout.ms={low} and group.max.session.timeout.ms={high}",
            setting="session_timeout_ms")

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
        self.sampler.stopped.set()
        self.progress.tick(time.monotonic(), final=True)
        log.info("consumer stopped", extra={"action": "stopped"})


CLOSE_MARGIN = 0.5  # seconds a stop's bound keeps for what follows a bounded step


_SESSION_BOUNDS = ("group.min.session.timeout.ms", "group.max.session.timeout.ms")


def _ends_member(err: KafkaError) -> bool:
    """A client error no retry can heal: fatal ones, a fenced static member, and a
    session timeout the broker refuses (a join that fails the same way forever)."""
    return err.fatal() or err.code() in (
        KafkaError._FATAL, KafkaError.FENCED_INSTANCE_ID, KafkaError.INVALID_SESSION_TIMEOUT)


def _tps(partitions: list[TopicPartition]) -> list[TP]:
    return [(p.topic, p.partition) for p in partitions]


GC_YOUNG_THRESHOLD = 10_000  # allocations between collections of the youngest generation


def tune_gc() -> None:
    """Fewer, cheaper garbage collections on the loop thread (``gc_tuning``): what the
    member made while starting (modules, the app, clients) is frozen out of every
    collection, and the youngest generation is collected every 10,000 net allocations
    instead of 700, so the older ones, which scan more, run proportionally less often.
    Measured on the gateway benchmark: collections took 8-10% of the loop thread before,
    about half that after (docs/PERFORMANCE.md). Once per process."""
    _, older, oldest = gc.get_threshold()
    if gc.get_threshold()[0] < GC_YOUNG_THRESHOLD:
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def _positions(tps: list[TP]) -> list[TopicPartition]:
    return [TopicPartition(topic, part) for topic, part in tps]


def _names(partitions: list[TopicPartition]) -> str:
    return ",".join(f"{p.topic}[{p.partition}]" for p in partitions)
