"""The Citus cluster of the distributed-store tests (a pytest plugin of tests/conftest.py):
one per session, a store schema of its own per test.

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
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.conftest import DB

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def citus() -> str:
    url = os.environ.get("KAFKA_IDEM_TEST_CITUS_URL")
    if url:
        return url
    done = subprocess.run(["bash", str(ROOT / "scripts" / "citus.sh"), "start"],
                          capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        pytest.fail("the local Citus cluster did not start (scripts/citus.sh start; or set "
                    f"KAFKA_IDEM_TEST_CITUS_URL to a cluster of your own):\n{done.stderr[-4000:]}")
    return done.stdout.strip().splitlines()[-1]


class CitusStore(DB):
    """A test's store on the cluster: ``schema`` (the store's) and ``app_schema`` (its
    app's tables), both dropped after the test; ``rows`` and ``value`` read there."""

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
