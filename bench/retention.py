"""Background retention under load (issue 35, part 4): ``python -m bench.retention``.

A fresh database holds ``--records`` (1,000,000) succeeded records of the payments app
older than the window (``--window``, 2d: three days old, written by one ``INSERT ...
SELECT generate_series`` and a legal completion of each,
:func:`tools.old_records.fill`), and ``--keep``
(10,000) succeeded records inside it (one day old). Then, in this process, two members
of the payments example (local mode, the batch path, the bulk handler, events off)
each drain a backlog of ``--messages`` (200,000) charges on a topic of their own
(4 partitions, ``retention.ms`` one day, so the window passes the start's check):

1. **without**: retention off;
2. **with**: ``retention`` = the window and ``retention_interval_seconds`` 0.5, so the
   member's own retention thread starts purging at once, in its batches (1,000) and
   its pacing, while the member drains the backlog.

msgs/s of each run counts from the first message done to the last (the group's join
left out), from the member's ``kafka_idem_messages_total``; the ratio with / without
is the issue's target (>= 0.8). ``--pairs`` repeats the pair (the old records filled
again), in alternating order (without-with, with-without...), so a drift of the
machine does not always count against the same run; the lowest ratio is printed last.
The purge's rate during the "with" run, and the share of the run it overlapped (a purge
that ended early measured less), come from ``kafka_idem_retention_purged_total``; then a
member with nothing to consume purges the rest: the purge's own rate, unloaded.

Checked at the end (exit 1 otherwise): every old record removed, every record inside
the window kept, each run's charges succeeded once (one record per key). The
database is dropped at the end; the topics are deleted.

    python -m bench.retention                       # about 3 minutes on the bench VM
    python -m bench.retention --pairs 2             # about 6
    python -m bench.retention --records 2000 --messages 300 --keep 50   # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
import uuid
from typing import Any

import psycopg
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from psycopg import sql

from bench.contention import create_database, drop_database
from bench.workload import Plan, produce_backlog
from consumers import payments
from kafka_idem.consume.runner import Runner
from kafka_idem.settings import Settings, load_settings
from kafka_idem.settings.durations import parse_duration
from tools.old_records import fill

SCHEMA, TABLE = "kafka_idem", "task_idempotency"
NAMESPACE = "bench-retention"
DAY_MS = 86_400_000


def count(dsn: str, prefix: str, namespace: str = NAMESPACE) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql.SQL(
            "SELECT count(*) FROM {} WHERE namespace = %s AND starts_with(idempotency_key, %s) "
            "AND status = 'succeeded'").format(sql.Identifier(SCHEMA, TABLE)),
            (namespace, prefix)).fetchone()
    return int(row[0]) if row else 0


def older_left(dsn: str, window: str) -> bool:
    """Whether a succeeded record older than ``window`` is left (down the status index)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql.SQL(
            "SELECT EXISTS (SELECT 1 FROM {} WHERE status = 'succeeded' AND updated_at < "
            "clock_timestamp() - make_interval(secs => %s))").format(
            sql.Identifier(SCHEMA, TABLE)), (parse_duration(window),)).fetchone()
    return bool(row and row[0])


def _topic(s: Settings, name: str) -> None:
    admin = AdminClient(s.admin_config())
    new = [NewTopic(t, num_partitions=4, replication_factor=1,
                    config={"retention.ms": str(DAY_MS)}) for t in (name, f"{name}.dlq")]
    for f in admin.create_topics(new).values():
        f.result(timeout=30)


def drain(s: Settings, dsn: str, topic: str, messages: int, *, timeout: float,
          retention: str | None) -> dict[str, Any]:
    """One member drains ``topic``; msgs/s from its first message done to its last,
    and, with ``retention``, what its retention thread removed meanwhile and when."""
    extra: dict[str, Any] = ({"retention": retention, "retention_interval_seconds": 0.5}
                             if retention else {})
    app = payments.build_app(topic=topic, name=NAMESPACE, events=False, database_url=dsn,
                             bootstrap_servers=s.bootstrap_servers, kafka=s.kafka,
                             group_id=f"bench-retention-{uuid.uuid4().hex[:8]}",
                             schema_name=SCHEMA, **extra)
    runner = Runner(app)
    thread = threading.Thread(target=runner.run, name="bench-member", daemon=True)

    def done() -> float:
        return _total(runner.metrics.messages)

    purged_at: list[tuple[float, float]] = []  # (time, removed so far) while it grows
    out: dict[str, Any] = {"retention": retention}
    started = time.perf_counter()
    thread.start()
    first = first_n = end = 0.0
    try:
        while (n := done()) < messages:
            now = time.perf_counter()
            if now - started > timeout:
                out["check"] = f"{n:,.0f} of {messages:,} messages in {timeout:.0f}s"
                return out
            if not first and n > 0:
                first, first_n = now, n
            _note(purged_at, now, float(runner.metrics.retention_purged._value.get()))
            time.sleep(0.02)
        end = time.perf_counter()
        _note(purged_at, end, float(runner.metrics.retention_purged._value.get()))
    finally:
        if retention and out.get("check") is None:
            out["purge_in_run"] = _during(purged_at, first, end)
        runner.stop()
        thread.join(60)
    out.update(seconds=end - first, timed=messages - first_n,
               msgs_per_s=(messages - first_n) / max(end - first, 1e-9))
    return out


def _total(counter: Any) -> float:
    return float(sum(s.value for m in counter.collect() for s in m.samples
                     if s.name.endswith("_total")))


def _note(series: list[tuple[float, float]], now: float, value: float) -> None:
    if not series or value != series[-1][1]:
        series.append((now, value))


def _during(series: list[tuple[float, float]], first: float, end: float) -> dict[str, Any]:
    """What the purge removed during the timed window [first, end], and its rate."""
    grew = [(t, v) for t, v in series if v > 0]
    if not grew:
        return {"removed": 0, "overlap": 0.0}
    start_t, last_t = grew[0][0], grew[-1][0]
    inside = [(t, v) for t, v in grew if first <= t <= end]
    removed = (inside[-1][1] - inside[0][1]) if len(inside) > 1 else 0.0
    overlap = max(0.0, min(end, last_t) - max(first, start_t)) / max(end - first, 1e-9)
    return {"removed": removed, "overlap": round(overlap, 3),
            "started_after_s": round(start_t - first, 2), "last_seen_s": round(last_t - first, 2)}


def purge_rest(dsn: str, s: Settings, topic: str, window: str, timeout: float
               ) -> dict[str, Any]:
    """Let a member with retention on (and nothing to consume) purge what is left: the
    purge's own rate, from its first record removed to its last, unloaded."""
    app = payments.build_app(topic=topic, name=NAMESPACE, events=False, database_url=dsn,
                             bootstrap_servers=s.bootstrap_servers, kafka=s.kafka,
                             group_id=f"bench-retention-{uuid.uuid4().hex[:8]}",
                             schema_name=SCHEMA, retention=window,
                             retention_interval_seconds=0.5)
    runner = Runner(app)
    thread = threading.Thread(target=runner.run, name="bench-purger", daemon=True)
    thread.start()
    series: list[tuple[float, float]] = []
    deadline = time.perf_counter() + timeout
    try:
        while older_left(dsn, window) and time.perf_counter() < deadline:
            _note(series, time.perf_counter(), float(runner.metrics.retention_purged._value.get()))
            time.sleep(0.2)
        _note(series, time.perf_counter(), float(runner.metrics.retention_purged._value.get()))
    finally:
        runner.stop()
        thread.join(60)
    grew = [(t, v) for t, v in series if v > 0]
    if len(grew) < 2:
        return {"removed": grew[-1][1] if grew else 0}
    (t0, v0), (t1, v1) = grew[0], grew[-1]
    return {"removed": v1, "per_s": (v1 - v0) / (t1 - t0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.retention", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--records", type=int, default=1_000_000, help="old succeeded records")
    p.add_argument("--keep", type=int, default=10_000, help="records inside the window")
    p.add_argument("--messages", type=int, default=200_000, help="charges per run")
    p.add_argument("--window", default="2d", help="retention (the topics keep one day)")
    p.add_argument("--pairs", type=int, default=1, help="pairs of runs, in alternating order")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", dest="as_json", action="store_true")
    args = p.parse_args(argv)
    s = load_settings()
    tag = uuid.uuid4().hex[:8]
    dbname = f"bench_retention_{tag}"
    dsn = create_database(s, dbname)
    topics: list[str] = []
    result: dict[str, Any] = {"records": args.records, "keep": args.keep,
                              "messages": args.messages, "window": args.window,
                              "database": dbname, "pairs": []}
    try:
        fill(dsn, n=args.keep, age_seconds=86400, prefix="keep:", namespace=NAMESPACE)
        for i in range(args.pairs):
            result["pairs"].append(_pair(s, dsn, args, f"{tag}{i}", topics, first=i % 2 == 0))
        ok, check = _check(dsn, args)
        result.update(ok=ok, check=check)
    finally:
        drop_database(s, dbname)
        admin = AdminClient(s.admin_config())
        gone = [*topics, *(f"{t}.dlq" for t in topics)]
        for f in admin.delete_topics(gone, operation_timeout=30).values():
            with contextlib.suppress(Exception):  # a topic left behind is no result
                f.result(timeout=30)
    _say(result, as_json=args.as_json)
    return 0 if result["ok"] else 1


def _pair(s: Settings, dsn: str, args: argparse.Namespace, tag: str, topics: list[str], *,
          first: bool) -> dict[str, Any]:
    """The old records filled, then a run without the purge and one with it (in this
    order when ``first``, else the other way round), then the rest purged alone."""
    t0 = time.perf_counter()
    fill(dsn, n=args.records, age_seconds=3 * 86400, prefix=f"old{tag}:", namespace=NAMESPACE)
    out: dict[str, Any] = {"fill_seconds": round(time.perf_counter() - t0, 1)}
    order = ["without", "with"] if first else ["with", "without"]
    mine = {name: f"bench.retention.{tag}.{name}" for name in order}
    for name, topic in mine.items():
        _topic(s, topic)
        topics.append(topic)
        _, msgs = Plan(f"{tag}-{name}", args.messages, 0.0, 1).build()
        produce_backlog(s, topic, msgs)
    for name in order:
        out[name] = drain(s, dsn, mine[name], args.messages, timeout=args.timeout,
                          retention=args.window if name == "with" else None)
    out["purge_after"] = purge_rest(dsn, s, mine["with"], args.window, args.timeout)
    return out


def _check(dsn: str, args: argparse.Namespace) -> tuple[bool, str]:
    old, kept = count(dsn, "old"), count(dsn, "keep:")
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql.SQL(
            "SELECT count(*), count(DISTINCT idempotency_key) FROM {} WHERE namespace = %s "
            "AND starts_with(idempotency_key, 'bench-') AND status = 'succeeded'").format(
            sql.Identifier(SCHEMA, TABLE)), (NAMESPACE,)).fetchone()
    charges = int(row[0]) if row else 0
    runs = 2 * args.messages * args.pairs
    ok = old == 0 and kept == args.keep and charges == runs
    return ok, (f"old records left {old:,} (expected 0); inside the window kept {kept:,} of "
                f"{args.keep:,}; charges succeeded {charges:,} of {runs:,}")


def _say(r: dict[str, Any], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(r, indent=2, default=str))
        return
    print(f"store: {r['records']:,} old succeeded records per pair + {r['keep']:,} inside "
          f"the window ({r['window']})")
    ratios = []
    for i, pair in enumerate(r["pairs"]):
        w, b = pair.get("without", {}), pair.get("with", {})
        order = "without, then with" if list(pair)[1] == "without" else "with, then without"
        print(f"pair {i + 1} ({order}; filled in {pair['fill_seconds']:.1f}s):")
        for name, run in (("without purge", w), ("with purge", b)):
            if "msgs_per_s" in run:
                print(f"  batch path {name}: {run['msgs_per_s']:,.0f} msgs/s "
                      f"({run['timed']:,.0f} messages in {run['seconds']:.1f}s)")
            else:
                print(f"  batch path {name}: {run.get('check')}")
        if "msgs_per_s" in w and "msgs_per_s" in b:
            ratios.append(b["msgs_per_s"] / w["msgs_per_s"])
            print(f"  ratio with / without: {ratios[-1]:.2f} (target >= 0.8)")
        during = b.get("purge_in_run", {})
        if during:
            seconds = b.get("seconds", 0.0) or 1e-9
            print(f"  purge during the run: {during['removed']:,.0f} records removed "
                  f"({during['removed'] / seconds:,.0f}/s), overlapping "
                  f"{during['overlap']:.0%} of it")
        after = pair.get("purge_after", {})
        if "per_s" in after:
            print(f"  purge alone (the rest): {after['per_s']:,.0f} records/s")
    if ratios:
        print(f"ratio with / without, lowest of {len(ratios)}: {min(ratios):.2f}")
    print(f"{'ok' if r.get('ok') else 'FAILED'}: {r.get('check')}")


if __name__ == "__main__":
    sys.exit(main())
