"""One scenario's own artefacts: a fresh store schema (``verify_<run>_s<id>``), a
business schema next to it (``..._biz``: ledger, handler calls, record history), fresh
topics and a consumer group, the member processes it starts, and the clean-up."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql
from psycopg.rows import dict_row

from kafka_idem.admin.migrate import distribute_store, migrate
from kafka_idem.settings import Settings
from kafka_idem.store import Store
from kafka_idem.verify.app import APP_NAME, ENV_PREFIX, Config, business_tables
from kafka_idem.verify.kafka import Kafka

TABLE = "task_idempotency"
OUTBOX_TABLE = "outbox"
APP_SPEC = "kafka_idem.verify.app:app"
# Member settings: small leases and timeouts, so a scenario takes seconds.
MEMBER_SETTINGS = {
    "SESSION_TIMEOUT_MS": "6000",
    "BATCH_MAX_WAIT_SECONDS": "0.05",
    "LEASE_SECONDS": "1.5",
    "BUSY_RETRY_SECONDS": "0.2",
    "MAX_ATTEMPTS": "5",
    "BACKOFF_BASE_SECONDS": "0.2",
    "BACKOFF_CAP_SECONDS": "2",
    "METRICS_SAMPLE_SECONDS": "5",
    "IDLE_IN_TRANSACTION_TIMEOUT_SECONDS": "30",
}

HISTORY_TABLE = """
CREATE TABLE {history} (
    id bigserial PRIMARY KEY, op text, idempotency_key text, status text, attempts integer,
    owner_token uuid, completed_token uuid, lease_until timestamptz,
    next_attempt_at timestamptz, last_failure_at timestamptz, error_kind text,
    updated_at timestamptz, at timestamptz NOT NULL DEFAULT clock_timestamp());
"""
HISTORY_TRIGGER = """
CREATE FUNCTION {fn}() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    INSERT INTO {history} (op, idempotency_key, status, attempts, owner_token,
        completed_token, lease_until, next_attempt_at, last_failure_at, error_kind, updated_at)
    VALUES (TG_OP, NEW.idempotency_key, NEW.status, NEW.attempts, NEW.owner_token,
        NEW.completed_token, NEW.lease_until, NEW.next_attempt_at, NEW.last_failure_at,
        NEW.error_kind, NEW.updated_at);
    RETURN NULL;
END
$fn$;
CREATE TRIGGER zz_verify_history AFTER INSERT OR UPDATE ON {table}
    FOR EACH ROW EXECUTE FUNCTION {fn}();
"""
HISTORY = HISTORY_TABLE + HISTORY_TRIGGER


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Member:
    """One ``kafka-idem run`` process this scenario started (stopped by its pid only)."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path, port: int) -> None:
        self.proc = proc
        self.log = log
        self.port = port

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> int | None:
        """SIGKILL; return the exit status (``-9``)."""
        self.proc.send_signal(signal.SIGKILL)
        return self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples with these labels, scraped from /metrics now."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        total = 0.0
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total


class Workspace:
    def __init__(self, settings: Settings, kafka: Kafka, run_id: str, sid: str, *,
                 logdir: Path) -> None:
        self.settings = settings
        self.kafka = kafka
        self.dsn = settings.dsn
        self.sid = sid
        self.store_schema = f"verify_{run_id}_s{sid}"
        self.biz_schema = f"{self.store_schema}_biz"
        # name_prefix (--prefix): every topic and group is the run's, inside the prefix
        # a cluster's ACLs grant
        self.topic = f"{settings.name_prefix}kafka-idem-verify.{run_id}.s{sid}"
        self.dlq = f"{self.topic}{settings.dlq_suffix}"
        self.group = self.topic
        self.store = Store(schema=self.store_schema, table=TABLE, namespace=APP_NAME)
        self.distributed = False  # a store distributed on Citus (setup_db finds out)
        self.logdir = logdir
        self.members: list[Member] = []
        self.schemas: list[str] = []
        self.topics: list[str] = []
        self.groups: list[str] = []
        self.pythonpath: list[str] = [str(Path(__file__).resolve().parents[2])]

    # --- set-up ----------------------------------------------------------------------

    def setup_db(self) -> None:
        """Fresh schemas only: refuse to go on if either name exists already."""
        names = [self.store_schema, self.biz_schema]
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute("SELECT string_agg(nspname, ', ') FROM pg_namespace "
                               "WHERE nspname = ANY(%s)", (names,)).fetchone()
        if row and row[0]:
            raise RuntimeError(f"schema(s) {row[0]} exist already; verify only uses fresh ones")
        self.schemas.append(self.store_schema)
        migrate(self.dsn, self.store_schema, TABLE)
        # on a Citus coordinator the store is distributed, as `kafka-idem migrate` does
        self.distributed = bool(distribute_store(self.dsn, self.store_schema, TABLE, citus=None))
        if self.distributed:
            self.store.distribute()
        self.schemas.append(self.biz_schema)
        history = sql.Identifier(self.biz_schema, "record_history")
        with psycopg.connect(self.dsn) as conn:
            for stmt in business_tables(self.biz_schema):
                conn.execute(stmt)
            conn.execute(sql.SQL(HISTORY).format(
                history=history, fn=sql.Identifier(self.biz_schema, "record_history"),
                table=sql.Identifier(self.store_schema, TABLE),
            ) if not self.distributed else sql.SQL(HISTORY_TABLE).format(history=history))
            if self.distributed:
                self._co_locate(conn)

    def _co_locate(self, conn: psycopg.Connection[Any]) -> None:
        """A distributed store: the business tables distributed by the idempotency key
        (the verify app's shard key), with the records; the record history's trigger on
        the records then writes its own shard's rows."""
        records = sql.Identifier(self.store_schema, TABLE).as_string(conn)
        conn.execute("SET LOCAL citus.enable_unsafe_triggers = on")
        for name in ("ledger", "calls", "record_history"):
            table = sql.Identifier(self.biz_schema, name)
            conn.execute(sql.SQL("ALTER TABLE {t} DROP CONSTRAINT {k}, ADD PRIMARY KEY "
                                 "(idempotency_key, id)").format(
                t=table, k=sql.Identifier(f"{name}_pkey")))
            conn.execute("SELECT create_distributed_table(%s, 'idempotency_key', "
                         "colocate_with => %s)", (table.as_string(conn), records))
        for statement in HISTORY_TRIGGER.split("\n$fn$;\n"):  # one at a time for Citus
            conn.execute(sql.SQL(statement if statement.lstrip().startswith("CREATE TRIGGER")
                                 else statement + "\n$fn$").format(
                history=sql.Identifier(self.biz_schema, "record_history"),
                fn=sql.Identifier(self.biz_schema, "record_history"),
                table=sql.Identifier(self.store_schema, TABLE)))

    def setup_topics(self, partitions: int) -> None:
        names = [self.topic, self.dlq]
        self.topics.extend(names)
        self.kafka.create_topics(names, partitions)

    def config(self, **faults: Any) -> Config:
        return Config(topic=self.topic, biz_schema=self.biz_schema, **faults)

    # --- members ---------------------------------------------------------------------

    def env(self, config: Config, **settings: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KAFKA_IDEM_", ENV_PREFIX))}
        s = self.settings
        ours = {
            "BOOTSTRAP_SERVERS": s.bootstrap_servers,
            "DATABASE_URL": s.dsn,
            "SCHEMA_NAME": self.store_schema,
            "TABLE": TABLE,
            "DLQ_SUFFIX": s.dlq_suffix,
            **MEMBER_SETTINGS,
            **settings,
        }
        if s.kafka:
            ours["KAFKA"] = json.dumps(s.kafka)
        env.update({f"KAFKA_IDEM_{k}": v for k, v in ours.items()})
        env.update(config.to_env())
        extra = os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = os.pathsep.join([*self.pythonpath, *([extra] if extra else [])])
        return env

    def start(self, config: Config, *, relay: bool = False, **settings: str) -> Member:
        """A ``kafka-idem run`` member (``relay``: a ``kafka-idem relay`` process)."""
        if self.group not in self.groups and not relay:
            self.groups.append(self.group)
        port = free_port()
        what = "relay" if relay else "member"
        log = self.logdir / f"s{self.sid}-{what}-{len(self.members)}.log"
        cmd = [sys.executable, "-m", "kafka_idem.cli", "relay", APP_SPEC] if relay else [
            sys.executable, "-m", "kafka_idem.cli", "run", APP_SPEC, "--group-id", self.group,
            "--metrics-port", str(port)]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=self.logdir, env=self.env(config, **settings),
                                    stdout=out, stderr=subprocess.STDOUT)
        member = Member(proc, log, port)
        self.members.append(member)
        return member

    # --- durable state -----------------------------------------------------------------

    def rows(self, query: str | sql.Composable, params: Any = None) -> list[dict[str, Any]]:
        with psycopg.connect(self.dsn, row_factory=dict_row) as conn:
            return conn.execute(query, params).fetchall()  # type: ignore[arg-type]

    def value(self, query: str | sql.Composable, params: Any = None) -> Any:
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute(query, params).fetchone()  # type: ignore[arg-type]
            return row[0] if row else None

    def _t(self, name: str) -> sql.Identifier:
        if name == TABLE:
            return sql.Identifier(self.store_schema, TABLE)
        return sql.Identifier(self.biz_schema, name)

    def record(self, key: str) -> dict[str, Any] | None:
        found = self.rows(sql.SQL("SELECT *, clock_timestamp() AS db_now FROM {} "
                                  "WHERE idempotency_key = %s").format(self._t(TABLE)), (key,))
        return found[0] if found else None

    def status_counts(self) -> dict[str, int]:
        found = self.rows(sql.SQL("SELECT status, count(*) AS n FROM {} GROUP BY 1 ORDER BY 1")
                          .format(self._t(TABLE)))
        return {r["status"]: int(r["n"]) for r in found}

    def history(self, key: str) -> list[dict[str, Any]]:
        return self.rows(sql.SQL("SELECT * FROM {} WHERE idempotency_key = %s ORDER BY id")
                         .format(self._t("record_history")), (key,))

    def tokens(self, key: str) -> list[Any]:
        """Every owner token the record had while processing, in order (committed states)."""
        seen: list[Any] = []
        for h in self.history(key):
            if h["status"] == "processing" and h["owner_token"] not in seen:
                seen.append(h["owner_token"])
        return seen

    def ledger(self, key: str | None = None) -> list[dict[str, Any]]:
        where = sql.SQL("WHERE idempotency_key = %s" if key else "")
        return self.rows(sql.SQL("SELECT * FROM {} {} ORDER BY id").format(
            self._t("ledger"), where), (key,) if key else None)

    def calls(self, key: str, event: str | None = None) -> list[dict[str, Any]]:
        found = self.rows(sql.SQL("SELECT * FROM {} WHERE idempotency_key = %s ORDER BY id")
                          .format(self._t("calls")), (key,))
        return [c for c in found if event is None or c["event"] == event]

    def dlq_records(self) -> list[Any]:
        return self.kafka.read(self.dlq)

    def outbox(self) -> list[dict[str, Any]]:
        """The outbox rows not yet published (the store schema's ``outbox``)."""
        return self.rows(sql.SQL("SELECT id, topic, key, idem_key FROM {} WHERE namespace = %s "
                                 "ORDER BY id").format(sql.Identifier(self.store_schema,
                                                                      OUTBOX_TABLE)),
                         (APP_NAME,))

    def snapshot(self) -> dict[str, Any]:
        """Generic figures, for a scenario that stopped early."""
        figures: dict[str, Any] = {}
        if self.biz_schema in self.schemas:
            try:
                figures["records"] = self.status_counts()
                figures["business_rows"] = len(self.ledger())
            except psycopg.Error as exc:
                figures["database_error"] = str(exc).strip()
        if self.dlq in self.topics:
            try:
                figures["dlq_records"] = len(self.dlq_records())
            except Exception as exc:  # a broker problem: say so, don't mask the verdict
                figures["kafka_error"] = str(exc)
        return figures

    # --- clean-up ----------------------------------------------------------------------

    def stop_members(self) -> None:
        for m in self.members:
            m.stop()

    def artefacts(self) -> dict[str, Any]:
        return {"schemas": list(self.schemas), "topics": list(self.topics),
                "groups": list(self.groups)}

    def cleanup(self) -> list[str]:
        """Drop what this scenario made; return the problems (never raises)."""
        self.stop_members()
        errors: list[str] = []
        try:
            errors += self.kafka.delete_topics(self.topics)
            for group in self.groups:
                errors += self.kafka.delete_group(group)
        except Exception as exc:
            errors.append(f"kafka clean-up: {exc}")
        if self.schemas:
            try:
                with psycopg.connect(self.dsn) as conn:
                    conn.execute("SET lock_timeout = '30s'")
                    for schema in reversed(self.schemas):
                        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE")
                                     .format(sql.Identifier(schema)))
            except psycopg.Error as exc:
                errors.append(f"dropping schemas {self.schemas}: {exc}")
        return errors
