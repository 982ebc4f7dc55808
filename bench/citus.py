"""The store on Citus beside one PostgreSQL, in one run: ``python -m bench.citus``.

    python -m bench.citus                   # 20,000 charges a row (about 4 minutes)
    python -m bench.citus --messages 5000   # quicker

Rows, each with a fresh database, a fresh topic of the same charges (64 tenants, 4
partitions) and one member draining it in a process of its own (``worker``):

* ``single_local``: one PostgreSQL, local mode, a transaction per message
  (``batch_path=false``), the payments example (``consumers/payments.py``);
* ``single_batch``: the same on the batch path (the default on one PostgreSQL);
* ``single_leased``: leased mode (claim, then call and completion);
* ``citus_local`` / ``citus_groups`` / ``citus_leased``: the same example on the local
  Citus cluster (a coordinator and two workers, ``scripts/citus.sh``), the store
  distributed, the tables co-located by tenant (``shard_key="{tenant_id}"``): local mode
  with a transaction per message (``batch_path=false``: each message one single-shard
  transaction), local mode with its default on Citus (a unit's messages in one
  transaction per worker: ``kafka_idem.consume.paths.worker_groups``), leased mode.

For each: messages/s (wall time from the member's start to the last offset committed),
CPU per message of the consumer process and of PostgreSQL (every process of the
server, or of the three Citus nodes), and an exactly-once check (one ledger row per
key). Then ``sql``: the statements of one message (claim, ledger row, balance upsert,
completion) on the Citus cluster, 4,000 messages over 64 tenants, committed three
ways: a transaction per message (single shard, what the member does), one transaction
per 500 across shards (two-phase commit), and one transaction per worker of each 500
(its messages' shards only: one-phase). Prints a table, writes bench/results-citus.json.
No assertions on timing; the exactly-once checks fail the run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from psycopg import sql
from rich.console import Console
from rich.table import Table

from bench.procstat import TICK, _children_of, _cpu, _pid_from, _stat
from kafka_idem.settings import load_settings
from tools import citus as citus_db

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results-citus.json"
TENANTS = 64
PARTITIONS = 4
ROWS = {  # row -> (database kind, mode, batch path)
    "single_local": ("single", "local", False),
    "single_batch": ("single", "local", True),
    "single_leased": ("single", "leased", False),
    "citus_local": ("citus", "local", False),
    "citus_groups": ("citus", "local", True),
    "citus_leased": ("citus", "leased", False),
}
console = Console(stderr=True)


# --- the servers' CPU ---------------------------------------------------------------------


def postmasters(kind: str) -> list[int]:
    local = Path(os.environ.get("KAFKA_IDEM_LOCAL_DIR", ROOT / ".local"))
    dirs = ([local / "postgres"] if kind == "single" else
            [local / "citus" / n / "postgres" for n in ("coordinator", "worker1", "worker2")])
    pids = [_pid_from(d / "data" / "postmaster.pid") for d in dirs]
    return [p for p in pids if p is not None]


def server_cpu(pids: list[int]) -> float:
    """CPU seconds of every process of these servers (:func:`node_cpu` summed)."""
    return sum(node_cpu(pids))


def node_cpu(pids: list[int]) -> list[float]:
    """CPU seconds of each server: its postmaster's own and its ended children's (reaped:
    cutime), and its live children's."""
    out = []
    for pm in pids:
        total = 0.0
        fields = _stat(pm)
        if fields is not None:
            total += _cpu(fields, children=True)
        for pid in _children_of(pm):
            fields = _stat(pid)
            if fields is not None:
                total += _cpu(fields)
        out.append(total)
    return out


# --- one row: a member draining a backlog --------------------------------------------------


def produce(bootstrap: str, topic: str, n: int) -> None:
    from consumers.payments import encode_charge

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    for i in range(n):
        while True:
            try:
                p.produce(topic, key=f"o{i}".encode(),
                          value=encode_charge(f"t{i % TENANTS}", f"o{i}", "5.00"))
                break
            except BufferError:
                p.poll(0.1)
    if p.flush(120):
        raise SystemExit("bench.citus: produce did not finish")


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """In the row's own process: the payments app on ``spec``'s database and topic, run
    until every offset is committed; wall and CPU seconds."""
    os.environ.update({"PAYMENTS_TOPIC": spec["topic"], "PAYMENTS_EVENTS": "off",
                       "PAYMENTS_MODE": spec["mode"]})
    from consumers import payments
    from kafka_idem.consume.runner import Runner

    app = payments.build_app(topic=spec["topic"], mode=spec["mode"], events=False,
                             database_url=spec["dsn"], bootstrap_servers=spec["bootstrap"],
                             group_id=spec["group"], batch_path=spec["batch_path"],
                             metrics_port=None)
    runner = Runner(app)
    started, cpu0 = time.monotonic(), cpu_now()
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    c = Consumer({"bootstrap.servers": spec["bootstrap"], "group.id": spec["group"]})
    want = [TopicPartition(spec["topic"], p) for p in range(PARTITIONS)]
    ends = {p: c.get_watermark_offsets(TopicPartition(spec["topic"], p))[1]
            for p in range(PARTITIONS)}
    first: tuple[int, float, float] | None = None  # (committed, wall, cpu) at the first commit
    while time.monotonic() - started < spec["timeout"]:
        got = {t.partition: t.offset for t in c.committed(want, timeout=10)}
        done = sum(max(got.get(p, 0), 0) for p in ends)
        if first is None and done:
            first = (done, time.monotonic(), cpu_now())
        if all(got.get(p, -1) >= end for p, end in ends.items()):
            break
        time.sleep(0.05)
    end, cpu1 = time.monotonic(), cpu_now()
    runner.stop()
    thread.join(60)
    c.close()
    assert first is not None
    # from the first commit on: the member's start (imports, connections, the group's
    # join) is not per message
    return {"seconds": end - first[1], "messages_timed": sum(ends.values()) - first[0],
            "done": end - started < spec["timeout"], "consumer_cpu": cpu1 - first[2],
            "consumer_cpu_with_start": cpu1 - cpu0}


def cpu_now() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def prepare(kind: str, s: Any, citus_url: str, name: str, topic: str) -> str:
    """The row's database with the store and the payments tables (co-located on Citus)."""
    if kind == "citus":
        dsn = citus_db.create_database(citus_url, name)
    else:
        with psycopg.connect(s.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        dsn = psycopg.conninfo.make_conninfo(s.dsn, dbname=name)
    env = {**os.environ, "KAFKA_IDEM_DATABASE_URL": dsn, "PAYMENTS_TOPIC": topic,
           "PAYMENTS_EVENTS": "off", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "kafka_idem.cli", "migrate", "--app",
                          "consumers.payments:app"], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=False)
    if out.returncode:
        raise SystemExit(f"bench.citus: migrate failed: {out.stderr[-800:]}")
    return dsn


def run_row(row: str, n: int, s: Any, citus_url: str, work: Path) -> dict[str, Any]:
    kind, mode, batch_path = ROWS[row]
    tag = uuid.uuid4().hex[:8]
    topic, name, group = f"bench-citus.{tag}.{row}", f"bench_citus_{tag}", f"bench-citus-{tag}"
    admin = AdminClient({"bootstrap.servers": s.bootstrap_servers})
    for f in admin.create_topics([NewTopic(topic, PARTITIONS, 1)]).values():
        f.result(timeout=30)
    dsn = prepare(kind, s, citus_url, name, topic)
    try:
        produce(s.bootstrap_servers, topic, n)
        spec = {"dsn": dsn, "topic": topic, "group": group, "mode": mode,
                "batch_path": batch_path, "bootstrap": s.bootstrap_servers, "timeout": 900}
        spec_file = work / f"{row}.json"
        spec_file.write_text(json.dumps(spec))
        pids = postmasters(kind)
        nodes0 = node_cpu(pids)
        done = subprocess.run([sys.executable, "-m", "bench.citus", "worker", str(spec_file)],
                              cwd=ROOT, capture_output=True, text=True, timeout=1000,
                              check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
        per_node = [b - a for a, b in zip(nodes0, node_cpu(pids), strict=True)]
        pg = sum(per_node)
        if done.returncode:
            raise SystemExit(f"bench.citus: {row} worker failed: {done.stderr[-1500:]}")
        out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        with psycopg.connect(dsn) as conn:
            rows, keys = conn.execute("SELECT count(*), count(DISTINCT idempotency_key) "
                                      "FROM payments.ledger").fetchone()  # type: ignore[misc]
        out.update({"row": row, "messages": n, "postgres_cpu": pg, "node_cpu": per_node,
                    "exactly_once": rows == keys == n, "ledger_rows": rows})
        return out
    finally:
        for f in admin.delete_topics([topic]).values():
            f.result(timeout=30)
        if kind == "citus":
            citus_db.drop_database(citus_url, name)
        else:
            with psycopg.connect(s.dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(
                    sql.Identifier(name)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.citus", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--rows", default=",".join(ROWS), help="a subset of " + ",".join(ROWS))
    ap.add_argument("--no-sql", action="store_true", help="skip the SQL strategies")
    args = ap.parse_args(argv)
    from bench.citus_sql import strategies
    from tools.chaos.services import citus_url as start_citus

    s = load_settings()
    url = start_citus()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-citus-{uuid.uuid4().hex[:6]}"
    work.mkdir(parents=True)
    results: dict[str, Any] = {"machine": {"cores": os.cpu_count(), "tick": TICK},
                               "messages": args.messages, "rows": {}}
    for row in args.rows.split(","):
        console.print(f"[bold]{row}[/] ...")
        results["rows"][row] = r = run_row(row, args.messages, s, url, work)
        console.print(f"  {r['messages_timed'] / r['seconds']:,.0f} msgs/s, exactly once: "
                      f"{r['exactly_once']}")
    if not args.no_sql:
        console.print("[bold]sql strategies[/] ...")
        results["sql"] = strategies(url)
    RESULTS.write_text(json.dumps(results, indent=2))
    print_table(results)
    return 0 if all(r["exactly_once"] for r in results["rows"].values()) else 1


def print_table(results: dict[str, Any]) -> None:
    t = Table(title=f"kafka_idem on Citus beside one PostgreSQL ({results['messages']:,} "
              "charges a row)")
    for col in ("row", "msgs/s", "consumer µs/msg", "PostgreSQL µs/msg",
                "of which coordinator", "exactly once"):
        t.add_column(col)
    rows = results["rows"]
    for name, r in rows.items():
        n, timed = r["messages"], r["messages_timed"]
        coordinator = (f"{r['node_cpu'][0] / n * 1e6:,.0f}" if len(r["node_cpu"]) > 1
                       else "-")
        t.add_row(name, f"{timed / r['seconds']:,.0f}", f"{r['consumer_cpu'] / timed * 1e6:,.0f}",
                  f"{r['postgres_cpu'] / n * 1e6:,.0f}", coordinator, str(r["exactly_once"]))
    Console().print(t)
    for single, dist in (("single_local", "citus_local"), ("single_batch", "citus_groups"),
                         ("single_leased", "citus_leased"), ("citus_local", "citus_groups")):
        if single in rows and dist in rows:
            a, b = rows[single], rows[dist]
            extra = (b["postgres_cpu"] / b["messages"] - a["postgres_cpu"] / a["messages"]) * 1e6
            wall = (b["seconds"] / b["messages_timed"] - a["seconds"] / a["messages_timed"]) * 1e6
            print(f"{dist} over {single}: {extra:+,.0f} µs of PostgreSQL CPU and {wall:+,.0f} "
                  "µs of wall time per message")
    for name, r in results.get("sql", {}).items():
        print(f"sql {name}: {r['rate']:,.0f} msgs/s, {r['postgres_us']:,.0f} µs of PostgreSQL "
              f"CPU per message ({r['coordinator_us']:,.0f} on the coordinator), "
              f"{r['commits']} commits, two-phase: {r['prepared']}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        print(json.dumps(worker(json.loads(Path(sys.argv[2]).read_text()))))
        sys.exit(0)
    sys.exit(main())
