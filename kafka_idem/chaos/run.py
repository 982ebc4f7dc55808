"""The chaos run: a consumer group under seeded faults, then the anomaly checker.

    python -m kafka_idem.chaos.run --duration 120 --faults 24 --seed 7 --members 3 \\
        [--json report.json] [--allow-broker-restart] [--keep]

Everything is fresh and named after a run id: the topic ``chaos.<id>.charge-requested``
(6 partitions) and its ``.dlq``, the database ``chaos_<id>`` (store and
``payments`` tables, migrated here), the group ``chaos-<id>``. They are removed
at the end unless ``--keep`` is given or an anomaly was found.

1. ``--members`` ``kafka-idem run consumers.payments:app`` processes join the group
   (session timeout 6 s, max.poll.interval 10 s, short backoffs).
2. A producer thread sends charge intents at ``--rate`` per second (idempotent,
   acks=all): originals, re-sends of earlier intents (new request id), payload
   conflicts, invalid charges (amount <= 0, unknown currency), undecodable bytes.
3. A fault injector, seeded by ``--seed`` and logged, injects ``--faults``
   faults spread over ``--duration`` seconds, each type at least once first:
   ``kill`` (SIGKILL a member, start a replacement), ``zombie`` (SIGSTOP a member
   past max.poll.interval.ms, then SIGCONT), ``add`` / ``remove`` (start a member
   / SIGTERM one, keeping 2-4), ``pg_terminate`` (``pg_terminate_backend`` of the
   members' sessions), ``dlq_outage`` (the DLQ topic's ``max.message.bytes`` set to
   1 byte, so every dead-letter produce fails with MSG_SIZE_TOO_LARGE, records
   kept; restored later), ``broker_restart`` (``scripts/kafka.sh restart``: only
   with ``--allow-broker-restart`` and the local broker).
4. Heal: SIGCONT everyone, restore the DLQ, keep at least one member, stop
   producing; wait until the group's committed offsets equal the end offsets
   (bounded by ``--heal-timeout``: liveness); SIGTERM the members.
5. Run the checker (:mod:`kafka_idem.chaos.checker`) on durable state; print
   the fault log, the checker's table and the seed. Exit 1 on any anomaly.

Kafka and PostgreSQL come from ``KAFKA_IDEM_BOOTSTRAP_SERVERS`` and
``KAFKA_IDEM_DATABASE_URL`` (the local services by default); the database user
must be allowed to create databases and to terminate the members' sessions.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
)
from psycopg import sql
from rich.console import Console
from rich.table import Table

from kafka_idem.chaos.checker import ROOT, Liveness, Report, check
from kafka_idem.migrate import migrate
from kafka_idem.settings import Settings, load_settings

APP = "consumers.payments:app"
FAULTS = ("kill", "zombie", "add", "remove", "pg_terminate", "dlq_outage", "broker_restart")
WEIGHTS = {"kill": 2.0, "zombie": 2.0, "add": 1.0, "remove": 1.0, "pg_terminate": 2.0,
           "dlq_outage": 1.0, "broker_restart": 0.6}
MIN_MEMBERS, MAX_MEMBERS = 2, 4
SESSION_TIMEOUT_MS, MAX_POLL_INTERVAL_MS = 6000, 10000
TENANTS = 20
CURRENCIES = ("EUR", "USD", "GBP", "CHF", "JPY")
# The members' settings (environment variables set before the caller's own).
MEMBER_ENV = {
    "KAFKA_IDEM_SESSION_TIMEOUT_MS": str(SESSION_TIMEOUT_MS),
    "KAFKA_IDEM_MAX_POLL_INTERVAL_MS": str(MAX_POLL_INTERVAL_MS),
    "KAFKA_IDEM_BACKOFF_BASE_SECONDS": "0.1",
    "KAFKA_IDEM_BACKOFF_CAP_SECONDS": "2",
    "KAFKA_IDEM_BUSY_RETRY_SECONDS": "0.2",
    "KAFKA_IDEM_LEASE_SECONDS": "5",
    # A stopped member's open transaction would block the others' writes to the same
    # rows (the balances); the server ends it after this long idle in a transaction.
    "KAFKA_IDEM_IDLE_IN_TRANSACTION_TIMEOUT_SECONDS": "4",
    "KAFKA_IDEM_BATCH_MAX_WAIT_SECONDS": "0.05",
    "KAFKA_IDEM_METRICS_SAMPLE_SECONDS": "5",
}
# Our own clients: the broker restarts are expected, their connection errors are noise.
QUIET = {"log_level": 2}
LOG_SIGNS = {  # what the members' logs say about the faults (evidence, not verdicts)
    "dlq_produce_failed": "dead-letter produce failed",
    "commit_refused": "commit refused, ownership lost",
    "commit_failed": "commit failed, will retry",
    "partitions_lost": "kafka_idem.runner: lost ",
    "store_errors": "the message will be retried",
    "batch_failed": "batch transaction failed",
    "tracebacks": "Traceback (most recent call last)",
}

console = Console(highlight=False)
T0 = time.monotonic()


def say(text: str) -> None:
    console.print(f"[dim]{time.monotonic() - T0:7.1f}s[/] {text}", soft_wrap=True)


# --- members ---


class Member:
    """One ``kafka-idem run`` process (its own session: our Ctrl-C is not its)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        self.stopped = False  # SIGSTOPped, not yet SIGCONTed
        self.gone: str | None = None  # killed | terminated | crashed
        self.exit_code: int | None = None

    def __repr__(self) -> str:
        return f"{self.name}({self.pid})"


class Pool:
    def __init__(self, cmd: list[str], env: dict[str, str], logs: Path) -> None:
        self.cmd, self.env, self.logs = cmd, env, logs
        self.members: list[Member] = []
        self.crashed: list[Member] = []
        self.slow_stops: list[str] = []
        self._waiters: list[threading.Thread] = []

    def alive(self) -> list[Member]:
        return [m for m in self.members if m.gone is None]

    def running(self) -> list[Member]:
        return [m for m in self.alive() if not m.stopped]

    def start(self) -> Member:
        name = f"m{len(self.members) + 1}"
        m = Member(name, self.cmd, self.env, self.logs / f"{name}.log")
        self.members.append(m)
        return m

    def kill(self, m: Member) -> None:
        m.proc.send_signal(signal.SIGKILL)
        m.exit_code = m.proc.wait()
        m.gone, m.stopped = "killed", False

    def sigstop(self, m: Member) -> None:
        m.proc.send_signal(signal.SIGSTOP)
        m.stopped = True

    def sigcont(self, m: Member) -> None:
        if m.gone is None:
            m.proc.send_signal(signal.SIGCONT)
        m.stopped = False

    def terminate(self, m: Member, *, wait: bool = False, timeout: float = 60.0) -> None:
        """SIGTERM (graceful); the exit code is collected by a thread unless ``wait``."""
        m.gone = "terminated"

        def collect() -> None:
            try:
                m.exit_code = m.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.slow_stops.append(f"{m} did not stop within {timeout:.0f}s of SIGTERM")
                m.proc.kill()
                m.exit_code = m.proc.wait()

        m.proc.send_signal(signal.SIGTERM)
        if wait:
            collect()
        else:
            t = threading.Thread(target=collect, daemon=True)
            t.start()
            self._waiters.append(t)

    def reap(self) -> list[Member]:
        """Members that exited without being told to."""
        out = []
        for m in self.alive():
            code = m.proc.poll()
            if code is not None:
                m.gone, m.exit_code, m.stopped = "crashed", code, False
                self.crashed.append(m)
                out.append(m)
        return out

    def stop_all(self) -> None:
        for m in self.alive():
            self.sigcont(m)
        for m in self.alive():
            self.terminate(m, wait=False, timeout=45)
        for t in self._waiters:
            t.join(60)

    def scan_logs(self) -> tuple[dict[str, int], dict[str, int]]:
        """Counts of :data:`LOG_SIGNS` and, per exception, the tracebacks in the logs."""
        counts: Counter[str] = Counter()
        errors: Counter[str] = Counter()
        for m in self.members:
            try:
                lines = m.log.read_text(errors="replace").splitlines()
            except OSError:
                continue
            for name, sign in LOG_SIGNS.items():
                counts[name] += sum(1 for line in lines if sign in line)
            for i, line in enumerate(lines):
                if not line.startswith("Traceback (most recent call last)"):
                    continue
                said = re.sub(r"^\S+ \S+ ", "", lines[i - 1])[:120] if i else ""
                raised = next((ln for ln in lines[i + 1:] if ln and not ln[0].isspace()), "?")
                errors[f"{raised[:160]} (after: {said})"] += 1
        return dict(counts), dict(errors)


# --- the producer ---


@dataclass(frozen=True, slots=True)
class Intent:
    tenant: str
    order: str
    amount: Decimal
    currency: str


class Feed(threading.Thread):
    """Sends charge intents at a steady rate; records every acknowledged message."""

    def __init__(self, bootstrap: str, topic: str, rate: float, seed: int,
                 kafka: dict[str, Any]) -> None:
        super().__init__(name="chaos-feed", daemon=True)
        from consumers.payments import encode_charge

        self.encode = encode_charge
        self.topic, self.rate = topic, rate
        self.rng = random.Random(seed)
        conf = {k: v for k, v in kafka.items() if not k.startswith(("group.", "fetch."))}
        conf.update({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
                     "linger.ms": 5, "message.timeout.ms": 300_000, **QUIET,
                     "error_cb": lambda err: None})  # transient: the client retries
        self.producer = Producer(conf)
        self.stopping = threading.Event()
        self.intents: list[Intent] = []
        self.sent: Counter[str] = Counter()
        self.acked: dict[tuple[int, int], bytes | None] = {}
        self.acked_kinds: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self._lock = threading.Lock()

    def next_message(self, n: int) -> tuple[str, bytes | None, bytes]:
        rng, intents = self.rng, self.intents
        r = rng.random()
        if r < 0.03:
            return "garbage", *self._garbage(n)
        if intents and r < 0.07:
            base = rng.choice(intents[-500:])
            other = Intent(base.tenant, base.order,
                           base.amount + Decimal(rng.randint(1, 999)) / 100, base.currency)
            return "conflict", base.order.encode(), self._value(other)
        if intents and r < 0.22:
            base = rng.choice(intents[-200:] if rng.random() < 0.6 else intents)
            return "duplicate", base.order.encode(), self._value(base)
        amount = Decimal(rng.randint(1, 100_000)) / 100
        currency = rng.choice(CURRENCIES)
        kind = "original"
        if rng.random() < 0.05:
            kind = "invalid"
            if rng.random() < 0.5:
                amount = Decimal(0) if rng.random() < 0.3 else -amount
            else:
                currency = "XXX"
        intent = Intent(f"t{rng.randrange(TENANTS):02d}", f"o-{len(intents):07d}", amount,
                        currency)
        intents.append(intent)
        return kind, intent.order.encode(), self._value(intent)

    def _value(self, i: Intent) -> bytes:
        # A fresh request_id and requested_at per send, like a producer's retry.
        return self.encode(i.tenant, i.order, i.amount, i.currency,
                           request_id=str(uuid.UUID(int=self.rng.getrandbits(128))))

    def _garbage(self, n: int) -> tuple[bytes | None, bytes]:
        rng = self.rng
        good = self.encode("t", "o", "1.00")
        junk = [b"", b"not avro", b'{"tenant_id": "t1", "amount": 10}', good[:12],
                b"\xc3\x01" + rng.randbytes(8) + good[10:], b"\x00\x00\x00\x00\x01" + good[10:],
                rng.randbytes(rng.randint(1, 64))]
        key = None if rng.random() < 0.3 else b"garbage-%d" % n
        return key, rng.choice(junk)

    def run(self) -> None:
        start, n = time.monotonic(), 0
        while not self.stopping.is_set():
            due = start + n / self.rate
            wait = due - time.monotonic()
            if wait > 0:
                self.stopping.wait(min(wait, 0.5))
                continue
            if wait < -1.0:  # fell behind (broker away): no catch-up burst
                start, n = time.monotonic(), 0
            kind, key, value = self.next_message(sum(self.sent.values()))
            while not self.stopping.is_set():
                try:
                    self.producer.produce(self.topic, key=key, value=value,
                                          on_delivery=self._acked(kind, value))
                    break
                except BufferError:
                    self.producer.poll(0.1)
            self.sent[kind] += 1
            n += 1
            self.producer.poll(0)
        left = self.producer.flush(120)
        if left:
            self.errors["not acknowledged within 120 s of the end"] += left

    def _acked(self, kind: str, value: bytes) -> Callable[[Any, Any], None]:
        def on_delivery(err: Any, msg: Any) -> None:
            with self._lock:
                if err is not None:
                    self.errors[str(err)] += 1
                else:
                    self.acked[(msg.partition(), msg.offset())] = value
                    self.acked_kinds[kind] += 1
        return on_delivery


# --- Kafka and PostgreSQL helpers ---


class Offsets:
    """The group's committed offsets and the end offsets, asked without joining the group."""

    def __init__(self, conf: dict[str, Any], group: str, topic: str, partitions: int) -> None:
        self.consumer = Consumer({**conf, "group.id": group, "enable.auto.commit": False,
                                  **QUIET})
        self.tps = [TopicPartition(topic, p) for p in range(partitions)]

    def lag(self, timeout: float = 5.0) -> tuple[int, int] | None:
        """``(committed total, lag)``, or None when the broker does not answer."""
        try:
            committed = [max(tp.offset, 0) for tp in self.consumer.committed(self.tps,
                                                                              timeout=timeout)]
            ends = [self.consumer.get_watermark_offsets(tp, timeout=timeout)[1]
                    for tp in self.tps]
        except KafkaException:
            return None
        return sum(committed), sum(max(e - c, 0) for c, e in zip(committed, ends, strict=True))

    def close(self) -> None:
        self.consumer.close()


def _local_bootstrap(bootstrap: str) -> bool:
    port = os.environ.get("KAFKA_IDEM_KAFKA_PORT", "39092")
    return bootstrap.strip() in (f"127.0.0.1:{port}", f"localhost:{port}")


def _kafka_sh(action: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ROOT / "scripts" / "kafka.sh"), action], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _dlq_limit(admin: AdminClient, topic: str, value: str | None) -> None:
    """Set the topic's max.message.bytes (``None``: back to the broker default)."""
    entry = ConfigEntry("max.message.bytes", value or "",
                        incremental_operation=AlterConfigOpType.SET if value
                        else AlterConfigOpType.DELETE)
    res = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[entry])
    for f in admin.incremental_alter_configs([res], request_timeout=10).values():
        f.result(timeout=15)


def _create_database(admin_dsn: str, name: str) -> str:
    with psycopg.connect(admin_dsn, autocommit=True, application_name="chaos-run") as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return psycopg.conninfo.make_conninfo(admin_dsn, dbname=name)


def _migrate(dsn: str, schema: str, table: str) -> None:
    migrate(dsn, schema, table)
    from consumers.payments import create_tables

    with psycopg.connect(dsn, application_name="chaos-run") as conn:
        create_tables(conn)


def _drop_database(admin_dsn: str, name: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True, application_name="chaos-run") as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))


def _terminate_backends(dsn: str, dbname: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True, application_name="chaos-run") as conn:
        rows = conn.execute(
            "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND application_name LIKE 'kafka_idem%%' "
            "AND pid <> pg_backend_pid()", (dbname,)).fetchall()
    return [int(pid) for pid, done in rows if done]


# --- the fault injector ---


@dataclass
class Fault:
    n: int
    at: float  # seconds since the producer started
    fault: str
    pids: list[int]
    detail: str
    took: float = 0.0


@dataclass
class Undo:
    due: float  # monotonic
    what: str  # sigcont | dlq_restore
    member: Member | None = None


@dataclass
class Injector:
    rng: random.Random
    pool: Pool
    admin: AdminClient
    dsn: str
    dbname: str
    dlq_topic: str
    types: tuple[str, ...]
    log: list[Fault] = field(default_factory=list)
    undo: list[Undo] = field(default_factory=list)
    queue: list[str] = field(default_factory=list)
    restart: threading.Thread | None = None
    restart_result: list[str] = field(default_factory=list)
    dlq_down: bool = False
    t_start: float = 0.0
    health: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.queue = list(self.types)
        self.rng.shuffle(self.queue)  # every type once first, then weighted at random

    def busy(self) -> bool:
        return self.restart is not None and self.restart.is_alive()

    def choose(self) -> str:
        if not self.queue:
            self.queue.append(self.rng.choices(self.types, [WEIGHTS[t] for t in self.types])[0])
        for i, kind in enumerate(self.queue):
            if self.feasible(kind):
                return self.queue.pop(i)
        # Nothing queued is possible now (e.g. remove at the minimum): a rebalance instead.
        return "add" if len(self.pool.alive()) < MAX_MEMBERS else "remove"

    def feasible(self, kind: str) -> bool:
        alive, running = self.pool.alive(), self.pool.running()
        if kind == "kill":
            return bool(alive)
        if kind == "zombie":
            return len(running) >= 2
        if kind == "add":
            return len(alive) < MAX_MEMBERS
        if kind == "remove":
            return len(alive) > MIN_MEMBERS and bool(running)
        if kind == "dlq_outage":
            return not self.dlq_down
        return True

    def inject(self, n: int) -> Fault:
        kind = self.choose()
        started = time.monotonic()
        fault = Fault(n, round(started - self.t_start, 1), kind, [], "")
        getattr(self, f"_{kind}")(fault)
        fault.took = round(time.monotonic() - started, 2)
        self.log.append(fault)
        say(f"fault {n:3d} [bold]{kind}[/] {fault.detail}")
        return fault

    def _pick(self, members: list[Member]) -> Member:
        return self.rng.choice(sorted(members, key=lambda m: m.name))

    def _kill(self, f: Fault) -> None:
        victim = self._pick(self.pool.alive())
        self.pool.kill(victim)
        new = self.pool.start()
        f.pids = [victim.pid, new.pid]
        f.detail = f"SIGKILL {victim}{' (was stopped)' if victim.stopped else ''}; started {new}"

    def _zombie(self, f: Fault) -> None:
        victim = self._pick(self.pool.running())
        seconds = MAX_POLL_INTERVAL_MS / 1000 + self.rng.uniform(1.0, 4.0)
        self.pool.sigstop(victim)
        self.undo.append(Undo(time.monotonic() + seconds, "sigcont", victim))
        f.pids = [victim.pid]
        f.detail = f"SIGSTOP {victim} for {seconds:.1f}s (max.poll.interval.ms " \
                   f"{MAX_POLL_INTERVAL_MS})"

    def _add(self, f: Fault) -> None:
        new = self.pool.start()
        f.pids = [new.pid]
        f.detail = f"started {new}; {len(self.pool.alive())} members"

    def _remove(self, f: Fault) -> None:
        victim = self._pick(self.pool.running())
        self.pool.terminate(victim)
        f.pids = [victim.pid]
        f.detail = f"SIGTERM {victim}; {len(self.pool.alive())} members"

    def _pg_terminate(self, f: Fault) -> None:
        pids = _terminate_backends(self.dsn, self.dbname)
        f.pids = pids
        f.detail = f"pg_terminate_backend: {len(pids)} member sessions"

    def _dlq_outage(self, f: Fault) -> None:
        seconds = self.rng.uniform(8.0, 20.0)
        try:
            _dlq_limit(self.admin, self.dlq_topic, "1")
        except Exception as exc:  # the broker may be away: the fault did not happen
            f.detail = f"could not limit the DLQ: {exc}"
            return
        self.dlq_down = True
        self.undo.append(Undo(time.monotonic() + seconds, "dlq_restore"))
        f.detail = f"{self.dlq_topic} max.message.bytes=1 for {seconds:.1f}s"

    def _broker_restart(self, f: Fault) -> None:
        def restart() -> None:
            t = time.monotonic()
            out = _kafka_sh("restart")
            took = time.monotonic() - t
            if out.returncode:
                self.health.append(f"broker restart failed: {out.stderr.strip()[-300:]}")
            self.restart_result.append(f"{took:.1f}s")
            say(f"broker back after {took:.1f}s (exit {out.returncode})")

        self.restart = threading.Thread(target=restart, daemon=True)
        self.restart.start()
        f.detail = "scripts/kafka.sh restart"

    def tick(self, *, everything: bool = False) -> None:
        """Undo what is due (everything when healing); replace crashed members."""
        now = time.monotonic()
        for u in sorted(self.undo, key=lambda u: u.due):
            if not everything and u.due > now:
                continue
            if u.what == "sigcont" and u.member is not None:
                self.pool.sigcont(u.member)
                self.undo.remove(u)
                say(f"SIGCONT {u.member}")
            elif u.what == "dlq_restore" and not self.busy():
                try:
                    _dlq_limit(self.admin, self.dlq_topic, None)
                except Exception as exc:  # retried on the next tick
                    say(f"[yellow]DLQ restore failed, will retry: {exc}[/]")
                    continue
                self.dlq_down = False
                self.undo.remove(u)
                say(f"{self.dlq_topic} max.message.bytes restored")
        for m in self.pool.reap():
            self.health.append(f"{m} exited on its own with code {m.exit_code}")
            new = self.pool.start()
            say(f"[red]{m} exited on its own (code {m.exit_code})[/]; started {new}")


# --- the run ---


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m kafka_idem.chaos.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=120.0,
                    help="seconds over which the faults are spread (default 120)")
    ap.add_argument("--faults", type=int, default=24, help="faults to inject (default 24)")
    ap.add_argument("--seed", type=int, help="random seed (default: a new one, printed)")
    ap.add_argument("--members", type=int, default=3, help="group members at the start (2-4)")
    ap.add_argument("--rate", type=float, default=150.0, help="messages per second (default 150)")
    ap.add_argument("--partitions", type=int, default=6, help="source topic partitions")
    ap.add_argument("--mode", choices=("local", "leased"), default="local",
                    help="the payments handler's processing mode (default local)")
    ap.add_argument("--heal-timeout", type=float, default=180.0,
                    help="liveness bound: seconds for the lag to reach 0 after healing")
    ap.add_argument("--fault-types", default=",".join(FAULTS),
                    help=f"comma-separated subset of {','.join(FAULTS)}")
    ap.add_argument("--allow-broker-restart", action="store_true",
                    help="allow restarting the local broker (scripts/kafka.sh restart)")
    ap.add_argument("--json", type=Path, help="write the report to this file")
    ap.add_argument("--keep", action="store_true", help="keep topics, database and logs")
    args = ap.parse_args(argv)
    types = tuple(t.strip() for t in args.fault_types.split(",") if t.strip())
    unknown = set(types) - set(FAULTS)
    if unknown or not types:
        ap.error(f"unknown fault types {sorted(unknown)}; choose from {','.join(FAULTS)}")
    if not args.allow_broker_restart:
        types = tuple(t for t in types if t != "broker_restart")
    args.types = types
    if not MIN_MEMBERS <= args.members <= MAX_MEMBERS:
        ap.error(f"--members must be between {MIN_MEMBERS} and {MAX_MEMBERS}")
    if args.duration <= 0 or args.faults < 0 or args.rate <= 0 or args.partitions < 1:
        ap.error("--duration, --rate and --partitions must be positive, --faults >= 0")
    return args


def member_env(s: Settings, dsn: str, topic: str, mode: str) -> dict[str, str]:
    kafka = dict(s.kafka)
    kafka.setdefault("heartbeat.interval.ms", 1000)
    env = {**MEMBER_ENV, **os.environ}
    env.update({
        "PAYMENTS_TOPIC": topic,
        "PAYMENTS_MODE": mode,
        "KAFKA_IDEM_BOOTSTRAP_SERVERS": s.bootstrap_servers,
        "KAFKA_IDEM_DATABASE_URL": dsn,
        "KAFKA_IDEM_KAFKA": json.dumps(kafka),
        "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
    })
    for name in ("KAFKA_IDEM_SESSION_TIMEOUT_MS", "KAFKA_IDEM_MAX_POLL_INTERVAL_MS"):
        env[name] = MEMBER_ENV[name]  # the zombie fault depends on these two
    return env


def table(title: str, columns: tuple[str, ...], rows: list[tuple[Any, ...]]) -> Table:
    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col)
    for row in rows:
        t.add_row(*(str(v) for v in row))
    return t


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not (ROOT / "consumers" / "payments.py").exists():
        console.print(f"[red]the chaos run needs a checkout: no consumers/payments.py in {ROOT}[/]")
        return 2
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # the payments example, from any working directory
    s = load_settings()
    seed = args.seed if args.seed is not None else random.randrange(1_000_000_000)
    run_id = uuid.uuid4().hex[:8]
    topic, group, dbname = f"chaos.{run_id}.charge-requested", f"chaos-{run_id}", f"chaos_{run_id}"
    dlq_topic = f"{topic}{s.dlq_suffix}"
    if "broker_restart" in args.types and not _local_bootstrap(s.bootstrap_servers):
        console.print("[red]--allow-broker-restart needs the local broker (scripts/kafka.sh); "
                      f"{s.bootstrap_servers} is not it[/]")
        return 2
    logs = Path(tempfile.mkdtemp(prefix=f"kafka-idem-chaos-{run_id}-"))
    console.rule(f"kafka_idem chaos run {run_id}: seed {seed}, {args.faults} faults over "
                 f"{args.duration:.0f}s, {args.members} members, {args.mode} mode")
    say(f"Kafka {s.bootstrap_servers}, PostgreSQL {s.redacted()['database_url']}, "
        f"faults: {', '.join(args.types)}")
    admin = AdminClient({**s.admin_config(), **QUIET})
    pool: Pool | None = None
    injector: Injector | None = None
    feed: Feed | None = None
    offsets: Offsets | None = None
    report: Report | None = None
    result: dict[str, Any] = {"seed": seed, "run_id": run_id, "topic": topic,
                              "dlq_topic": dlq_topic, "group": group, "database": dbname,
                              "options": {k: (str(v) if isinstance(v, Path) else v)
                                          for k, v in vars(args).items()},
                              "started_at": dt.datetime.now(dt.UTC).isoformat()}
    health: list[tuple[str, bool, str]] = []
    passed = False
    created_db = created_topics = False
    try:
        # -- set-up
        dsn = _create_database(s.dsn, dbname)
        created_db = True
        _migrate(dsn, s.schema_name, s.table)
        brokers = len(admin.list_topics(timeout=15).brokers)
        rf = min(3, brokers)
        for f in admin.create_topics([NewTopic(t, args.partitions, rf)
                                      for t in (topic, dlq_topic)]).values():
            f.result(timeout=30)
        created_topics = True
        say(f"database {dbname} migrated; topics {topic} (+ .dlq), {args.partitions} "
            f"partitions, replication factor {rf}; group {group}")
        cmd = [sys.executable, "-m", "kafka_idem.cli", "run", APP, "--group-id", group]
        pool = Pool(cmd, member_env(s, dsn, topic, args.mode), logs)
        for _ in range(args.members):
            pool.start()
        say(f"members {pool.alive()} starting; logs in {logs}")
        offsets = Offsets(s.admin_config(), group, topic, args.partitions)
        _wait_assigned(admin, group, args.partitions, timeout=60)
        say("every partition assigned")

        # -- load and faults
        feed = Feed(s.bootstrap_servers, topic, args.rate, seed + 1, s.kafka)
        injector = Injector(random.Random(seed), pool, admin, s.dsn, dbname, dlq_topic,
                            args.types)
        feed.start()
        injector.t_start = t_start = time.monotonic()
        say(f"producing ~{args.rate:.0f} messages/s")
        spacing = args.duration / max(args.faults, 1)
        plan = [t_start + 2.0 + i * spacing + injector.rng.uniform(0, 0.4 * spacing)
                for i in range(args.faults)]
        last_progress = 0.0
        n = 0
        while n < len(plan) or time.monotonic() < t_start + args.duration:
            injector.tick()
            if n < len(plan) and time.monotonic() >= plan[n] and not injector.busy():
                n += 1
                injector.inject(n)
            if time.monotonic() - last_progress >= 10:
                last_progress = time.monotonic()
                _progress(feed, offsets, pool)
            time.sleep(0.1)
        while injector.busy():  # a broker restart still in progress
            injector.tick()
            time.sleep(0.2)
        last_fault = time.monotonic()

        # -- heal
        say("[bold]healing[/]: SIGCONT everyone, DLQ restored, producing stopped")
        deadline = time.monotonic() + 120
        while injector.undo and time.monotonic() < deadline:
            injector.tick(everything=True)
            time.sleep(0.5)
        if injector.undo:
            health.append(("faults undone", False, f"{len(injector.undo)} not undone"))
        if not pool.running():
            say(f"started {pool.start()} (no member left)")
        feed.stopping.set()
        feed.join(150)
        heal_start = time.monotonic()
        healed_in: float | None = None
        last_progress = 0.0
        while time.monotonic() - heal_start < args.heal_timeout:
            injector.tick()
            state = offsets.lag()
            if state is not None and state[1] == 0 and not feed.is_alive():
                healed_in = round(time.monotonic() - heal_start, 1)
                break
            if time.monotonic() - last_progress >= 10:
                last_progress = time.monotonic()
                _progress(feed, offsets, pool)
            time.sleep(0.5)
        say(f"lag 0 after {healed_in}s" if healed_in is not None
            else f"[red]lag not 0 after {args.heal_timeout:.0f}s[/]")
        alive = pool.alive()
        pool.stop_all()
        codes = {m.name: m.exit_code for m in alive}
        say(f"members stopped: {codes}")

        # -- check
        report = check(bootstrap=s.bootstrap_servers, dsn=dsn, topic=topic, group=group,
                       dlq_topic=dlq_topic, schema=s.schema_name, table=s.table,
                       max_attempts=s.max_attempts,
                       liveness=Liveness(healed_in, args.heal_timeout),
                       acknowledged=feed.acked, kafka=s.kafka)
        by_type = Counter(f.fault for f in injector.log)
        evidence, tracebacks = pool.scan_logs()
        health += [
            ("every planned fault injected", len(injector.log) == args.faults,
             f"{len(injector.log)} of {args.faults}"),
            ("every fault type injected", set(by_type) >= set(args.types) or
             len(injector.log) < len(args.types),
             ", ".join(f"{t} {by_type[t]}" for t in args.types)),
            ("no member exited on its own", not pool.crashed,
             "; ".join(f"{m} code {m.exit_code}" for m in pool.crashed) or "none"),
            ("members exit 0 on SIGTERM",
             all(m.exit_code == 0 for m in pool.members if m.gone == "terminated")
             and not pool.slow_stops,
             "; ".join(pool.slow_stops) or ", ".join(
                 f"{m.name} {m.exit_code}" for m in pool.members if m.gone == "terminated")),
            *(("injector", False, h) for h in injector.health if "exited on its own" not in h),
        ]
        result.update({
            "seconds": round(time.monotonic() - T0, 1),
            "faults": [asdict(f) for f in injector.log],
            "faults_by_type": dict(sorted(by_type.items())),
            "fault_span_seconds": round(last_fault - t_start, 1),
            "broker_restarts_took": injector.restart_result,
            "messages": {"sent": sum(feed.sent.values()), "sent_by_kind": dict(feed.sent),
                         "acknowledged": len(feed.acked), "delivery_errors": dict(feed.errors)},
            "heal": {"healed_in": healed_in, "bound": args.heal_timeout},
            "member_log_evidence": evidence,
            "member_log_tracebacks": tracebacks,
            "members_started": len(pool.members),
            "health": [{"check": n_, "ok": ok, "detail": d} for n_, ok, d in health],
            "checker": report.to_json(),
        })
        _print_summary(injector, feed, report, health, evidence, tracebacks, result)
        passed = report.ok and all(ok for _, ok, _ in health)
        result["anomalies"] = report.anomalies + sum(1 for _, ok, _ in health if not ok)
        result["passed"] = passed
    except KeyboardInterrupt:
        say("[red]interrupted[/]")
    except Exception as exc:  # set-up or the broker failed us: report, clean up, exit 1
        console.print_exception()
        result["error"] = repr(exc)
    finally:
        if feed is not None:
            feed.stopping.set()
        if pool is not None:
            pool.stop_all()
        if injector is not None and injector.dlq_down:
            try:
                _dlq_limit(admin, dlq_topic, None)
            except Exception as exc:  # best effort; the topic is removed unless kept
                say(f"[yellow]could not restore the DLQ limit: {exc}[/]")
        if offsets is not None:
            offsets.close()
        if args.json:
            result.setdefault("passed", False)
            args.json.write_text(json.dumps(result, indent=2, default=str))
        keep = args.keep or not passed
        verdict = "[bold green]PASSED[/]" if passed else "[bold red]FAILED[/]"
        console.print(f"{verdict}: seed {seed}; replay the same faults and messages with "
                      f"[bold]python -m kafka_idem.chaos.run {_replay_args(args, seed)}[/]")
        if keep:
            console.print(f"kept: database {dbname}, topics {topic} (+ .dlq), group {group}, "
                          f"member logs {logs}. Check again with: KAFKA_IDEM_DATABASE_URL="
                          f"'{psycopg.conninfo.make_conninfo(s.dsn, dbname=dbname)}' "
                          f"python -m kafka_idem.chaos.checker --topic {topic} --group {group}",
                          markup=False)
        else:
            _cleanup(s, dbname if created_db else None,
                     [topic, dlq_topic] if created_topics else [], group, logs)
    return 0 if passed else 1


def _replay_args(args: argparse.Namespace, seed: int) -> str:
    parts = [f"--duration {args.duration:g}", f"--faults {args.faults}", f"--seed {seed}",
             f"--members {args.members}", f"--rate {args.rate:g}",
             f"--partitions {args.partitions}", f"--mode {args.mode}",
             f"--fault-types {','.join(args.types)}"]
    if args.allow_broker_restart:
        parts.append("--allow-broker-restart")
    return " ".join(parts)


def _wait_assigned(admin: AdminClient, group: str, partitions: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            desc = admin.describe_consumer_groups([group], request_timeout=5)[group].result(
                timeout=10)
            got = sum(len(m.assignment.topic_partitions) for m in desc.members)
            if got >= partitions:
                return
        except Exception:  # the group may not exist yet
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the members did not get all {partitions} partitions in {timeout:.0f}s")


def _progress(feed: Feed, offsets: Offsets, pool: Pool) -> None:
    state = offsets.lag(timeout=3)
    where = "broker not answering" if state is None else f"committed {state[0]}, lag {state[1]}"
    members = ", ".join(f"{m}{' STOPPED' if m.stopped else ''}" for m in pool.alive())
    say(f"[dim]sent {sum(feed.sent.values())}, acked {len(feed.acked)}, {where}; "
        f"members {members}[/]")


def _print_summary(injector: Injector, feed: Feed, report: Report,
                   health: list[tuple[str, bool, str]], evidence: dict[str, int],
                   tracebacks: dict[str, int], result: dict[str, Any]) -> None:
    console.print(table("Fault log", ("#", "at", "fault", "pids", "detail"),
                        [(f.n, f"{f.at:.1f}s", f.fault, " ".join(map(str, f.pids)), f.detail)
                         for f in injector.log]))
    console.print(table("Faults by type", ("fault", "count"),
                        sorted(Counter(f.fault for f in injector.log).items())))
    console.print(table("Messages sent (acknowledged by kind)", ("kind", "sent", "acknowledged"),
                        [(k, feed.sent[k], feed.acked_kinds[k]) for k in sorted(feed.sent)]))
    console.print(table("What the members' logs show", ("sign", "lines"),
                        sorted(evidence.items())))
    if tracebacks:
        console.print(table("Tracebacks in the members' logs (logged, not necessarily fatal)",
                            ("exception (after: the log line before it)", "count"),
                            sorted(tracebacks.items())))
    console.print(report.figures_table())
    console.print(report.table())
    console.print(table("Run health", ("check", "", "detail"), [
        (name, "[green]PASS[/]" if ok else "[bold red]FAIL[/]", detail)
        for name, ok, detail in health]))
    heal = result["heal"]
    console.print(f"healed in {heal['healed_in']}s (bound {heal['bound']:.0f}s); "
                  f"{result['messages']['sent']} messages; {len(injector.log)} faults; "
                  f"{report.anomalies} anomalies")


def _cleanup(s: Settings, dbname: str | None, topics: list[str], group: str,
             logs: Path) -> None:
    """Remove the run's artefacts (best effort, each step retried a few times).

    A fresh admin client: one that lived through broker restarts can keep timing out
    on the group coordinator.
    """
    admin = AdminClient({**s.admin_config(), **QUIET})
    steps: list[tuple[str, Callable[[], list[Any]]]] = [
        ("group", lambda: list(admin.delete_consumer_groups(
            [group], request_timeout=15).values())),
    ]
    if topics:
        steps.append(("topics", lambda: list(admin.delete_topics(
            topics, operation_timeout=15).values())))
    for what, start in steps:
        for attempt in range(4):
            try:
                for f in start():
                    f.result(timeout=30)
                break
            except Exception as exc:  # the coordinator may still be settling after a restart
                if "GROUP_ID_NOT_FOUND" in str(exc) or "UNKNOWN_TOPIC" in str(exc):
                    break
                if attempt == 3:
                    say(f"[yellow]cleanup of the {what}: {exc}[/]")
                time.sleep(3)
    if dbname:
        try:
            _drop_database(s.dsn, dbname)
        except psycopg.Error as exc:
            say(f"[yellow]cleanup of the database: {exc}[/]")
    shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
