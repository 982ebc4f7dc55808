"""The CLI's output where operators read it: piped at 80 columns or less, as JSON, on a
store that was never migrated, with the broker down.

Each test is one of the walls a new user hit (issue 16): a table piped at 80 columns
wrapped one character per line and cut the request hash with "…"; ``migrate --app``
said "nothing to do" after creating the app's tables; ``status`` on a database where
``kafka-idem migrate`` never ran said ``relation ... does not exist``; ``run`` with the
broker down wrote hundreds of raw librdkafka lines; ``dlq replay`` leaked them too;
``dlq replay`` always named its group and transactional id ``kafka-idem-replay.*``.
"""

from __future__ import annotations

import datetime as dt
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from confluent_kafka.admin import AdminClient

from kafka_idem.store import Delivery, Store, connect
from tests.acceptance.conftest import kafka_idem, produce_with_headers
from tests.conftest import BOOTSTRAP, DB, ROOT, Topics, dsn_for, empty_database

KEY = "tenant-0042:charge:order-2026-12-01-000123456789"
HASH = "v1:sha256:" + "ab12" * 16
MESSAGE = "amount must be positive; the order was rejected by the business rules"
RAW_RDKAFKA = re.compile(r"^%\d\|\d+\.\d+\|")  # librdkafka's own stderr format

# The JSON shapes docs/reference/cli-conventions.md documents ("JSON output"): a field
# is only ever added.
STATUS_FIELDS = {"namespace", "by_status", "by_namespace", "processing", "long_running",
                 "retry_backlog", "failed_by_kind", "outbox", "paused_handlers", "retention"}
RECORD_FIELDS = {"idempotency_key", "namespace", "shard_key", "status", "request_hash", "attempts",
                 "attempts_counted", "owner_token", "lease_until", "lease_live",
                 "next_attempt_at", "result_json",
                 "error_kind", "error_class", "error_message", "first_failure_at",
                 "last_failure_at", "completed_token", "handler", "kafka_topic",
                 "kafka_partition", "kafka_offset", "created_at", "updated_at",
                 "completed_at", "audit"}
DLQ_FIELDS = {"dlq_topic", "partition", "offset", "timestamp", "namespace", "idempotency_key",
              "kind", "error_class", "error_message", "handler", "consumer_group", "attempts",
              "original_topic", "original_partition", "original_offset", "truncated",
              "first_failure_at", "last_failure_at", "kafka_key", "value_size", "headers",
              "signature"}


@dataclass
class Failed:
    db: DB
    source: str
    dlq: str


@pytest.fixture
def failed(db: DB, topics: Topics) -> Failed:
    """A failed record with a long key and a full request hash, and its dead letter."""
    source = topics(partitions=1)
    store = Store(schema="kafka_idem", table="task_idempotency", namespace="payments")
    conn = connect(db.dsn)
    with conn.transaction():
        claim = store.claim(conn, key=KEY, request_hash=HASH,
                            delivery=Delivery(source, 0, 0, "charge"), lease_seconds=60,
                            max_attempts=5, max_elapsed_seconds=3600)
        assert claim.token is not None
        store.fail(conn, key=KEY, token=claim.token, status="failed", kind="permanent",
                   error_class="Permanent", error_message=MESSAGE)
    conn.close()
    now = dt.datetime.now(dt.UTC).isoformat().encode()
    headers = [
        ("idem.original.topic", source.encode()), ("idem.original.partition", b"0"),
        ("idem.original.offset", b"0"), ("idem.key", KEY.encode()),
        ("idem.namespace", b"payments"), ("idem.error.kind", b"permanent"),
        ("idem.error.class", b"Permanent"), ("idem.error.message", MESSAGE.encode()),
        ("idem.attempts", b"1"), ("idem.first_failure_at", now),
        ("idem.last_failure_at", now), ("idem.consumer_group", b"payments"),
        ("idem.handler", b"charge"),
    ]
    produce_with_headers(f"{source}.dlq", [(b"order-2026-12-01-000123456789", b"v", headers)])
    return Failed(db, source, f"{source}.dlq")


def one_char_lines(text: str) -> list[str]:
    """Lines whose cells hold one character each: a table squeezed below its width."""
    return [ln for ln in text.splitlines()
            if ln.strip(" │┃|") and all(len(c.strip()) <= 1 for c in re.split("[│┃|]", ln))]


@pytest.mark.parametrize("columns", ["80", "40"])
def test_dlq_list_piped_at_80_columns_or_less_keeps_each_record_on_one_line(
    failed: Failed, columns: str
) -> None:
    r = kafka_idem("dlq", "list", "--dlq", failed.dlq, db=failed.db, env={"COLUMNS": columns})
    assert r.code == 0, r.err
    assert one_char_lines(r.out) == []
    (row,) = [ln for ln in r.out.splitlines() if KEY in ln]  # the whole key, on one line
    assert row.split()[:2] == ["0", "0"] and "permanent" in row and "charge" in row
    header = next(ln for ln in r.out.splitlines() if ln.startswith("partition"))
    assert header.split("  ")[0] == "partition" and "message" in header
    assert "…" in row and "amount must be positive" in row  # the message column is a summary


@pytest.mark.parametrize("columns", ["80", "40"])
def test_inspect_piped_at_80_columns_or_less_shows_the_whole_request_hash(
    failed: Failed, columns: str
) -> None:
    r = kafka_idem("inspect", KEY, db=failed.db, env={"COLUMNS": columns})
    assert r.code == 0, r.err
    assert one_char_lines(r.out) == []
    assert "…" not in r.out
    fields = {ln.split()[0]: ln.split(None, 1)[1] for ln in r.out.splitlines()
              if len(ln.split(None, 1)) == 2}
    assert fields["request_hash"] == HASH
    assert fields["status"] == "failed" and fields["error_message"] == MESSAGE
    assert "shard_key" not in fields  # none: written without one (one PostgreSQL)


def test_inspect_shows_the_shard_key_of_a_record_that_has_one(failed: Failed) -> None:
    store = Store(schema="kafka_idem", table="task_idempotency", namespace="payments")
    conn = connect(failed.db.dsn)
    with conn.transaction():
        store.claim(conn, key="tenant-0042:charge:o2", request_hash=HASH,
                    delivery=Delivery(failed.source, 0, 1, "charge"), lease_seconds=60,
                    max_attempts=5, max_elapsed_seconds=3600, shard="tenant-0042")
    conn.close()
    r = kafka_idem("inspect", "tenant-0042:charge:o2", db=failed.db)
    assert r.code == 0, r.err
    assert re.search(r"^shard_key +tenant-0042$", r.out, re.MULTILINE), r.out
    shown = kafka_idem("inspect", "tenant-0042:charge:o2", "--json", db=failed.db).json()
    assert shown["shard_key"] == "tenant-0042"


def test_status_piped_is_plain_columns(failed: Failed) -> None:
    r = kafka_idem("status", db=failed.db, env={"COLUMNS": "40"})
    assert r.code == 0, r.err
    assert one_char_lines(r.out) == []
    assert re.search(r"^failed: permanent +1$", r.out, re.MULTILINE), r.out
    assert re.search(r"^payments +0 +0 +0 +1$", r.out, re.MULTILINE), r.out


def test_every_read_command_prints_its_documented_json_shape(failed: Failed) -> None:
    status = kafka_idem("status", "--json", db=failed.db)
    assert status.code == 0 and set(status.json()) == STATUS_FIELDS
    record = kafka_idem("inspect", KEY, "--json", db=failed.db)
    assert record.code == 0 and set(record.json()) == RECORD_FIELDS
    assert record.json()["request_hash"] == HASH and record.json()["audit"] == []
    assert record.json()["attempts_counted"] == record.json()["attempts"]  # nothing withdrawn
    assert record.json()["shard_key"] is None
    for name in ("created_at", "updated_at", "last_failure_at"):  # ISO 8601, with its 'T'
        at = record.json()[name]
        assert dt.datetime.fromisoformat(at).tzinfo is not None and at[10] == "T", (name, at)
    listed = kafka_idem("dlq", "list", "--dlq", failed.dlq, "--json", db=failed.db)
    assert listed.code == 0 and [set(r) for r in listed.json()] == [DLQ_FIELDS]
    assert listed.json()[0]["error_message"] == MESSAGE  # never cut in JSON
    shown = kafka_idem("dlq", "show", "--dlq", failed.dlq, "--partition", "0", "--offset", "0",
                       "--json", db=failed.db)
    assert shown.code == 0 and set(shown.json()) == DLQ_FIELDS


def test_an_unknown_key_or_position_is_a_message_and_exit_1_also_with_json(
    failed: Failed,
) -> None:
    for args in (("inspect", "t1:charge:nope", "--json"), ("inspect", "t1:charge:nope"),
                 ("dlq", "show", "--dlq", failed.dlq, "--partition", "0", "--offset", "7",
                  "--json"),
                 ("dlq", "list", "--dlq", failed.dlq, "--key", "nope", "--json")):
        r = kafka_idem(*args, db=failed.db)
        assert r.code == 1, (args, r.out, r.err)
        assert r.out == "", args  # nothing a JSON reader would take for a result
        assert r.err.strip() and len(r.err.strip().splitlines()) == 1, (args, r.err)
        assert r.err.startswith("error: no record"), (args, r.err)


@pytest.fixture
def empty_db() -> Iterator[DB]:
    """A database where `kafka-idem migrate` never ran."""
    with empty_database("kafka_idem_e") as name:
        yield DB(name)


def test_status_on_a_database_never_migrated_says_to_run_migrate(empty_db: DB) -> None:
    for args in (("status",), ("status", "--json"), ("inspect", "k"),
                 ("purge", "--older-than", "30d"), ("rerun", "k", "--reason", "r"),
                 ("dlq", "replay", "--dlq", "any.dlq", "--dry-run")):
        r = kafka_idem(*args, db=empty_db)
        assert r.code == 2, (args, r.err)
        (line,) = r.err.strip().splitlines()
        assert "run `kafka-idem migrate`" in line, line
        assert "does not exist" not in line


def test_a_member_or_relay_before_migrate_names_the_migrate_of_its_app(empty_db: DB) -> None:
    """The app's tables need `migrate --app`: the hint names the app (and the store's
    options given), for a member and for a relay."""
    for args, command in (
            (("run", "consumers.payments:app", "--max-seconds", "5"),
             "kafka-idem migrate --app consumers.payments:app"),
            (("relay", "consumers.payments:app", "--max-seconds", "5"),
             "kafka-idem migrate --app consumers.payments:app"),
            (("--schema", "pay", "run", "consumers.payments:app", "--max-seconds", "5"),
             "kafka-idem --schema pay migrate --app consumers.payments:app")):
        r = kafka_idem(*args, db=empty_db)
        assert r.code == 2, (args, r.err)
        (line,) = r.err.strip().splitlines()
        assert f"run `{command}` to create it" in line, line


def test_migrate_app_reports_what_it_created_and_then_that_nothing_was_new(
    empty_db: DB,
) -> None:
    first = kafka_idem("migrate", "--app", "consumers.payments:app", db=empty_db)
    assert first.code == 0, first.err
    assert "schema kafka_idem: 0001_initial" in first.out
    (app_line,) = [ln for ln in first.out.splitlines() if ln.startswith("app payments:")]
    assert "create_tables: created schema payments" in app_line
    assert "table payments.ledger" in app_line and "table payments.balances" in app_line
    with psycopg.connect(dsn_for(empty_db.name)) as conn:  # it really did
        assert conn.execute("SELECT to_regclass('payments.ledger')").fetchone() == (
            "payments.ledger",)
    again = kafka_idem("migrate", "--app", "consumers.payments:app", db=empty_db)
    assert again.code == 0, again.err
    assert "schema kafka_idem: nothing to do" in again.out
    assert "app payments: create_tables: nothing new" in again.out


MEANWHILE_APP = """
import os
import psycopg
from kafka_idem import App

app = App("meanwhile")


@app.migration
def tables(conn):
    with psycopg.connect(os.environ["OTHER_DSN"], autocommit=True) as other:
        other.execute("CREATE SCHEMA other_run")  # another run's, committed meanwhile
    conn.execute("CREATE SCHEMA IF NOT EXISTS mine")
    conn.execute("CREATE TABLE IF NOT EXISTS mine.t (id int PRIMARY KEY)")
    with conn.transaction():  # a savepoint: still this run's work
        conn.execute("CREATE TABLE IF NOT EXISTS mine.u (id int PRIMARY KEY)")
"""


def test_migrate_app_reports_only_what_its_own_run_created(empty_db: DB, tmp_path: Path) -> None:
    (tmp_path / "meanwhile_app.py").write_text(MEANWHILE_APP)
    r = kafka_idem("migrate", "--app", "meanwhile_app:app", db=empty_db,
                   env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "OTHER_DSN": dsn_for(empty_db.name)})
    assert r.code == 0, r.err
    (line,) = [ln for ln in r.out.splitlines() if ln.startswith("app meanwhile:")]
    assert line == "app meanwhile: tables: created schema mine, table mine.t, table mine.u"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once closed


def test_run_with_the_broker_down_writes_a_few_clear_lines(db: DB, topics: Topics) -> None:
    topic = topics(partitions=1)
    down = f"127.0.0.1:{closed_port()}"
    r = kafka_idem("--bootstrap-servers", down, "run", "consumers.payments:app",
                   "--max-seconds", "6", db=db, env={"PAYMENTS_TOPIC": topic})
    assert r.code == 0, r.err
    lines = r.err.splitlines()
    assert [ln for ln in lines if RAW_RDKAFKA.match(ln)] == []
    assert len(lines) <= 8, r.err  # was 370 lines in 8 s
    kafka = [ln for ln in lines if "kafka_idem.observe.kafka_logs" in ln]
    assert kafka and all("WARNING" in ln for ln in kafka), r.err
    assert any(f"{down}/bootstrap: Connect to" in ln and "Connection refused" in ln
               for ln in kafka), r.err
    assert any("brokers are down; waiting for the broker and retrying" in ln
               for ln in kafka), r.err


def test_dlq_commands_write_no_raw_librdkafka_line(failed: Failed) -> None:
    """A bootstrap list with one unreachable address: librdkafka complains about it on
    every command; the complaint goes through logging (once), never raw."""
    boot = f"127.0.0.1:{closed_port()},{BOOTSTRAP}"
    for args in (("dlq", "list", "--dlq", failed.dlq),
                 ("dlq", "replay", "--dlq", failed.dlq, "--include-permanent", "--reason",
                  "test", "--namespace", "payments", "--no-progress")):
        r = kafka_idem("--bootstrap-servers", boot, *args, db=failed.db)
        assert r.code == 0, (args, r.err)
        assert [ln for ln in r.err.splitlines() if RAW_RDKAFKA.match(ln)] == [], r.err
        assert len(r.err.splitlines()) <= 3, r.err


def test_dlq_replay_names_its_group_and_transactional_id_inside_the_prefix(
    failed: Failed, admin: AdminClient
) -> None:
    """--prefix or KAFKA_IDEM_NAME_PREFIX (a cluster whose ACLs grant names by prefix):
    the replay's group (its transactional id too) starts with it, and no group outside
    it appears on the broker (scripts/acl_check.py runs this on a broker with such ACLs)."""
    flag = kafka_idem("dlq", "replay", "--dlq", failed.dlq, "--include-permanent",
                      "--reason", "INC-1", "--prefix", "team-a.", "--namespace", "payments",
                      "--no-progress", "--json", db=failed.db)
    assert flag.code == 0, flag.err
    group = flag.json()["group"]
    assert group.startswith(f"team-a.kafka-idem-replay.{failed.dlq}."), group
    assert flag.json()["rerun"] == 1
    setting = kafka_idem("dlq", "replay", "--dlq", failed.dlq, "--kind", "permanent",
                         "--no-progress", "--json", db=failed.db,
                         env={"KAFKA_IDEM_NAME_PREFIX": "team-b."})
    assert setting.code == 0 and setting.json()["group"].startswith("team-b.kafka-idem-replay.")
    listed = admin.list_consumer_groups(request_timeout=10).result()
    mine = sorted(g.group_id for g in listed.valid if failed.dlq in g.group_id)
    assert group in mine  # the replay committed its position in its own group
    assert all(g.startswith(("team-a.", "team-b.")) for g in mine), mine
