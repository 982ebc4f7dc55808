"""The outbox rows of the bench (issue 14): the relay's throughput on a full outbox, the
events of the batch path with one emit per message, and commit-to-readable latency.

* :func:`relay_throughput` (worker kind ``relay``): fill a fresh outbox with one
  ``payments.ChargeCompleted`` event per intent of the plan (the rows ``ctx.emit``
  writes, through the store's own statement, 1,000 per transaction), then run
  ``Relay(app).run`` in this process and time it from its first published row to
  its last: events/s, CPU of this process (the relay), PostgreSQL and the broker.
* :func:`make_topics`: the event topic and the relays' control topic of an app with
  event topics, as ``kafka-idem topics create`` makes them.
* :class:`EventClock`: a ``read_committed`` consumer of the event topic noting when
  each event (by its Kafka key, the order id) became readable; with the moments the
  handlers' transactions committed it gives commit-to-readable latency.
* :func:`published`: after a run, wait for the outbox to drain and check that the
  event topic holds exactly one event per succeeded intent.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from decimal import Decimal
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient
from psycopg import sql

from bench import procstat
from bench.workload import Plan
from consumers import payments
from kafka_idem.admin import topics as topic_rules
from kafka_idem.app import App
from kafka_idem.outbox import Relay
from kafka_idem.outbox.emit import shard_of, slot_of
from kafka_idem.settings import Settings
from kafka_idem.store import Delivery, Event, Store
from tools.kafka_state import read_topic

FILL_PER_TX = 1000


def make_topics(app: App, s: Settings, partitions: int) -> list[str]:
    """Create ``app``'s missing topics (its event topics and outbox control topic too)."""
    done = topic_rules.create(app, AdminClient(s.admin_config()), partitions=partitions)
    return [d.name for d in done if d.created]


def pending(dsn: str, schema: str, namespace: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {} WHERE namespace = %s").format(
            sql.Identifier(schema, "outbox")), (namespace,)).fetchone()
    return int(row[0]) if row else 0


def published(s: Settings, app: App, events: str, intents: int,
              timeout: float = 180.0) -> tuple[bool, str, float | None]:
    """Wait until the outbox is empty; then ``(ok, what the event topic holds, seconds
    the drain took)``: exactly one event per intent, no outbox row twice."""
    started = time.monotonic()
    st = app.settings
    while pending(s.dsn, st.schema_name, app.namespace):
        if time.monotonic() - started > timeout:
            left = pending(s.dsn, st.schema_name, app.namespace)
            return False, f"{left} outbox rows still unpublished after {timeout:.0f}s", None
        time.sleep(0.2)
    drained = time.monotonic() - started
    records, _ = read_topic(s.bootstrap_servers, events, kafka=s.kafka)
    keys = Counter(dict(r.headers).get("idem.key") for r in records)
    rows = Counter(dict(r.headers).get("idem.outbox.id") for r in records)
    twice = sum(1 for n in rows.values() if n > 1)
    ok = len(keys) == intents and all(n == 1 for n in keys.values()) and not twice
    return ok, (f"{len(records):,} events read_committed for {intents:,} intents, "
                f"{twice} outbox rows twice"), drained


def fill(app: App, plan: Plan, source: str) -> int:
    """Write one event per intent of ``plan`` into ``app``'s outbox, as its handlers'
    ``ctx.emit`` would (encoded, slotted, sharded), 1,000 rows per transaction."""
    st = app.settings
    store = Store(schema=st.schema_name, table=st.table, namespace=app.namespace)
    events_topic = payments.events_topic(source)
    codec = app.outbox.codec(events_topic)
    intents, _ = plan.build()
    now = time.time()
    batch: list[Event] = []
    with psycopg.connect(st.dsn) as conn:
        for i, it in enumerate(intents):
            key = it.order_id.encode()
            value = codec.encode({
                "tenant_id": it.tenant_id, "order_id": it.order_id, "amount": Decimal(it.amount),
                "currency": it.currency, "idempotency_key": it.key, "request_id": uuid.uuid4().hex,
                "ledger_entry": {"id": i + 1, "created_at": now}})
            slot = slot_of(key, it.key)
            batch.append(Event(topic=events_topic, key=key, value=value, headers=(),
                               idem_key=it.key, slot=slot, shard=shard_of(slot, st.outbox_shards),
                               source=Delivery(source, 0, i, "charge")))
            if len(batch) == FILL_PER_TX:
                with conn.transaction():
                    store.outbox_write(conn, batch)
                batch = []
        if batch:
            with conn.transaction():
                store.outbox_write(conn, batch)
    return len(intents)


def relay_throughput(s: Settings, spec: dict[str, Any], out: dict[str, Any]) -> None:
    """The relay on a full outbox: events/s from its first published row to its last."""
    plan = Plan.from_json(spec["plan"])
    source = f"{spec['topic']}.relay"  # an event topic of its own (not batch_emit's)
    app = payments.build_app(
        topic=source, name=f"bench-{spec['path']}", events=True,
        schema_name=spec["schema"], bootstrap_servers=s.bootstrap_servers,
        database_url=s.dsn, kafka=s.kafka, name_prefix=f"{spec['group']}.")
    out["topics_created"] = make_topics(app, s, spec.get("partitions", 4))
    t0 = time.perf_counter()
    n = fill(app, plan, source)
    out["fill_seconds"] = time.perf_counter() - t0
    relay = Relay(app)
    stop = threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop,), name="bench-relay", daemon=True)
    pids = procstat.Pids(procstat.database_of(s.dsn))

    def count() -> float:
        return float(relay.metrics.outbox_published._value.get())

    started = time.perf_counter()
    thread.start()
    watch: procstat.Watch | None = None
    first = first_n = 0.0
    try:
        while count() < n:
            if time.perf_counter() - started > spec["timeout"]:
                out["check"] = f"published {count():,.0f} of {n:,} in {spec['timeout']:.0f}s"
                return
            if watch is None and count() > 0:
                first, first_n = time.perf_counter(), count()
                watch = procstat.Watch(pids).start()
            time.sleep(0.005)
        end = time.perf_counter()
        cpu = watch.stop() if watch is not None else None
    finally:
        stop.set()
        thread.join(60)
    out["join_seconds"] = first - started
    out["seconds"] = end - first
    out["events_timed"] = n - first_n
    out["cpu"] = cpu
    out["ok"], out["check"], _ = published(s, app, payments.events_topic(source), n)
    out["check"] += (f"; {out['events_timed']:,.0f} events timed after the first round of "
                     f"{first_n:,.0f}; fill {out['fill_seconds']:.1f}s")


class EventClock:
    """Notes, per Kafka key, when its event became readable (``read_committed``)."""

    def __init__(self, s: Settings, topic: str) -> None:
        conf = s.consumer_config(f"bench-clock-{uuid.uuid4().hex[:8]}")
        conf.update({"isolation.level": "read_committed", "enable.auto.commit": False,
                     "auto.offset.reset": "latest", "fetch.wait.max.ms": 5,
                     "enable.partition.eof": False})
        self.consumer = Consumer(conf)
        meta = self.consumer.list_topics(topic, timeout=30).topics[topic]
        ends = {p: self.consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
                for p in meta.partitions}
        self.consumer.assign([TopicPartition(topic, p, end) for p, end in ends.items()])
        self.readable: dict[bytes, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-event-clock", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for m in self.consumer.consume(500, timeout=0.05):
                err = m.error()
                if err is None:
                    self.readable[m.key() or b""] = time.time()
                elif err.code() != KafkaError._PARTITION_EOF:
                    continue

    def wait(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.readable) < n and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.consumer.close()

    def latencies_ms(self, committed: dict[bytes, float]) -> list[float]:
        return sorted((self.readable[k] - at) * 1000.0 for k, at in committed.items()
                      if k in self.readable)
