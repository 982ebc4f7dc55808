"""Helpers for the outbox tests: an app whose charge handler emits an event, a relay
on a thread, the event topic read with read_committed."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from consumers import payments
from kafka_idem import App, Context
from kafka_idem.outbox import Relay, RelayHooks, control_topic
from tests.conftest import BOOTSTRAP, DB, Topics, end_offsets, wait_for
from tests.integration.support import charge_app

SHARDS = 2


def event_of(msg: payments.ChargeRequested, ctx: Context) -> dict[str, Any]:
    return {"order_id": msg.order_id, "amount": str(msg.amount), "attempt": ctx.attempt}


def emitting(events: str, fn: Callable[[payments.ChargeRequested, Context], Any]
             = payments.charge) -> Callable[[payments.ChargeRequested, Context], Any]:
    """One event on ``events`` (key: the order id), then ``fn``: the event is emitted
    before anything can fail, so a failure must take it back."""

    def handler(msg: payments.ChargeRequested, ctx: Context) -> Any:
        ctx.emit(events, event_of(msg, ctx), key=msg.order_id, headers={"x-test": "yes"})
        return fn(msg, ctx)

    return handler


def outbox_app(db: DB, topics: Topics, group: str, fn: Callable[..., Any] | None = None, *,
               events: str | None = None, **settings: Any) -> tuple[App, str]:
    """A charge app on a new source topic whose handler emits to ``events`` (a new
    topic unless given); its control topic created. Returns ``(app, events)``."""
    source = topics(partitions=settings.pop("partitions", 1))
    events = events or topics(partitions=2, dlq=False, prefix="ev")
    handler = fn if fn is not None else emitting(events)
    settings.setdefault("outbox_relay", False)  # the test runs its relays itself
    app = charge_app(db, source, group, handler, outbox_shards=SHARDS,
                     name_prefix=f"p{uuid.uuid4().hex[:8]}-", outbox_poll_seconds=0.2,
                     **settings)
    app.event_topic(events)
    topics.create([control_topic(app.settings, app.namespace)], partitions=SHARDS)
    return app, events


class RelayThread:
    """``Relay(app).run`` on a thread: ``with RelayThread(app) as relay: ...``."""

    def __init__(self, app: App, hooks: RelayHooks | None = None) -> None:
        self.relay = Relay(app, hooks=hooks)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.relay.run(self.stop)
        except BaseException as exc:  # surfaced in __exit__
            self.error = exc

    def __enter__(self) -> RelayThread:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive(), "relay did not stop"
        if self.error is not None and exc[0] is None:
            raise self.error


def read_committed(topic: str, *, timeout: float = 10.0) -> list[Any]:
    """Every record of ``topic`` a read_committed reader sees, to the current end."""
    ends = end_offsets(topic)
    c = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": f"rc-{uuid.uuid4().hex}",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False,
                  "isolation.level": "read_committed", "enable.partition.eof": True})
    c.assign([TopicPartition(topic, p, 0) for p in ends])
    out: list[Any] = []
    at_end: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        while len(at_end) < len(ends) and time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is None:
                continue
            if m.error() is not None:
                at_end.add(m.partition())
                continue
            at_end.discard(m.partition())
            out.append(m)
    finally:
        c.close()
    return out


def events_by_key(topic: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for m in read_committed(topic):
        out.setdefault(m.key().decode(), []).append(m)
    return out


def outbox_rows(db: DB) -> list[dict[str, Any]]:
    return db.rows("SELECT * FROM kafka_idem.outbox ORDER BY id")


def wait_published(db: DB, topic: str, n: int, *, timeout: float = 60.0) -> list[Any]:
    """Wait until the outbox is empty and ``topic`` has ``n`` committed records."""
    wait_for(lambda: not outbox_rows(db), timeout=timeout, what="the outbox to drain")
    return wait_for(lambda: (lambda got: got if len(got) >= n else None)(read_committed(topic)),
                    timeout=timeout, what=f"{n} events on {topic}")


def direct_context(conn: Any, app: App, n: int, *, key: str | None = None) -> Context:
    """A handler's context on ``conn`` as the paths build it (``ctx.emit`` works), for
    writing events without a consumer."""
    return Context(tx=conn, idempotency_key=key or f"intent-{n}", request_hash="h", attempt=1,
                   handler="direct", topic="direct", partition=0, offset=n, timestamp=None,
                   kafka_key=None, emitter=app.outbox)


def write_events(conn: Any, app: App, topic: str, events: list[tuple[str, Any]], *,
                 n: int = 0, commit: bool = True) -> None:
    """``events`` ((key, value)) emitted and written in one transaction on ``conn``."""
    ctx = direct_context(conn, app, n)
    for key, value in events:
        ctx.emit(topic, value, key=key)
    app.outbox.flush(conn, ctx)
    if commit:
        conn.commit()


def values_by_key(topic: str) -> dict[str, list[Any]]:
    return {k: [json.loads(m.value()) for m in ms] for k, ms in events_by_key(topic).items()}
