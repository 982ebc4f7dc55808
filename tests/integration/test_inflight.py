"""Work in flight: the loop keeps consuming while worker threads process, local
batches run on disjoint partitions at once, and each partition stays in order."""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

import psycopg
import pytest

from consumers import payments
from consumers.payments import encode_charge
from kafka_idem import Context
from kafka_idem.consume.partitions import PartitionState
from tests.conftest import DB, InProcess, Topics, caught_up, committed, produce, wait_for
from tests.integration.support import charge_app

TRACE_SQL = """
CREATE TABLE public.trace (
    partition  integer     NOT NULL,
    kafka_offset bigint    NOT NULL,
    order_id   text        NOT NULL,
    backend    integer     NOT NULL DEFAULT pg_backend_pid(),
    txid       bigint      NOT NULL DEFAULT txid_current(),
    at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (partition, kafka_offset)
)
"""


def with_trace(db: DB) -> None:
    with psycopg.connect(db.dsn) as conn:
        conn.execute(TRACE_SQL)


def traced(msg: payments.ChargeRequested, ctx: Context) -> Any:
    """The payments charge, plus a trace row in the same transaction (committed or not
    with the effect) saying when, where and on which connection it ran."""
    ctx.tx.execute("SELECT pg_sleep(0.005)")  # long enough for units to overlap
    ctx.tx.execute("INSERT INTO public.trace (partition, kafka_offset, order_id) "
                   "VALUES (%s, %s, %s)", (ctx.partition, ctx.offset, msg.order_id))
    return payments.charge(msg, ctx)


@pytest.mark.parametrize("batch_path", [True, False], ids=["batch", "per-message"])
def test_local_batches_overlap_across_partitions_and_keep_each_partition_in_order(
    db: DB, topics: Topics, group: str, batch_path: bool
) -> None:
    topic = topics(partitions=4)
    with_trace(db)
    orders = [f"o{i}" for i in range(240)]
    produce(topic, [(o.encode(), encode_charge("t1", o, "1.00")) for o in orders])
    app = charge_app(db, topic, group, traced, local_workers=2, batch_size=20,
                     batch_path=batch_path)
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), timeout=120, what="the topic to drain")
    rows = db.rows("SELECT * FROM public.trace ORDER BY at")
    # One effect per message: one trace row and one ledger row each, nothing twice.
    assert sorted(r["order_id"] for r in rows) == sorted(orders)
    assert db.ledger_counts() == {f"t1:charge:{o}": 1 for o in orders}
    assert db.status_counts() == {"succeeded": len(orders)}
    assert sum(committed(group, topic).values()) == len(orders)
    # Each partition in offset order, one unit at a time: by time, its offsets only grow.
    by_partition: dict[int, list[int]] = defaultdict(list)
    for r in rows:
        by_partition[r["partition"]].append(r["kafka_offset"])
    assert len(by_partition) == 4
    for offsets in by_partition.values():
        assert offsets == sorted(offsets)
    if not batch_path:
        # The per-message path commits each message on its own: a transaction is one
        # message, not a unit. Units of other partitions, on the other connection, run
        # at once: in time, the two connections' messages interleave.
        # (the other connection wrote between two consecutive offsets of one
        # partition, which one unit runs one after the other).
        assert len({r["backend"] for r in rows}) == 2
        mine: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for r in rows:
            mine[r["partition"]].append(r)
        assert any(
            any(o["backend"] != a["backend"] and a["at"] < o["at"] < b["at"] for o in rows)
            for seq in mine.values() for a, b in itertools.pairwise(seq)
            if b["kafka_offset"] == a["kafka_offset"] + 1 and a["backend"] == b["backend"]
        ), "no two units overlapped"
        return
    # A transaction is one unit; a partition's units never overlap in time ...
    spans: dict[int, tuple[Any, Any, int, set[int]]] = {}
    for r in rows:
        first, last, backend, parts = spans.get(r["txid"], (r["at"], r["at"], r["backend"], set()))
        parts = parts | {r["partition"]}
        spans[r["txid"]] = (min(first, r["at"]), max(last, r["at"]), backend, parts)
    units = sorted(spans.values(), key=lambda s: s[0])
    for i, a in enumerate(units):
        for b in units[i + 1:]:
            if a[3] & b[3]:
                assert a[1] < b[0], "two units of one partition ran at once"
    # ... while units of other partitions, on the other connection, do.
    assert len({u[2] for u in units}) == 2
    assert any(a[1] > b[0] and a[2] != b[2]
               for i, a in enumerate(units) for b in units[i + 1:]), "no two batches overlapped"


def test_a_single_local_worker_still_drains_everything_in_order(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=2)
    with_trace(db)
    orders = [f"o{i}" for i in range(60)]
    produce(topic, [(o.encode(), encode_charge("t1", o, "1.00")) for o in orders])
    app = charge_app(db, topic, group, traced, local_workers=1, batch_size=7)
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), timeout=120, what="the topic to drain")
    rows = db.rows("SELECT * FROM public.trace ORDER BY at")
    assert sorted(r["order_id"] for r in rows) == sorted(orders)
    assert len({r["backend"] for r in rows}) == 1
    for p in (0, 1):
        offsets = [r["kafka_offset"] for r in rows if r["partition"] == p]
        assert offsets == sorted(offsets)


def test_a_partition_behind_a_slow_unit_is_paused_so_its_queue_stays_bounded(
    db: DB, topics: Topics, group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic = topics(partitions=1)
    with_trace(db)
    orders = [f"o{i}" for i in range(300)]
    produce(topic, [(o.encode(), encode_charge("t1", o, "1.00")) for o in orders])
    # The queue's length after every message the loop queues: measured where it grows,
    # not sampled from another thread (a sample can miss the peak).
    longest = 0
    add = PartitionState.add

    def measured(self: PartitionState, msg: Any, now: float) -> None:
        nonlocal longest
        add(self, msg, now)
        longest = max(longest, len(self.queue))

    monkeypatch.setattr(PartitionState, "add", measured)
    app = charge_app(db, topic, group, traced, local_workers=1, batch_size=10)
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), timeout=120, what="the topic to drain")
    # Consuming went on while units ran, but never more than a consume() beyond two
    # batches: the partition was paused, not read into memory.
    assert 10 < longest <= 3 * 10
    assert db.ledger_counts() == {f"t1:charge:{o}": 1 for o in orders}
