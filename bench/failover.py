"""How long a killed member's partitions stand still: ``python -m bench.failover``.

For each scenario, two ``kafka-idem run`` members of a small JSON app share a fresh
4-partition topic while a producer sends one message to every partition every 50 ms.
Once every partition is being processed, one member is stopped (SIGKILL, or SIGTERM
for the graceful rows), optionally started again at once with the same settings, and
the script measures, from the store's own completion times (``completed_at``, the
database clock), how long each of the stopped member's partitions went without a
processed message::

    stall(p) = first completed_at on p after the signal - the time of the signal

and prints the worst partition of each scenario (and the median of ``--rounds``).

    python -m bench.failover                          # every scenario, the default session timeout
    python -m bench.failover --session-timeout-ms 45000 --scenarios dynamic-kill
    python -m bench.failover --rounds 3

The members run with the settings a user gets (only the group, the instance id and
``--session-timeout-ms`` are set). Nothing is asserted: the figures are for reading
(the README's "Crash recovery" quotes them).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from psycopg import sql
from pydantic import BaseModel

from kafka_idem import App, Context
from kafka_idem.admin.migrate import migrate
from kafka_idem.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parent.parent
PARTITIONS = 4

# --- the app the members run (``kafka-idem run bench.failover:app``) ----------------------


class Tick(BaseModel):
    run: str
    n: int


app = App("failover")


@app.handler(topic=os.environ.get("FAILOVER_TOPIC", "failover"), model=Tick,
             key="{run}:tick:{n}", hash_fields=("n",))
def tick(msg: Tick, ctx: Context) -> None:
    return None  # the record's completed_at is the measurement


# --- scenarios ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    static: bool  # members have a group.instance.id
    sig: signal.Signals
    restart: bool  # the stopped member is started again at once, same settings
    what: str


SCENARIOS = [
    Scenario("dynamic-kill", False, signal.SIGKILL, False,
             "SIGKILL, no restart: the other member takes over"),
    Scenario("dynamic-kill-restart", False, signal.SIGKILL, True,
             "SIGKILL, restarted at once (a new member)"),
    Scenario("static-kill-restart", True, signal.SIGKILL, True,
             "SIGKILL, restarted at once with the same group.instance.id"),
    Scenario("static-kill", True, signal.SIGKILL, False,
             "SIGKILL, no restart: the other member takes over"),
    Scenario("dynamic-term", False, signal.SIGTERM, False,
             "SIGTERM (graceful), no restart"),
    Scenario("static-term", True, signal.SIGTERM, False,
             "SIGTERM (graceful), no restart"),
]


class Members:
    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *, instance: str | None) -> None:
        env = {**self.env, "KAFKA_IDEM_KAFKA": json.dumps({"client.id": name})}
        if instance:
            env["KAFKA_IDEM_GROUP_INSTANCE_ID"] = instance
        log = (self.logs / f"{name}.log").open("ab")  # a restart appends
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "kafka_idem.cli", "run", "bench.failover:app"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def signal(self, name: str, sig: signal.Signals) -> None:
        self.procs[name].send_signal(sig)

    def wait(self, name: str, timeout: float = 60) -> None:
        try:
            self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.procs[name].kill()
            self.procs[name].wait()

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class Feed(threading.Thread):
    """One message to every partition every ``period`` seconds."""

    def __init__(self, s: Settings, topic: str, run: str, period: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.producer = Producer({"bootstrap.servers": s.bootstrap_servers, "linger.ms": 0})
        self.topic, self.run_id, self.period = topic, run, period
        self.stopped = threading.Event()
        self.n = 0

    def run(self) -> None:
        while not self.stopped.is_set():
            for p in range(PARTITIONS):
                value = json.dumps({"run": self.run_id, "n": self.n}).encode()
                self.producer.produce(self.topic, value=value, partition=p)
                self.n += 1
            self.producer.poll(0)
            self.stopped.wait(self.period)
        self.producer.flush(10)


def assignments(admin: AdminClient, group: str) -> dict[str, set[int]]:
    """client.id -> assigned partitions, as the group coordinator reports them."""
    desc = admin.describe_consumer_groups([group])[group].result(timeout=10)
    return {m.client_id: {tp.partition for tp in m.assignment.topic_partitions}
            for m in desc.members}


def db_now(dsn: str) -> Any:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]


def first_after(dsn: str, topic: str, since: Any) -> dict[int, Any]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT kafka_partition, min(completed_at) FROM kafka_idem.task_idempotency "
            "WHERE kafka_topic = %s AND completed_at > %s GROUP BY 1", (topic, since)).fetchall()
    return {int(p): t for p, t in rows}


def wait_until(what: str, pred: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise SystemExit(f"failover: timed out waiting for {what}")


def assigned_after(log: Path, since: float) -> float | None:
    """Seconds from ``since`` (epoch) to the first ``assigned`` line of ``log`` after it."""
    for line in log.read_text(errors="replace").splitlines():
        if "action=assigned" not in line:
            continue
        at = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if at >= since:
            return at - since
    return None


def measure(sc: Scenario, s: Settings, dsn: str, admin: AdminClient, logs: Path,
            session_ms: int | None) -> tuple[float, float, float | None]:
    """Return (worst stall of the stopped member's partitions, worst of all partitions,
    when the restarted member was assigned partitions, if it was restarted)."""
    tag = uuid.uuid4().hex[:8]
    topic, group = f"failover-{tag}", f"failover-{tag}"
    for f in admin.create_topics([NewTopic(topic, PARTITIONS, 1),
                                  NewTopic(f"{topic}.dlq", PARTITIONS, 1)]).values():
        f.result(timeout=30)
    env = {**os.environ, "KAFKA_IDEM_BOOTSTRAP_SERVERS": s.bootstrap_servers,
           "KAFKA_IDEM_DATABASE_URL": dsn, "KAFKA_IDEM_GROUP_ID": group,
           "FAILOVER_TOPIC": topic, "PYTHONPATH": str(ROOT)}
    if session_ms is not None:
        env["KAFKA_IDEM_SESSION_TIMEOUT_MS"] = str(session_ms)
    members = Members(env, logs)
    feed = Feed(s, topic, tag)
    try:
        for name in ("m1", "m2"):
            members.start(name, instance=f"{tag}-{name}" if sc.static else None)
        feed.start()
        def settled() -> dict[str, set[int]] | None:
            a = assignments(admin, group)
            return a if len(a) == 2 and all(a.values()) and sum(
                len(v) for v in a.values()) == PARTITIONS else None

        wait_until("both members assigned", settled, 60)
        started = db_now(dsn)
        wait_until("every partition processed", lambda: len(
            first_after(dsn, topic, started)) == PARTITIONS, 60)
        time.sleep(1.0)
        victim = wait_until("a settled assignment", settled, 30)["m1"]  # as it is now
        members.signal("m1", sc.sig)
        at, wall = db_now(dsn), time.time()
        if sc.restart:
            members.wait("m1")
            members.start("m1", instance=f"{tag}-m1" if sc.static else None)
        budget = (session_ms or s.session_timeout_ms) / 1000 * 3 + 60
        resumed = wait_until("the stopped member's partitions processed again", lambda: (
            r if victim <= (r := first_after(dsn, topic, at)).keys() else None), budget)
        time.sleep(0.5)
        resumed = first_after(dsn, topic, at)
        stalls = {p: (t - at).total_seconds() for p, t in resumed.items()}
        joined = assigned_after(logs / "m1.log", wall) if sc.restart else None
        return max(stalls[p] for p in victim), max(stalls.values()), joined
    finally:
        feed.stopped.set()
        feed.join(15)
        members.stop_all()
        for f in admin.delete_topics([topic, f"{topic}.dlq"]).values():
            with contextlib.suppress(Exception):  # best effort: the report matters more
                f.result(timeout=30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default=",".join(sc.name for sc in SCENARIOS))
    ap.add_argument("--session-timeout-ms", type=int, default=None,
                    help="default: the settings' (KAFKA_IDEM_SESSION_TIMEOUT_MS or its default)")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(argv)
    chosen = [sc for sc in SCENARIOS if sc.name in args.scenarios.split(",")]
    s = load_settings()
    dbname = f"failover_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(s.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    dsn = psycopg.conninfo.make_conninfo(s.dsn, dbname=dbname)
    migrate(dsn, "kafka_idem", "task_idempotency")
    admin = AdminClient({"bootstrap.servers": s.bootstrap_servers})
    session = args.session_timeout_ms or s.session_timeout_ms
    print(f"session.timeout.ms = {session}; {PARTITIONS} partitions, 2 members, one message "
          f"per partition every 50 ms; {args.rounds} round(s)", flush=True)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="failover-") as tmp:
            for sc in chosen:
                figures = [measure(sc, s, dsn, admin, Path(tmp), args.session_timeout_ms)
                           for _ in range(args.rounds)]
                mine = statistics.median(f[0] for f in figures)
                worst = statistics.median(f[1] for f in figures)
                rows.append((sc, mine, worst, [round(f[0], 1) for f in figures]))
                joined = [round(f[2], 1) for f in figures if f[2] is not None]
                up = f"; the restarted member was assigned after {joined} s" if joined else ""
                print(f"  {sc.name:<22} {mine:6.1f} s  (all partitions: {worst:5.1f} s; "
                      f"rounds {rows[-1][3]}{up})  {sc.what}", flush=True)
    finally:
        with psycopg.connect(s.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(dbname)))
    print("\n| scenario | membership | stopped by | restarted | stall of its partitions |")
    print("| --- | --- | --- | --- | ---: |")
    for sc, mine, _worst, _ in rows:
        print(f"| {sc.name} | {'static' if sc.static else 'dynamic'} | {sc.sig.name} | "
              f"{'at once' if sc.restart else 'no'} | {mine:.1f} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
