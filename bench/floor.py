"""The gateway rows' floor: their essential work with no framework and no Kafka.

    .venv/bin/python -m bench.floor [--messages 6000] [--concurrency 64]

For each message, what a leased handler of the gateway example cannot do without:
the claim (an ``INSERT`` committed alone: it must be durable before the remote call),
the remote call (``consumers.gateway``'s own clients against its gateway in a
process of its own, 50 ms per call), then ``BEGIN``, the handler's ``INSERT``, a
fenced ``UPDATE`` of the claim and ``COMMIT`` in one pipeline sync. ``concurrency``
messages at a time, as threads with the sync client (one connection each) and as
asyncio tasks with the async client. No decoding, no key-ordering, no offsets, no
retries, no metrics: what the same machine can do at best, in Python, with psycopg.

Prints msgs/s, the client's CPU per message and the fraction of the ideal
``concurrency / 50 ms``; the gateway rows of ``python -m bench`` compare with it.
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import threading
import time
import uuid
from decimal import Decimal
from typing import Any

import psycopg

from bench.gateway import LATENCY_MS, GatewayProcess
from consumers.gateway import AsyncGatewayClient, GatewayClient
from kafka_idem.settings import load_settings

SCHEMA = f"bench_floor_{uuid.uuid4().hex[:8]}"  # this run's own: runs may overlap
CLAIM = f"INSERT INTO {SCHEMA}.claims (key, state, token) VALUES (%s, 'processing', %s)"
RECORD = (f"INSERT INTO {SCHEMA}.charges (key, charge_id, amount, currency)"
          " VALUES (%s, %s, %s, %s)")
COMPLETE = (f"UPDATE {SCHEMA}.claims SET state = 'succeeded', result = %s"
            " WHERE key = %s AND token = %s")


def _request(key: str) -> dict[str, Any]:
    return {"tenant_id": "floor", "order_id": key, "amount": "10.00", "currency": "EUR"}


def _tables(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        conn.execute(f"CREATE SCHEMA {SCHEMA}")
        conn.execute(f"CREATE TABLE {SCHEMA}.claims (key text PRIMARY KEY, state text NOT NULL,"
                     " token uuid NOT NULL, result jsonb)")
        conn.execute(f"CREATE TABLE {SCHEMA}.charges (id bigserial PRIMARY KEY, key text NOT NULL,"
                     " charge_id text NOT NULL, amount numeric(18,2) NOT NULL,"
                     " currency text NOT NULL)")


def _drop(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")


def run_threads(dsn: str, url: str, keys: list[str], concurrency: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) for ``keys`` on ``concurrency`` threads."""
    todo: queue.SimpleQueue[str] = queue.SimpleQueue()
    for key in keys:
        todo.put(key)
    client = GatewayClient(url, 2.0)

    def work() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while True:
                try:
                    key = todo.get_nowait()
                except queue.Empty:
                    return
                token = uuid.uuid4()
                conn.execute(CLAIM, (key, token))
                charge = client.charge(key, _request(key))
                with conn.pipeline():
                    conn.execute("BEGIN", prepare=False)
                    conn.execute(RECORD, (key, charge["id"], Decimal(charge["amount"]),
                                          charge["currency"]))
                    conn.execute(COMPLETE, ('{"ok": true}', key, token))
                    conn.execute("COMMIT", prepare=False)

    threads = [threading.Thread(target=work) for _ in range(concurrency)]
    wall, cpu = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - wall, time.process_time() - cpu


def run_tasks(dsn: str, url: str, keys: list[str], concurrency: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) for ``keys`` as ``concurrency`` asyncio tasks."""

    async def main() -> tuple[float, float]:
        todo: asyncio.Queue[str] = asyncio.Queue()
        for key in keys:
            todo.put_nowait(key)
        client = AsyncGatewayClient(url, 2.0)

        async def work() -> None:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                while not todo.empty():
                    key = todo.get_nowait()
                    token = uuid.uuid4()
                    await conn.execute(CLAIM, (key, token))
                    charge = await client.charge_async(key, _request(key))
                    async with conn.pipeline():
                        await conn.execute("BEGIN", prepare=False)
                        await conn.execute(RECORD, (key, charge["id"], Decimal(charge["amount"]),
                                                    charge["currency"]))
                        await conn.execute(COMPLETE, ('{"ok": true}', key, token))
                        await conn.execute("COMMIT", prepare=False)

        wall, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(work() for _ in range(concurrency)))
        return time.perf_counter() - wall, time.process_time() - cpu

    return asyncio.run(main())


def _check(dsn: str, keys: list[str]) -> str:
    with psycopg.connect(dsn) as conn:
        charges, distinct = conn.execute(
            f"SELECT count(*), count(DISTINCT key) FROM {SCHEMA}.charges WHERE key = ANY(%s)",
            (keys,)).fetchone() or (0, 0)
        done = conn.execute(
            f"SELECT count(*) FROM {SCHEMA}.claims WHERE state = 'succeeded' AND key = ANY(%s)",
            (keys,)).fetchone()
    ok = charges == distinct == len(keys) and done is not None and done[0] == len(keys)
    return "ok" if ok else f"FAILED: {charges} charges, {distinct} keys, {done} succeeded"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--messages", type=int, default=6000, help="per run [6000]")
    parser.add_argument("--concurrency", type=int, default=64, help="in flight [64]")
    args = parser.parse_args(argv)
    dsn = load_settings().dsn
    ideal = args.concurrency / (LATENCY_MS / 1000)
    gateway = GatewayProcess()
    failed = False
    try:
        for name, run in (("threads, sync client", run_threads),
                          ("asyncio tasks, async client", run_tasks)):
            _tables(dsn)
            keys = [f"floor:{uuid.uuid4().hex[:8]}:{i}" for i in range(args.messages)]
            wall, cpu = run(dsn, gateway.url, keys, args.concurrency)
            check = _check(dsn, keys)
            failed = failed or check != "ok"
            rate = len(keys) / wall
            print(f"floor, {name}, concurrency={args.concurrency}: {rate:,.0f} msgs/s "
                  f"({rate / ideal:.2f} x the ideal {ideal:,.0f}), client CPU "
                  f"{cpu / len(keys) * 1000:.3f} ms/msg; {check}")
    finally:
        gateway.stop()
        _drop(dsn)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
