"""The chaos run's Kafka and PostgreSQL plumbing.

Creating, migrating and dropping the run's database; watching the group's lag
without joining it; the admin operations the faults use (a topic's
``max.message.bytes``, ``pg_terminate_backend``, ``scripts/kafka.sh restart``);
the outbox's topics (``kafka-idem topics create``) and whether it is drained;
and removing the run's artefacts at the end.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
)
from psycopg import sql

from kafka_idem.admin.migrate import distribute_store, migrate, migrate_app
from kafka_idem.settings import Settings
from tools import citus as citus_db
from tools.chaos.checker import ROOT
from tools.chaos.db_state import read_outbox
from tools.chaos.output import say

# Our own clients: the broker restarts are expected, their connection errors are noise.
QUIET = {"log_level": 2}


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


def local_bootstrap(bootstrap: str) -> bool:
    port = os.environ.get("KAFKA_IDEM_KAFKA_PORT", "39092")
    return bootstrap.strip() in (f"127.0.0.1:{port}", f"localhost:{port}")


def kafka_sh(action: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ROOT / "scripts" / "kafka.sh"), action], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)


def citus_sh(*args: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ROOT / "scripts" / "citus.sh"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)


def citus_url() -> str:
    """The Citus coordinator of ``--citus``: KAFKA_IDEM_TEST_CITUS_URL, else the local
    cluster, started (its URL is the script's last line)."""
    url = os.environ.get("KAFKA_IDEM_TEST_CITUS_URL")
    if url:
        return url
    out = citus_sh("start", timeout=600)
    if out.returncode:
        raise RuntimeError(f"scripts/citus.sh start failed: {out.stderr.strip()[-600:]}")
    return out.stdout.strip().splitlines()[-1]


def admin_cli(env: dict[str, str], *args: str,
              timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """``kafka-idem ARGS`` with the members' environment (e.g. ``pause APP --handler``)."""
    return subprocess.run([sys.executable, "-m", "kafka_idem.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def dlq_limit(admin: AdminClient, topic: str, value: str | None) -> None:
    """Set the topic's max.message.bytes (``None``: back to the broker default)."""
    entry = ConfigEntry("max.message.bytes", value or "",
                        incremental_operation=AlterConfigOpType.SET if value
                        else AlterConfigOpType.DELETE)
    res = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[entry])
    for f in admin.incremental_alter_configs([res], request_timeout=10).values():
        f.result(timeout=15)


def create_database(admin_dsn: str, name: str, *, citus: bool = False) -> str:
    if citus:  # on every node of the cluster, with the extension and the workers
        return citus_db.create_database(admin_dsn, name)
    with psycopg.connect(admin_dsn, autocommit=True, application_name="chaos-run") as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return psycopg.conninfo.make_conninfo(admin_dsn, dbname=name)


def migrate_database(dsn: str, schema: str, table: str, app: str) -> None:
    """The store's migrations, then ``app``'s own (``MODULE:APP``), as ``kafka-idem
    migrate --app`` runs them: payments.py's ``create_tables``, or the ORM example's
    metadata."""
    migrate(dsn, schema, table)
    distribute_store(dsn, schema, table, citus=None)  # on a Citus coordinator, as the CLI
    module, name = app.split(":")
    migrate_app(dsn, schema, getattr(importlib.import_module(module), name).migrations)


def create_outbox_topics(admin: AdminClient, env: dict[str, str], app: str, prefix: str,
                         partitions: int) -> list[str]:
    """``kafka-idem topics create APP`` in the members' environment (it adds the event
    topic and the relays' control topic); return every topic named ``prefix...``."""
    out = subprocess.run([sys.executable, "-m", "kafka_idem.cli", "topics", "create", app,
                          "--partitions", str(partitions)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    if out.returncode:
        raise RuntimeError(f"kafka-idem topics create {app} exited {out.returncode}: "
                           f"{(out.stdout + out.stderr).strip()[-600:]}")
    return sorted(t for t in admin.list_topics(timeout=15).topics if t.startswith(prefix))


def drained(dsn: str, schema: str) -> bool:
    """The payments outbox holds no unpublished row (or there is no outbox)."""
    left = read_outbox(dsn, schema, "payments")
    return left is None or left[0] == 0


def drop_database(admin_dsn: str, name: str, *, citus: bool = False) -> None:
    if citus:
        citus_db.drop_database(admin_dsn, name)
        return
    with psycopg.connect(admin_dsn, autocommit=True, application_name="chaos-run") as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))


def terminate_backends(dsn: str, dbname: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True, application_name="chaos-run") as conn:
        rows = conn.execute(
            "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND application_name LIKE 'kafka_idem%%' "
            "AND pid <> pg_backend_pid()", (dbname,)).fetchall()
    return [int(pid) for pid, done in rows if done]


def wait_assigned(admin: AdminClient, group: str, partitions: int, timeout: float) -> None:
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


def cleanup(s: Settings, dbname: str | None, topics: list[str], group: str,
            logs: Path, *, citus: bool = False) -> None:
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
            drop_database(s.dsn, dbname, citus=citus)
        except psycopg.Error as exc:
            say(f"[yellow]cleanup of the database: {exc}[/]")
    shutil.rmtree(logs, ignore_errors=True)


def prepared_left(dsn: str) -> tuple[str, bool, str]:
    """On a Citus cluster, after healing: Citus's recovery (run now, as its daemon does
    every minute) leaves no transaction prepared on any node for the run's database:
    every two-phase commit a fault cut short (a relay's multi-shard delete, a worker
    restarted mid-commit) was committed or rolled back."""
    with psycopg.connect(dsn, autocommit=True, application_name="chaos-run") as conn:
        recovered = conn.execute("SELECT recover_prepared_transactions()").fetchone()
    coordinator, workers = citus_db.nodes(dsn)
    left = []
    for host, port in [coordinator, *workers]:
        node = psycopg.conninfo.make_conninfo(dsn, host=host, port=str(port))
        with psycopg.connect(node, application_name="chaos-run") as conn:
            row = conn.execute("SELECT count(*) FROM pg_prepared_xacts WHERE database = "
                               "current_database()").fetchone()
        if row and row[0]:
            left.append(f"{host}:{port} {row[0]}")
    return ("no transaction left prepared on the Citus nodes", not left,
            "; ".join(left) or f"none (recovery found {recovered[0] if recovered else 0})")
