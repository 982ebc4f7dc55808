"""The gateway rows: a leased handler whose remote call takes 50 ms.

``consumers.gateway``'s app (its leased ``charge`` handler, or the ``async def``
one) against its HTTP gateway run in a process of its own (``python -m
consumers.gateway serve --latency-ms 50``: its CPU is the remote system's, not the
consumer's). One partition; the charges of 1,000 accounts (``tenant_id``, the
ordering key) interleaved, each account's charges a distinct idempotency key.

The check, after a run: the gateway charged every key exactly once; the local
table holds one row per key; the store one ``succeeded`` record per key; for
every account, its rows were written in offset order (``payments.gateway_charges``
ids grow in insertion order, and one account's charges run one after another);
and the gateway never answered more charges at once than the row's
``concurrency`` (its ``/_in_flight`` count, from the row's start).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import urllib.request
from collections import defaultdict
from typing import Any

import psycopg
from psycopg import sql

from bench.effects import TABLE
from bench.workload import Plan

LATENCY_MS = 50.0
ACCOUNTS = 1_000
ORDERING_KEY = "{tenant_id}"
# path -> (concurrency, async def)
GATEWAY_PATHS: dict[str, tuple[int, bool]] = {
    "gateway": (1, False),
    "gateway_c64": (64, False),
    "gateway_c64_orm": (64, False),  # bench/orm_gateway.py: the same work on ctx.session
    "gateway_async": (64, True),
    "gateway_async_orm": (64, True),
}


def ideal(path: str) -> float:
    """concurrency / remote call: what the path would reach if only the call counted."""
    return GATEWAY_PATHS[path][0] / (LATENCY_MS / 1000)


class GatewayProcess:
    """The gateway server in a process of its own, on a free port of 127.0.0.1."""

    def __init__(self, latency_ms: float = LATENCY_MS) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "consumers.gateway", "serve", "--port", "0", "--asyncio",
             "--latency-ms", str(latency_ms)],
            stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "payment gateway listening on http://..."
        if "listening on " not in line:
            self.stop()
            raise SystemExit(f"bench: the gateway did not start ({line!r})")
        self.url = line.rsplit(" ", 1)[-1].strip()

    def cpu_seconds(self) -> float:
        """The gateway process's CPU time so far (user + system, from /proc)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def mark(dsn: str, gateway_url: str) -> int:
    """Where the row's charges start in the local table; the gateway's count of calls
    at once starts again from here."""
    _in_flight(gateway_url, reset=True)
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT coalesce(max(id), 0) FROM payments.gateway_charges").fetchone()
    return int(row[0]) if row else 0


def _in_flight(gateway_url: str, *, reset: bool = False) -> dict[str, int]:
    req = urllib.request.Request(gateway_url + "/_in_flight", method="POST" if reset else "GET")
    with urllib.request.urlopen(req, timeout=30) as resp:
        stats: dict[str, int] = json.loads(resp.read())
    return stats


def check(dsn: str, schema: str, plan: Plan, since: int, gateway_url: str,
          path: str) -> tuple[bool, str]:
    _intents, messages = plan.build()
    keys = [m.key for m in messages]  # one partition: the list order is the offset order
    expected = set(keys)
    account = {m.key: m.tenant_id for m in messages}
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT idempotency_key FROM payments.gateway_charges"
            " WHERE id > %s AND idempotency_key = ANY(%s) ORDER BY id", (since, list(expected)),
        ).fetchall()
        succeeded = conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE status = 'succeeded'").format(
                sql.Identifier(schema, TABLE))).fetchone()
    written = [r[0] for r in rows]
    with urllib.request.urlopen(gateway_url + "/charges", timeout=30) as resp:
        charges = json.loads(resp.read())["charges"]
    charged: dict[str, int] = defaultdict(int)
    for c in charges:
        if c["idempotency_key"] in expected:
            charged[c["idempotency_key"]] += 1
    by_account: dict[str, list[str]] = defaultdict(list)
    for k in written:
        by_account[account[k]].append(k)
    position = {k: i for i, k in enumerate(keys)}
    out_of_order = sum(
        1 for ks in by_account.values() for a, b in itertools.pairwise(ks)
        if position[a] > position[b])
    once = len(written) == len(set(written)) == len(expected)
    gateway_once = len(charged) == len(expected) and all(n == 1 for n in charged.values())
    store_ok = succeeded is not None and succeeded[0] == len(expected)
    at_once = _in_flight(gateway_url)["max"]
    concurrency = GATEWAY_PATHS[path][0]
    ok = (once and gateway_once and store_ok and out_of_order == 0
          and at_once <= concurrency)
    text = (f"{len(written)} rows / {len(expected)} keys, {sum(charged.values())} gateway "
            f"charges, {succeeded[0] if succeeded else 0} succeeded; {len(by_account)} "
            f"accounts, {out_of_order} out of offset order; at most {at_once} calls at once "
            f"(concurrency {concurrency})")
    return ok, ("ok: " if ok else "FAILED: ") + text


def app_settings(path: str) -> dict[str, Any]:
    concurrency, use_async = GATEWAY_PATHS[path]
    return {"concurrency": concurrency, "use_async": use_async,
            "ordering_key": ORDERING_KEY if concurrency > 1 or use_async else None}
