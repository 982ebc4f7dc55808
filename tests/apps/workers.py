"""Worker processes for the concurrency scenarios: each runs the real
processing path (``Processor``) on one message, released together by a barrier."""

from __future__ import annotations

import time
from typing import Any

from consumers import payments
from kafka_idem import Context
from kafka_idem.consume.outcome import Deferred, Finished
from kafka_idem.consume.paths.processor import Processor
from kafka_idem.consume.startup import check_schema
from kafka_idem.observe.metrics import Metrics
from kafka_idem.store import Store
from kafka_idem.testing import FakeMessage


def describe(result: Any) -> tuple[str, str, str | None]:
    if isinstance(result, Finished):
        kind = result.letter.kind if result.letter else None
        return ("finished", result.outcome, kind)
    assert isinstance(result, Deferred)
    return ("deferred", result.reason, None)


def processor(dsn: str, topic: str, mode: str, hold: float = 0.0) -> Processor:
    app = payments.build_app(topic=topic, mode=mode, database_url=dsn, group_id="workers")
    if hold:
        def slow(msg: payments.ChargeRequested, ctx: Context) -> dict[str, Any]:
            result = payments.charge(msg, ctx)
            time.sleep(hold)  # hold the claim while others arrive
            return result

        app.handlers[topic].fn = slow
    store = Store(schema="kafka_idem", table="task_idempotency", namespace=app.namespace)
    check_schema(app.settings, store, app)  # as a member starts: distributed on Citus?
    return Processor(app, store=store, metrics=Metrics())


def process_one(dsn: str, topic: str, mode: str, value: bytes, offset: int,
                barrier: Any, queue: Any, hold: float = 0.0) -> None:
    proc = processor(dsn, topic, mode, hold)
    msg = FakeMessage(topic, offset=offset, key=b"order", value=value)
    proc.connection()  # connect before the barrier, so the race is on the claim
    barrier.wait(timeout=30)
    if mode == "local":
        result = proc.run_local([((topic, 0), [msg])])[(topic, 0)][0]
    else:
        result = proc.run_leased(msg)
    proc.close()
    queue.put(describe(result))
