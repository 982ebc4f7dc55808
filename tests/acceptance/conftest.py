"""Acceptance fixtures: the installed ``kafka-idem`` run as a subprocess, and one mixed
run of the payments example per module whose dead-letter topic the DLQ tests read.

The mixed run's database is kept as a template; each test gets its own clone, so
replays and audit rows of one test never show in another.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ConfigSource,
)
from psycopg import sql

from consumers.payments import encode_charge
from tests.apps.mixed import build as mixed_app
from tests.conftest import (
    ADMIN_DSN,
    BOOTSTRAP,
    DB,
    ROOT,
    InProcess,
    Topics,
    app_settings,
    caught_up,
    produce,
    wait_for,
)


def _executable() -> list[str]:
    """The installed console script, next to this interpreter (the venv's bin)."""
    script = Path(sys.executable).parent / "kafka-idem"
    if script.exists():
        return [str(script)]
    found = shutil.which("kafka-idem")
    if found:
        return [found]
    return [sys.executable, "-m", "kafka_idem.cli"]


KAFKA_IDEM = _executable()


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def kafka_idem(*args: str, db: DB | None = None, timeout: float = 60.0,
               env: dict[str, str] | None = None) -> Result:
    """Run ``kafka-idem [--database-url DB] ARGS...`` (``env``: more variables) and
    return its exit code and output."""
    env = {**os.environ, "KAFKA_IDEM_BOOTSTRAP_SERVERS": BOOTSTRAP, "COLUMNS": "250",
           "KAFKA_IDEM_ACTOR": "acceptance", **(env or {})}
    env.pop("KAFKA_IDEM_DATABASE_URL", None)
    cmd = [*KAFKA_IDEM, *(["--database-url", db.dsn] if db is not None else []), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def read_all(topic: str, *, timeout: float = 20.0) -> list[Any]:
    """Every committed record of ``topic``, up to its end (transaction markers skipped)."""
    c = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": f"reader-{uuid.uuid4().hex}",
                  "enable.auto.commit": False, "enable.partition.eof": True,
                  "isolation.level": "read_committed"})
    try:
        parts = list(c.list_topics(topic, timeout=10).topics[topic].partitions)
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        pending, out = set(parts), []
        deadline = time.monotonic() + timeout
        while pending:
            assert time.monotonic() < deadline, f"reading {topic} timed out"
            for m in c.consume(500, timeout=0.2):
                err = m.error()
                if err is None:
                    out.append(m)
                elif err.code() == KafkaError._PARTITION_EOF:
                    pending.discard(m.partition())
        return out
    finally:
        c.close()


def headers_of(msg: Any) -> dict[str, str]:
    return {k: (v or b"").decode("utf-8", "replace") for k, v in (msg.headers() or [])}


def set_topic_config(admin: AdminClient, topic: str, name: str, value: str | None) -> None:
    """Set (or, with ``None``, reset) a topic config and wait until the broker reports it,
    e.g. ``max.message.bytes`` to make the broker refuse larger record batches."""
    op = AlterConfigOpType.DELETE if value is None else AlterConfigOpType.SET
    entry = ConfigEntry(name, "" if value is None else value, incremental_operation=op)
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[entry])
    for fut in admin.incremental_alter_configs([resource]).values():
        fut.result(timeout=30)

    def applied() -> bool:
        probe = ConfigResource(ConfigResource.Type.TOPIC, topic)
        config = next(iter(admin.describe_configs([probe]).values())).result(timeout=30)
        entry = config[name]
        if value is None:
            return bool(entry.source != ConfigSource.DYNAMIC_TOPIC_CONFIG)
        return bool(entry.value == value)

    wait_for(applied, timeout=30, what=f"{topic}: {name}={value}")


# --- the mixed run ---------------------------------------------------------------------


@dataclass
class MixedRun:
    """What one run of the payments example left behind."""

    charges: str  # source topic of handler "charge" (2 partitions), DLQ ``charges.dlq``
    refunds: str  # source topic of handler "refund", dead-lettering into ``charges.dlq``
    dlq: str
    template: str  # the database after the run
    between: dt.datetime  # after the first wave's failures, before the second's
    dlq_records: list[Any] = field(default_factory=list)  # ground truth, read directly

    def by_kafka_key(self) -> dict[bytes, Any]:
        return {m.key(): m for m in self.dlq_records}

    def env(self) -> dict[str, str]:
        """What ``--app`` :data:`MIXED_APP` needs to name this run's topics."""
        return {"MIXED_CHARGES": self.charges, "MIXED_REFUNDS": self.refunds}


MIXED_APP = "tests.apps.mixed:app"  # the mixed run's app, for --app


FIRST_WAVE_CHARGES: list[tuple[bytes | str | None, bytes]] = [
    (b"o1", encode_charge("t1", "o1", "10.00")),
    (b"o2", encode_charge("t1", "o2", "5.00")),
    (b"o3", encode_charge("t1", "o3", "7.25")),
    (b"o5", encode_charge("t1", "o5", "0")),  # permanent: amount must be positive
    (b"o6", encode_charge("t1", "o6", "5.00", "XXX")),  # permanent: unknown currency
    (b"g1", b"\x00not avro at all"),  # undecodable
    (b"o1", encode_charge("t1", "o1", "99.00")),  # payload conflict with o1 (succeeded)
]
FIRST_WAVE_REFUNDS: list[tuple[bytes | str | None, bytes]] = [
    (b"r1", encode_charge("t2", "r1", "-1.00")),  # permanent, handler "refund"
    (b"r2", encode_charge("t2", "r2", "3.00")),
]
SECOND_WAVE_CHARGES: list[tuple[bytes | str | None, bytes]] = [
    (b"o7", encode_charge("t1", "o7", "0")),  # permanent
    (b"g2", b"garbage, second wave"),  # undecodable
]
# The Kafka key of every DLQ record is distinct: the tests identify records by it.
EXPECTED_DLQ = {
    b"o5": ("permanent", "t1:charge:o5", "charge"),
    b"o6": ("permanent", "t1:charge:o6", "charge"),
    b"g1": ("undecodable", None, "charge"),
    b"o1": ("payload_conflict", "t1:charge:o1", "charge"),
    b"r1": ("permanent", "t2:refund:r1", "refund"),
    b"o7": ("permanent", "t1:charge:o7", "charge"),
    b"g2": ("undecodable", None, "charge"),
}
SECOND_WAVE = {b"o7", b"g2"}
TRACE = [("trace-id", b"trace-o6"), ("idem.stale", b"dropped by the DLQ")]


def _create_db(template: str) -> str:
    """A copy of ``template``, once the connections of the run that filled it have
    ended (a member's connections close after it stopped: on a busy machine, a moment
    later; a copy refuses a template someone is connected to)."""
    name = f"kafka_idem_t_{uuid.uuid4().hex[:12]}"

    def copied() -> bool:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            try:
                conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                    sql.Identifier(name), sql.Identifier(template)))
            except psycopg.errors.ObjectInUse:
                return False
        return True

    wait_for(copied, timeout=30, interval=0.2, what=f"the connections to {template} to end")
    return name


def _drop_db(name: str) -> None:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))


def _wait_dlq(dlq: str, n: int) -> list[Any]:
    def enough() -> list[Any] | None:
        records = read_all(dlq)
        return records if len(records) >= n else None

    records: list[Any] = wait_for(enough, what=f"{n} records in {dlq}", interval=0.2)
    return records


def produce_with_headers(
    topic: str, records: list[tuple[bytes | str | None, bytes, list[Any] | None]]
) -> None:
    producer = Producer({"bootstrap.servers": BOOTSTRAP, "enable.idempotence": True})
    for key, value, hdrs in records:
        producer.produce(topic, key=key, value=value, headers=hdrs or [])
    assert producer.flush(30) == 0


@pytest.fixture(scope="module")
def mixed(admin: AdminClient, template_db: str) -> Iterator[MixedRun]:
    topics = Topics(admin)
    charges = topics(partitions=2, prefix="charges")
    refunds = topics(partitions=1, dlq=False, prefix="refunds")
    dlq = f"{charges}.dlq"
    name = _create_db(template_db)
    group = f"g-{uuid.uuid4().hex[:10]}"
    try:
        app = mixed_app(charges, refunds, **app_settings(DB(name), group_id=group))
        # The original o1 must succeed before its conflicting twin arrives (same key, same
        # partition, so order holds); everything else can go at once.
        produce_with_headers(charges, [(k, v, TRACE if k == b"o6" else None)
                                       for k, v in FIRST_WAVE_CHARGES])
        produce(refunds, FIRST_WAVE_REFUNDS)
        with InProcess(app):
            wait_for(lambda: caught_up(group, charges) and caught_up(group, refunds),
                     what="the first wave")
            _wait_dlq(dlq, 5)
            time.sleep(0.05)
            between = dt.datetime.now(dt.UTC)
            time.sleep(0.05)
            produce(charges, SECOND_WAVE_CHARGES)
            wait_for(lambda: caught_up(group, charges), what="the second wave")
            records = _wait_dlq(dlq, len(EXPECTED_DLQ))
        run = MixedRun(charges, refunds, dlq, name, between, records)
        assert {m.key(): headers_of(m)["idem.error.kind"] for m in records} == {
            k: v[0] for k, v in EXPECTED_DLQ.items()}
        assert len({m.partition() for m in records}) == 2, "both DLQ partitions are used"
        yield run
    finally:
        topics.delete_all()
        _drop_db(name)


@pytest.fixture
def mixed_db(mixed: MixedRun) -> Iterator[DB]:
    """A clone of the mixed run's database, for this test only."""
    name = _create_db(mixed.template)
    yield DB(name)
    _drop_db(name)

