"""Shared fixtures: one broker and one PostgreSQL server per session, a fresh
database (cloned from a migrated template) and fresh topics per test.

The services come from KAFKA_IDEM_BOOTSTRAP_SERVERS / KAFKA_IDEM_DATABASE_URL,
which ``./dev test`` sets after starting the local ones; the schema registry from
``schema_registry`` (started on first use). Tests never skip for a missing service:
they fail and say how to start it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from psycopg import sql
from psycopg.rows import dict_row

from kafka_idem.admin.migrate import migrate
from kafka_idem.settings import DEFAULT_BOOTSTRAP, DEFAULT_DATABASE_URL
from kafka_idem.store import Store
from kafka_idem.store.citus import fit
from kafka_idem.verify.kafka import retrying

ROOT = Path(__file__).resolve().parent.parent
# the Citus cluster of the distributed-store tests (fixtures citus, citus_store); the
# lock that lets a test marked ``exclusive`` run alone among parallel workers
pytest_plugins = ["tests.parallel", "tests.citus"]
BOOTSTRAP = os.environ.get("KAFKA_IDEM_BOOTSTRAP_SERVERS", DEFAULT_BOOTSTRAP)
ADMIN_DSN = os.environ.get("KAFKA_IDEM_DATABASE_URL", DEFAULT_DATABASE_URL)
HINT = "start the local services with `./dev services start` (or run the tests with `./dev test`)"


def dsn_for(dbname: str) -> str:
    return psycopg.conninfo.make_conninfo(ADMIN_DSN, dbname=dbname)


@contextlib.contextmanager
def empty_database(prefix: str) -> Iterator[str]:
    """A new, empty database on the test server (its name starts with ``prefix``),
    dropped afterwards, whoever is still connected."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


def wait_for(predicate: Callable[[], Any], *, timeout: float = 60.0, what: str = "condition",
             interval: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns a truthy value; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


# --- services ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def schema_registry() -> str:
    """The URL of a real Confluent-compatible Schema Registry: KAFKA_IDEM_TEST_SCHEMA_REGISTRY_URL
    if set, else the local Apicurio Registry of ``scripts/registry.sh``, started now (built
    the first time: a few minutes) and left running like the broker. It is shared: tests
    use subjects of their own (fresh topic names), never fixed schema ids. Fault injection
    (an outage, a 5xx) needs the in-test registry (``tests/registry.py``) instead."""
    url = os.environ.get("KAFKA_IDEM_TEST_SCHEMA_REGISTRY_URL")
    if url:
        return url
    done = subprocess.run(["bash", str(ROOT / "scripts" / "registry.sh"), "start"],
                          capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        pytest.fail(f"the local schema registry did not start (scripts/registry.sh start):\n"
                    f"{done.stderr[-4000:]}")
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def admin() -> AdminClient:
    client = AdminClient({"bootstrap.servers": BOOTSTRAP})
    try:
        client.list_topics(timeout=10)
    except KafkaException as exc:
        pytest.fail(f"Kafka at {BOOTSTRAP} is not reachable ({exc}); {HINT}")
    return client


@pytest.fixture(scope="session")
def template_db() -> Iterator[str]:
    """A database migrated once per session (store schema + example tables)."""
    try:
        admin_conn = psycopg.connect(ADMIN_DSN, autocommit=True)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL at {ADMIN_DSN} is not reachable ({exc}); {HINT}")
    name = f"kafka_idem_tpl_{os.getpid()}"
    with admin_conn:
        admin_conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))
        admin_conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    migrate(dsn_for(name), "kafka_idem", "task_idempotency")
    from consumers.payments import create_tables

    with psycopg.connect(dsn_for(name)) as conn:
        create_tables(conn)
    yield name
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))


class DB:
    """A per-test database with the questions tests ask of durable state: on the
    single-node server, or (``flavour`` ``"citus"``) a copy on every node of the Citus
    cluster, ``dsn`` the coordinator's and ``nodes`` every node's (the coordinator first)."""

    flavour = "postgres"

    def __init__(self, name: str, dsn: str | None = None, *, nodes: tuple[str, ...] = ()) -> None:
        self.name = name
        self.dsn = dsn or dsn_for(name)
        self.nodes = nodes or (self.dsn,)
        if nodes:
            self.flavour = "citus"

    def store(self, **kw: Any) -> Store:
        """A :class:`Store` on ``kafka_idem.task_idempotency`` (``kw``: its namespace, ...)
        with the queries of its placement, learnt as a member learns it at start
        (:func:`kafka_idem.store.citus.fit`): distributed on Citus, local on one server."""
        store = Store(schema="kafka_idem", table="task_idempotency", **kw)
        with psycopg.connect(self.dsn) as conn:
            fit(conn, store)
        return store

    def rows(self, query: str, params: Any = None) -> list[dict[str, Any]]:
        with psycopg.connect(self.dsn, row_factory=dict_row) as conn:
            return conn.execute(query, params).fetchall()  # type: ignore[arg-type]

    def value(self, query: str, params: Any = None) -> Any:
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute(query, params).fetchone()  # type: ignore[arg-type]
            return row[0] if row else None

    def record(self, key: str) -> dict[str, Any] | None:
        rows = self.rows("SELECT * FROM kafka_idem.task_idempotency WHERE idempotency_key = %s",
                         (key,))
        return rows[0] if rows else None

    def records(self) -> list[dict[str, Any]]:
        return self.rows("SELECT * FROM kafka_idem.task_idempotency ORDER BY idempotency_key")

    def ledger(self) -> list[dict[str, Any]]:
        return self.rows("SELECT * FROM payments.ledger ORDER BY id")

    def ledger_counts(self) -> dict[str, int]:
        rows = self.rows("SELECT idempotency_key, count(*) AS n FROM payments.ledger GROUP BY 1")
        return {r["idempotency_key"]: r["n"] for r in rows}

    def balances(self) -> dict[tuple[str, str], Any]:
        rows = self.rows("SELECT tenant_id, currency, balance FROM payments.balances")
        return {(r["tenant_id"], r["currency"]): r["balance"] for r in rows}

    def status_counts(self) -> dict[str, int]:
        rows = self.rows("SELECT status, count(*) AS n FROM kafka_idem.task_idempotency GROUP BY 1")
        return {r["status"]: r["n"] for r in rows}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``both_stores`` (a module marks all its tests with ``pytestmark``)
    runs twice: its ``db`` on one PostgreSQL (id ``postgres``) and on the Citus cluster
    (``citus``: the store distributed, the payments tables co-located; tests/citus.py).
    ``postgres_only`` keeps one test of such a module on one PostgreSQL (with the reason)."""
    test = metafunc.definition
    if "db" not in metafunc.fixturenames or not test.get_closest_marker("both_stores"):
        return
    kept = test.get_closest_marker("postgres_only")
    if kept is None:
        metafunc.parametrize("db", ["postgres", "citus"], indirect=True)
    elif not kept.args:
        pytest.fail(f"{test.name}: postgres_only needs the reason it cannot hold on Citus")


@pytest.fixture
def db(request: pytest.FixtureRequest) -> Iterator[DB]:
    if getattr(request, "param", "postgres") == "citus":
        copies = request.getfixturevalue("citus_copies")
        copy = copies.take()
        yield copy
        copies.give_back(copy)
        return
    template_db = request.getfixturevalue("template_db")
    name = f"kafka_idem_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template_db)))
    yield DB(name)
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))


# --- Kafka ---------------------------------------------------------------------------


class Topics:
    def __init__(self, admin: AdminClient) -> None:
        self.admin = admin
        self.created: list[str] = []

    def __call__(self, partitions: int = 1, *, dlq: bool = True, prefix: str = "t") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        names = [name, f"{name}.dlq"] if dlq else [name]
        self.create(names, partitions)
        return name

    def create(self, names: list[str], partitions: int = 1) -> None:
        futures = self.admin.create_topics(
            [NewTopic(n, num_partitions=partitions, replication_factor=1) for n in names]
        )
        for f in futures.values():
            f.result(timeout=30)
        self.created.extend(names)
        # Metadata can lag creation by a moment; wait until every partition has a leader.
        def ready() -> bool:
            md = self.admin.list_topics(timeout=10)
            return all(n in md.topics and len(md.topics[n].partitions) == partitions
                       and md.topics[n].error is None for n in names)
        wait_for(ready, timeout=30, what=f"topics {names}")

    def delete_all(self) -> None:
        if self.created:
            for f in self.admin.delete_topics(self.created, operation_timeout=30).values():
                with contextlib.suppress(KafkaException):
                    f.result(timeout=30)


@pytest.fixture
def topics(admin: AdminClient) -> Iterator[Topics]:
    t = Topics(admin)
    yield t
    t.delete_all()


@pytest.fixture
def topic(topics: Topics) -> str:
    return topics(partitions=1)


def produce(topic: str, records: list[tuple[bytes | str | None, bytes]], *,
            partition: int | None = None) -> list[tuple[int, int]]:
    """Produce (key, value) pairs with an idempotent producer; return (partition, offset)s."""
    producer = Producer({"bootstrap.servers": BOOTSTRAP, "enable.idempotence": True,
                         "acks": "all", "linger.ms": 5})
    acked: list[tuple[int, int]] = []
    errors: list[Any] = []

    def on_delivery(err: Any, msg: Any) -> None:
        if err:
            errors.append(err)
        else:
            acked.append((msg.partition(), msg.offset()))

    for key, value in records:
        kwargs: dict[str, Any] = {"key": key, "value": value, "on_delivery": on_delivery}
        if partition is not None:
            kwargs["partition"] = partition
        producer.produce(topic, **kwargs)
    producer.flush(30)
    assert not errors, errors
    assert len(acked) == len(records)
    return acked


def end_offsets(topic: str) -> dict[int, int]:
    c = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": f"probe-{uuid.uuid4().hex}"})

    def ask() -> dict[int, int]:
        md = c.list_topics(topic, timeout=10)
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in md.topics[topic].partitions}

    try:
        return retrying(ask, what=f"end offsets of {topic}", timeout=30)
    finally:
        c.close()


def committed(group: str, topic: str) -> dict[int, int]:
    """The group's committed offset per partition (-1001 when none)."""
    c = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": group})

    def ask() -> dict[int, int]:
        # A coordinator that is loading or moving (NOT_COORDINATOR, e.g. just after the
        # broker started) answers again shortly: transient, not a test failure.
        md = c.list_topics(topic, timeout=10)
        tps = [TopicPartition(topic, p) for p in md.topics[topic].partitions]
        return {tp.partition: tp.offset for tp in c.committed(tps, timeout=10)}

    try:
        return retrying(ask, what=f"committed offsets of {group}", timeout=30)
    finally:
        c.close()


def caught_up(group: str, topic: str) -> bool:
    ends = end_offsets(topic)
    got = committed(group, topic)
    return all(got.get(p, -1) == end for p, end in ends.items() if end > 0)


def read_topic(topic: str, *, timeout: float = 10.0) -> list[Any]:
    """Every record of ``topic`` from the beginning to its current end."""
    ends = end_offsets(topic)
    total = sum(ends.values())
    if total == 0:
        return []
    c = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": f"reader-{uuid.uuid4().hex}",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.assign([TopicPartition(topic, p, 0) for p in ends])
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < total and time.monotonic() < deadline:
            for m in c.consume(500, timeout=0.5):
                if m.error() is None:
                    out.append(m)
    finally:
        c.close()
    return out


def headers(msg: Any) -> dict[str, str]:
    return {k: (v or b"").decode() for k, v in (msg.headers() or [])}


# --- apps and members ------------------------------------------------------------------


def app_settings(db: DB, **extra: Any) -> dict[str, Any]:
    return {"database_url": db.dsn, "bootstrap_servers": BOOTSTRAP,
            "session_timeout_ms": 6000, "batch_max_wait_seconds": 0.05, **extra}


def member_env(db: DB, topic: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "KAFKA_IDEM_DATABASE_URL": db.dsn,
        "KAFKA_IDEM_BOOTSTRAP_SERVERS": BOOTSTRAP,
        "KAFKA_IDEM_SESSION_TIMEOUT_MS": "6000",
        "KAFKA_IDEM_BATCH_MAX_WAIT_SECONDS": "0.05",
        "PAYMENTS_TOPIC": topic,
        "PYTHONPATH": str(ROOT),
        **extra,
    })
    return env


class Members:
    """``kafka-idem run`` subprocesses, stopped (by their pid) at the end of the test."""

    def __init__(self, tmp: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tmp = tmp

    def start(self, app_spec: str, env: dict[str, str], *, group: str,
              args: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"member-{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "kafka_idem.cli", "run", app_spec, "--group-id", group, *args],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")
                         for p in sorted(self.tmp.glob("member-*.log")))

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def members(tmp_path: Path) -> Iterator[Members]:
    m = Members(tmp_path)
    yield m
    m.stop_all()


@pytest.fixture
def group() -> str:
    return f"g-{uuid.uuid4().hex[:10]}"


class InProcess:
    """A Runner on a thread: ``with InProcess(app) as r: ...``; stops on exit."""

    def __init__(self, app: Any) -> None:
        import threading

        from kafka_idem.consume.runner import Runner

        self.runner = Runner(app)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.runner.run()
        except BaseException as exc:  # surfaced in __exit__
            self.error = exc

    def __enter__(self) -> InProcess:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.runner.stop()
        self.thread.join(60)
        assert not self.thread.is_alive(), "runner did not stop"
        if self.error is not None and exc[0] is None:
            raise self.error
