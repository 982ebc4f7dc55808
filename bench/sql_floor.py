"""The batch path's SQL against the minimal keyed SQL, whole transactions, interleaved.

    .venv/bin/python -m bench.sql_floor [--transactions 120] [--batch-size 500]

Issue 38 asks the batch path for at most 1.3 x the minimal keyed SQL's PostgreSQL CPU
per message. The bench's two rows run minutes apart, and on a shared machine their
ratio moves by a third between runs. This puts the database work of both side by side,
transaction by transaction, each variant on a backend of its own (its CPU read from
``/proc``), their order alternating, so the machine's drift falls on all of them:

``keyed``
    ``bench/keyed.py``'s transaction: the inbox's key row and ``charge_many``'s two
    statements, one pipeline, ``COMMIT``.
``batch``
    what the batch path sends for a batch of new keys, through the store's own
    methods: the read of every key (``BatchQueries.found``), then ``charge_many``'s
    statements and the records' write (``write_done``: the clock in the pipeline,
    then a ``COPY``), ``COMMIT``.
``batch without the read``
    the same with no read: not something the framework may do (a redelivered key
    that succeeded would run its handler before the write found it), only to show
    what the read costs.

Every key is new (each variant has its own charge requests and schema, dropped
afterwards). Prints each variant's PostgreSQL CPU per message, its median transaction
time and its ratio to ``keyed``; checks each variant wrote one ledger row per key.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from bench.keyed import _batches, _create
from bench.workload import Plan
from kafka_idem.admin.migrate import migrate
from kafka_idem.settings import load_settings
from kafka_idem.store import Store
from kafka_idem.store.batch import Done
from kafka_idem.store.types import new_tokens

VARIANTS = {"keyed": "minimal keyed SQL", "batch": "batch path's SQL",
            "noread": "batch path's SQL without the read"}


def backend_cpu(pid: int) -> float:
    """Seconds of CPU the backend ``pid`` used (this machine's ``/proc``)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Variant:
    name: str
    schema: str
    batches: list[list[tuple[str, Any]]]
    conn: psycopg.Connection[Any]
    store: Store | None
    cpu0: float = 0.0
    walls: list[float] = field(default_factory=list)

    def run(self, n: int) -> None:
        stmts = self.batches[n]
        conn = self.conn
        t0 = time.perf_counter()
        if self.store is None:
            with conn.pipeline():
                for query, params in stmts:
                    conn.execute(query, params)
            conn.commit()
        else:
            keys: list[str] = stmts[0][1][0]  # the inbox statement's keys, sorted
            if self.name == "batch" and self.store.found(conn, keys):
                raise SystemExit(f"{self.name}: a new key was found")
            with conn.pipeline():
                for query, params in stmts[1:]:
                    conn.execute(query, params)
                done = [Done(key, "v1:sha256:" + "0" * 64, token, "bench-topic", 0, i, "charge",
                             None, {"order_id": key[-8:], "amount": "12.50", "currency": "EUR"})
                        for i, (key, token) in enumerate(
                            zip(keys, new_tokens(len(keys)), strict=True))]
                finish = self.store.write_done(conn, done)
            if not finish():
                raise SystemExit(f"{self.name}: a record existed")
            conn.commit()
        self.walls.append(time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sql_floor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transactions", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=500)
    args = ap.parse_args(argv)
    dsn = load_settings().dsn
    tag = uuid.uuid4().hex[:8]
    variants: list[Variant] = []
    try:
        for name in VARIANTS:
            schema = f"bench_sqlfloor_{tag}_{name}"
            with psycopg.connect(dsn, autocommit=True) as c:
                _create(c, schema)
            _, messages = Plan(f"{tag}{name[0]}", args.transactions * args.batch_size,
                               0.0, 7).build()
            store = None
            if name != "keyed":
                migrate(dsn, schema, "records")
                store = Store(schema=schema, table="records", namespace="bench")
            conn = psycopg.connect(dsn)
            conn.execute("SET synchronous_commit = on")  # as the framework's sessions
            conn.commit()
            variants.append(Variant(name, schema, _batches(messages, schema, args.batch_size),
                                    conn, store))
        for v in variants:
            v.cpu0 = backend_cpu(v.conn.info.backend_pid)
        for n in range(args.transactions):
            for v in (variants if n % 2 == 0 else variants[::-1]):
                v.run(n)
        messages_each = args.transactions * args.batch_size
        cpu = {v.name: (backend_cpu(v.conn.info.backend_pid) - v.cpu0) / messages_each * 1e6
               for v in variants}
        for v in variants:
            rows = v.conn.execute(sql.SQL("SELECT count(DISTINCT idempotency_key) FROM {}.ledger")
                                  .format(sql.Identifier(v.schema))).fetchone()
            v.conn.commit()
            ok = rows is not None and rows[0] == messages_each
            print(f"{VARIANTS[v.name]:36} {cpu[v.name]:6.1f} us of PostgreSQL CPU a message, "
                  f"{cpu[v.name] / cpu['keyed']:.2f} x keyed; median "
                  f"{statistics.median(v.walls) * 1e3:.1f} ms a transaction; "
                  f"{'ok' if ok else 'FAILED'}: {rows[0] if rows else 0:,} ledger rows")
            if not ok:
                return 1
        return 0
    finally:
        for v in variants:
            v.conn.close()
        with psycopg.connect(dsn, autocommit=True) as c:
            for name in VARIANTS:
                c.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                    sql.Identifier(f"bench_sqlfloor_{tag}_{name}")))


if __name__ == "__main__":
    raise SystemExit(main())
