"""Worker processes for the barrier race (scenario 1): each runs the real
:class:`~kafka_idem.consume.executor.Processor` on one message, all released together by a
``multiprocessing`` barrier (spawn context), and reports what became of it."""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from typing import Any

from kafka_idem.consume.executor import Processor
from kafka_idem.consume.outcome import Deferred, Finished
from kafka_idem.metrics import Metrics
from kafka_idem.store import Store
from kafka_idem.verify.app import Config, build_app


@dataclass
class FakeMessage:
    """The parts of ``confluent_kafka.Message`` the processor reads."""

    topic_: str
    partition_: int
    offset_: int
    key_: bytes | None
    value_: bytes | None
    headers_: list[tuple[str, bytes]] = field(default_factory=list)

    def topic(self) -> str:
        return self.topic_

    def partition(self) -> int:
        return self.partition_

    def offset(self) -> int:
        return self.offset_

    def key(self) -> bytes | None:
        return self.key_

    def value(self) -> bytes | None:
        return self.value_

    def headers(self) -> list[tuple[str, bytes]]:
        return self.headers_

    def timestamp(self) -> tuple[int, int]:
        return (0, -1)

    def error(self) -> None:
        return None


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
                                          namespace=app.namespace),
                         metrics=Metrics())
        msg = FakeMessage(conf["topic"], 0, offset, b"race", value)
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
