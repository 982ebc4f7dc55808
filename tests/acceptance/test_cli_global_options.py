"""The group's own options (``--database-url``, ``--schema``, ``--debug``...) work after
the command as before it (``kafka-idem status --database-url URL``), run as the
installed ``kafka-idem`` against the suite's database; an option the command does not
know that is close to one of the group's says that it goes before the command."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kafka_idem.store import Delivery, Store, connect
from tests.acceptance.conftest import kafka_idem
from tests.conftest import DB


def one_record(db: DB) -> None:
    """One record, claimed and still processing, in the default store of ``db``."""
    store = Store(schema="kafka_idem", table="task_idempotency", namespace="cli")
    with connect(db.dsn) as conn:
        store.claim(conn, key="t1:charge:o1", request_hash="h",
                    delivery=Delivery("payments", 0, 0, "charge"), lease_seconds=600.0,
                    max_attempts=5, max_elapsed_seconds=3600)
        conn.commit()


@pytest.mark.parametrize("placement", ["before", "after", "after="])
def test_status_takes_the_database_url_after_the_command(db: DB, placement: str) -> None:
    one_record(db)
    args: list[str] = {
        "before": ["--database-url", db.dsn, "status", "--json"],
        "after": ["status", "--database-url", db.dsn, "--json"],
        "after=": ["status", "--json", f"--database-url={db.dsn}"],
    }[placement]
    r = kafka_idem(*args)
    assert r.code == 0, r.err
    st: dict[str, Any] = json.loads(r.out)
    assert st["by_status"]["processing"] == 1 and st["processing"]["live"] == 1


def test_migrate_and_inspect_take_schema_and_debug_after_the_command(db: DB) -> None:
    r = kafka_idem("migrate", "--schema", "after_cmd", "--database-url", db.dsn)
    assert r.code == 0, r.err
    assert r.out.startswith("schema after_cmd: 0001_initial, ")
    assert db.value("SELECT count(*) FROM after_cmd.schema_migrations") >= 7
    one_record(db)
    shown = kafka_idem("inspect", "t1:charge:o1", "--json", "--database-url", db.dsn)
    assert shown.code == 0, shown.err
    assert json.loads(shown.out)["status"] == "processing"
    # --debug after the command: the failure (no store in that schema) with its traceback
    failed = kafka_idem("status", "--schema", "no_store_here", "--debug",
                        "--database-url", db.dsn)
    assert failed.code == 2
    assert "Traceback (most recent call last)" in failed.err
    assert failed.err.strip().splitlines()[-1].startswith(
        "error: this database has no kafka_idem store in schema 'no_store_here'")


def test_a_misspelt_group_option_after_the_command_says_where_it_goes(db: DB) -> None:
    r = kafka_idem("status", "--database_url", db.dsn)
    assert r.code == 2
    assert r.err.strip() == (
        "error: No such option: --database_url. --database-url is an option of kafka-idem "
        "itself: it goes before the command (kafka-idem --database-url ... COMMAND) "
        "(see 'kafka-idem status --help')")
