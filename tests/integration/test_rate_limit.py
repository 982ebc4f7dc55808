"""``max_rate`` against the real broker and PostgreSQL, in each mode: everything runs
exactly once, the limited handler's calls are spread over at least the time its tokens
take to accrue (measured by the database's own clock: a lower bound, which a loaded
machine only makes longer), the throttled partition's queue stays bounded (it is paused,
not read into memory), and a handler without a limit in the same member is not held back.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from kafka_idem import App, Context
from kafka_idem.consume.concurrency.keyed_state import KeyedState
from kafka_idem.consume.partitions import PartitionState
from tests.conftest import DB, InProcess, Topics, app_settings, caught_up, produce, wait_for

RATE = 10.0  # a second's worth of burst: 10 tokens
N = 40  # the limited handler's messages: the last can start no sooner than (N - 10) / 10 s
BATCH = 5

TRACE_SQL = """
CREATE TABLE public.trace (
    topic      text        NOT NULL,
    partition  integer     NOT NULL,
    kafka_offset bigint    NOT NULL,
    at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (topic, partition, kafka_offset)
)
"""

MODES: dict[str, dict[str, Any]] = {
    "local": {},
    "local-workers": {"local_workers": 2},
    "leased": {"mode": "leased"},
    "key-ordered": {"mode": "leased", "concurrency": 4},
}


def rate_app(db: DB, group: str, slow_topic: str, fast_topic: str, **opts: Any) -> App:
    settings = {k: v for k, v in opts.items() if k == "local_workers"}
    handler = {k: v for k, v in opts.items() if k != "local_workers"}
    app = App("rates", **app_settings(db, group_id=group, batch_size=BATCH, **settings))

    def trace(ctx: Context) -> None:
        ctx.tx.execute("INSERT INTO public.trace (topic, partition, kafka_offset) "
                       "VALUES (%s, %s, %s)", (ctx.topic, ctx.partition, ctx.offset))

    @app.handler(topic=slow_topic, key="slow:{id}", hash_fields=("id",), max_rate=RATE,
                 **handler)
    def slow(msg: dict[str, Any], ctx: Context) -> None:
        trace(ctx)

    @app.handler(topic=fast_topic, key="fast:{id}", hash_fields=("id",), **handler)
    def fast(msg: dict[str, Any], ctx: Context) -> None:
        trace(ctx)

    return app


@pytest.mark.parametrize("mode", list(MODES))
def test_a_limited_handler_runs_everything_once_no_faster_than_its_rate(
    db: DB, topics: Topics, group: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_topic, fast_topic = topics(partitions=2), topics(partitions=2)
    with psycopg.connect(db.dsn) as conn:
        conn.execute(TRACE_SQL)
    for t in (slow_topic, fast_topic):
        produce(t, [(str(i).encode(), json.dumps({"id": str(i)}).encode()) for i in range(N)])
    # The slow topic's queues measured where they grow (a sample can miss the peak).
    longest = 0

    def measure(cls: Any, size: Any) -> None:
        add = cls.add

        def measured(self: Any, msg: Any, now: float) -> None:
            nonlocal longest
            add(self, msg, now)
            if msg.topic() == slow_topic:
                longest = max(longest, size(self))

        monkeypatch.setattr(cls, "add", measured)

    measure(PartitionState, lambda st: len(st.queue))
    # key-ordered: what the pause bounds, the messages held unfinished (finished ones
    # wait only for the next offset commit, which a loaded machine may delay)
    measure(KeyedState, lambda st: st.size - st._done)
    app = rate_app(db, group, slow_topic, fast_topic, **MODES[mode])
    with InProcess(app) as r:
        wait_for(lambda: caught_up(group, slow_topic) and caught_up(group, fast_topic),
                 timeout=120, what="both topics to drain")
        reg = r.runner.metrics.registry
        throttled = {name: reg.get_sample_value(
            "kafka_idem_handler_throttled_seconds_total", {"topic": t, "handler": name})
            for name, t in (("slow", slow_topic), ("fast", fast_topic))}
    rows = db.rows("SELECT topic, min(at) AS first, max(at) AS last, count(*) AS n, "
                   "count(DISTINCT (partition, kafka_offset)) AS once "
                   "FROM public.trace GROUP BY topic")
    got = {r["topic"]: r for r in rows}
    # Exactly once: one effect per message, every record succeeded.
    assert {t: (got[t]["n"], got[t]["once"]) for t in got} == {
        slow_topic: (N, N), fast_topic: (N, N)}
    assert db.status_counts() == {"succeeded": 2 * N}
    # The N-th token exists (N - burst) / rate after the first: 3 s. Half a second of it
    # is left for the first call's own latency after its token (a lower bound only: a slow
    # machine makes the spread longer, never shorter).
    spread = (got[slow_topic]["last"] - got[slow_topic]["first"]).total_seconds()
    assert spread >= (N - RATE) / RATE - 0.5, spread
    # Held back, and said so; the other handler, in the same member, never was.
    assert throttled["slow"] is not None and throttled["slow"] > 0
    assert throttled["fast"] is None
    # Throttled partitions are paused at two batches: never more than a consume() beyond.
    assert longest <= 3 * BATCH
