"""A handler's ``max_rate`` held per member: ``python -m bench.rate``.

``--members`` ``kafka-idem run bench.rate:app`` processes share two fresh topics, each
with a backlog: the **limited** topic's handler has ``max_rate=--rate``, the **raw**
topic's none (the unthrottled baseline, in the same members, the same run). The limited
topic has two partitions a member (at least 4), the raw one a single partition, so that
the group's balanced assignment (over all partitions, not per topic) gives every member
some of the limited topic: a member without any would add nothing to the group's rate.
Each handler call writes a row in the same transaction (the member's pid, the
database's ``clock_timestamp()``). Once every member is processing, the script counts
each member's limited rows over ``--seconds`` of the database's clock (the first burst,
a second's worth, is before the window) and prints msgs/s per member and for the group,
the raw handler's rate over its own rows, and the exactly-once check (no offset run
twice, one ``succeeded`` record per row); exit 1 if it fails. Nothing is asserted on
time: the figures are for reading (docs/PERFORMANCE.md, "Rate limits")::

    python -m bench.rate                              # max_rate=50, 2 members, 30 s, local mode
    python -m bench.rate --mode leased --members 1    # or key-ordered: --mode keyed
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from psycopg import sql
from pydantic import BaseModel

from kafka_idem import App, Context
from kafka_idem.admin.migrate import migrate
from kafka_idem.settings import load_settings

ROOT = Path(__file__).resolve().parent.parent
TRACE_SQL = """CREATE TABLE IF NOT EXISTS public.rate_trace (
    member integer NOT NULL, topic text NOT NULL, kafka_partition integer NOT NULL,
    kafka_offset bigint NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"""

# --- the app the members run (``kafka-idem run bench.rate:app``) --------------------------


class Item(BaseModel):
    n: int


app = App("rate")
_MODE = os.environ.get("RATE_MODE", "local")
_OPTS: dict[str, Any] = {"mode": "local" if _MODE == "local" else "leased",
                         **({"concurrency": 8} if _MODE == "keyed" else {})}


def _trace(ctx: Context) -> None:
    ctx.tx.execute("INSERT INTO public.rate_trace (member, topic, kafka_partition, "
                   "kafka_offset) VALUES (%s, %s, %s, %s)",
                   (os.getpid(), ctx.topic, ctx.partition, ctx.offset))


@app.handler(topic=os.environ.get("RATE_TOPIC", "rate-limited"), model=Item,
             key="limited:{n}", hash_fields=("n",),
             max_rate=float(os.environ.get("RATE_MAX", "50")), **_OPTS)
def limited(msg: Item, ctx: Context) -> None:
    _trace(ctx)


@app.handler(topic=os.environ.get("RATE_RAW_TOPIC", "rate-raw"), model=Item,
             key="raw:{n}", hash_fields=("n",), **_OPTS)
def raw(msg: Item, ctx: Context) -> None:
    _trace(ctx)


# --- the run ---------------------------------------------------------------------------------


def _produce(bootstrap: str, topic: str, n: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    for i in range(n):
        producer.produce(topic, key=str(i).encode(), value=json.dumps({"n": i}).encode())
        if i % 1000 == 0:
            producer.poll(0)
    if producer.flush(60):
        raise SystemExit(f"rate: producing to {topic} did not finish")


def _one(dsn: str, query: str, params: Any = None) -> Any:
    with psycopg.connect(dsn) as conn:
        return conn.execute(query, params).fetchone()


def _wait(what: str, pred: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"rate: timed out waiting for {what}")
        time.sleep(0.2)


def _members(n: int, env: dict[str, str], logs: Path) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen(
        [sys.executable, "-m", "kafka_idem.cli", "run", "bench.rate:app"], cwd=ROOT, env=env,
        stdout=(logs / f"m{i}.log").open("wb"), stderr=subprocess.STDOUT)
        for i in range(n)]


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _report(dsn: str, args: argparse.Namespace, limited_t: str, raw_t: str,
            window: tuple[Any, Any]) -> bool:
    """Print the figures; return whether the exactly-once check passed."""
    with psycopg.connect(dsn) as conn:
        per = conn.execute("SELECT member, count(*) FROM public.rate_trace WHERE topic = %s "
                           "AND at >= %s AND at < %s GROUP BY 1 ORDER BY 1",
                           (limited_t, *window)).fetchall()
        n_raw, first, last = conn.execute(
            "SELECT count(*), min(at), max(at) FROM public.rate_trace WHERE topic = %s",
            (raw_t,)).fetchone() or (0, None, None)
        rows, once = conn.execute(
            "SELECT count(*), count(DISTINCT (topic, kafka_partition, kafka_offset)) "
            "FROM public.rate_trace").fetchone() or (0, 0)
        succeeded = conn.execute("SELECT count(*) FROM kafka_idem.task_idempotency "
                                 "WHERE status = 'succeeded'").fetchone()
    seconds = (window[1] - window[0]).total_seconds()
    for member, n in per:
        print(f"  member {member}: {n} msgs in {seconds:.1f} s = {n / seconds:.1f} msgs/s "
              f"(max_rate={args.rate:g})")
    total = sum(n for _, n in per)
    print(f"  group: {total / seconds:.1f} msgs/s over {len(per)} member(s) "
          f"(max_rate x members = {args.rate * len(per):g})")
    span = (last - first).total_seconds() if n_raw > 1 else 0.0
    if span > 0:
        print(f"  raw handler (no max_rate, same members): {n_raw} msgs in {span:.1f} s = "
              f"{n_raw / span:.0f} msgs/s")
    ok = rows == once and succeeded == (rows,)
    print(f"  exactly once: {'ok' if ok else 'FAILED'} ({rows} handler calls, {once} distinct "
          f"offsets, {succeeded[0] if succeeded else 0} succeeded records)")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rate", description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=50.0, help="the limited handler's max_rate")
    ap.add_argument("--members", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=30.0, help="the measured window")
    ap.add_argument("--mode", choices=("local", "leased", "keyed"), default="local")
    ap.add_argument("--raw-messages", type=int, default=20_000)
    args = ap.parse_args(argv)
    s = load_settings()
    tag = uuid.uuid4().hex[:8]
    limited_t, raw_t, dbname = f"rate-{tag}-limited", f"rate-{tag}-raw", f"rate_{tag}"
    admin = AdminClient({"bootstrap.servers": s.bootstrap_servers})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still clean up (finally)
    parts = {limited_t: max(4, 2 * args.members), raw_t: 1}
    made = [limited_t, raw_t, f"{limited_t}.dlq", f"{raw_t}.dlq"]
    for f in admin.create_topics([NewTopic(t, parts[t.removesuffix(".dlq")], 1)
                                  for t in made]).values():
        f.result(timeout=30)
    with psycopg.connect(s.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    dsn = psycopg.conninfo.make_conninfo(s.dsn, dbname=dbname)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        migrate(dsn, "kafka_idem", "task_idempotency")
        with psycopg.connect(dsn) as conn:
            conn.execute(TRACE_SQL)
        # A backlog that outlasts the warm-up and the window, at the limit of every member.
        _produce(s.bootstrap_servers, limited_t, int(args.rate * args.members
                                                     * (args.seconds + 40)) + 100)
        _produce(s.bootstrap_servers, raw_t, args.raw_messages)
        env = {**os.environ, "KAFKA_IDEM_BOOTSTRAP_SERVERS": s.bootstrap_servers,
               "KAFKA_IDEM_DATABASE_URL": dsn, "KAFKA_IDEM_GROUP_ID": f"rate-{tag}",
               "RATE_TOPIC": limited_t,
               "RATE_RAW_TOPIC": raw_t, "RATE_MAX": str(args.rate), "RATE_MODE": args.mode,
               "PYTHONPATH": str(ROOT)}
        print(f"max_rate={args.rate:g} per member, {args.members} member(s), {args.mode} mode, "
              f"{parts[limited_t]} limited partitions, 1 raw; window {args.seconds:g} s; load "
              f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
        with tempfile.TemporaryDirectory(prefix="rate-") as logs:
            procs = _members(args.members, env, Path(logs))
            _wait("every member processing the limited topic", lambda: _one(
                dsn, "SELECT count(DISTINCT member) FROM public.rate_trace WHERE topic = %s",
                (limited_t,)) == (args.members,), 120)
            time.sleep(2.0)  # the first burst (a second's worth) spent, the group settled
            start = _one(dsn, "SELECT clock_timestamp()")[0]
            time.sleep(args.seconds + 0.5)
            end = start + dt.timedelta(seconds=args.seconds)
            _stop(procs)
            if any(p.returncode not in (0, -15) for p in procs):
                print(f"  a member failed: {(Path(logs) / 'm0.log').read_text()[-2000:]}")
                return 1
        return 0 if _report(dsn, args, limited_t, raw_t, (start, end)) else 1
    finally:
        _stop(procs)
        for f in admin.delete_topics(made).values():
            with contextlib.suppress(Exception):  # best effort: the report matters more
                f.result(timeout=30)
        with psycopg.connect(s.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(dbname)))


if __name__ == "__main__":
    raise SystemExit(main())
