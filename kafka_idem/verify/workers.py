"""Worker processes for the barrier race (scenario 1): each runs the real
:class:`~kafka_idem.consume.paths.processor.Processor` on one message, all released together by a
``multiprocessing`` barrier (spawn context), and reports what became of it."""

from __future__ import annotations

import os
import traceback
from typing import Any

from kafka_idem.consume.outcome import Deferred, Finished
from kafka_idem.consume.paths.processor import Processor
from kafka_idem.observe.metrics import Metrics
from kafka_idem.store import Store
from kafka_idem.testing.message import FakeMessage
from kafka_idem.verify.app import Config, build_app


def describe(result: Any) -> dict[str, Any]:
    if isinstance(result, Finished):
        return {"result": result.outcome, "dlq_kind": result.letter.kind if result.letter
                else None}
    if isinstance(result, Deferred):
        return {"result": result.reason}
    return {"result": repr(result)}


def race_one(conf: dict[str, Any], value: bytes, offset: int, barrier: Any, queue: Any) -> None:
    """Build a processor, connect, wait at the barrier, process one message, report."""
    out: dict[str, Any] = {"pid": os.getpid(), "offset": offset}
    try:
        config = Config(topic=conf["topic"], biz_schema=conf["biz_schema"], mode=conf["mode"],
                        slow_seconds=conf["hold"], slow_attempts=99)
        app = build_app(config, database_url=conf["dsn"], schema_name=conf["store_schema"],
                        table=conf["table"], lease_seconds=conf["lease"],
                        bootstrap_servers=conf["bootstrap"], group_id=conf["group"])
        proc = Processor(app, store=Store(schema=conf["store_schema"], table=conf["table"],
                                          namespace=app.namespace,
                                          distributed=conf["distributed"]),
                         metrics=Metrics())
        msg = FakeMessage(conf["topic"], offset=offset, key=b"race", value=value)
        proc.connection()  # connected before the barrier: the race is on the claim
        barrier.wait(timeout=60)
        if conf["mode"] == "local":
            result = proc.run_local([((conf["topic"], 0), [msg])])[(conf["topic"], 0)][0]
        else:
            result = proc.run_leased(msg)
        proc.close()
        out.update(describe(result))
    except BaseException as exc:  # reported to the parent, never lost in a child
        out.update({"result": "error", "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc(limit=5)})
    queue.put(out)
