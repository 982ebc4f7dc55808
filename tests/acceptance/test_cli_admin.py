"""The installed ``kafka-idem`` CLI as a subprocess: migrate, status, inspect, rerun, purge."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import AdminClient

from consumers.payments import encode_charge
from kafka_idem.store import Delivery, Store, connect
from tests.acceptance.conftest import set_topic_config
from tests.conftest import (
    BOOTSTRAP,
    DB,
    ROOT,
    Members,
    Topics,
    caught_up,
    empty_database,
    member_env,
    produce,
    read_topic,
    wait_for,
)

VARIANTS = "tests.apps.variants:app"
BIN = shutil.which("kafka-idem", path=str(Path(sys.executable).parent)) or "kafka-idem"


def kafka_idem(
    db: DB, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = [BIN, "--database-url", db.dsn, "--bootstrap-servers", BOOTSTRAP, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_migrate_is_versioned_and_a_second_run_is_a_noop(db: DB) -> None:
    schema = f"s_{uuid.uuid4().hex[:8]}"
    first = kafka_idem(db, "--schema", schema, "migrate")
    assert first.returncode == 0, first.stderr
    assert "0001_initial" in first.stdout and "0002_rerun_budget" in first.stdout
    assert "0003_guard_when" in first.stdout and "0004_dead_again" in first.stdout
    assert "0005_namespaces" in first.stdout and "0006_outbox" in first.stdout
    assert "0007_fenced_complete" in first.stdout and "0008_handler_pauses" in first.stdout
    assert "0009_shard_key" in first.stdout and "0010_one_row_success" in first.stdout
    assert "distributed" not in first.stdout
    second = kafka_idem(db, "--schema", schema, "migrate")
    assert second.returncode == 0 and "nothing to do" in second.stdout
    versions = db.rows(f'SELECT version FROM "{schema}".schema_migrations ORDER BY 1')
    assert [r["version"] for r in versions] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


@pytest.fixture
def empty_db() -> Iterator[DB]:
    """A fresh database with nothing in it (no store, no example tables)."""
    with empty_database("kafka_idem_e") as name:
        yield DB(name)


def test_concurrent_migrate_app_runs_on_a_fresh_database_all_succeed(empty_db: DB) -> None:
    cmd = [BIN, "--database-url", empty_db.dsn, "migrate", "--app",
           "tests.apps.migrations:app"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(6)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, [err for _out, err in outs]
    assert sum("0001_initial" in out for out, _err in outs) == 1, "one run created the store"
    versions = empty_db.rows('SELECT version FROM "kafka_idem".schema_migrations ORDER BY 1')
    assert [r["version"] for r in versions] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    tables = empty_db.rows("SELECT schemaname || '.' || tablename AS t FROM pg_tables "
                           "WHERE schemaname IN ('payments', 'payments_audit') ORDER BY 1")
    assert [r["t"] for r in tables] == ["payments.balances", "payments.ledger",
                                        "payments_audit.events"]


def test_a_name_that_would_break_sql_is_a_usage_error_naming_the_setting(db: DB) -> None:
    out = kafka_idem(db, "--table", 'bad"; drop table x; --', "status")
    assert out.returncode == 2
    assert "table" in out.stderr and "KAFKA_IDEM_TABLE" in out.stderr


def _mixed_run(db: DB, topics: Topics, members: Members, group: str, **env: str) -> str:
    topic = topics(partitions=1)
    produce(topic, [
        (b"o1", encode_charge("t1", "o1", "5.00")),
        (b"o2", encode_charge("t1", "o2", "7.00")),
        (b"o2", encode_charge("t1", "o2", "7.00")),   # duplicate
        (b"o2", encode_charge("t1", "o2", "8.00")),   # conflict
        (b"o3", encode_charge("t1", "o3", "-1")),     # permanent
        (b"o4", encode_charge("t1", "o4", "4.00")),
    ])
    proc = members.start(VARIANTS, member_env(db, topic, **env), group=group)
    wait_for(lambda: caught_up(group, topic), what="the mixed run to finish")
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    return topic


def assert_outbox_lines(human: str, namespaces: list[str], pending: dict[str, Any]) -> None:
    """Every namespace of the store has a line in the outbox table, with nothing pending too."""
    outbox = human.split("outbox: events not published yet", 1)[1]
    for ns in namespaces:
        n = pending.get(ns, {"pending": 0})["pending"]
        age = r"[0-9.]+" if n else "-"
        assert re.search(rf"^\W*{re.escape(ns or '(unassigned)')}\W+{n}\W+{age}\W*$",
                         outbox, re.M), outbox


def test_status_and_inspect_after_a_mixed_run(db: DB, topics: Topics, members: Members,
                                              group: str) -> None:
    _mixed_run(db, topics, members, group)
    out = kafka_idem(db, "status", "--json")
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert st["by_status"] == {"processing": 0, "succeeded": 3, "retryable_failed": 0,
                               "failed": 1}
    assert st["failed_by_kind"] == {"permanent": 1}
    assert st["processing"] == {"live": 0, "expired": 0}
    human = kafka_idem(db, "status")
    assert human.returncode == 0 and "succeeded" in human.stdout
    assert_outbox_lines(human.stdout, list(st["by_namespace"]), st["outbox"])
    with psycopg.connect(db.dsn, autocommit=True) as conn:  # as if the relay had published
        conn.execute("DELETE FROM kafka_idem.outbox")
    # every namespace the text shows, with nothing pending (0, no age) as well
    assert json.loads(kafka_idem(db, "status", "--json").stdout)["outbox"] == {
        ns: {"pending": 0, "oldest_age_seconds": None} for ns in st["by_namespace"]}
    assert_outbox_lines(kafka_idem(db, "status").stdout, list(st["by_namespace"]), {})

    rec = json.loads(kafka_idem(db, "inspect", "t1:charge:o3", "--json").stdout)
    assert rec["status"] == "failed" and rec["error_kind"] == "permanent"
    assert rec["kafka_offset"] == 4 and rec["attempts"] == 1 and rec["audit"] == []
    ok = json.loads(kafka_idem(db, "inspect", "t1:charge:o2", "--json").stdout)
    assert ok["result_json"] == {"order_id": "o2", "amount": "7.00", "currency": "EUR"}
    missing = kafka_idem(db, "inspect", "t1:charge:nope")
    assert missing.returncode == 1


def test_rerun_of_a_failed_key_after_the_fix_succeeds_once_with_an_audit_row(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    topic = _mixed_run(db, topics, members, group, PERMANENT_ORDERS="o4")
    key = "t1:charge:o4"
    assert db.record(key)["status"] == "failed"  # type: ignore[index]
    assert db.ledger_counts().get(key) is None

    refused = kafka_idem(db, "rerun", "t1:charge:o1", "--reason", "try")
    assert refused.returncode == 1 and "already succeeded" in refused.stderr

    # The cause is fixed: members now run without the injected failure.
    member = members.start(VARIANTS, member_env(db, topic), group=group)
    out = kafka_idem(db, "rerun", key, "--reason", "bug 42 fixed", "--actor", "alice")
    assert out.returncode == 0, out.stderr
    wait_for(lambda: (db.record(key) or {}).get("status") == "succeeded",
             what="the re-run to succeed")
    wait_for(lambda: caught_up(group, topic), what="the republished message to be committed")
    assert db.ledger_counts()[key] == 1
    rec = db.record(key)
    assert rec is not None and rec["attempts"] == 2
    trail = db.rows("SELECT * FROM kafka_idem.admin_audit WHERE idempotency_key = %s", (key,))
    assert len(trail) == 1
    assert (trail[0]["actor"], trail[0]["action"], trail[0]["reason"],
            trail[0]["previous_status"]) == ("alice", "rerun", "bug 42 fixed", "failed")
    assert "injected permanent failure" in trail[0]["previous_error"]
    replayed = [m for m in read_topic(topic) if m.key() == b"o4"]
    assert len(replayed) == 2
    lineage = dict(replayed[-1].headers() or [])
    assert lineage["idem.replay.by"] == b"alice"
    inspected = json.loads(kafka_idem(db, "inspect", key, "--json").stdout)
    assert [a["action"] for a in inspected["audit"]] == ["rerun"]
    member.terminate()
    assert member.wait(timeout=30) == 0


def test_inspect_of_a_key_typed_unescaped_suggests_the_stored_escaped_one(db: DB) -> None:
    """A template with '-' in its text escapes '-' inside values (docs/BAD_INPUT.md):
    an operator who types the id as they know it is shown the key that exists."""
    store = Store(schema="kafka_idem", table="task_idempotency", namespace="tests")
    conn = connect(db.dsn)
    with conn.transaction():
        store.claim(conn, key="t1:email-sync:h%2Dperm%2D0", request_hash="v1:x",
                    delivery=Delivery("t", 0, 0, "h"), lease_seconds=1, max_attempts=5,
                    max_elapsed_seconds=3600)
    conn.close()
    out = kafka_idem(db, "inspect", "t1:email-sync:h-perm-0")
    assert out.returncode == 1
    assert out.stderr.strip() == (
        "error: no record with key 't1:email-sync:h-perm-0' (did you mean "
        "'t1:email-sync:h%2Dperm%2D0'? a key template percent-encodes its separators "
        "inside a field's value)")
    found = kafka_idem(db, "inspect", "t1:email-sync:h%2Dperm%2D0")
    assert found.returncode == 0 and "processing" in found.stdout
    none = kafka_idem(db, "inspect", "t1:email-sync:other-0")
    assert (none.returncode, none.stderr.strip()) == (
        1, "error: no record with key 't1:email-sync:other-0'")


def test_rerun_refuses_a_live_processing_record(db: DB) -> None:
    store = Store(schema="kafka_idem", table="task_idempotency", namespace="tests")
    conn = connect(db.dsn)
    with conn.transaction():
        store.claim(conn, key="k:live", request_hash="v1:x", delivery=Delivery("t", 0, 0, "h"),
                    lease_seconds=600, max_attempts=5, max_elapsed_seconds=3600)
    conn.close()
    out = kafka_idem(db, "rerun", "k:live", "--reason", "x")
    assert out.returncode == 1 and "live lease" in out.stderr
    assert db.record("k:live")["status"] == "processing"  # type: ignore[index]
    assert db.rows("SELECT * FROM kafka_idem.admin_audit") == []


def _records(db: DB, statuses: dict[str, int]) -> None:
    store = Store(schema="kafka_idem", table="task_idempotency", namespace="tests")
    conn = connect(db.dsn)
    for status, n in statuses.items():
        for i in range(n):
            key = f"{status}:{i}"
            with conn.transaction():
                c = store.claim(conn, key=key, request_hash="v1:x",
                                delivery=Delivery("purge-topic", 0, i, "h"), lease_seconds=600,
                                max_attempts=5, max_elapsed_seconds=3600)
                assert c.token is not None
                if status == "succeeded":
                    store.complete(conn, key=key, token=c.token, result=i)
                elif status in ("failed", "retryable_failed"):
                    store.fail(conn, key=key, token=c.token, status=status, kind="permanent",
                               error_class="E", error_message="m", delay=60)
    conn.close()


def test_purge_deletes_old_terminal_records_in_audited_batches_only(db: DB) -> None:
    _records(db, {"succeeded": 5, "failed": 2, "retryable_failed": 2, "processing": 2})
    nothing = kafka_idem(db, "purge", "--older-than", "1h")
    assert nothing.returncode == 0 and "purged 0" in nothing.stdout
    assert sum(db.status_counts().values()) == 11

    # 0s is under the one-hour floor ("purge-topic" does not exist: no retention to read)
    out = kafka_idem(db, "purge", "--older-than", "0s", "--batch-size", "2", "--actor", "ops",
                     "--force")
    assert out.returncode == 0, out.stderr
    assert "purged 5" in out.stdout
    assert db.status_counts() == {"failed": 2, "retryable_failed": 2, "processing": 2}
    audit: list[dict[str, Any]] = db.rows(
        "SELECT * FROM kafka_idem.admin_audit WHERE action = 'purge' ORDER BY id")
    assert [a["counts"]["deleted"] for a in audit] == [2, 2, 1]
    assert {a["actor"] for a in audit} == {"ops"}

    out = kafka_idem(db, "purge", "--older-than", "0s", "--include-failed", "--force")
    assert "purged 2" in out.stdout
    assert db.status_counts() == {"retryable_failed": 2, "processing": 2}


def test_purge_dry_run_counts_what_would_go_and_deletes_and_audits_nothing(db: DB) -> None:
    _records(db, {"succeeded": 3, "failed": 2, "retryable_failed": 1, "processing": 1})
    before = db.status_counts()
    out = kafka_idem(db, "purge", "--older-than", "0s", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert ("dry run: would purge 3 records older than 0s (succeeded 3); nothing deleted"
            in out.stdout)
    out = kafka_idem(db, "purge", "--older-than", "0s", "--include-failed", "--dry-run")
    assert "would purge 5 records older than 0s (succeeded 3, failed 2)" in out.stdout
    out = kafka_idem(db, "purge", "--older-than", "1h", "--dry-run")
    assert "would purge 0 records older than 1h (succeeded 0)" in out.stdout
    assert db.status_counts() == before
    assert db.rows("SELECT * FROM kafka_idem.admin_audit WHERE action = 'purge'") == []
    out = kafka_idem(db, "purge", "--older-than", "0s", "--include-failed", "--force")
    assert "purged 5" in out.stdout  # what the dry run said


def test_bad_duration_is_a_usage_error(db: DB) -> None:
    out = kafka_idem(db, "purge", "--older-than", "soon")
    assert out.returncode == 2 and "duration" in out.stderr


def test_a_rerun_whose_message_the_broker_refuses_changes_nothing_and_can_be_run_again(
    db: DB, topics: Topics, members: Members, group: str, admin: AdminClient
) -> None:
    topic = _mixed_run(db, topics, members, group, PERMANENT_ORDERS="o4")
    key = "t1:charge:o4"
    before = db.record(key)
    assert before is not None and before["status"] == "failed"
    # The source topic now refuses record batches over 200 bytes: the republished message
    # (its original bytes plus the lineage headers) fails in its delivery report.
    set_topic_config(admin, topic, "max.message.bytes", "200")

    out = kafka_idem(db, "rerun", key, "--reason", "INC-7", "--actor", "alice")
    assert out.returncode == 3, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"error: re-run not recorded, {key} is still failed")
    assert "Message size too large" in lines[0]
    after = db.record(key)
    assert after == before, "not stranded: still failed, budget and times untouched"
    assert db.rows("SELECT * FROM kafka_idem.admin_audit") == []
    assert len([m for m in read_topic(topic) if m.key() == b"o4"]) == 1

    # The topic is fixed and the cause too: the same rerun now works, once.
    set_topic_config(admin, topic, "max.message.bytes", None)
    member = members.start(VARIANTS, member_env(db, topic), group=group)
    again = kafka_idem(db, "rerun", key, "--reason", "INC-7", "--actor", "alice")
    assert again.returncode == 0, again.stderr
    wait_for(lambda: (db.record(key) or {}).get("status") == "succeeded",
             what="the re-run to succeed")
    wait_for(lambda: caught_up(group, topic), what="the republished message to be committed")
    assert db.ledger_counts()[key] == 1
    trail = db.rows("SELECT * FROM kafka_idem.admin_audit WHERE idempotency_key = %s", (key,))
    assert [(a["actor"], a["action"], a["reason"]) for a in trail] == [
        ("alice", "rerun", "INC-7")]
    member.terminate()
    assert member.wait(timeout=30) == 0
