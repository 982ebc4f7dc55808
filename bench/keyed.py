"""The minimal keyed SQL (issue 38): the batch row's business effect and one unique key row
per message, from plain psycopg, with no Kafka and no framework. The floor a hand-rolled
inbox table would pay; the ``keyed_sql`` row of ``python -m bench``.

The same charge requests as the bench's main topic (``bench/workload.py``: 50 tenants x
5 currencies, every one a new key), in batches of ``--batch-size`` (500), one
transaction per batch on one connection, in one pipeline sync:

    BEGIN
    INSERT INTO <schema>.inbox (key) SELECT unnest(%b::text[]) ON CONFLICT (key) DO NOTHING
    the ledger insert and the balance upsert of consumers.payments.charge_many
    COMMIT

``ON CONFLICT DO NOTHING``: an inbox that a redelivered message must not break (the
framework's insert has it too). The business statements are ``charge_many``'s own,
captured on a recording connection and pointed at a fresh schema (with the payments
tables and the inbox, dropped afterwards), their parameters built before the clock
starts: inside it are only psycopg sending them and PostgreSQL running them. Measured:
rows/s, CPU of this process (the client), PostgreSQL and the broker (``bench/procstat.py``),
and the database's work (``bench/dbwork.py``). Checked: one inbox row and one ledger
row per key, every balance the sum of its charges.
"""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import psycopg
from psycopg import sql

from bench import dbwork, procstat, roundtrips
from bench.workload import Intent, Plan
from consumers import payments

LABEL = "minimal keyed SQL (psycopg, 1 connection, a key row + charge_many, 500/tx)"
INBOX = "INSERT INTO {s}.inbox (key) SELECT unnest(%b::text[]) ON CONFLICT (key) DO NOTHING"


@dataclass
class KeyedResult:
    label: str = LABEL
    messages: int = 0
    seconds: float = 0.0
    transactions: int = 0
    cpu: dict[str, float | None] = field(default_factory=dict)
    round_trips: dict[str, int] = field(default_factory=dict)
    row_versions: dict[str, Any] = field(default_factory=dict)
    wal_bytes: int | None = None
    ok: bool = False
    check: str = ""

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.ok and self.seconds else 0.0

    def per_1k(self, part: str) -> float | None:
        v = self.cpu.get(part)
        return v / self.messages * 1000 if v is not None and self.messages else None

    def to_json(self) -> dict[str, Any]:
        return {**vars(self), "msgs_per_s": self.rate}


class _Capture:
    """A connection that records what it is asked to run (``charge_many`` with events
    fetches its ledger insert's ``RETURNING`` rows: none here, it runs without)."""

    def __init__(self) -> None:
        self.statements: list[tuple[str, Any]] = []

    def execute(self, query: str, params: Any = None) -> _Capture:
        self.statements.append((query, params))
        return self

    def fetchall(self) -> list[Any]:
        return []


def _retarget(query: str, schema: str) -> str:
    return query.replace("IF NOT EXISTS payments", f'IF NOT EXISTS "{schema}"').replace(
        "payments.", f'"{schema}".')


def _batches(intents: list[Intent], schema: str, size: int) -> list[list[tuple[str, Any]]]:
    """Every transaction's statements and parameters, keys in order within a batch."""
    inbox = INBOX.format(s=f'"{schema}"')
    at = dt.datetime.now(dt.UTC)
    out = []
    for start in range(0, len(intents), size):
        chunk = sorted(intents[start:start + size], key=lambda i: i.key)
        items = [(payments.ChargeRequested(tenant_id=i.tenant_id, order_id=i.order_id,
                                           amount=i.amount, currency=i.currency,
                                           request_id=i.key, requested_at=at),
                  SimpleNamespace(idempotency_key=i.key, topic="")) for i in chunk]
        rec = _Capture()
        payments.charge_many(items, rec)  # type: ignore[arg-type]
        out.append([(inbox, ([i.key for i in chunk],)),
                    *((_retarget(q, schema), p) for q, p in rec.statements)])
    return out


def _create(conn: psycopg.Connection[Any], schema: str) -> None:
    rec = _Capture()
    payments.create_tables(rec)
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    for stmt, _ in rec.statements:
        conn.execute(_retarget(stmt, schema))
    conn.execute(sql.SQL("CREATE TABLE {}.inbox (key text PRIMARY KEY)").format(
        sql.Identifier(schema)))


def _check(conn: psycopg.Connection[Any], schema: str, intents: list[Intent]) -> tuple[bool, str]:
    s = sql.Identifier(schema)
    keys, ledger, distinct = conn.execute(sql.SQL(
        "SELECT (SELECT count(*) FROM {s}.inbox), count(*), count(DISTINCT idempotency_key)"
        " FROM {s}.ledger").format(s=s)).fetchone() or (0, 0, 0)
    balances = {(t, c): b for t, c, b in conn.execute(sql.SQL(
        "SELECT tenant_id, currency, balance FROM {}.balances").format(s))}
    sums: Counter[tuple[str, str]] = Counter()
    for i in intents:
        sums[(i.tenant_id, i.currency)] += i.amount  # type: ignore[assignment]
    balances_ok = balances == {k: Decimal(v) for k, v in sums.items()}
    ok = keys == ledger == distinct == len({i.key for i in intents}) and balances_ok
    return ok, (("ok: " if ok else "FAILED: ") + f"{keys} key rows / {ledger} ledger rows / "
                f"{len(intents)} intents; balances {'ok' if balances_ok else 'WRONG'}")


def _timed(conn: psycopg.Connection[Any], batches: list[list[tuple[str, Any]]],
           r: KeyedResult, pids: procstat.Pids) -> None:
    """Every batch in its transaction, the clock and the CPU watch around them."""
    conn.execute("SET synchronous_commit = on")  # as the framework's sessions
    wal_first = dbwork.lsn(conn)
    with roundtrips.counting() as counts:
        watch = procstat.Watch(pids, interval=0.25).start()
        t0 = time.perf_counter()
        with conn.pipeline():
            for stmts in batches:
                with conn.transaction():
                    for query, params in stmts:
                        conn.execute(query, params)
        r.seconds = time.perf_counter() - t0
        r.cpu = watch.stop()
    r.wal_bytes = dbwork.lsn(conn) - wal_first
    r.round_trips = roundtrips.summary(counts)
    r.transactions = len(batches)


def run(dsn: str, run_id: str, plan: Plan, *, batch: int, keep: bool = False,
        log: Any = print) -> KeyedResult:
    schema = f"bench_{run_id}_keyed"
    intents, messages = plan.build()  # messages: the intents shuffled, as on the topic
    r = KeyedResult(messages=len(messages))
    pids = procstat.Pids(procstat.database_of(dsn))
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            _create(conn, schema)
        batches = _batches(messages, schema, batch)
        versions = dbwork.RowVersions(dsn, [schema])
        with psycopg.connect(dsn, autocommit=True) as conn:
            _timed(conn, batches, r, pids)
        r.row_versions = versions.settled()
        with psycopg.connect(dsn, autocommit=True) as conn:
            r.ok, r.check = _check(conn, schema, intents)
    except psycopg.Error as exc:
        r.ok, r.check = False, f"error: {type(exc).__name__}: {exc}"[:300]
    finally:
        if not keep:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                    sql.Identifier(schema)))
    log(f"  keyed SQL: {r.rate:,.0f} rows/s; {r.check}")
    return r


def cells(r: KeyedResult) -> list[str]:
    """Its line in the main table (the pgbench rows' columns)."""

    def f(v: float | None) -> str:
        return "—" if v is None else f"{v:.3f}"

    return [r.label, f"{r.messages:,}", f"{r.rate:,.0f}" if r.rate else "—", "—", "—", "—",
            f(r.per_1k("consumer")) + " (psycopg)", f(r.per_1k("postgres")),
            f(r.per_1k("broker")), "—", "—", "—", "—",
            ("[green]" if r.ok else "[red]") + r.check
            + (f"; {r.transactions:,} tx in {r.seconds:.2f}s" if r.ok else "")]


def targets(batch: Any, keyed: KeyedResult | None, pgbench_c4: float | None
            ) -> list[dict[str, Any]]:
    """Issue 38's: the batch path next to the keyed SQL and to pgbench batched -c 4."""
    out: list[dict[str, Any]] = []
    if batch is None:
        return out

    def add(name: str, value: float | None, goal: float, at_most: bool = False) -> None:
        met = value is not None and (value <= goal if at_most else value >= goal)
        out.append({"target": name, "value": value, "goal": goal, "met": met, "unit": "x"})

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    if keyed is not None:
        add("batch path PostgreSQL CPU/msg <= 1.3 x the minimal keyed SQL's",
            ratio(batch.cpu_per_1k("postgres"), keyed.per_1k("postgres")), 1.3, at_most=True)
    add("batch path >= 0.5 x pgbench batched -c 4", ratio(batch.rate, pgbench_c4), 0.5)
    if keyed is not None:
        add("batch path >= 0.3 x the minimal keyed SQL rows/s", ratio(batch.rate, keyed.rate),
            0.3)
    return out
