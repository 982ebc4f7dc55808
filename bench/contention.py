"""Throughput under contention: ``python -m bench.contention`` (issue 31).

Four ``kafka-idem run`` members (``python -m kafka_idem.cli run consumers.payments:app``:
the payments example as shipped, local mode, the batch path with the bulk handler
``charge_many``, **events on**: every charge emits a ``ChargeCompleted`` through the
outbox, published by the members' own relays) drain a backlog of ``--messages`` charge
requests on one topic of ``--partitions`` (8) partitions, produced before they start, in
two configurations that do the same work:

* **hot**: the tenant of every charge is one of ``--tenants`` (20) tenants shared by all
  partitions, in one currency: every member updates the same 20 balance rows;
* **cold**: the same charges (same partitions, order ids, amounts and tenant *index*), but
  each partition has its own 20 tenants (``cold-p3-t07``...): no two members share a
  balance row.

The configurations alternate, ``--pairs`` times: hot cold, cold hot, hot cold... (a drift
over the run does not count against whichever always runs second). Every run gets a fresh
topic (and its DLQ, event topic and outbox control topic, made by
:func:`kafka_idem.admin.topics.create` as ``kafka-idem topics create`` makes them, under a name
prefix of the run's own: ``KAFKA_IDEM_NAME_PREFIX``), a fresh consumer group and a fresh
database (store and ``payments.*`` tables migrated), dropped at the end of the run.

Per run:

* **msgs/s**: from the moment the group first holds all four members with partitions
  (``describe_consumer_groups``, polled every 0.2 s) until its committed offsets reach the
  topic's end offsets, the messages committed in between; and, for reference, all messages
  over the whole window from the members' launch (Python start-up and group joins in it);
* **deadlocks** per 10,000 messages: the change of ``pg_stat_database.deadlocks`` for the
  run's database, from before the launch to after the members exited (read again until two
  reads agree: PostgreSQL flushes these counters up to a second late);
* **lock timeouts** (SQLSTATE 55P03, ``lock_timeout_seconds``) per 10,000 messages: from
  the PostgreSQL server log when it is readable (``--pg-log``; every statement that gave
  up, on either path), else ``-``; and the members' INFO lines ``transient store error
  (... SQLSTATE 55P03 ...)`` (the per-message path's only: a batch that falls back on a
  lock timeout or a deadlock says so at DEBUG);
* **lock waits** per 10,000 messages: statements of the run's database seen waiting for a
  lock (``pg_stat_activity.wait_event_type = 'Lock'``, sampled every ``--sample-ms``, 20 ms;
  one wait = one (backend, statement start) seen at least once, so waits shorter than a
  sample are mostly missed), and their total in backend-seconds (samples x interval), by
  statement;
* **rollbacks** per 10,000 messages: the change of ``pg_stat_database.xact_rollback``
  (every batch that fell back, every per-message retry, and whatever else rolls back);
* whether a member was **dropped** from its group (``action=lost`` or
  ``_MAX_POLL_EXCEEDED`` in its log), the rebalances it logged, and every member's **exit
  status** after SIGTERM (expected 0);
* the CPU of everything on the machine but the members, PostgreSQL and the broker, in
  cores ("others": other users' tests make noise).

Per configuration: min / median / max msgs/s and medians of the rest; the ratio hot /
cold of the medians and per pair, against the issue's target (>= 0.5).

Checked after every run (exit status 1 otherwise, or when a member did not exit 0): one
``payments.ledger`` row per charge (no key twice, none missing), every balance equal to
the sum of its tenant's charges, one ``succeeded`` record per key in the store, the outbox
empty (the members' relays published everything before they were stopped), and the event
topic (read ``read_committed``) holding exactly one event per charge, no outbox row twice.
Nothing asserts on timing.

    python -m bench.contention                 # 2 pairs of 350,000 messages (~3.5 minutes)
    python -m bench.contention --quick         # 1 pair of 12,000 (proves the bench works)
    python -m bench.contention --pairs 3 --messages 60000 --results /tmp/ct.json
    python -m bench.contention --member-env KAFKA_IDEM_BATCH_PATH=false   # per-message path
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from psycopg import sql
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bench import procstat
from bench.workload import end_offsets
from consumers import payments
from kafka_idem.admin import topics as topic_rules
from kafka_idem.admin.migrate import migrate
from kafka_idem.outbox import control_topic
from kafka_idem.settings import Settings, load_settings
from tools.kafka_state import read_topic

ROOT = Path(__file__).resolve().parent.parent
APP = "consumers.payments:app"
SCHEMA, TABLE = "kafka_idem", "task_idempotency"
HOT, COLD = "hot", "cold"
CURRENCY = "EUR"
PG_LOG = ROOT / ".local" / "postgres" / "log" / "postgres.log"
TARGET = 0.5  # issue 31: hot >= 0.5 x cold
console = Console(stderr=True)


# --- the workload -------------------------------------------------------------------------


@dataclass(frozen=True)
class Charge:
    partition: int
    tenant: str
    order: str
    amount: Decimal

    @property
    def key(self) -> str:
        return f"{self.tenant}:charge:{self.order}"


def charges(config: str, n: int, partitions: int, tenants: int, seed: int) -> list[Charge]:
    """``n`` charges, message ``i`` on partition ``i % partitions``. Both configurations
    draw the same tenant index, amount and order id for every message; hot names the
    tenant the same on every partition, cold gives each partition tenants of its own."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = i % partitions
        j = rng.randrange(tenants)
        amount = Decimal(rng.randint(100, 100_000)) / 100
        tenant = f"hot-t{j:02d}" if config == HOT else f"cold-p{p}-t{j:02d}"
        out.append(Charge(p, tenant, f"o{i:07d}", amount))
    return out


def produce(s: Settings, topic: str, items: list[Charge], values: list[bytes]) -> None:
    """Every charge to its partition, as fast as the broker takes them."""
    producer = Producer({**s.producer_config(), "linger.ms": 20})
    failures: list[str] = []

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is not None:
            failures.append(str(err))

    for i, (c, value) in enumerate(zip(items, values, strict=True)):
        while True:
            try:
                producer.produce(topic, key=c.order.encode(), value=value,
                                 partition=c.partition, on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.1)
        if i % 1000 == 0:
            producer.poll(0)
    left = producer.flush(120)
    if left or failures:
        raise SystemExit(f"bench: produce failed ({left} unacknowledged, errors: {failures[:3]})")


# --- what the run's database says ---------------------------------------------------------


def db_stats(admin_dsn: str, dbname: str) -> dict[str, int]:
    """``pg_stat_database``'s deadlocks, commits and rollbacks of ``dbname`` now."""
    with psycopg.connect(admin_dsn, autocommit=True, application_name="bench-contention") as c:
        row = c.execute("SELECT deadlocks, xact_commit, xact_rollback FROM pg_stat_database "
                        "WHERE datname = %s", (dbname,)).fetchone()
    if row is None:
        return {"deadlocks": 0, "xact_commit": 0, "xact_rollback": 0}
    return {"deadlocks": int(row[0] or 0), "xact_commit": int(row[1] or 0),
            "xact_rollback": int(row[2] or 0)}


def settled_stats(admin_dsn: str, dbname: str) -> dict[str, int]:
    """The counters once they stop moving: backends flush them at most once a second (and
    when they exit), so wait a little and read until two reads agree (at most ~5 s)."""
    time.sleep(1.2)
    last = db_stats(admin_dsn, dbname)
    for _ in range(8):
        time.sleep(0.5)
        now = db_stats(admin_dsn, dbname)
        if now == last:
            break
        last = now
    return last


def statement_kind(query: str | None) -> str:
    """What a statement is, for the lock-wait and server-log summaries."""
    q = " ".join((query or "").split())
    for needle, kind in (("payments.balances", "balances upsert"),
                         ("payments.ledger", "ledger insert"),
                         ("outbox_slots", "outbox slot lock"),
                         ("outbox", "outbox")):
        if needle in q:
            return kind
    if TABLE in q:
        return f"store {q.split(' ', 1)[0].upper()}"
    if q.upper().startswith(("SAVEPOINT", "RELEASE")):
        return q.split(" ", 1)[0].upper()  # not the savepoint's name
    return q[:60] or "?"


class LockWaits:
    """Samples the run database's backends waiting for a lock (``pg_stat_activity``)."""

    QUERY = ("SELECT pid, query_start, query, wait_event FROM pg_stat_activity "
             "WHERE datname = %s AND wait_event_type = 'Lock'")

    def __init__(self, admin_dsn: str, dbname: str, interval: float) -> None:
        self.admin_dsn, self.dbname, self.interval = admin_dsn, dbname, interval
        self.waits: dict[tuple[int, Any], tuple[str, str]] = {}  # (pid, start) -> kind, event
        self.seconds: dict[str, float] = {}  # backend-seconds waiting, per statement kind
        self.samples = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-lock-waits", daemon=True)

    def start(self) -> LockWaits:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            with psycopg.connect(self.admin_dsn, autocommit=True,
                                 application_name="bench-contention") as conn:
                last = time.perf_counter()
                while not self._stop.wait(self.interval):
                    rows = conn.execute(self.QUERY, (self.dbname,)).fetchall()
                    now = time.perf_counter()
                    dt, last = now - last, now
                    self.samples += 1
                    for pid, started, query, event in rows:
                        kind = f"{statement_kind(query)} [{event}]"
                        self.waits.setdefault((int(pid), started), (kind, str(event)))
                        self.seconds[kind] = self.seconds.get(kind, 0.0) + dt
        except psycopg.Error as exc:
            self.error = str(exc).splitlines()[0]

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(10)
        kinds = Counter(kind for kind, _ in self.waits.values())
        events = Counter(event for _, event in self.waits.values())
        return {"waits": len(self.waits), "seconds": sum(self.seconds.values()),
                "by_statement": {k: {"waits": kinds[k],
                                     "seconds": round(self.seconds.get(k, 0.0), 3)}
                                 for k in sorted(set(kinds) | set(self.seconds))},
                "by_event": dict(events), "samples": self.samples, "error": self.error}


_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \S+ \[(\d+)\] "
                       r"(?:\S*@(\S*) )?([A-Z]+):  ?(.*)$")


def server_log_size(path: Path | None) -> int | None:
    try:
        return path.stat().st_size if path is not None else None
    except OSError:
        return None


def server_log_errors(path: Path | None, offset: int | None, dbname: str) -> dict[str, Any] | None:
    """The run database's errors in the server log written since ``offset``: deadlocks and
    lock timeouts, with the statement that got the error, where it was (CONTEXT) and, for a
    deadlock, the statements of every process in the cycle. None when unreadable."""
    if path is None or offset is None:
        return None
    try:
        with path.open("rb") as f:
            if f.seek(0, os.SEEK_END) < offset:
                offset = 0  # rotated or truncated
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    entries: list[list[str]] = []  # [pid, db, level, text]
    for line in text.splitlines():
        m = _LOG_LINE.match(line)
        if m:
            entries.append([m.group(1), m.group(2) or "", m.group(3), m.group(4)])
        elif entries:
            entries[-1][3] += "\n" + line.strip()
    errors: list[dict[str, str]] = []
    current: dict[str, dict[str, str]] = {}  # pid -> the error being read
    for pid, db, level, body in entries:
        if db != dbname:
            continue
        if level in ("ERROR", "FATAL"):
            current[pid] = {"error": body.split("\n", 1)[0]}
            errors.append(current[pid])
        elif level in ("DETAIL", "CONTEXT", "STATEMENT") and pid in current:
            current[pid][level.lower()] = body
    deadlocks: Counter[str] = Counter()
    timeouts: Counter[str] = Counter()
    others: Counter[str] = Counter()
    for e in errors:
        where = e.get("context", "").split("\n", 1)[0]
        if e["error"] == "deadlock detected":
            cycle = sorted(statement_kind(q) for q in re.findall(
                r"Process \d+: (.*)", e.get("detail", "")))
            deadlocks[f"{statement_kind(e.get('statement'))} ({where}); cycle: "
                      f"{' / '.join(cycle) or '?'}"] += 1
        elif "lock timeout" in e["error"]:
            timeouts[f"{statement_kind(e.get('statement'))} ({where})"] += 1
        else:
            others[e["error"][:100]] += 1
    return {"deadlocks": sum(deadlocks.values()), "lock_timeouts": sum(timeouts.values()),
            "deadlock_statements": dict(deadlocks), "lock_timeout_statements": dict(timeouts),
            "other_errors": dict(others)}


# --- the members --------------------------------------------------------------------------

_TRANSIENT = re.compile(r"(transient store error|commit failed) \((\w+): SQLSTATE (\w+)")
LOG_SIGNS = {"lost": "action=lost", "poll_exceeded": "_MAX_POLL_EXCEEDED",
             "revoked": "action=revoked", "assigned": "action=assigned",
             "batch_path_failed": "batch path failed", "tracebacks": "Traceback (most recent"}


@dataclass
class Member:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    exit_code: int | None = None
    stop_seconds: float | None = None

    def cpu(self) -> float | None:
        """CPU seconds of the process so far (/proc)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return None
        rest = fields[fields.rfind(")") + 2:].split()
        return (int(rest[11]) + int(rest[12])) / float(procstat.TICK)


def member_env(s: Settings, topic: str, dsn: str, prefix: str,
               extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYMENTS_")}
    env.update({
        "PAYMENTS_TOPIC": topic,
        "PAYMENTS_FORMAT": payments.FORMAT,  # the producer's (this process's) format
        "KAFKA_IDEM_BOOTSTRAP_SERVERS": s.bootstrap_servers,
        "KAFKA_IDEM_DATABASE_URL": dsn,
        "KAFKA_IDEM_NAME_PREFIX": prefix,
        "KAFKA_IDEM_KAFKA": json.dumps(s.kafka),
        "KAFKA_IDEM_LOG_FORMAT": "text",
        "KAFKA_IDEM_LOG_LEVEL": "INFO",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                      if p),
    })
    env.update(extra)
    return env


def start_members(k: int, group: str, env: dict[str, str], work: Path,
                  name: str) -> list[Member]:
    cmd = [sys.executable, "-m", "kafka_idem.cli", "run", APP, "--group-id", group]
    out = []
    for m in range(1, k + 1):
        log = work / f"{name}-m{m}.log"
        with log.open("wb") as f:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # our Ctrl-C is not theirs
        out.append(Member(f"m{m}", proc, log))
    return out


def stop_members(members: list[Member], timeout: float = 60.0) -> None:
    """SIGTERM every member still running, then collect each one's exit status."""
    started = time.perf_counter()
    for m in members:
        if m.proc.poll() is None:
            m.proc.send_signal(signal.SIGTERM)
    for m in members:
        try:
            m.exit_code = m.proc.wait(timeout=max(timeout - (time.perf_counter() - started), 1))
        except subprocess.TimeoutExpired:
            m.proc.kill()
            m.proc.wait()
            m.exit_code = None  # did not stop: killed
        m.stop_seconds = time.perf_counter() - started


def scan_logs(members: list[Member]) -> dict[str, Any]:
    signs: Counter[str] = Counter()
    transient: Counter[str] = Counter()
    dropped: list[str] = []
    for m in members:
        try:
            text = m.log.read_text(errors="replace")
        except OSError:
            continue
        for name, sign in LOG_SIGNS.items():
            signs[name] += text.count(sign)
        if "action=lost" in text or "_MAX_POLL_EXCEEDED" in text:
            dropped.append(m.name)
        for what, _cls, state in _TRANSIENT.findall(text):
            transient[f"{what} {state}"] += 1
    return {"signs": dict(signs), "transient": dict(transient), "dropped": dropped}


class Group:
    """The group's committed offsets and membership, asked without joining it."""

    def __init__(self, s: Settings, admin: AdminClient, group: str, topic: str,
                 partitions: int) -> None:
        self.admin, self.group = admin, group
        self.consumer = Consumer({**s.consumer_config(group), "log_level": 2})
        self.tps = [TopicPartition(topic, p) for p in range(partitions)]

    def committed(self) -> dict[int, int] | None:
        try:
            got = self.consumer.committed(self.tps, timeout=5)
        except KafkaException:
            return None
        return {int(tp.partition): max(int(tp.offset), 0) for tp in got}

    def members_with_partitions(self) -> int:
        try:
            desc = self.admin.describe_consumer_groups(
                [self.group], request_timeout=5)[self.group].result(timeout=10)
        except KafkaException:
            return 0
        return sum(1 for m in desc.members if m.assignment.topic_partitions)

    def close(self) -> None:
        self.consumer.close()


# --- one run ------------------------------------------------------------------------------


@dataclass
class Run:
    run: int
    pair: int
    config: str
    out: dict[str, Any] = field(default_factory=dict)


def create_database(s: Settings, dbname: str) -> str:
    with psycopg.connect(s.dsn, autocommit=True, application_name="bench-contention") as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    dsn = psycopg.conninfo.make_conninfo(s.dsn, dbname=dbname)
    migrate(dsn, SCHEMA, TABLE)
    with psycopg.connect(dsn) as conn:
        payments.create_tables(conn)
    return dsn


def drop_database(s: Settings, dbname: str) -> str | None:
    try:
        with psycopg.connect(s.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(dbname)))
    except psycopg.Error as exc:
        return f"database {dbname}: {exc}"
    return None


def outbox_left(dsn: str) -> int:
    with psycopg.connect(dsn, application_name="bench-contention") as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(
            sql.Identifier(SCHEMA, "outbox"))).fetchone()
    return int(row[0]) if row else 0


def check(s: Settings, dsn: str, events: str, items: list[Charge]) -> tuple[bool, str]:
    """One ledger row per charge, balances = sums, one succeeded record per key, an empty
    outbox, one event per charge on the event topic."""
    n = len(items)
    want_keys = {c.key for c in items}
    sums: dict[tuple[str, str], Decimal] = {}
    for c in items:
        sums[(c.tenant, CURRENCY)] = sums.get((c.tenant, CURRENCY), Decimal(0)) + c.amount
    problems = []
    with psycopg.connect(dsn, application_name="bench-contention") as conn:
        ledger = Counter(k for (k,) in conn.execute(
            "SELECT idempotency_key FROM payments.ledger").fetchall())
        balances = {(t, cur): Decimal(b) for t, cur, b in conn.execute(
            "SELECT tenant_id, currency, balance FROM payments.balances").fetchall()}
        statuses: dict[str, int] = dict(conn.execute(sql.SQL(
            "SELECT status, count(*) FROM {} GROUP BY 1").format(
                sql.Identifier(SCHEMA, TABLE))).fetchall())
    twice = sum(1 for v in ledger.values() if v > 1)
    missing = len(want_keys - set(ledger))
    if sum(ledger.values()) != n or twice or missing or set(ledger) != want_keys:
        problems.append(f"{sum(ledger.values()):,} ledger rows for {n:,} charges ({missing:,} "
                        f"missing, {twice:,} keys twice)")
    wrong = sum(1 for k in set(sums) | set(balances) if balances.get(k) != sums.get(k))
    if wrong:
        problems.append(f"{wrong} of {len(sums)} balances differ from the sum of their charges")
    if statuses != {"succeeded": n}:
        problems.append(f"store records {statuses}, expected {n:,} succeeded")
    left = outbox_left(dsn)
    if left:
        problems.append(f"{left:,} outbox rows unpublished")
    records, _ = read_topic(s.bootstrap_servers, events, kafka=s.kafka, timeout=180)
    heads = [r.header_map() for r in records]
    by_key = Counter(h.get("idem.key") for h in heads)
    rows = Counter(h.get("idem.outbox.id") for h in heads)
    rows_twice = sum(1 for v in rows.values() if v > 1)
    if len(records) != n or set(by_key) != want_keys or rows_twice:
        problems.append(f"{len(records):,} events for {n:,} charges "
                        f"({len(want_keys - set(by_key)):,} missing, {rows_twice} outbox rows "
                        "twice)")
    if problems:
        return False, "; ".join(problems)
    return True, (f"ok: {n:,} ledger rows, {len(sums)} balances = sums, {n:,} succeeded, "
                  f"outbox empty, {len(records):,} events, none twice")


def one_run(s: Settings, admin: AdminClient, args: argparse.Namespace, run_id: str, r: Run,
            items: list[Charge], values: list[bytes], work: Path,
            created: dict[str, list[str]]) -> None:
    out = r.out
    n = len(items)
    tag = f"{run_id}_{r.run}"
    dbname = f"bench_ct_{tag}"
    topic = f"bench.{run_id}.ct{r.run}"
    prefix = f"bench.{run_id}.ct{r.run}."
    group = f"bench-{run_id}-ct{r.run}"
    name = f"run{r.run}-{r.config}"
    created["groups"].append(group)
    out.update(database=dbname, topic=topic, group=group, loadavg_before=os.getloadavg()[0])
    members: list[Member] = []
    try:
        dsn = create_database(s, dbname)
        created["databases"].append(dbname)
        app = payments.build_app(topic=topic, events=True, name_prefix=prefix,
                                 bootstrap_servers=s.bootstrap_servers, kafka=s.kafka)
        done = topic_rules.create(app, admin, partitions=args.partitions)
        created["topics"].extend(d.name for d in done if d.created)
        created["groups"].append(control_topic(app.settings, app.namespace))  # the relays'
        events = payments.events_topic(topic)
        t0 = time.perf_counter()
        produce(s, topic, items, values)
        ends = end_offsets(s, topic, args.partitions)
        if sum(ends.values()) != n:
            raise SystemExit(f"bench: {topic} holds {sum(ends.values())} messages, not {n}")
        console.print(f"run {r.run} ({r.config}): produced {n:,} to {topic} "
                      f"({args.partitions} partitions) in {time.perf_counter() - t0:.1f}s; "
                      f"{args.members} members draining ...")

        before = db_stats(s.dsn, dbname)
        log_offset = server_log_size(args.pg_log)
        env = member_env(s, topic, dsn, prefix, args.member_env)
        grp = Group(s, admin, group, topic, args.partitions)
        waits = LockWaits(s.dsn, dbname, args.sample_ms / 1000).start()
        watch = procstat.Watch(procstat.Pids(dbname)).start()
        launched = time.perf_counter()
        members = start_members(args.members, group, env, work, name)
        stable_at: float | None = None
        committed_at_stable = 0
        end_at: float | None = None
        last_group_check = 0.0
        failure = None
        try:
            while end_at is None:
                now = time.perf_counter()
                if now - launched > args.timeout:
                    failure = f"timed out after {args.timeout:.0f}s"
                    break
                exited = [m.name for m in members if m.proc.poll() is not None]
                if exited:
                    failure = f"member(s) {', '.join(exited)} exited during the run"
                    break
                got = grp.committed()
                if got is None:
                    time.sleep(0.2)
                    continue
                total = sum(min(got.get(p, 0), e) for p, e in ends.items())
                if stable_at is None and now - last_group_check >= 0.2:
                    last_group_check = now
                    if grp.members_with_partitions() >= args.members:
                        stable_at, committed_at_stable = time.perf_counter(), total
                if all(got.get(p, 0) >= e for p, e in ends.items()):
                    end_at = time.perf_counter()
                    break
                time.sleep(0.2)
        finally:
            cpu = watch.stop()
            member_cpu = [m.cpu() for m in members]
            lock = waits.stop()
            grp.close()
        out.update(lock_waits=lock, cpu=cpu)
        if end_at is not None:
            start = stable_at if stable_at is not None else launched
            counted = n - (committed_at_stable if stable_at is not None else 0)
            out.update(seconds=end_at - start, counted=counted, rate=counted / (end_at - start),
                       wall_seconds=end_at - launched, wall_rate=n / (end_at - launched),
                       join_seconds=(stable_at - launched) if stable_at is not None else None,
                       committed_at_stable=committed_at_stable if stable_at else None)
            # the relays publish what is left, then the members stop
            t1 = time.perf_counter()
            while outbox_left(dsn) and time.perf_counter() - t1 < 180:
                time.sleep(0.2)
            out["outbox_drain_seconds"] = time.perf_counter() - t1
        busy, wall = cpu.get("machine_busy"), cpu.get("wall")
        parts = [cpu.get("postgres"), cpu.get("broker"), cpu.get("consumer"), *member_cpu]
        if busy is not None and wall and all(p is not None for p in parts):
            out["members_cpu_s"] = sum(p for p in member_cpu if p is not None)
            out["others_cores"] = max(busy - sum(p for p in parts if p is not None), 0.0) / wall
        stop_members(members)
        out["exits"] = [m.exit_code for m in members]
        out["stop_seconds"] = max((m.stop_seconds or 0.0) for m in members)
        after = settled_stats(s.dsn, dbname)
        out["stats"] = {k: after[k] - before[k] for k in after}
        out["server_log"] = server_log_errors(args.pg_log, log_offset, dbname)
        out["logs"] = scan_logs(members)
        if failure is not None:
            out.update(ok=False, check=failure)
        elif any(code != 0 for code in out["exits"]):
            out.update(ok=False, check=f"member exit statuses {out['exits']} after SIGTERM")
        else:
            ok, text = check(s, dsn, events, items)
            out.update(ok=ok, check=text)
        if not out["ok"]:
            out["check"] += f" (member logs: {work / name}-m*.log)"
    finally:
        if any(m.proc.poll() is None for m in members):
            stop_members(members, timeout=30)
        if not args.keep and dbname in created["databases"]:
            problem = drop_database(s, dbname)
            if problem:
                console.print(f"[yellow]clean-up: {problem}")
            else:
                created["databases"].remove(dbname)


# --- figures ------------------------------------------------------------------------------


def per10k(v: float | None, n: int) -> float | None:
    return v / n * 10_000 if v is not None and n else None


def figures(r: Run, n: int) -> dict[str, Any]:
    """The per-10,000-message figures of a run."""
    o = r.out
    stats = o.get("stats") or {}
    slog = o.get("server_log")
    lock = o.get("lock_waits") or {}
    transient = (o.get("logs") or {}).get("transient", {})
    return {
        "rate": o.get("rate"),
        "deadlocks": per10k(stats.get("deadlocks"), n),
        "lock_timeouts_server": per10k(slog["lock_timeouts"], n) if slog else None,
        "lock_timeouts_logs": per10k(sum(v for k, v in transient.items() if "55P03" in k), n),
        "deadlocks_logs": per10k(sum(v for k, v in transient.items() if "40P01" in k), n),
        "lock_waits": per10k(lock.get("waits"), n),
        "lock_wait_seconds": per10k(lock.get("seconds"), n),
        "rollbacks": per10k(stats.get("xact_rollback"), n),
        "commits": per10k(stats.get("xact_commit"), n),
    }


def _f(v: float | None, fmt: str = "{:,.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def _median(vals: list[float | None]) -> float | None:
    got = [v for v in vals if v is not None]
    return statistics.median(got) if got else None


def summarize(runs: list[Run], n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for config in (HOT, COLD):
        mine = [figures(r, n) for r in runs if r.config == config and r.out.get("ok")]
        rates = [f["rate"] for f in mine if f["rate"]]
        out[config] = {
            "runs": len(mine),
            "rate_min": min(rates, default=None), "rate_max": max(rates, default=None),
            "rate_median": statistics.median(rates) if rates else None,
            **{f"{k}_median": _median([f[k] for f in mine])
               for k in ("deadlocks", "lock_timeouts_server", "lock_timeouts_logs",
                         "deadlocks_logs", "lock_waits", "lock_wait_seconds", "rollbacks",
                         "commits")},
            "dropped": sum(len((r.out.get("logs") or {}).get("dropped", [])) for r in runs
                           if r.config == config),
        }
    h, c = out[HOT]["rate_median"], out[COLD]["rate_median"]
    out["ratio"] = h / c if h and c else None
    pairs = []
    for k in sorted({r.pair for r in runs}):
        rate = {r.config: r.out["rate"] for r in runs
                if r.pair == k and r.out.get("ok") and r.out.get("rate")}
        if HOT in rate and COLD in rate:
            pairs.append(rate[HOT] / rate[COLD])
    out["pair_ratios"] = pairs
    out["target_met"] = out["ratio"] is not None and out["ratio"] >= TARGET
    return out


def render(runs: list[Run], summary: dict[str, Any], n: int, args: argparse.Namespace) -> list[
        Table]:
    t = Table(title=f"{args.members} members, {n:,} charges per run on {args.partitions} "
                    f"partitions; hot: {args.tenants} tenants shared by every partition, "
                    f"cold: {args.tenants} per partition (per 10,000 messages unless said)")
    for col in ("run", "config", "msgs/s", "s", "join s", "msgs/s from launch", "deadlocks",
                "lock timeouts (server log)", "55P03 in logs", "lock waits seen",
                "lock-wait backend-s", "rollbacks", "dropped", "exits", "others' cores",
                "check"):
        t.add_column(col, justify="left" if col in ("config", "check", "exits") else "right")
    for r in runs:
        o, f = r.out, figures(r, n)
        dropped = (o.get("logs") or {}).get("dropped")
        t.add_row(f"{r.run} (pair {r.pair})", r.config, _f(f["rate"]),
                  _f(o.get("seconds"), "{:.1f}"), _f(o.get("join_seconds"), "{:.1f}"),
                  _f(o.get("wall_rate")), _f(f["deadlocks"], "{:.2f}"),
                  _f(f["lock_timeouts_server"], "{:.2f}"), _f(f["lock_timeouts_logs"], "{:.2f}"),
                  _f(f["lock_waits"], "{:.1f}"), _f(f["lock_wait_seconds"], "{:.2f}"),
                  _f(f["rollbacks"], "{:.1f}"),
                  "-" if dropped is None else (", ".join(dropped) or "none"),
                  " ".join(str(c) for c in o.get("exits", [])) or "-",
                  _f(o.get("others_cores"), "{:.2f}"),
                  "ok" if o.get("ok") else str(o.get("check", "")))
    s = Table(title="Per configuration (medians of the runs but min and max msgs/s; per "
                    "10,000 messages)")
    for col in ("config", "runs", "min msgs/s", "median", "max", "deadlocks",
                "lock timeouts (server log)", "55P03 in logs", "lock waits seen",
                "lock-wait backend-s", "rollbacks", "commits", "members dropped"):
        s.add_column(col, justify="left" if col == "config" else "right")
    for config in (HOT, COLD):
        c = summary[config]
        s.add_row(config, str(c["runs"]), _f(c["rate_min"]), _f(c["rate_median"]),
                  _f(c["rate_max"]), _f(c["deadlocks_median"], "{:.2f}"),
                  _f(c["lock_timeouts_server_median"], "{:.2f}"),
                  _f(c["lock_timeouts_logs_median"], "{:.2f}"),
                  _f(c["lock_waits_median"], "{:.1f}"),
                  _f(c["lock_wait_seconds_median"], "{:.2f}"),
                  _f(c["rollbacks_median"], "{:.1f}"), _f(c["commits_median"], "{:.1f}"),
                  str(c["dropped"]))
    ratio = summary["ratio"]
    pairs = ", ".join(f"{p:.3f}" for p in summary["pair_ratios"])
    s.caption = (f"hot / cold: {_f(ratio, '{:.3f}')} (medians); per pair {pairs or '-'}; "
                 f"target >= {TARGET}: {'met' if summary['target_met'] else 'NOT met'}")
    tables = [t, s]
    w = Table(title="Where the time waiting for locks went (all runs of a configuration; "
                    "statements seen waiting / backend-seconds; \\[the lock waited for])")
    for col in ("config", "statement", "waits seen", "backend-s"):
        w.add_column(col, justify="left" if col in ("config", "statement") else "right")
    e = Table(title="Errors in the server log (the run's database): statement (where); for "
                    "a deadlock the statements of the cycle")
    for col in ("config", "error", "statement", "count"):
        e.add_column(col, justify="left" if col != "count" else "right")
    for config in (HOT, COLD):
        waits: Counter[str] = Counter()
        secs: dict[str, float] = {}
        errs: Counter[tuple[str, str]] = Counter()
        for r in runs:
            if r.config != config:
                continue
            for kind, v in ((r.out.get("lock_waits") or {}).get("by_statement") or {}).items():
                waits[kind] += v["waits"]
                secs[kind] = secs.get(kind, 0.0) + v["seconds"]
            slog = r.out.get("server_log") or {}
            for what, key in (("deadlock", "deadlock_statements"),
                              ("lock timeout", "lock_timeout_statements"),
                              ("other", "other_errors")):
                for stmt, count in (slog.get(key) or {}).items():
                    errs[(what, stmt)] += count
        for kind in sorted(waits, key=lambda k: -secs[k]):
            w.add_row(config, escape(kind), f"{waits[kind]:,}", f"{secs[kind]:.2f}")
        for (what, stmt), count in sorted(errs.items(), key=lambda kv: -kv[1]):
            e.add_row(config, what, escape(stmt), f"{count:,}")
    tables.append(w)
    if e.row_count:
        tables.append(e)
    return tables


# --- main ---------------------------------------------------------------------------------


def cleanup(s: Settings, admin: AdminClient, created: dict[str, list[str]]) -> list[str]:
    problems = []
    topics, groups = created["topics"], list(created["groups"])
    for attempt in range(5):
        # a group its members left a moment ago can still say NON_EMPTY_GROUP: again
        busy = []
        for name, fut in (admin.delete_consumer_groups(groups) if groups else {}).items():
            try:
                fut.result(30)
            except KafkaException as exc:
                code = exc.args[0].code() if exc.args else None
                if code == KafkaError.NON_EMPTY_GROUP and attempt < 4:
                    busy.append(name)
                elif code != KafkaError.GROUP_ID_NOT_FOUND:
                    problems.append(f"group {name}: {exc}")
        if not busy:
            break
        groups = busy
        time.sleep(2)
    for name, fut in (admin.delete_topics(topics) if topics else {}).items():
        try:
            fut.result(30)
        except KafkaException as exc:
            code = exc.args[0].code() if exc.args else None
            if code != KafkaError.UNKNOWN_TOPIC_OR_PART:
                problems.append(f"topic {name}: {exc}")
    for dbname in created["databases"]:
        problem = drop_database(s, dbname)
        if problem:
            problems.append(problem)
    return problems


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.contention",
                                description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="1 pair of 12,000 messages")
    p.add_argument("--messages", type=int, help="charges per run [350000; quick 12000]")
    p.add_argument("--pairs", type=int, help="hot/cold pairs, alternating [2; quick 1]")
    p.add_argument("--members", type=int, default=4, help="kafka-idem run members [4]")
    p.add_argument("--partitions", type=int, default=8, help="partitions of the topic [8]")
    p.add_argument("--tenants", type=int, default=20,
                   help="tenants: shared by every partition (hot) or per partition (cold) [20]")
    p.add_argument("--seed", type=int, default=31, help="the workload's seed [31]")
    p.add_argument("--sample-ms", type=float, default=20.0,
                   help="lock-wait sampling interval, ms [20]")
    p.add_argument("--member-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the members (repeatable)")
    p.add_argument("--pg-log", type=Path, default=PG_LOG,
                   help=f"PostgreSQL's server log, for the statements of deadlocks and lock "
                        f"timeouts [{PG_LOG.relative_to(ROOT)}]")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run [600]")
    p.add_argument("--keep", action="store_true",
                   help="keep topics, groups, databases and the member logs")
    p.add_argument("--results", type=Path, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    args.messages = args.messages or (12_000 if args.quick else 350_000)
    args.pairs = args.pairs or (1 if args.quick else 2)
    if args.messages < 1 or args.pairs < 1 or args.members < 1 or args.tenants < 1:
        p.error("need --messages, --pairs, --members and --tenants >= 1")
    extra = {}
    for item in args.member_env:
        k, sep, v = item.partition("=")
        if not sep or not k:
            p.error(f"--member-env {item!r}: NAME=VALUE")
        extra[k] = v
    args.member_env = extra
    if server_log_size(args.pg_log) is None:
        args.pg_log = None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    s = load_settings()
    run_id = uuid.uuid4().hex[:8]
    admin = AdminClient(s.admin_config())
    work = Path(tempfile.mkdtemp(prefix=f"bench-ct-{run_id}-"))
    n = args.messages
    created: dict[str, list[str]] = {"topics": [], "groups": [], "databases": []}
    runs: list[Run] = []
    load_start = os.getloadavg()
    console.print(f"bench.contention {run_id}: {args.pairs} pair(s) of {n:,} charges, "
                  f"{args.members} members, {args.partitions} partitions, {args.tenants} "
                  f"tenants; {os.cpu_count()} cores, load average {load_start[0]:.2f}; "
                  f"server log {args.pg_log or 'not readable'}; member logs in {work}")
    workloads: dict[str, tuple[list[Charge], list[bytes]]] = {}
    t0 = time.perf_counter()
    for config in (HOT, COLD):
        items = charges(config, n, args.partitions, args.tenants, args.seed)
        values = [payments.encode_charge(c.tenant, c.order, c.amount, CURRENCY) for c in items]
        workloads[config] = (items, values)
    console.print(f"encoded {2 * n:,} charge requests in {time.perf_counter() - t0:.1f}s")
    order = [(k, c) for k in range(args.pairs)
             for c in ((HOT, COLD) if k % 2 == 0 else (COLD, HOT))]
    try:
        for i, (pair, config) in enumerate(order, 1):
            r = Run(i, pair + 1, config)
            runs.append(r)
            try:
                one_run(s, admin, args, run_id, r, *workloads[config], work, created)
            except (KafkaException, psycopg.Error, OSError) as exc:
                r.out.update(ok=False, check=f"run failed: {type(exc).__name__}: {exc}")
            f = figures(r, n)
            console.print(f"  {_f(f['rate'])} msgs/s (from launch {_f(r.out.get('wall_rate'))});"
                          f" deadlocks {_f(f['deadlocks'], '{:.2f}')}, lock timeouts "
                          f"{_f(f['lock_timeouts_server'], '{:.2f}')}, lock waits seen "
                          f"{_f(f['lock_waits'], '{:.1f}')} per 10k; exits "
                          f"{r.out.get('exits')}; {r.out.get('check')}")
    finally:
        if args.keep:
            console.print(f"kept {created}")
        else:
            for problem in cleanup(s, admin, created):
                console.print(f"[yellow]clean-up: {problem}")
    summary = summarize(runs, n)
    out_console = Console(width=max(Console().width, 200))
    for table in render(runs, summary, n, args):
        out_console.print(table)
    load_end = os.getloadavg()
    exits_ok = all(r.out.get("exits") and all(c == 0 for c in r.out["exits"]) for r in runs)
    out_console.print(
        f"members stopped with SIGTERM: {'every one exited 0' if exits_ok else 'NOT all exited 0'}"
        f"; load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end; "
        f"{os.cpu_count()} cores")
    if args.results is not None:
        args.results.write_text(json.dumps({
            "run_id": run_id, "messages": n, "pairs": args.pairs, "members": args.members,
            "partitions": args.partitions, "tenants": args.tenants,
            "member_env": args.member_env, "cores": os.cpu_count(),
            "loadavg_start": load_start, "loadavg_end": load_end,
            "runs": [{"run": r.run, "pair": r.pair, "config": r.config, **r.out,
                      "per_10k": figures(r, n)} for r in runs],
            "summary": summary, "kept": created if args.keep else None, "work": str(work)},
            indent=2, default=str))
        console.print(f"results written to {args.results}")
    ok = len(runs) == 2 * args.pairs and all(r.out.get("ok") for r in runs)
    if not ok:
        console.print(f"[red]a check failed: see the table; member logs in {work}")
    elif not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
