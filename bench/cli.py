"""The ``cli`` row: the batch path's app run as a user runs it, ``kafka-idem run``.

``python -m kafka_idem.cli run consumers.payments:app`` in a process of its own, on the
main topic (the same payloads as the ``batch`` row), with the settings' defaults: only
what a deployment must name comes from the environment (the broker, the database, the
store's schema and table, the group, the topic) and ``PAYMENTS_EVENTS=off`` (the ``batch``
row's app has no events either). Its logging, its metrics registry, its signal handling
and its own defaults (batch size, local workers, linger) are the CLI's.

The bench cannot see inside that process, so its clock is read from outside, by
polling the group's committed offsets every 20 ms (the bench's worker process does
that, on a core it shares): it starts at the first poll that sees a committed offset
(a batch done) and stops at the first that sees the topic's end; msgs/s counts the
messages committed in between. The CPU of the member (its whole process), of
PostgreSQL and of the broker is read over the same window. The effects are checked
as for the other framework rows.

The two rows' clocks differ (the ``batch`` row's starts at its first fetched batch, in
process, this one's after the first committed batch), so the ``cli`` target (issue 38:
within 0.85 x the ``batch`` row of the same run) compares a third clock that both rows
have alike, :func:`db_clock_rate`: the database's, read from the records they wrote.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaException, TopicPartition
from psycopg import sql

from bench import procstat
from bench.effects import TABLE, check_effects, ledger_state
from bench.workload import Plan, tenants_of
from kafka_idem.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
APP = "consumers.payments:app"
POLL = 0.02


def member_env(s: Settings, spec: dict[str, Any]) -> dict[str, str]:
    """The member's environment: the deployment's names, nothing tuned."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAFKA_IDEM_")}
    return {**env, "PAYMENTS_TOPIC": spec["topic"], "PAYMENTS_EVENTS": "off",
            "PAYMENTS_MODE": "local", "KAFKA_IDEM_BOOTSTRAP_SERVERS": s.bootstrap_servers,
            "KAFKA_IDEM_DATABASE_URL": s.dsn, "KAFKA_IDEM_SCHEMA_NAME": spec["schema"],
            "KAFKA_IDEM_TABLE": TABLE, "KAFKA_IDEM_GROUP_ID": spec["group"]}


def throughput(s: Settings, spec: dict[str, Any], out: dict[str, Any]) -> None:
    """Drain the topic with one ``kafka-idem run`` member; fill ``out`` as
    :func:`bench.worker.drain` does."""
    ends = {int(p): int(o) for p, o in spec["ends"].items()}
    total = sum(ends.values())
    plan = Plan.from_json(spec["plan"])
    mark, before = ledger_state(s.dsn, tenants_of(plan.tag))
    tps = [TopicPartition(spec["topic"], p) for p in ends]
    probe = Consumer(s.consumer_config(spec["group"]))
    log = Path(spec["work"]) / f"cli-{spec['phase']}.log"
    started = time.perf_counter()
    with open(log, "wb") as log_file:
        member = subprocess.Popen(
            [sys.executable, "-m", "kafka_idem.cli", "run", APP], cwd=ROOT,
            env=member_env(s, spec), stdout=log_file, stderr=subprocess.STDOUT)
    try:
        window = _window(s, spec, member, probe, tps, ends, started)
    finally:
        member.terminate()  # SIGTERM: the member drains and leaves the group
        try:
            member.wait(timeout=60)
        except subprocess.TimeoutExpired:
            member.kill()
            member.wait()
        probe.close()
    out["member_exit"] = member.returncode
    out["log"] = str(log)
    if window is None:
        out["check"] = (f"timed out after {spec['timeout']:.0f}s or the member exited "
                        f"({member.returncode}); its log: {log}")
        return
    first_at, first_done, end_at, cpu = window
    out["join_seconds"] = first_at - started
    intents, _messages = plan.build()
    out["ok"], out["check"] = check_effects(s.dsn, spec["schema"], intents, mark, before)
    if first_done < total:
        out["seconds"] = end_at - first_at
        out["window_messages"] = total - first_done
        out["cpu"] = cpu
    else:  # no rate: the first poll saw every message committed (a tiny topic)
        out["check"] += "; every message committed at the first poll: none timed"


def _window(
    s: Settings, spec: dict[str, Any], member: subprocess.Popen[bytes], probe: Consumer,
    tps: list[TopicPartition], ends: dict[int, int], started: float,
) -> tuple[float, int, float, dict[str, float | None]] | None:
    """(clock start, messages committed then, clock end, CPU over the window), or None."""
    pids = procstat.Pids(procstat.database_of(s.dsn))
    watch: procstat.Watch | None = None
    first: tuple[float, int] | None = None
    while time.perf_counter() - started < spec["timeout"] and member.poll() is None:
        try:
            done = {tp.partition: tp.offset for tp in probe.committed(tps, timeout=10)}
        except KafkaException:  # e.g. the coordinator moved: ask again
            continue
        now = time.perf_counter()
        committed = sum(max(done.get(p, 0), 0) for p in ends)
        if first is None and committed > 0:
            first = (now, committed)
            watch = procstat.Watch(pids, pid=member.pid).start()
        if all(done.get(p, -1) >= end for p, end in ends.items()):
            assert first is not None and watch is not None
            return first[0], first[1], now, watch.stop()
        time.sleep(POLL)
    if watch is not None:
        watch.stop()
    return None


def db_clock_rate(dsn: str, schema: str) -> float | None:
    """msgs/s by the database's clock: the records written after the first batch's, over
    the time from that batch's insert to the last one's (every record of a batch has
    its write's time: ``batch_insert_done``, ``batch_clock``). None with fewer than two batches."""
    query = sql.SQL(
        "SELECT count(*) FILTER (WHERE created_at > t.first), "
        "extract(epoch FROM t.last - t.first) FROM {records}, "
        "(SELECT min(created_at) AS first, max(created_at) AS last FROM {records}) AS t "
        "GROUP BY t.first, t.last").format(records=sql.Identifier(schema, TABLE))
    with psycopg.connect(dsn) as conn:
        row = conn.execute(query).fetchone()
    if row is None or not row[1]:
        return None
    return float(row[0]) / float(row[1])
