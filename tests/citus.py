"""The Citus cluster of the distributed-store tests (a pytest plugin of tests/conftest.py):
one per session, a store schema of its own per test (``citus_store``), and the Citus
flavour of the ``db`` fixture for the suites marked ``both_stores`` (``citus_copies``: a
database of its own per test, copied from a template on every node).

``citus`` is the coordinator's URL: ``KAFKA_IDEM_TEST_CITUS_URL`` when set (a cluster of
your own; a superuser, the tests create and drop schemas in it), else the local cluster
of ``scripts/citus.sh`` (a coordinator and two workers), started now and left running like
the broker. Tests never skip for a missing cluster: they fail and say how to get one.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from kafka_idem.admin.migrate import distribute_store, migrate, migrate_app
from tests.conftest import DB
from tests.parallel import one_at_a_time
from tools import citus as citus_db

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def citus() -> str:
    url = os.environ.get("KAFKA_IDEM_TEST_CITUS_URL")
    if url:
        return url
    with one_at_a_time("citus-start"):  # parallel workers: the first one starts it
        done = subprocess.run(["bash", str(ROOT / "scripts" / "citus.sh"), "start"],
                              capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        pytest.fail("the local Citus cluster did not start (scripts/citus.sh start; or set "
                    f"KAFKA_IDEM_TEST_CITUS_URL to a cluster of your own):\n{done.stderr[-4000:]}")
    return done.stdout.strip().splitlines()[-1]


class CitusStore(DB):
    """A test's store on the cluster: ``schema`` (the store's) and ``app_schema`` (its
    app's tables), both dropped after the test; ``rows`` and ``value`` read there."""

    flavour = "citus"

    def __init__(self, url: str, schema: str, app_schema: str) -> None:
        super().__init__(psycopg.conninfo.conninfo_to_dict(url).get("dbname", "kafka_idem"))
        self.url = self.dsn = url
        self.schema, self.app_schema = schema, app_schema

    def records(self) -> list[dict[str, Any]]:  # the test's store, not kafka_idem's
        return self.rows(sql.SQL("SELECT * FROM {} ORDER BY idempotency_key").format(
            sql.Identifier(self.schema, "task_idempotency")).as_string(None))

    def placement(self, table: str) -> tuple[str, str] | None:
        """(method, distribution column) of ``schema.table`` in Citus's metadata."""
        row = self.rows("SELECT partmethod::text AS m, coalesce(column_to_column_name("
                        "logicalrelid, partkey), '') AS col FROM pg_dist_partition "
                        "WHERE logicalrelid = %s::regclass", (table,))
        return (row[0]["m"], row[0]["col"]) if row else None


@pytest.fixture
def citus_store(citus: str) -> Iterator[CitusStore]:
    tag = uuid.uuid4().hex[:10]
    store = CitusStore(citus, f"ki_{tag}", f"app_{tag}")
    yield store
    with psycopg.connect(citus, autocommit=True) as conn:
        for schema in (store.app_schema, store.schema):
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                sql.Identifier(schema)))


# --- the db fixture's Citus flavour (tests/conftest.py: a ``both_stores`` test) -----------

STORE = ("kafka_idem", "task_idempotency")


def node_urls(url: str, dbname: str) -> tuple[str, ...]:
    """``dbname`` on every node of ``url``'s cluster, the coordinator first."""
    coordinator, workers = citus_db.nodes(url)
    return tuple(psycopg.conninfo.make_conninfo(url, dbname=dbname, host=host, port=str(port))
                 for host, port in [coordinator, *workers])


def on_each_node(url: str, statement: sql.Composable) -> None:
    """Run ``statement`` on every node at once, each node alone, from its ``postgres``
    database (no ``citus`` extension there: a database made, closed or dropped node by
    node is none of Citus's business, which refuses such statements on a worker's)."""
    def run(node: str) -> None:
        with psycopg.connect(node, autocommit=True) as conn:
            conn.execute(statement)

    nodes = node_urls(url, "postgres")
    with ThreadPoolExecutor(len(nodes)) as pool:
        list(pool.map(run, nodes))


def citus_template(citus: str) -> str:
    """A database on the cluster, as the single-node ``template_db``: the store migrated
    and distributed, the payments example's tables created and co-located by the
    example's own migrations (``create_tables``, ``co_locate``). Then closed to
    connections on every node (the Citus maintenance daemon's too): a template."""
    name = f"kafka_idem_tplc_{os.getpid()}"
    citus_db.drop_database(citus, name)
    dsn = citus_db.create_database(citus, name)
    try:
        migrate(dsn, *STORE)
        assert distribute_store(dsn, *STORE, citus=True)
        from consumers.payments import build_app

        migrate_app(dsn, STORE[0], build_app().migrations)
        on_each_node(citus, sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false").format(
            sql.Identifier(name)))
        on_each_node(citus, sql.SQL("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                    "WHERE datname = {} AND pid <> pg_backend_pid()").format(
            sql.Literal(name)))
    except BaseException:
        citus_db.drop_database(citus, name)
        raise
    return name


class Copies:
    """Each test's database on the cluster: the template copied on every node
    (``CREATE DATABASE ... TEMPLATE``: each node's copy holds its part of Citus's
    metadata, shards and placements, as the template does), dropped on every node after
    the test. About a second each way, where making and distributing a database takes
    several; and mostly off the tests' clock: on threads of their own, the next test's
    copy is made while this one runs, and this one's dropped while the next one runs."""

    def __init__(self, citus: str) -> None:
        self.citus = citus
        self.template = citus_template(citus)
        self.maker = ThreadPoolExecutor(1, thread_name_prefix="citus-copies")
        self.dropper = ThreadPoolExecutor(1, thread_name_prefix="citus-drops")
        self.spare: Future[str] = self.maker.submit(self._make)
        self.drops: list[Future[None]] = []

    def _make(self) -> str:
        name = f"kafka_idem_tc_{uuid.uuid4().hex[:12]}"
        try:
            on_each_node(self.citus, sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(self.template)))
        except BaseException:
            self._drop(name)  # made on some nodes only
            raise
        return name

    def _drop(self, name: str) -> None:
        on_each_node(self.citus, sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))

    def take(self) -> DB:
        spare, self.spare = self.spare, self.maker.submit(self._make)
        name = spare.result()  # a copy that failed fails this test, not every next one
        nodes = node_urls(self.citus, name)
        return DB(name, nodes[0], nodes=nodes)

    def give_back(self, db: DB) -> None:
        self.drops.append(self.dropper.submit(self._drop, db.name))

    def close(self) -> None:
        """Drop the spare copy and the template; a drop that failed fails the session."""
        try:
            self._drop(self.spare.result())
        finally:
            self.maker.shutdown(wait=True)
            self.dropper.shutdown(wait=True)
            citus_db.drop_database(self.citus, self.template)
        for done in self.drops:
            done.result()


@pytest.fixture(scope="session")
def citus_copies(citus: str) -> Iterator[Copies]:
    copies = Copies(citus)
    yield copies
    copies.close()
