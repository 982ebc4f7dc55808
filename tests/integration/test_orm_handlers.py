"""ORM handlers (``ctx.session``) exactly once through the real broker and database:
every mode (local, the batch path, leased, ``async def``), duplicates replayed, a
member SIGKILLed between the database commit and the offset commit, and ``kafka-idem
migrate --app`` creating the app's ORM tables. The app: tests/apps/orm_ledger.py."""

from __future__ import annotations

import signal
import subprocess
import sys
from decimal import Decimal

import pytest

from tests.apps.orm_ledger import MODES, build_app, encode
from tests.conftest import (
    DB,
    ROOT,
    InProcess,
    Members,
    Topics,
    app_settings,
    caught_up,
    committed,
    end_offsets,
    member_env,
    produce,
    wait_for,
)
from tests.integration.support import migrate_app

LEDGER = "tests.apps.orm_ledger:app"


def deposits(n: int, accounts: int = 3) -> list[tuple[str, str, str]]:
    """``n`` deposits (account, order, amount) over a few accounts."""
    return [(f"a{i % accounts}", f"o{i}", f"{(i % 5) + 1}.25") for i in range(n)]


def messages(items: list[tuple[str, str, str]]) -> list[tuple[bytes, bytes]]:
    return [(o.encode(), encode(a, o, amount)) for a, o, amount in items]


def entry_counts(db: DB) -> dict[str, int]:
    rows = db.rows("SELECT idempotency_key, count(*) AS n FROM public.orm_entry GROUP BY 1")
    return {r["idempotency_key"]: r["n"] for r in rows}


def balances(db: DB) -> dict[str, Decimal]:
    return {r["id"]: r["balance"] for r in db.rows("SELECT id, balance FROM public.orm_account")}


def expected_balances(items: list[tuple[str, str, str]]) -> dict[str, Decimal]:
    out: dict[str, Decimal] = {}
    for a, _o, amount in items:
        out[a] = out.get(a, Decimal(0)) + Decimal(amount)
    return out


def keys(items: list[tuple[str, str, str]]) -> set[str]:
    return {f"{a}:deposit:{o}" for a, o, _amount in items}


def assert_exactly_once(db: DB, items: list[tuple[str, str, str]]) -> None:
    """One entry per key, balances the sum of each key once, every record succeeded at
    its first attempt."""
    assert entry_counts(db) == dict.fromkeys(keys(items), 1)
    assert balances(db) == expected_balances(items)
    records = db.records()
    assert {r["idempotency_key"] for r in records} == keys(items)
    assert {(r["status"], r["attempts"]) for r in records} == {("succeeded", 1)}
    # The account's version counts its updates: one per applied deposit (and none for a
    # replay), the first deposit creating the row at version 1.
    versions = {r["id"]: r["version"] for r in db.rows("SELECT * FROM public.orm_account")}
    per_account: dict[str, int] = {}
    for a, _o, _amount in items:
        per_account[a] = per_account.get(a, 0) + 1
    assert versions == {a: n + 1 for a, n in per_account.items()}


@pytest.mark.parametrize("mode", MODES)
def test_orm_handlers_take_effect_once_and_duplicates_replay(
    db: DB, topics: Topics, group: str, mode: str
) -> None:
    topic = topics(partitions=2)
    items = deposits(30)
    # Migrated by another app object, as `kafka-idem migrate --app` would: the running
    # app's engine connects for the first time inside a handler's transaction (in a
    # pipeline on the batch path and in leased mode).
    migrate_app(db, build_app(topic=topic, mode=mode))
    app = build_app(topic=topic, mode=mode, **app_settings(db, group_id=group, batch_size=10))
    # Every intent, then a third of them again (a producer's retry: the same payload).
    produce(topic, messages(items) + messages(items[:10]))
    with InProcess(app) as r:
        wait_for(lambda: caught_up(group, topic), what="the group to catch up")
        replayed = r.runner.metrics.messages.labels(topic, "deposit", "replayed")._value.get()
    assert replayed == 10
    assert_exactly_once(db, items)
    results = {r["idempotency_key"]: r["result_json"] for r in db.records()}
    assert all(res["order_id"] == k.split(":")[-1] for k, res in results.items())
    assert committed(group, topic) == end_offsets(topic)


@pytest.mark.parametrize("mode", MODES)
def test_a_member_killed_between_the_database_commit_and_the_offset_commit_replays(
    db: DB, topics: Topics, members: Members, group: str, mode: str
) -> None:
    topic = topics(partitions=1)
    items = deposits(20)
    migrate_app(db, build_app(topic=topic, mode=mode))
    produce(topic, messages(items))
    env = {"ORM_TOPIC": topic, "ORM_MODE": mode}
    crasher = members.start(LEDGER, member_env(db, topic, CRASH_BEFORE_OFFSET_COMMIT="1", **env),
                            group=group)
    assert crasher.wait(timeout=60) == -signal.SIGKILL, members.logs()
    done_before = db.status_counts().get("succeeded", 0)
    assert done_before > 0, (db.records(), members.logs())
    assert committed(group, topic)[0] < 0, "no offset was committed before the crash"
    before = {r["idempotency_key"]: r for r in db.records()}

    members.start(LEDGER, member_env(db, topic, **env), group=group)
    wait_for(lambda: caught_up(group, topic), what="the replacement to catch up")
    assert_exactly_once(db, items)  # attempts 1 everywhere: replayed, never re-run
    after = {r["idempotency_key"]: r for r in db.records()}
    finished = {k: rec for k, rec in before.items() if rec["status"] == "succeeded"}
    assert {k: after[k] for k in finished} == finished  # redelivered: replayed, untouched
    assert committed(group, topic) == end_offsets(topic)


def _migrate(db: DB) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kafka_idem.cli", "--database-url", db.dsn, "migrate",
           "--app", LEDGER]
    return subprocess.run(cmd, cwd=ROOT, env=member_env(db, "unused"), capture_output=True,
                          text=True, timeout=120, check=False)


def _orm_columns(db: DB) -> dict[str, list[str]]:
    rows = db.rows("SELECT table_name, column_name FROM information_schema.columns "
                   "WHERE table_schema = 'public' AND table_name LIKE 'orm\\_%%' "
                   "ORDER BY table_name, ordinal_position")
    out: dict[str, list[str]] = {}
    for r in rows:
        out.setdefault(r["table_name"], []).append(r["column_name"])
    return out


def test_migrate_app_creates_the_metadata_tables_and_a_second_run_changes_nothing(
    db: DB,
) -> None:
    assert _orm_columns(db) == {}
    first = _migrate(db)
    assert first.returncode == 0, first.stderr
    expected = {"orm_account": ["id", "balance", "version"],
                "orm_entry": ["id", "account_id", "order_id", "amount", "idempotency_key"]}
    assert _orm_columns(db) == expected
    constraints = db.rows(
        "SELECT table_name, constraint_type FROM information_schema.table_constraints "
        "WHERE table_schema = 'public' AND table_name LIKE 'orm\\_%%' "
        "AND constraint_type IN ('PRIMARY KEY', 'FOREIGN KEY', 'UNIQUE') ORDER BY 1, 2")
    assert [(c["table_name"], c["constraint_type"]) for c in constraints] == [
        ("orm_account", "PRIMARY KEY"), ("orm_entry", "FOREIGN KEY"),
        ("orm_entry", "PRIMARY KEY"), ("orm_entry", "UNIQUE")]
    db.rows("INSERT INTO public.orm_account (id, balance, version) VALUES ('kept', 1, 1) "
            "RETURNING id")

    second = _migrate(db)
    assert second.returncode == 0, second.stderr
    assert _orm_columns(db) == expected
    assert balances(db) == {"kept": Decimal("1.00")}  # nothing dropped or re-created
