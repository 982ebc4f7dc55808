"""The database limit: ``pgbench`` running exactly the framework's SQL, with no Kafka and no Python.

Two custom scripts (and a third, ``gen_only``, below) are generated into a temporary directory:

* **per-message** (the leased path's statements and transactions): the claim
  (``claim_insert``, committed on its own, as the leased path does in
  autocommit), then ``BEGIN``; the payments handler's two statements (ledger
  row, balance upsert); the fenced ``complete``; ``COMMIT``. One pgbench
  transaction = one message.
* **batched** (the batch path's set-based statements for a batch of new keys,
  ``--batch`` messages per transaction): ``BEGIN``; the read of every key
  (``succeeded_results``: none exists); the bulk handler's ledger insert and
  balance upsert (``charge_many``); ``batch_insert_done`` (every record written
  once, as succeeded); ``COMMIT``. One pgbench transaction = ``--batch`` messages.
  The framework writes a batch of 64 new keys or more with a binary ``COPY``
  (``batch_copy_done``) instead, which pgbench cannot feed: the script sends the
  insert the framework uses for smaller batches, which costs the server about
  1.5 x the COPY's CPU. This limit is therefore a little lower than the
  framework's own SQL's, and flatters the batch path's ratio to it by that much.

The statement texts are not copied: the store's come from
``kafka_idem/store/queries.sql`` (``compile_queries``), the handler's are
captured by calling ``consumers.payments.charge`` / ``charge_many`` with a
recording transaction, and ``payments.`` is pointed at a fresh schema. Only
the parameters differ: where the framework sends values, the per-message
script computes them from pgbench's ``random()`` (unique keys from
``:client_id`` and a 10^12 random number). The batched script sends arrays as
parameters, as the framework does: each client builds the arrays whose values
need not be unique once (first transaction; pgbench keeps a client's
variables), and its 500 new keys in one ``SELECT ... \\gset`` before each
``BEGIN``: one extra round trip and a read-only statement per batch, measured
apart by the ``gen_only`` script (it slightly lowers the limit, flattering the
framework's ratio by that much). The owner tokens are made there too (the
framework makes them in Python).

Tables: a fresh schema with a store built by ``kafka_idem.admin.migrate`` (the
same table, indexes and transition-guard triggers) and the payments tables,
dropped afterwards. Query mode ``prepared`` (psycopg prepares repeated
statements too). 50 tenants x 5 currencies, as the Kafka workload.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
from psycopg import sql

from bench import dbwork, procstat
from consumers import payments
from kafka_idem.admin.migrate import migrate
from kafka_idem.store.queries import compile_queries

TABLE = "task_idempotency"
CURRENCIES = sorted(payments.CURRENCIES)

# --- per-message parameter expressions (pgbench variables :k :t :c :a) -------------

# Every variable is cast: a prepared statement's parameters need a type.
_K, _T, _CL = "(:k::bigint)", "(:t::int)", "(:client_id::int)"
_TENANT = f"('pgb-t' || {_T})"
_ORDER = f"('pgb-o' || {_CL} || '-' || {_K})"
# pgbench takes ":name" for a variable even inside a string literal: no ':' before a letter.
_COLON = "':'"
_KEY = f"('pgb-t' || {_T} || {_COLON} || 'charge' || {_COLON} || 'pgb-o' || {_CL} || '-' || {_K})"
_AMOUNT = "(:a::numeric / 100)"
_CURRENCY = "((ARRAY[" + ", ".join(f"'{c}'" for c in CURRENCIES) + "])[:c::int])"
_HASH = f"('v1' || {_COLON} || 'sha256' || {_COLON} || md5({_K}::text) || md5({_T}::text))"
_TOKEN = f"(md5({_CL}::text || '-' || {_K}::text)::uuid)"
_RESULT = (f"jsonb_build_object('order_id', {_ORDER}, 'amount', {_AMOUNT}::text, "
           f"'currency', {_CURRENCY})")

# Every runtime statement names the app's namespace (the payments app's, as the
# consumer paths of the bench run it).
_NS = "'payments'"

PER_MESSAGE_VARS = {
    "ns": _NS, "key": _KEY, "hash": _HASH, "token": _TOKEN, "lease": "(:lease::float8)",
    "handler": "'charge'",
    "topic": "'bench.pgbench'", "partition": f"({_CL} % 4)", "offset": _K,
    "result": _RESULT,
    "shard": _TENANT,  # the payments handler's shard key (shard_key="{tenant_id}")
}

# --- batched: arrays built once per transaction, then sent as parameters -------------

# Positions 1..batch in the order of their keys (the tenant, zero-padded, leads the key);
# every array below lists its values in that order, as the framework sorts its batch.
_ORDER_BY = "ORDER BY g % 50, g::text"

# Once per client (pgbench keeps a client's variables between transactions): the arrays
# whose values need not be unique. (The keys and owner tokens: GEN_KEYS.)
GEN_STATIC = """
WITH m AS MATERIALIZED (
    SELECT g,
           'pgb-t' || lpad((g % 50)::text, 2, '0') AS tenant,
           'pgb-o' || g AS ord,
           round((1 + (random() * 99999)::int)::numeric / 100, 2) AS amount,
           (ARRAY[{currencies}])[1 + (random() * 4)::int] AS currency,
           md5(random()::text) AS h
    FROM generate_series(1, {batch}) AS g
), p AS (
    SELECT tenant, currency, sum(amount) AS total FROM m GROUP BY 1, 2 ORDER BY 1, 2
)
SELECT
    (SELECT array_agg('v1' || ':' || 'sha256' || ':' || h || h {order}) FROM m)::text AS hashes,
    (SELECT array_agg('charge'::text {order}) FROM m)::text AS handlers,
    (SELECT array_agg('bench.pgbench'::text {order}) FROM m)::text AS topics,
    (SELECT array_agg(:client_id::int % 4 {order}) FROM m)::text AS parts,
    (SELECT array_agg(g::bigint {order}) FROM m)::text AS offs,
    (SELECT jsonb_agg(jsonb_build_object('order_id', ord, 'amount', amount::text,
                                         'currency', currency) {order}) FROM m)::text
        AS results,
    (SELECT array_agg(tenant {order}) FROM m)::text AS l_tenants,
    (SELECT array_agg(ord {order}) FROM m)::text AS l_orders,
    (SELECT array_agg(amount {order}) FROM m)::text AS l_amounts,
    (SELECT array_agg(currency {order}) FROM m)::text AS l_currencies,
    (SELECT array_agg(tenant) FROM p)::text AS p_tenants,
    (SELECT array_agg(currency) FROM p)::text AS p_currencies,
    (SELECT array_agg(total) FROM p)::text AS p_totals
"""

# Every transaction: new keys (unique by client and a 10^12 random number), and their
# owner tokens.
GEN_KEYS = """
SELECT array_agg('pgb-t' || lpad((g % 50)::text, 2, '0') || ':' || 'charge' || ':' || 'pgb-o'
                 || :client_id::int || '-' || :k::bigint || '-' || g {order})::text AS keys,
       array_agg(gen_random_uuid())::text AS tokens
FROM generate_series(1, {batch}) AS g
"""

BATCH_VARS = {name: f"(:{name}::{cast})" for name, cast in (
    ("keys", "text[]"), ("hashes", "text[]"), ("tokens", "uuid[]"), ("handlers", "text[]"),
    ("topics", "text[]"), ("parts", "int[]"), ("offs", "bigint[]"), ("results", "jsonb"),
    ("lease", "float8"))} | {"ns": _NS, "shards": "(:l_tenants::text[])"}  # shard: tenant


# --- capturing the payments handler's statements ---------------------------------------


class _Recorder:
    """A connection that records what it is asked to run; its answers are made up
    (the ledger insert's ``RETURNING``: one row, or none for the bulk one)."""

    def __init__(self) -> None:
        self.statements: list[tuple[str, Any]] = []

    def execute(self, query: str, params: Any = None) -> _Recorder:
        self.statements.append((query, params))
        return self

    def fetchone(self) -> tuple[int, Any]:
        return (0, None)

    def fetchall(self) -> list[Any]:
        return []


def _model(tenant: str, order: str, amount: str, currency: str) -> payments.ChargeRequested:
    import datetime as dt

    return payments.ChargeRequested(
        tenant_id=tenant, order_id=order, amount=Decimal(amount), currency=currency,
        request_id="r", requested_at=dt.datetime.now(dt.UTC),
    )


def _bind_positional(query: str, params: Any, mapping: list[tuple[Any, str]], what: str) -> str:
    """Replace each ``%s`` (or binary ``%b``) by the pgbench expression of the value it
    was given."""
    parts = re.split(r"%[sb]", query)
    if len(parts) - 1 != len(params):
        raise RuntimeError(f"{what}: {len(params)} parameters for {len(parts) - 1} placeholders")
    out = [parts[0]]
    for value, rest in zip(params, parts[1:], strict=True):
        expr = next((e for v, e in mapping if v == value and type(v) is type(value)), None)
        if expr is None:
            raise RuntimeError(
                f"{what}: cannot map parameter {value!r}; consumers.payments changed, "
                "update bench/pgbench.py"
            )
        out.extend([expr, rest])
    return "".join(out)


def handler_statements(schema: str) -> tuple[list[str], list[str]]:
    """The payments handler's statements, per message and bulk, retargeted to ``schema``."""
    one = _Recorder()
    ctx = SimpleNamespace(tx=one, idempotency_key="\x01key", topic="")  # no events
    payments.charge(_model("\x01tenant", "\x01order", "12.34", "CHF"), ctx)  # type: ignore[arg-type]
    single = [
        (Decimal("12.34"), _AMOUNT), ("\x01tenant", _TENANT), ("\x01order", _ORDER),
        ("CHF", _CURRENCY), ("\x01key", _KEY),
    ]
    per_message = [
        _bind_positional(q, p, single, "charge") for q, p in one.statements
    ]
    many = _Recorder()
    items = [(_model("\x01tB", "\x01o1", "1.00", "USD"),
              SimpleNamespace(idempotency_key="\x01k1", topic="")),
             (_model("\x01tA", "\x01o2", "2.00", "EUR"),
              SimpleNamespace(idempotency_key="\x01k2", topic=""))]
    payments.charge_many(items, many)  # type: ignore[arg-type]
    bulk_map: list[tuple[Any, str]] = [
        (["\x01tB", "\x01tA"], ":l_tenants"), (["\x01o1", "\x01o2"], ":l_orders"),
        ([Decimal("1.00"), Decimal("2.00")], ":l_amounts"), (["USD", "EUR"], ":l_currencies"),
        (["\x01k1", "\x01k2"], ":keys"),
        (["\x01tA", "\x01tB"], ":p_tenants"), (["EUR", "USD"], ":p_currencies"),
        ([Decimal("2.00"), Decimal("1.00")], ":p_totals"),
    ]
    bulk = [_bind_positional(q, p, bulk_map, "charge_many") for q, p in many.statements]
    target = f'"{schema}".'
    return ([q.replace("payments.", target) for q in per_message],
            [q.replace("payments.", target) for q in bulk])


def _bind_named(query: str, mapping: dict[str, str], what: str) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in mapping:
            raise RuntimeError(f"{what}: no pgbench value for %({name})s")
        return mapping[name]

    return re.sub(r"%\((\w+)\)[sb]", sub, query)


def _one_line(query: str) -> str:
    # pgbench reads a SQL command up to the first unquoted ';' (multi-line is fine),
    # but keep each on one line so the generated scripts are easy to read in a diff.
    return " ".join(query.split()) + ";"


def scripts(conn: psycopg.Connection[Any], schema: str, batch: int) -> dict[str, str]:
    q = {name: c.as_string(conn) for name, c in compile_queries(schema, TABLE).items()}
    handler_one, handler_bulk = handler_statements(schema)
    per_message = "\n".join([
        "-- generated by bench/pgbench.py: the leased path, one message",
        "\\set k random(1, 1000000000000)",
        "\\set t random(0, 49)",
        f"\\set c random(1, {len(CURRENCIES)})",
        "\\set a random(1, 100000)",
        "\\set lease 30",
        "-- claim: one statement, committed on its own (autocommit)",
        _one_line(_bind_named(q["claim_insert"], PER_MESSAGE_VARS, "claim_insert")),
        "BEGIN;",
        *(_one_line(s) for s in handler_one),
        _one_line(_bind_named(q["complete"], PER_MESSAGE_VARS, "complete")),
        "COMMIT;",
        "",
    ])
    fill = {"currencies": ", ".join(f"'{c}'" for c in CURRENCIES), "batch": batch,
            "order": _ORDER_BY}
    gen_static = _one_line(GEN_STATIC.format(**fill))[:-1] + " \\gset"
    gen_keys = _one_line(GEN_KEYS.format(**fill))[:-1] + " \\gset"
    batched = "\n".join([
        f"-- generated by bench/pgbench.py: the batch path, {batch} messages",
        "-- run with -D inited=0: the client's static arrays are built in its first transaction",
        "\\if :inited = 0",
        gen_static,
        "\\set inited 1",
        "\\endif",
        "\\set k random(1, 1000000000000)",
        "\\set lease 30",
        "-- the client's side: this batch's keys (sent as parameters below, like the rest)",
        gen_keys,
        "BEGIN;",
        "-- the read of every key (all new: it finds none)",
        _one_line(_bind_named(q["succeeded_results"], BATCH_VARS, "succeeded_results")),
        *(_one_line(s) for s in handler_bulk),
        "-- every record written once, as succeeded (the framework: a COPY of these rows)",
        _one_line(_bind_named(q["batch_insert_done"], BATCH_VARS, "batch_insert_done")),
        "COMMIT;",
        "",
    ])
    gen_only = "\n".join([
        "-- generated by bench/pgbench.py: only the per-transaction key building of 'batched'",
        "\\set k random(1, 1000000000000)",
        gen_keys,
        "",
    ])
    return {"per_message": per_message, "batched": batched, "gen_only": gen_only}


# --- running -----------------------------------------------------------------------------


@dataclass
class PgbenchResult:
    script: str
    clients: int
    seconds: float
    messages_per_tx: int
    tps: float = 0.0
    latency_ms: float | None = None
    transactions: int = 0
    failed: int = 0
    cpu: dict[str, float | None] = field(default_factory=dict)
    statements_ms: list[tuple[float, str]] = field(default_factory=list)  # pgbench -r
    db: dict[str, Any] = field(default_factory=dict)  # bench/dbwork.py: statements, WAL...
    error: str = ""

    @property
    def msgs_per_s(self) -> float:
        return self.tps * self.messages_per_tx


def find_pgbench() -> str | None:
    for candidate in (shutil.which("pgbench"), *sorted(Path("/usr/lib/postgresql").glob(
            "*/bin/pgbench"), reverse=True)):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def sql_statements(script: str) -> int:
    """SQL statements per transaction of a script: not ``BEGIN`` / ``COMMIT``, not its
    ``\\gset`` key building (the framework builds keys in Python), not a client's
    once-only block (``\\if`` ... ``\\endif``)."""
    n, once = 0, False
    for line in script.splitlines():
        once = (once or line.startswith("\\if")) and not line.startswith("\\endif")
        if not once and line.endswith(";") and line not in ("BEGIN;", "COMMIT;"):
            n += 1
    return n


def _measured(cmd: list[str], dsn: str, schema: str, pids: procstat.Pids, r: PgbenchResult
              ) -> subprocess.CompletedProcess[str]:
    """One pgbench run: its CPU, and the database's work (row versions, WAL)."""
    versions = dbwork.RowVersions(dsn, [schema])
    wal = dbwork.WalMarks(dsn)
    wal.mark("first")
    before_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    watch = procstat.Watch(pids, interval=0.25).start()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    r.cpu = watch.stop()
    after_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    wal.mark("last")
    r.cpu["consumer"] = (after_children.ru_utime + after_children.ru_stime
                         - before_children.ru_utime - before_children.ru_stime)
    r.db["wal_bytes"] = dbwork.wal_bytes(wal.close())
    r.db["row_versions"] = versions.settled()
    return proc


def _parse(out: str, r: PgbenchResult) -> None:
    if m := re.search(r"^tps = ([\d.]+)", out, re.M):
        r.tps = float(m.group(1))
    if m := re.search(r"^latency average = ([\d.]+) ms", out, re.M):
        r.latency_ms = float(m.group(1))
    if m := re.search(r"^number of transactions actually processed: (\d+)", out, re.M):
        r.transactions = int(m.group(1))
    if m := re.search(r"^number of failed transactions: (\d+)", out, re.M):
        r.failed = int(m.group(1))
    # -r: "statement latencies in milliseconds and failures:" then "  ms  failures  command"
    tail = out.split("statement latencies in milliseconds", 1)
    if len(tail) == 2:
        for line in tail[1].splitlines()[1:]:
            parts = line.split(None, 2)
            if len(parts) == 3 and not parts[2].startswith("\\"):
                try:
                    r.statements_ms.append((float(parts[0]), parts[2][:90]))
                except ValueError:
                    continue


def run(
    dsn: str, run_id: str, *, clients: list[int], seconds: float, batch: int,
    scripts_wanted: tuple[str, ...] = ("per_message", "batched", "gen_only"),
    keep: bool = False, log: Any = print,
) -> list[PgbenchResult]:
    binary = find_pgbench()
    if binary is None:
        return [PgbenchResult(s, 0, seconds, 1, error="pgbench not found") for s in scripts_wanted]
    schema = f"bench_{run_id}_pgbench"
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-{run_id}-pgbench-"))
    results: list[PgbenchResult] = []
    pids = procstat.Pids(procstat.database_of(dsn))
    try:
        migrate(dsn, schema, TABLE)
        with psycopg.connect(dsn, autocommit=True) as conn:
            rec = _Recorder()
            payments.create_tables(rec)
            for stmt, _ in rec.statements:
                text = stmt.replace("IF NOT EXISTS payments", f'IF NOT EXISTS "{schema}"')
                conn.execute(text.replace("payments.", f'"{schema}".'))
            texts = scripts(conn, schema, batch)
        for name, text in texts.items():
            (tmp / f"{name}.sql").write_text(text)
        log(f"  pgbench scripts in {tmp}")
        for name in scripts_wanted:
            for c in clients if name != "gen_only" else [1]:
                r = PgbenchResult(name, c, seconds, batch if name == "batched" else 1)
                cmd = [binary, "-n", "-r", "-M", "prepared", "-D", "inited=0",
                       "-c", str(c), "-j", str(min(c, 2)),
                       "-T", str(int(seconds)), "-f", str(tmp / f"{name}.sql"), dsn]
                r.db["statements_per_tx"] = sql_statements(texts[name])
                proc = _measured(cmd, dsn, schema, pids, r)
                _parse(proc.stdout, r)
                if proc.returncode != 0 or r.tps == 0:
                    r.error = (proc.stderr.strip().splitlines() or ["pgbench failed"])[-1][:300]
                log(f"  pgbench {name} -c {c}: {r.tps:,.1f} tx/s = {r.msgs_per_s:,.0f} msgs/s"
                    + (f" [{r.error}]" if r.error else ""))
                results.append(r)
    finally:
        if not keep:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                    sql.Identifier(schema)))
            shutil.rmtree(tmp, ignore_errors=True)
    return results
