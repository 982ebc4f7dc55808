"""kafka_idem against its limits, in one run: ``python -m bench`` (``./dev bench``).

    python -m bench                 # the full suite (about 6-8 minutes on 2 cores)
    python -m bench --quick         # small sizes, same rows (about 2 minutes)
    python -m bench --paths raw,batch --messages 50000

1. Produce the workloads (payments charge requests, ``bench/workload.py``) into
   fresh 4-partition topics: the main topic (``--messages``), a smaller one for
   the per-message paths (``--slow-messages``), one that is 90% duplicates and
   one for the RSS run (``--rss-messages``).
2. Measure, each in a process of its own (``bench/worker.py``), each with a
   fresh consumer group and a fresh store schema:
   raw confluent-kafka; pgbench with the framework's SQL, per message and
   batched (``bench/pgbench.py``); the naive consumer (``bench/naive.py``);
   kafka_idem leased; batch with the bulk handler; batch with the per-message
   handler; batch on 90% duplicates; the batch path's RSS over the RSS topic.
3. For each path: max throughput (draining a backlog), CPU seconds per 1,000
   messages of the consumer process, PostgreSQL and the broker over the same
   window, then end-to-end latency (p50/p99) at half that throughput, produced
   at a fixed rate by another process.
4. Check exactly-once effects after every framework and naive run.
5. Print one table, the targets of issue 6 (met / not met), write
   ``bench/results.json``; drop topics, groups, schemas and rows (unless ``--keep``).

No assertions on timing anywhere: numbers are for reading, checks are on effects.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import confluent_kafka
import psycopg
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient
from psycopg import sql
from rich.console import Console
from rich.table import Table

from bench import cli, dbwork, keyed, orm, pgbench, procstat
from bench.effects import TABLE, ledger_state
from bench.gateway import ACCOUNTS, GATEWAY_PATHS, GatewayProcess, ideal
from bench.workload import (
    PARTITIONS,
    Plan,
    create_topic,
    end_offsets,
    produce_backlog,
    tenants_of,
)
from consumers import gateway as gateway_example
from consumers import payments
from kafka_idem.admin.migrate import migrate
from kafka_idem.settings import Settings, load_settings

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.json"
console = Console(stderr=True)

# path -> (label, worker kind, mode, bulk handler, topic)
PATHS: dict[str, tuple[str, str, str, bool, str]] = {
    "raw": ("raw confluent-kafka (consume + commit)", "raw", "", False, "main"),
    "naive": ("naive consumer (1 tx/msg, sync commit)", "naive", "", False, "slow"),
    "leased": ("kafka_idem leased", "framework", "leased", True, "slow"),
    "leased_orm": ("kafka_idem leased, ORM handler (ctx.session)", "framework", "leased", False,
                   "slow"),
    "leased_orm_core": ("kafka_idem leased, ORM handler, 2.0-style statements (ctx.session)",
                        "framework", "leased", False, "slow"),
    "batch": ("kafka_idem batch (bulk handler)", "framework", "local", True, "main"),
    "cli": ("kafka-idem run of the same app (the CLI, defaults; bulk handler)", "cli", "local",
            True, "main"),
    "batch_nobulk": ("kafka_idem batch (per-message handler)", "framework", "local", False,
                     "main"),
    "batch_orm": ("kafka_idem batch (per-message ORM handler, ctx.session)", "framework",
                  "local", False, "main"),
    "batch_orm_core": ("kafka_idem batch (per-message ORM handler, 2.0-style statements)",
                       "framework", "local", False, "main"),
    "batch_m2": ("kafka_idem batch, two members in one group (bulk handler)", "framework",
                 "local", True, "main"),
    "batch_json": ("kafka_idem batch, JSON payloads (bulk handler)", "framework", "local", True,
                   "json"),
    "dup90": ("kafka_idem batch, 90% duplicates", "framework", "local", True, "dup"),
    "batch_emit": ("kafka_idem batch, one emit per message (bulk handler; the member's relay)",
                   "framework", "local", True, "main"),
    "relay": ("outbox relay, batched (a full outbox; msgs = events)", "relay", "", False,
              "main"),
    "gateway": ("kafka_idem leased, gateway 50 ms, concurrency=1", "gateway", "leased", False,
                "gw1"),
    "gateway_c64": ("kafka_idem leased, gateway 50 ms, concurrency=64", "gateway", "leased",
                    False, "gw"),
    "gateway_c64_orm": ("kafka_idem leased, gateway 50 ms, concurrency=64, ORM handler",
                        "gateway", "leased", False, "gw"),
    "gateway_async": ("kafka_idem leased, gateway 50 ms, async def, concurrency=64", "gateway",
                      "leased", False, "gw"),
    "gateway_async_orm": ("kafka_idem leased, gateway 50 ms, async def, concurrency=64, ORM "
                          "handler (AsyncSession)", "gateway", "leased", False, "gw"),
}
ALL = ["raw", "pgbench", "keyed_sql", "naive", "leased", "leased_orm", "leased_orm_core", "batch",
       "cli", "batch_m2", "batch_json", "batch_nobulk", "batch_orm", "batch_orm_core", "dup90",
       "batch_emit", "relay", "rss", "gateway", "gateway_c64", "gateway_c64_orm",
       "gateway_async", "gateway_async_orm"]
ONE_PARTITION = ("gw", "gw1")  # the gateway rows: one partition, key-ordered inside it
BATCH_FAMILY = ("batch", "cli", "batch_m2", "batch_json", "batch_nobulk", "batch_orm",
                "batch_orm_core", "dup90", "batch_emit")
# paths drained by several members of one group at once (the throughput phase only)
MEMBERS = {"batch_m2": 2}
EMITTING = ("batch_emit", "relay")  # the paths whose payments app has its events
EMIT_LATENCY_RATE = 1000.0  # msgs/s of batch_emit's latency run (the outbox target's rate)
FORMATS = {"json": "json"}  # topic key -> payload format (the others: the app's, Avro)
RSS_FLAT_MB = 10.0


@dataclass
class Measured:
    path: str
    label: str
    throughput: dict[str, Any] = field(default_factory=dict)
    latency: dict[str, Any] = field(default_factory=dict)

    @property
    def messages(self) -> int:
        return int(self.throughput.get("messages", 0))

    @property
    def rate(self) -> float:
        secs = self.throughput.get("seconds") or 0.0
        return self.messages / secs if secs and self.throughput.get("ok") else 0.0

    def cpu_per_1k(self, part: str) -> float | None:
        cpu = self.throughput.get("cpu") or {}
        v = cpu.get(part)
        return v / self.messages * 1000 if v is not None and self.messages else None


# --- set-up ----------------------------------------------------------------------------------


def create_payments_tables(dsn: str) -> None:
    for attempt in range(3):  # concurrent first-time CREATE ... IF NOT EXISTS can collide
        try:
            with psycopg.connect(dsn) as conn:
                payments.create_tables(conn)
                gateway_example.create_tables(conn)
            return
        except psycopg.errors.UniqueViolation:
            if attempt == 2:
                raise
            time.sleep(0.2)


def machine(dsn: str) -> dict[str, Any]:
    info: dict[str, Any] = {"cores": os.cpu_count(), "loadavg_start": os.getloadavg()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        info["cpu_model"] = next(
            (ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines()
             if ln.startswith("model name")), None)
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()
        info["memory_gib"] = round(int(mem[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    with psycopg.connect(dsn) as conn:
        info["postgres"] = {
            name: conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
            for name in ("server_version", "fsync", "synchronous_commit", "wal_sync_method",
                         "shared_buffers", "full_page_writes")
        }
    return info


# --- running a worker -----------------------------------------------------------------------


def run_worker(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    load_before = os.getloadavg()
    proc, out_file = _start_worker(spec, work)
    out = _worker_result(proc, out_file, spec["timeout"])
    out["loadavg_before"] = load_before
    return out


def _start_worker(spec: dict[str, Any], work: Path) -> tuple[subprocess.Popen[bytes], Path]:
    name = (f"{spec['path']}-{spec['phase']}" + (f"-{spec['rep']}" if spec.get("rep") else "")
            + (f"-m{spec['member']}" if "member" in spec else ""))
    spec_file, out_file = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec_file.write_text(json.dumps(spec))
    # the worker's app (and its paced producer) decode/encode in the path's format
    fmt = FORMATS.get(PATHS.get(spec["path"], PATHS["batch"])[4])
    env = {**os.environ, **({"PAYMENTS_FORMAT": fmt} if fmt else {}),
           "PAYMENTS_EVENTS": "on" if spec["path"] in EMITTING else "off"}
    cmd = [sys.executable, "-m", "bench.worker", str(spec_file), str(out_file)]
    return subprocess.Popen(cmd, env=env), out_file


def _worker_result(proc: subprocess.Popen[bytes], out_file: Path, timeout: float
                   ) -> dict[str, Any]:
    try:
        proc.wait(timeout=timeout + 180)
        out: dict[str, Any] = json.loads(out_file.read_text())
    except (subprocess.TimeoutExpired, OSError, ValueError) as exc:
        proc.kill()
        out = {"ok": False, "check": f"worker failed: {exc}"}
    return out


def run_members(s: Any, spec: dict[str, Any], work: Path, n: int) -> dict[str, Any]:
    """``n`` workers of one group draining one topic at once. The group's clock runs from
    the first member's first batch to the last member's last commit; consumer CPU is
    the members' sum, PostgreSQL's and the broker's that of the longest member window
    (they cover the same span); the effects are checked once, by member 0, after the
    group's committed offsets reached the end (the ledger mark taken before any start)."""
    load_before = os.getloadavg()
    mark, before = ledger_state(s.dsn, tenants_of(Plan.from_json(spec["plan"]).tag))
    barrier = work / f"{spec['path']}-{spec['phase']}-start"
    # The members' joins take a rebalance each, a heartbeat (3 s by default) apart:
    # frequent heartbeats keep that out of most of the group's clock.
    shared = {**spec, "members": n, "mark": mark, "barrier": str(barrier),
              "kafka": {"heartbeat.interval.ms": 250},
              "before": [[t, c, str(b)] for (t, c), b in before.items()]}
    started = [_start_worker({**shared, "member": i}, work) for i in range(n)]
    # Each member imports and connects at its own pace: they subscribe together.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(
            Path(f"{barrier}.ready{i}").exists() for i in range(n)):
        if any(proc.poll() is not None for proc, _ in started):
            break
        time.sleep(0.01)
    barrier.with_suffix(".go").touch()
    outs = [_worker_result(proc, out_file, spec["timeout"]) for proc, out_file in started]
    out = _merge_members(outs)
    out["loadavg_before"] = load_before
    return out


def _merge_members(outs: list[dict[str, Any]]) -> dict[str, Any]:
    first, *_ = outs
    if not all(o.get("ok") and o.get("first_batch_at") for o in outs):
        bad = [f"member {i}: {o.get('check')}" for i, o in enumerate(outs) if not o.get("ok")]
        return {**first, "ok": False, "check": "; ".join(bad) or "a member fetched nothing",
                "members": outs}
    begin = min(o["first_batch_at"] for o in outs)
    end = max(o["last_commit_at"] for o in outs)
    longest = max(outs, key=lambda o: o["cpu"]["wall"])
    cpu = dict(longest["cpu"])
    cpu["consumer"] = sum(o["cpu"]["consumer"] for o in outs)
    cpu["wall"] = end - begin
    cpu["other"] = max(cpu["machine_busy"] - cpu["consumer"] - (cpu.get("postgres") or 0)
                       - (cpu.get("postgres_other_databases") or 0) - (cpu.get("broker") or 0),
                       0.0)
    spread = max(o["first_batch_at"] for o in outs) - begin
    return {**first, "seconds": end - begin, "cpu": cpu, "wal": dbwork.merge_wal(outs),
            "peak_rss_mb": max(o.get("peak_rss_mb") or 0 for o in outs),
            "effects_recorded": sum(o.get("effects_recorded") or 0 for o in outs),
            "check": f"{first.get('check')}; {len(outs)} members, effects per member "
                     f"{[o.get('effects_recorded') for o in outs]}, first batches "
                     f"{spread:.2f}s apart", "members": outs}


# --- output -----------------------------------------------------------------------------------


def _f(v: float | None, fmt: str = "{:.3f}") -> str:
    return "—" if v is None else fmt.format(v)


def _ratio(a: float, b: float | None) -> float | None:
    return a / b if a and b else None


def render(
    rows: list[Measured], pg: list[pgbench.PgbenchResult], limits: dict[str, float | None],
    rss: dict[str, Any] | None, floor: keyed.KeyedResult | None = None,
) -> Table:
    table = Table(title="kafka_idem benchmark (one run; CPU in seconds per 1,000 messages; "
                  "latency = effect committed - Kafka CreateTime, at the rate shown)",
                  title_justify="left")
    for col in ("path", "messages", "msgs/s", "x raw", "x SQL limit", "x naive",
                "CPU consumer", "CPU PG", "CPU broker", "p50 ms", "p99 ms", "at msgs/s",
                "peak RSS MB", "check"):
        table.add_column(col, justify="left" if col in ("path", "check") else "right")
    raw, naive = limits.get("raw"), limits.get("naive")
    by = {m.path: m for m in rows}
    if "raw" in by:
        _row(table, by["raw"], raw, None, naive)
    for r in pg:
        table.add_row(
            f"pgbench {r.script.replace('_', '-')} -c {r.clients}",
            f"{r.transactions * r.messages_per_tx:,}", f"{r.msgs_per_s:,.0f}" if r.tps else "—",
            "—", "—", "—", _f(_per_1k(r.cpu.get("consumer"), r)) + " (pgbench)",
            _f(_per_1k(r.cpu.get("postgres"), r)), _f(_per_1k(r.cpu.get("broker"), r)),
            "—", "—", "—", "—",
            ("[red]" + r.error) if r.error else
            f"[green]{r.tps:,.1f} tx/s, avg {r.latency_ms or 0:.2f} ms/tx, {r.failed} failed",
        )
    if floor is not None:
        table.add_row(*keyed.cells(floor))
    for m in rows:
        if m.path == "raw":
            continue
        limit = limits.get("sql_batched") if m.path in BATCH_FAMILY else limits.get(
            "sql_per_message")
        if m.path in GATEWAY_PATHS:
            limit = ideal(m.path)  # "x SQL limit" of a gateway row: x concurrency / 50 ms
        _row(table, m, raw, limit, naive)
    if rss is not None:
        table.add_row(
            "kafka_idem batch, RSS run", f"{rss.get('messages', 0):,}",
            _f(rss.get("msgs_per_s"), "{:,.0f}"), "—", "—", "—",
            _f(rss.get("cpu_consumer_per_1k")), _f(rss.get("cpu_postgres_per_1k")),
            _f(rss.get("cpu_broker_per_1k")), "—", "—", "—",
            _f(rss.get("peak_mb"), "{:.0f}"),
            ("[green]" if rss.get("ok") else "[red]")
            + f"RSS {_f(rss.get('after_warmup_mb'), '{:.0f}')} MB after "
            f"{rss.get('warmup_messages', 0):,}, max after "
            f"{_f(rss.get('max_after_warmup_mb'), '{:.0f}')}, at end "
            f"{_f(rss.get('end_mb'), '{:.0f}')} MB; "
            + str(rss.get("check", "")),
        )
    return table


def _per_1k(v: float | None, r: pgbench.PgbenchResult) -> float | None:
    n = r.transactions * r.messages_per_tx
    return v / n * 1000 if v is not None and n else None


def _row(table: Table, m: Measured, raw: float | None, limit: float | None,
         naive: float | None) -> None:
    lat = m.latency.get("latency_ms") or {}
    prod = m.latency.get("producer") or {}
    ok = m.throughput.get("ok") and (not m.latency or m.latency.get("ok"))
    check = m.throughput.get("check", "")
    if m.latency and not m.latency.get("ok"):
        check += f"; latency: {m.latency.get('check')}"
    table.add_row(
        m.label, f"{m.messages:,}", f"{m.rate:,.0f}" if m.rate else "—",
        _f(_ratio(m.rate, raw)), _f(_ratio(m.rate, limit), "{:.2f}"),
        _f(_ratio(m.rate, naive) if m.path != "naive" else None, "{:.1f}"),
        _f(m.cpu_per_1k("consumer")), _f(m.cpu_per_1k("postgres")),
        _f(m.cpu_per_1k("broker")),
        _f(lat.get("p50"), "{:.1f}"), _f(lat.get("p99"), "{:.1f}"),
        _f(prod.get("rate"), "{:,.0f}"),
        _f(m.throughput.get("peak_rss_mb"), "{:.0f}"),
        ("[green]" if ok else "[red]") + check,
    )


def render_round_trips(rows: list[Measured]) -> Table | None:
    have = [m for m in rows if m.throughput.get("round_trips")]
    if not have:
        return None
    table = Table(title="SQL per message, by kind (round trips = waits for the server; "
                  "statements and commands sent in a pipeline share one)", title_justify="left")
    columns = [("round trips", "round_trips"), ("pipeline waits", "pipeline_waits"),
               ("statements", "statements"), ("pipelined sends", "pipelined"),
               ("BEGIN", "begin"), ("COMMIT", "commit"), ("ROLLBACK", "rollback"),
               ("SAVEPOINT", "savepoint"), ("RELEASE", "release"),
               ("ROLLBACK TO", "rollback_to")]
    table.add_column("path")
    for name, _ in columns:
        table.add_column(name, justify="right")
    for m in have:
        rt = m.throughput["round_trips"]
        table.add_row(m.label, *(f"{rt[k] / m.messages:.3f}" for _, k in columns))
    return table


def render_cpu(rows: list[Measured]) -> Table:
    table = Table(title="CPU split over each throughput window (seconds of CPU per second of "
                  f"wall time; {procstat.cpu_count()} cores = {procstat.cpu_count()}.0)",
                  title_justify="left")
    for col in ("path", "wall s", "consumer", "postgres", "broker", "other", "machine busy"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for m in rows:
        cpu = m.throughput.get("cpu") or {}
        wall = cpu.get("wall") or 0.0
        if not wall:
            continue

        def per_s(k: str, cpu: dict[str, Any] = cpu, wall: float = wall) -> str:
            v = cpu.get(k)
            return "—" if v is None else f"{v / wall:.2f}"

        table.add_row(m.label, f"{wall:.2f}", per_s("consumer"), per_s("postgres"),
                      per_s("broker"), per_s("other"), per_s("machine_busy"))
    return table


def render_pg_statements(pg: list[pgbench.PgbenchResult]) -> Table | None:
    runs = [r for r in pg if r.statements_ms and r.clients == 1 and r.script != "gen_only"]
    if not runs:
        return None
    table = Table(title="pgbench -c 1, per statement (pgbench -r): ms per transaction "
                  "(a batched transaction is 500 messages)", title_justify="left")
    table.add_column("script")
    table.add_column("ms", justify="right")
    table.add_column("statement")
    for r in runs:
        for ms, text in r.statements_ms:
            table.add_row(r.script, f"{ms:.3f}", text)
    return table


PHASES = [
    ("runner.step", "whole loop step"),
    ("consumer.consume", "  consume()"),
    ("processor.run_local", "  Processor.run_local"),
    ("batch.run_batch", "    batch.run_batch"),
    ("batch._prepare", "      decode, validate, key, hash"),
    ("batch._read", "      read of every key (lock of the existing ones)"),
    ("batch._run_handlers", "      handlers + one insert of every success"),
    ("commit", "      COMMIT and the rest"),
    ("runner._apply", "  _apply (offsets, metrics)"),
    ("runner._commit_pending", "  offset commit (async)"),
]


def render_phases(rows: list[Measured]) -> Table | None:
    have = [m for m in rows if m.throughput.get("phases", {}).get("batch.run_batch")]
    if not have:
        return None
    table = Table(title="Where the batch path's time goes, microseconds per message: wall / "
                  "CPU of the loop's thread (wall - CPU = waiting, mostly for PostgreSQL)",
                  title_justify="left")
    table.add_column("step")
    for m in have:
        table.add_column(m.label, justify="right")
    cells: dict[str, list[str]] = {name: [] for name, _ in PHASES}
    for m in have:
        ph = dict(m.throughput["phases"])
        rb = ph["batch.run_batch"]
        inner = [ph.get(k, {"wall_s": 0.0, "cpu_s": 0.0}) for k in
                 ("batch._prepare", "batch._read", "batch._replays", "batch._claim",
                  "batch._run_handlers")]  # _replays, _claim: results before migration 0010
        ph["commit"] = {"wall_s": rb["wall_s"] - sum(p["wall_s"] for p in inner),
                        "cpu_s": rb["cpu_s"] - sum(p["cpu_s"] for p in inner)}
        for name, _ in PHASES:
            p = ph.get(name)
            cells[name].append("—" if p is None else
                               f"{p['wall_s'] / m.messages * 1e6:.1f} / "
                               f"{p['cpu_s'] / m.messages * 1e6:.1f}")
    for name, label in PHASES:
        table.add_row(label, *cells[name])
    return table


def targets(
    by: dict[str, Measured], limits: dict[str, float | None], rss: dict[str, Any] | None,
    floor: keyed.KeyedResult | None = None,
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: float, unit: str = "") -> None:
        out.append({"target": name, "value": value, "goal": goal,
                    "met": value is not None and value >= goal, "unit": unit})

    if (b := by.get("batch")) is not None:
        add("batch path msgs/s >= 30,000", b.rate or None, 30_000, "msgs/s")
        add("batch path >= 0.5 x batched SQL limit", _ratio(b.rate, limits.get("sql_batched")),
            0.5, "x")
        add("batch path >= 10 x naive", _ratio(b.rate, limits.get("naive")), 10, "x")
        out.extend(keyed.targets(b, floor, limits.get("sql_batched_c4")))  # issue 38
        if (c := by.get("cli")) is not None:
            # by the database's clock, which both rows have alike (bench/cli.py)
            add("kafka-idem run (the CLI) >= 0.85 x the batch path (database clock)",
                _ratio(c.throughput.get("db_clock_rate") or 0.0,
                       b.throughput.get("db_clock_rate")), 0.85, "x")
    if (le := by.get("leased")) is not None:
        add("leased >= 0.8 x pgbench per-message", _ratio(le.rate,
            limits.get("sql_per_message")), 0.8, "x")
    for path in ("gateway_c64", "gateway_async"):
        if (g := by.get(path)) is not None:
            add(f"{path}: >= 0.7 x {ideal(path):,.0f} msgs/s (64 / 50 ms), exactly once, "
                "in key order", _ratio(g.rate, ideal(path)) if g.throughput.get("ok") else None,
                0.7, "x")
    if (d := by.get("dup90")) is not None:
        add("90%-duplicates msgs/s >= 20,000", d.rate or None, 20_000, "msgs/s")
    out.extend(outbox_targets(by))
    if rss is not None:
        growth = rss.get("growth_mb")
        out.append({"target": f"RSS flat over {rss.get('messages', 0):,} messages (max after "
                    f"warm-up <= warm-up + {RSS_FLAT_MB:.0f} MB)",
                    "value": growth, "goal": RSS_FLAT_MB, "unit": "MB growth",
                    "met": growth is not None and growth <= RSS_FLAT_MB and bool(rss.get("ok"))})
    return out


def outbox_targets(by: dict[str, Measured]) -> list[dict[str, Any]]:
    """Issue 14's: relay throughput, the batch path's cost of one emit, commit to readable."""
    out: list[dict[str, Any]] = []
    if (r := by.get("relay")) is not None:
        out.append({"target": "outbox relay >= 20,000 events/s (batched)", "value": r.rate or None,
                    "goal": 20_000, "unit": "msgs/s", "met": r.rate >= 20_000})
    emit, plain = by.get("batch_emit"), by.get("batch")
    if emit is not None and plain is not None:
        ratio = _ratio(emit.rate, plain.rate)
        out.append({"target": "batch path, one emit per message >= 0.7 x without",
                    "value": ratio, "goal": 0.7, "unit": "x",
                    "met": ratio is not None and ratio >= 0.7})
    if emit is not None:
        ev = emit.latency.get("event_latency_ms") or {}
        rate = (emit.latency.get("producer") or {}).get("rate") or 0
        p99 = ev.get("p99")
        out.append({"target": f"commit to readable p99 <= 100 ms at {rate:,.0f} events/s "
                    "(goal: at 1,000)", "value": p99, "goal": 100.0, "unit": "ms",
                    "met": p99 is not None and p99 <= 100.0 and rate >= 0.95 * EMIT_LATENCY_RATE})
    return out


def render_outbox(by: dict[str, Measured]) -> Table | None:
    """The outbox's figures: what one event costs (CPU, the load disturbs it less than
    the rates), the relay's rate, the batch path's with and without emit, latency."""
    rows = [by[p] for p in ("batch", "batch_emit", "relay") if p in by]
    if not any(m.path in EMITTING for m in rows):
        return None
    table = Table(title="Outbox (issue 14): CPU ms per event (or message), rates, commit to "
                  "readable", title_justify="left")
    for col in ("path", "msgs/s", "CPU process ms", "CPU PG ms", "CPU broker ms",
                "machine busy", "commit->readable p50 / p99 ms", "at msgs/s", "outbox drain"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for m in rows:
        cpu = m.throughput.get("cpu") or {}
        wall = cpu.get("wall") or 0.0
        ev = m.latency.get("event_latency_ms") or {}
        drain = m.throughput.get("outbox_drain_seconds")
        table.add_row(
            m.label, f"{m.rate:,.0f}" if m.rate else "—",
            _f(m.cpu_per_1k("consumer")), _f(m.cpu_per_1k("postgres")),
            _f(m.cpu_per_1k("broker")),
            _f(busy / wall if wall and (busy := cpu.get("machine_busy")) else None, "{:.2f}"),
            f"{_f(ev.get('p50'), '{:.1f}')} / {_f(ev.get('p99'), '{:.1f}')}" if ev else "—",
            _f((m.latency.get("producer") or {}).get("rate"), "{:,.0f}") if ev else "—",
            "—" if drain is None else
            f"{m.throughput.get('outbox_pending_at_end', 0):,} rows, {drain:.1f}s")
    return table


def render_targets(ts: list[dict[str, Any]]) -> Table:
    table = Table(title="targets (issues 6, 14, 15 and 38)", title_justify="left")
    for col in ("target", "measured", "met"):
        table.add_column(col, justify="left" if col == "target" else "right")
    for t in ts:
        v = t["value"]
        shown = "—" if v is None else (f"{v:,.0f} {t['unit']}" if t["unit"] == "msgs/s"
                                       else f"{v:.2f} {t['unit']}" if t["unit"] == "x"
                                       else f"{v:.1f} {t['unit']}")
        table.add_row(t["target"], shown, "[green]met" if t["met"] else "[red]not met")
    return table


# --- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="small sizes: 20k/2k messages, 5 s latency and pgbench runs, "
                        "100k-message RSS run")
    parser.add_argument("--paths", default=",".join(ALL),
                        help=f"comma-separated subset of {','.join(ALL)}")
    parser.add_argument("--messages", type=int, help="main topic (raw, batch paths, 90%% dup)"
                        " [200000; quick 20000]")
    parser.add_argument("--slow-messages", type=int,
                        help="topic of the per-message paths (naive, leased) [10000; quick 2000]")
    parser.add_argument("--dup-ratio", type=float, default=0.0,
                        help="share of duplicates in the main and slow topics [0]")
    parser.add_argument("--batch-size", type=int, default=500, help="framework and pgbench batch")
    parser.add_argument("--local-workers", type=int, default=None,
                        help="KAFKA_IDEM_LOCAL_WORKERS of the framework paths [settings default]")
    parser.add_argument("--latency-seconds", type=float,
                        help="paced production per latency run [10; quick 5]")
    parser.add_argument("--latency-fraction", type=float, default=0.5,
                        help="latency runs produce at this fraction of the path's max [0.5]")
    parser.add_argument("--latency-rate", type=float, default=None,
                        help="latency runs produce at this many msgs/s instead (at most the "
                        "path's max): every row's tail at one rate")
    parser.add_argument("--pgbench-seconds", type=float, help="per pgbench run [10; quick 3]")
    parser.add_argument("--pgbench-clients", default="1,4", help="pgbench -c values [1,4]")
    parser.add_argument("--gateway-messages", type=int,
                        help="topic of the gateway rows (1,000 accounts) [8000; quick 3000]; "
                        "concurrency=1 gets a twentieth")
    parser.add_argument("--rss-messages", type=int,
                        help="messages of the RSS run (batch path) [1000000; quick 100000]")
    parser.add_argument("--profile", action="store_true",
                        help="also run the batch path (pyinstrument) and the leased path "
                        "(cProfile of the worker threads) under a profiler -> "
                        "bench/profile-{batch,leased}.txt")
    parser.add_argument("--pairs", type=int, default=3,
                        help="throughput runs of each ORM row and its raw-SQL row (leased_orm"
                        "[_core] and leased, batch_orm[_core] and batch_nobulk, gateway_c64_orm "
                        "and gateway_c64, gateway_async_orm and gateway_async), alternating; "
                        "the rows show the run of median consumer CPU per message [3]")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per measurement")
    parser.add_argument("--seed", type=int, default=None, help="workload seed")
    parser.add_argument("--keep", action="store_true", help="keep topics, schemas and rows")
    parser.add_argument("--results", type=Path, default=RESULTS, help="JSON output file")
    parser.add_argument("--verbose", action="store_true", help="kafka_idem logs at INFO")
    args = parser.parse_args(argv)
    q = args.quick
    args.messages = args.messages or (20_000 if q else 200_000)
    args.slow_messages = args.slow_messages or (2_000 if q else 10_000)
    args.latency_seconds = args.latency_seconds or (5.0 if q else 10.0)
    args.pgbench_seconds = args.pgbench_seconds or (3.0 if q else 10.0)
    args.rss_messages = args.rss_messages or (100_000 if q else 1_000_000)
    args.gateway_messages = args.gateway_messages or (3_000 if q else 8_000)
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if unknown := set(args.paths) - set(ALL):
        parser.error(f"unknown paths {sorted(unknown)}")
    if not 0 <= args.dup_ratio < 1 or min(args.messages, args.slow_messages, args.pairs) < 1:
        parser.error("need messages >= 1, --pairs >= 1 and 0 <= --dup-ratio < 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    s = load_settings()
    run_id = uuid.uuid4().hex[:8]
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    admin = AdminClient(s.admin_config())
    work = Path(tempfile.mkdtemp(prefix=f"bench-{run_id}-"))
    wanted = [p for p in ALL if p in args.paths]
    consumer_paths = [p for p in wanted if p in PATHS]
    plans = {
        "main": Plan(f"{run_id}m", args.messages, args.dup_ratio, seed),
        "slow": Plan(f"{run_id}s", args.slow_messages, args.dup_ratio, seed),
        "dup": Plan(f"{run_id}d", args.messages, 0.9, seed),
        "json": Plan(f"{run_id}j", args.messages, args.dup_ratio, seed),
        "rss": Plan(f"{run_id}r", args.rss_messages, 0.0, seed),
        "gw": Plan(f"{run_id}g", args.gateway_messages, 0.0, seed, tenants=ACCOUNTS),
        # concurrency=1 runs at most 20 msgs/s: a shorter topic, the same accounts
        "gw1": Plan(f"{run_id}h", max(args.gateway_messages // 20, 1), 0.0, seed,
                    tenants=ACCOUNTS),
    }
    needed = {PATHS[p][4] for p in consumer_paths} | ({"rss"} if "rss" in wanted else set())
    if args.profile:
        needed |= {"main", "slow"}
    topics = {k: f"bench.{run_id}.{k}" for k in needed}
    created_topics: list[str] = []
    schemas: list[str] = []
    groups: list[str] = []
    info = machine(s.dsn)
    console.print(f"bench {run_id}: seed {seed}, paths {','.join(wanted)}; load average "
                  f"{info['loadavg_start'][0]:.2f}; work files in {work}")
    rows: list[Measured] = []
    gateway: GatewayProcess | None = None
    pg: list[pgbench.PgbenchResult] = []
    rss: dict[str, Any] | None = None
    floor: keyed.KeyedResult | None = None
    profiles: dict[str, Any] = {}

    def schema_for(path: str, phase: str, rep: int = 0) -> str:
        name = f"bench_{run_id}_{path}_{phase[0]}" + (f"{rep}" if rep else "")
        migrate(s.dsn, name, TABLE)
        schemas.append(name)
        return name

    def spec(path: str, phase: str, topic: str, plan: Plan, rep: int = 0,
             **extra: Any) -> dict[str, Any]:
        _label, kind, mode, bulk, _t = PATHS.get(path, PATHS["batch"])
        group = f"bench-{run_id}-{path}-{phase}" + (f"-{rep}" if rep else "")
        groups.append(group)
        return {"path": path, "phase": phase, "rep": rep, "kind": kind, "mode": mode,
                "bulk": bulk, "orm": path in orm.ORM_PATHS,
                "orm_core": path in orm.CORE_PATHS,
                "topic": topic, "group": group, "plan": plan.to_json(),
                "schema": schema_for(path, phase, rep) if kind != "raw" else None,
                "batch_size": args.batch_size, "local_workers": args.local_workers,
                "timeout": args.timeout, "verbose": args.verbose,
                "gateway_url": gateway.url if gateway is not None else None,
                "events": path in EMITTING, "work": str(work), **extra}

    def run_throughput(path: str, rep: int = 0) -> dict[str, Any]:
        topic_key = PATHS[path][4]
        tspec = spec(path, "throughput", topics[topic_key], plans[topic_key], rep=rep,
                     ends=ends[topic_key], round_trips=path not in MEMBERS,
                     wal=PATHS[path][1] not in ("raw", "relay", "cli"))
        # row versions of its store schema and the payments tables (not the relay's: it
        # fills its outbox before its clock starts)
        versions = (dbwork.RowVersions(s.dsn, [tspec["schema"], "payments"])
                    if tspec["schema"] and path != "relay" else None)
        out = (run_members(s, tspec, work, MEMBERS[path]) if path in MEMBERS
               else run_worker(tspec, work))
        out["row_versions"] = versions.settled() if versions is not None else None
        # the cli row's clock covers the messages committed inside it (bench/cli.py)
        out["messages"] = out.get("window_messages", plans[topic_key].n)
        if path in ("batch", "cli") and out.get("ok"):  # the clock both rows have alike
            out["db_clock_rate"] = cli.db_clock_rate(s.dsn, tspec["schema"])
        return out

    paired: dict[str, list[dict[str, Any]]] = {}  # an ORM pair's throughput runs, in order
    ends: dict[str, dict[int, int]] = {}
    try:
        create_payments_tables(s.dsn)
        if any(p in GATEWAY_PATHS for p in wanted):
            gateway = GatewayProcess()
            console.print(f"gateway (50 ms per charge) on {gateway.url}, pid {gateway.proc.pid}")
        for key in sorted(needed):
            partitions = 1 if key in ONE_PARTITION else PARTITIONS
            create_topic(admin, topics[key], partitions)
            created_topics.append(topics[key])
            t0 = time.perf_counter()
            _intents, messages = plans[key].build()
            produce_backlog(s, topics[key], messages, FORMATS.get(key))
            del messages, _intents
            ends[key] = end_offsets(s, topics[key], partitions)
            console.print(f"produced {sum(ends[key].values()):,} messages to {topics[key]} in "
                          f"{time.perf_counter() - t0:.1f}s")
            if sum(ends[key].values()) != plans[key].n:
                raise SystemExit(f"bench: {topics[key]} holds {sum(ends[key].values())} "
                                 f"messages, expected {plans[key].n}")

        for path in wanted:
            if path == "pgbench":
                console.print("measuring pgbench (the framework's SQL) ...")
                pg = pgbench.run(
                    s.dsn, run_id, clients=[int(c) for c in args.pgbench_clients.split(",")],
                    seconds=args.pgbench_seconds, batch=args.batch_size, keep=args.keep,
                    log=console.print,
                )
                continue
            if path == "keyed_sql":  # the main topic's work, all new keys, no Kafka
                console.print("measuring the minimal keyed SQL (plain psycopg) ...")
                floor = keyed.run(s.dsn, run_id, Plan(f"{run_id}k", args.messages, 0.0, seed),
                                  batch=args.batch_size, keep=args.keep, log=console.print)
                continue
            if path == "rss":
                console.print(f"measuring the batch path's RSS over {args.rss_messages:,} "
                              "messages ...")
                out = run_worker(spec("rss", "rss", topics["rss"], plans["rss"],
                                      ends=ends["rss"],
                                      rss_every=max(args.rss_messages // 10, 1)), work)
                rss = summarize_rss(out, args.rss_messages)
                console.print(f"  {out.get('check')}")
                continue
            label, _kind, _mode, _bulk, topic_key = PATHS[path]
            plan = plans[topic_key]
            m = Measured(path, label)
            if (pair := orm.pair_of(path, wanted)) is not None and path not in paired:
                # a raw-SQL row and its ORM rows: args.pairs throughput runs of each,
                # alternating, the order rotating (a pair: which goes first alternates)
                console.print(f"measuring {' and '.join(PATHS[p][0] for p in pair)}: "
                              f"{args.pairs} rounds of throughput runs ...")
                for i in range(args.pairs):
                    for p in pair[i % len(pair):] + pair[:i % len(pair)]:
                        out = run_throughput(p, i + 1)
                        paired.setdefault(p, []).append(out)
                        console.print(f"  pair {i + 1}, {p}: {orm.summary(out)}")
            console.print(f"measuring {label} ...")
            gw_cpu = gateway.cpu_seconds() if gateway is not None else 0.0
            m.throughput = (orm.median_run(paired[path]) if path in paired
                            else run_throughput(path))
            if path in GATEWAY_PATHS and gateway is not None:
                # the remote system's CPU (in "other"), over the whole worker run
                m.throughput["gateway_cpu_ms_per_msg"] = round(
                    (gateway.cpu_seconds() - gw_cpu) / plan.n * 1000, 3)
                m.throughput["check"] = (f"{m.throughput.get('check', '')}; gateway "
                                         f"{m.throughput['gateway_cpu_ms_per_msg']} ms CPU/msg")
            console.print(f"  {m.rate:,.0f} msgs/s; {m.throughput.get('check')}")
            if m.rate and path not in ("relay", "cli") and path not in MEMBERS:
                rate = max(m.rate * args.latency_fraction, 1.0)
                if args.latency_rate:  # one rate for every row, so their tails compare
                    rate = min(args.latency_rate, m.rate)
                if path == "batch_emit":  # the outbox target is at 1,000 events/s
                    rate = min(EMIT_LATENCY_RATE, m.rate)
                n = max(int(rate * args.latency_seconds), 1)
                lat_topic = f"bench.{run_id}.{path}.latency"
                create_topic(admin, lat_topic, 1 if topic_key in ONE_PARTITION else PARTITIONS)
                created_topics.append(lat_topic)
                lat_plan = Plan(f"{run_id}l{ALL.index(path)}", n,
                                0.9 if path == "dup90" else args.dup_ratio, seed,
                                tenants=plan.tenants)
                m.latency = run_worker(spec(path, "latency", lat_topic, lat_plan, rate=rate),
                                       work)
                lat = m.latency.get("latency_ms") or {}
                console.print(f"  latency at {rate:,.0f} msgs/s: p50 "
                              f"{_f(lat.get('p50'), '{:.1f}')} ms, p99 "
                              f"{_f(lat.get('p99'), '{:.1f}')} ms; {m.latency.get('check')}")
                if "event_latency_ms" in m.latency:
                    ev = m.latency["event_latency_ms"]
                    console.print(f"  commit to readable: p50 {_f(ev.get('p50'), '{:.1f}')} "
                                  f"ms, p99 {_f(ev.get('p99'), '{:.1f}')} ms over "
                                  f"{ev.get('n', 0):,} events")
            rows.append(m)
        if args.profile:
            for path, key in (("batch", "main"), ("leased", "slow"),
                              ("gateway_c64", "gw"), ("gateway_async", "gw")):
                if key not in topics or (key == "gw" and path not in wanted):
                    continue
                target = HERE / f"profile-{path}.txt"
                console.print(f"profiling {PATHS[path][0]} -> {target}")
                out = run_worker(spec(path, "profile", topics[key], plans[key],
                                      ends=ends[key], profile=str(target)), work)
                secs = out.get("seconds") or 0
                console.print(f"  under the profiler: {plans[key].n / secs if secs else 0:,.0f}"
                              f" msgs/s; {out.get('check')}")
                profiles[path] = out
    finally:
        if gateway is not None:
            gateway.stop()
        problems = [] if args.keep else cleanup(s, admin, created_topics, schemas, groups, run_id)
        for p in problems:
            console.print(f"[yellow]clean-up: {p}")
        if args.keep:
            console.print(f"kept topics {created_topics}, schemas {schemas}, tenants "
                          f"bench-{run_id}*")

    by = {m.path: m for m in rows}
    limits = compute_limits(by, pg)
    limits["keyed_sql"] = floor.rate if floor is not None and floor.rate else None
    ts = targets(by, limits, rss, floor)
    db_work = dbwork.collect(rows, pg, floor)
    out_console = Console(width=max(Console().width, 200))
    out_console.print(render(rows, pg, limits, rss, floor))
    out_console.print(render_cpu(rows))
    if (rt := render_round_trips(rows)) is not None:
        out_console.print(rt)
    if (ph := render_phases(rows)) is not None:
        out_console.print(ph)
    if (st := render_pg_statements(pg)) is not None:
        out_console.print(st)
    if (dw := dbwork.render(db_work)) is not None:
        out_console.print(dw)
    if (ob := render_outbox(by)) is not None:
        out_console.print(ob)
    if (ot := orm.render(orm.comparisons(rows))) is not None:
        out_console.print(ot)
    if ts:
        out_console.print(render_targets(ts))
    if rss and rss.get("samples"):
        out_console.print("RSS of the RSS run (messages: MB): " + ", ".join(
            f"{x['messages']:,}: {x['rss_mb']:.1f}" for x in rss["samples"]))
    joins = ", ".join(f"{m.path} {m.throughput.get('join_seconds', 0):.2f}s" for m in rows
                      if m.throughput.get("join_seconds"))
    out_console.print(f"group join + first fetch (not in any clock): {joins}")
    info["loadavg_end"] = os.getloadavg()
    write_results(args, run_id, seed, info, plans, rows, pg, limits, rss, ts, profiles,
                  floor, db_work)
    console.print(f"results written to {args.results}")
    oks = ([m.throughput.get("ok") for m in rows] + ([rss.get("ok")] if rss else [])
           + ([floor.ok] if floor is not None else []))
    return 0 if all(oks) and not any(r.error for r in pg) else 1


def summarize_rss(out: dict[str, Any], n: int) -> dict[str, Any]:
    samples = out.get("rss_samples") or []
    secs = out.get("seconds") or 0.0
    cpu = out.get("cpu") or {}
    res: dict[str, Any] = {
        "messages": n, "ok": out.get("ok", False), "check": out.get("check", ""),
        "samples": samples, "peak_mb": out.get("peak_rss_mb"), "end_mb": out.get("rss_mb"),
        "msgs_per_s": n / secs if secs and out.get("ok") else None,
    }
    for part in ("consumer", "postgres", "broker"):
        v = cpu.get(part)
        res[f"cpu_{part}_per_1k"] = v / n * 1000 if v is not None else None
    if samples:
        # Flat: no sample after the warm-up (the first tenth) is more than RSS_FLAT_MB above
        # it. The last sample may be lower: librdkafka frees its prefetch once the topic
        # is fully fetched.
        warm = samples[0]
        peak_after = max(x["rss_mb"] for x in samples)
        res["warmup_messages"] = warm["messages"]
        res["after_warmup_mb"] = warm["rss_mb"]
        res["max_after_warmup_mb"] = peak_after
        res["end_mb"] = samples[-1]["rss_mb"]
        res["growth_mb"] = peak_after - warm["rss_mb"]
        res["growth_pct"] = res["growth_mb"] / warm["rss_mb"] * 100
    return res


def compute_limits(by: dict[str, Measured], pg: list[pgbench.PgbenchResult]) -> dict[str, Any]:
    def best(script: str) -> float | None:
        rates = [r.msgs_per_s for r in pg if r.script == script and not r.error]
        return max(rates) if rates else None

    def at(script: str, clients: int) -> float | None:
        return next((r.msgs_per_s for r in pg if r.script == script and r.clients == clients
                     and not r.error), None)

    raw = by.get("raw")
    naive = by.get("naive")
    return {
        "raw": raw.rate if raw and raw.rate else None,
        "naive": naive.rate if naive and naive.rate else None,
        "sql_batched": best("batched"),
        "sql_batched_c1": at("batched", 1),
        "sql_batched_c4": at("batched", 4),
        "sql_per_message": best("per_message"),
        "sql_per_message_c1": at("per_message", 1),
    }


def write_results(
    args: argparse.Namespace, run_id: str, seed: int, info: dict[str, Any],
    plans: dict[str, Plan], rows: list[Measured], pg: list[pgbench.PgbenchResult],
    limits: dict[str, Any], rss: dict[str, Any] | None, ts: list[dict[str, Any]],
    profiles: dict[str, Any], floor: keyed.KeyedResult | None = None,
    db_work: list[dict[str, Any]] | None = None,
) -> None:
    args.results.write_text(json.dumps({
        "run_id": run_id,
        "seed": seed,
        "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python -m bench", *(sys.argv[1:])]),
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "partitions": PARTITIONS,
        "plans": {k: p.to_json() for k, p in plans.items()},
        "machine": info,
        "git": git_state(),
        "versions": {
            "python": platform.python_version(),
            "confluent_kafka": _version(confluent_kafka.version()),
            "librdkafka": _version(confluent_kafka.libversion()),
            "psycopg": psycopg.__version__,
        },
        "limits": limits,
        "pgbench": [{**vars(r), "msgs_per_s": r.msgs_per_s} for r in pg],
        "paths": [
            {
                "path": m.path, "label": m.label, "messages": m.messages, "msgs_per_s": m.rate,
                "ratio_to_raw": _ratio(m.rate, limits.get("raw")),
                "ratio_to_sql_limit": None if m.path == "raw" else _ratio(m.rate, (
                    ideal(m.path) if m.path in GATEWAY_PATHS else limits.get(
                        "sql_batched" if m.path in BATCH_FAMILY else "sql_per_message"))),
                "ratio_to_naive": _ratio(m.rate, limits.get("naive")),
                "cpu_s_per_1k": {k: m.cpu_per_1k(k) for k in ("consumer", "postgres", "broker",
                                                               "other")},
                "round_trips_per_msg": (m.throughput["round_trips"]["round_trips"] / m.messages
                                        if m.throughput.get("round_trips") else None),
                "throughput": m.throughput,
                "latency": m.latency,
            }
            for m in rows
        ],
        "rss": rss,
        "keyed_sql": floor.to_json() if floor is not None else None,
        "db_work": db_work or [],
        "orm": orm.comparisons(rows),
        "profiles": profiles,
        "targets": ts,
    }, indent=2, default=str) + "\n")


def _version(v: Any) -> str:
    return str(v[0]) if isinstance(v, tuple) else str(v)


def git_state() -> dict[str, Any]:
    """The commit measured, and which framework files differed from it."""
    root = HERE.parent

    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", *argv], cwd=root, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"head": git("rev-parse", "HEAD"),
            "modified": git("status", "--short", "--", "kafka_idem", "consumers",
                            "bench").splitlines()}


def cleanup(
    s: Settings, admin: AdminClient, topics: list[str], schemas: list[str], groups: list[str],
    run_id: str,
) -> list[str]:
    problems = []
    try:
        with psycopg.connect(s.dsn, autocommit=True) as conn:
            for schema in schemas:
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                    sql.Identifier(schema)))
            like = f"bench-{run_id}%"
            conn.execute("DELETE FROM payments.ledger WHERE tenant_id LIKE %s", (like,))
            conn.execute("DELETE FROM payments.balances WHERE tenant_id LIKE %s", (like,))
            conn.execute("DELETE FROM payments.gateway_charges WHERE idempotency_key LIKE %s",
                         (like,))
    except psycopg.Error as exc:
        problems.append(f"database clean-up: {exc}")
    dlq = [f"{t}.dlq" for t in topics]
    # the outbox's event and control topics, and the relays' groups (named after those)
    try:
        extra = [t for t in admin.list_topics(timeout=15).topics if run_id in t
                 and t not in topics and t not in dlq]
        relays = [g.group_id for g in admin.list_consumer_groups(request_timeout=15).result(
            ).valid if run_id in g.group_id and "kafka-idem-outbox" in g.group_id]
    except KafkaException as exc:
        problems.append(f"listing the outbox's topics and groups: {exc}")
        extra, relays = [], []
    for name, futures in (
        ("topic", admin.delete_topics(topics + dlq + extra) if topics else {}),
        ("group", admin.delete_consumer_groups(groups + relays) if groups else {}),
    ):
        for what, fut in futures.items():
            try:
                fut.result(30)
            except KafkaException as exc:
                code = exc.args[0].code() if exc.args else None
                if code not in (confluent_kafka.KafkaError.UNKNOWN_TOPIC_OR_PART,
                                confluent_kafka.KafkaError.GROUP_ID_NOT_FOUND):
                    problems.append(f"{name} {what}: {exc}")
    return problems


if __name__ == "__main__":
    sys.exit(main())
