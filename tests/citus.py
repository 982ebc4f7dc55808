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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

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


@dataclass
class CitusStore:
    """A test's store on the cluster: ``schema`` (the store's) and ``app_schema`` (its
    app's tables), both dropped after the test."""

    url: str
    schema: str
    app_schema: str

    def rows(self, query: str, params: Any = None) -> list[dict[str, Any]]:
        with psycopg.connect(self.url, row_factory=dict_row) as conn:
            return conn.execute(query, params).fetchall()  # type: ignore[arg-type]

    def value(self, query: str, params: Any = None) -> Any:
        with psycopg.connect(self.url) as conn:
            row = conn.execute(query, params).fetchone()  # type: ignore[arg-type]
            return row[0] if row else None

    def records(self) -> list[dict[str, Any]]:
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
