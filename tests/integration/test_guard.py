"""The transition guard after migration 0003 (triggers with WHEN conditions): it
decides every row exactly as the always-firing trigger of 0001 did, and its
plpgsql function runs only for rows that need checking."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql

from kafka_idem.admin.migrate import migrations, render
from kafka_idem.store import Delivery, Store, connect
from tests.conftest import DB
from tests.integration.support import record_in

TABLE = "task_idempotency"
STORE = "kafka_idem"  # the test database's store: every migration applied
OTHER_TOKEN = "00000000-0000-0000-0000-0000000000aa"

# Every outcome of one UPDATE / INSERT / DELETE of a matrix of cases, computed in the
# server: each case in its own subtransaction, rolled back whatever happened.
OUTCOMES = """
CREATE FUNCTION pg_temp.guard_outcomes(tbl regclass) RETURNS TABLE (case_id text, outcome text)
LANGUAGE plpgsql AS $fn$
DECLARE
    old_status text; new_status text; tok text; key_change boolean; hash text;
    delta integer; admin text; n bigint;
BEGIN
    FOREACH admin IN ARRAY ARRAY['', 'rerun', 'purge', 'other'] LOOP
        FOREACH old_status IN ARRAY ARRAY['processing', 'succeeded', 'retryable_failed',
                                          'failed'] LOOP
            FOREACH new_status IN ARRAY ARRAY['processing', 'succeeded', 'retryable_failed',
                                              'failed', 'bogus', NULL] LOOP
                FOREACH tok IN ARRAY ARRAY['keep', 'owner', 'other', 'null'] LOOP
                    FOREACH key_change IN ARRAY ARRAY[false, true] LOOP
                        FOREACH hash IN ARRAY ARRAY['same', 'changed', 'null'] LOOP
                            FOREACH delta IN ARRAY ARRAY[-1, 0, 1] LOOP
                                case_id := format('update admin=%s %s->%s token=%s key_change=%s '
                                                  'hash=%s attempts%s', admin, old_status,
                                                  coalesce(new_status, 'NULL'), tok, key_change,
                                                  hash, delta);
                                BEGIN
                                    PERFORM set_config('kafka_idem.admin_action', admin, true);
                                    EXECUTE format(
                                        'UPDATE %s SET status = $1, completed_token = CASE $2 '
                                        'WHEN ''keep'' THEN completed_token '
                                        'WHEN ''owner'' THEN owner_token '
                                        'WHEN ''other'' THEN %L::uuid END, '
                                        'idempotency_key = CASE WHEN $3 THEN idempotency_key '
                                        '|| ''-x'' ELSE idempotency_key END, '
                                        'request_hash = CASE $4 WHEN ''same'' THEN request_hash '
                                        'WHEN ''changed'' THEN ''v1:other'' END, '
                                        'attempts = attempts + $5 WHERE idempotency_key = $6',
                                        tbl, %(other)s)
                                    USING new_status, tok, key_change, hash, delta,
                                          'k-' || old_status;
                                    GET DIAGNOSTICS n = ROW_COUNT;
                                    RAISE EXCEPTION USING ERRCODE = 'ZZ999', MESSAGE = n::text;
                                EXCEPTION WHEN OTHERS THEN
                                    outcome := CASE WHEN SQLSTATE = 'ZZ999'
                                                    THEN 'ok, rows: ' || SQLERRM
                                                    ELSE SQLSTATE || ': ' || SQLERRM END;
                                    RETURN NEXT;
                                END;
                            END LOOP;
                        END LOOP;
                    END LOOP;
                END LOOP;
            END LOOP;
            case_id := format('delete admin=%s %s', admin, old_status);
            BEGIN
                PERFORM set_config('kafka_idem.admin_action', admin, true);
                EXECUTE format('DELETE FROM %s WHERE idempotency_key = $1', tbl)
                USING 'k-' || old_status;
                GET DIAGNOSTICS n = ROW_COUNT;
                RAISE EXCEPTION USING ERRCODE = 'ZZ999', MESSAGE = n::text;
            EXCEPTION WHEN OTHERS THEN
                outcome := CASE WHEN SQLSTATE = 'ZZ999' THEN 'ok, rows: ' || SQLERRM
                                ELSE SQLSTATE || ': ' || SQLERRM END;
                RETURN NEXT;
            END;
        END LOOP;
        FOREACH new_status IN ARRAY ARRAY['processing', 'succeeded', 'retryable_failed',
                                          'failed', 'bogus', NULL] LOOP
            case_id := format('insert admin=%s (new)->%s', admin, coalesce(new_status, 'NULL'));
            BEGIN
                PERFORM set_config('kafka_idem.admin_action', admin, true);
                EXECUTE format('INSERT INTO %s (idempotency_key, request_hash, status, '
                               'owner_token, lease_until, completed_token) VALUES (''k-new'', '
                               '''v1:x'', $1, gen_random_uuid(), now() + interval ''1 minute'', '
                               'gen_random_uuid())', tbl)
                USING new_status;
                GET DIAGNOSTICS n = ROW_COUNT;
                RAISE EXCEPTION USING ERRCODE = 'ZZ999', MESSAGE = n::text;
            EXCEPTION WHEN OTHERS THEN
                outcome := CASE WHEN SQLSTATE = 'ZZ999' THEN 'ok, rows: ' || SQLERRM
                                ELSE SQLSTATE || ': ' || SQLERRM END;
                RETURN NEXT;
            END;
        END LOOP;
    END LOOP;
END
$fn$;
"""


def _seed(conn: psycopg.Connection[Any], table: sql.Composable) -> None:
    """One record per status, each reached through legal transitions."""
    for status in ("processing", "succeeded", "retryable_failed", "failed"):
        conn.execute(sql.SQL(
            "INSERT INTO {} (idempotency_key, request_hash, status, owner_token, lease_until, "
            "attempts) VALUES (%s, 'v1:x', 'processing', gen_random_uuid(), "
            "now() + interval '1 minute', 1)").format(table), (f"k-{status}",))
    conn.execute(sql.SQL(
        "UPDATE {} SET status = 'succeeded', completed_token = owner_token, owner_token = NULL, "
        "lease_until = NULL, result_json = '1' WHERE idempotency_key = 'k-succeeded'"
    ).format(table))
    for status in ("retryable_failed", "failed"):
        conn.execute(sql.SQL(
            "UPDATE {} SET status = %s, owner_token = NULL, lease_until = NULL "
            "WHERE idempotency_key = %s").format(table), (status, f"k-{status}"))


def _before_0003(db: DB, schema: str) -> None:
    """A store built by the migrations before 0003: the always-firing guard."""
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        for migration in migrations():
            if migration.version < 3:
                conn.execute(render(migration, schema, TABLE))


def _outcomes(db: DB, schema: str) -> dict[str, str]:
    table = sql.Identifier(schema, TABLE)
    with psycopg.connect(db.dsn) as conn:
        conn.execute(sql.SQL(OUTCOMES.replace("%(other)s", "{}")).format(
            sql.Literal(OTHER_TOKEN)))
        if _has_namespaces(conn, schema):  # the matrix's rows, in one namespace (rolled back)
            conn.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN namespace SET DEFAULT 'tests'")
                         .format(table))
        _seed(conn, table)
        rows = conn.execute("SELECT case_id, outcome FROM pg_temp.guard_outcomes(%s::regclass)",
                            (table.as_string(conn),)).fetchall()
        conn.rollback()
    return dict(rows)


def _has_namespaces(conn: psycopg.Connection[Any], schema: str) -> bool:
    row = conn.execute("SELECT count(*) FROM information_schema.columns WHERE table_schema = %s "
                       "AND table_name = %s AND column_name = 'namespace'",
                       (schema, TABLE)).fetchone()
    return bool(row and row[0])


def _dead_again(case: str) -> bool:
    return (case.startswith("update ") and " failed->failed " in case
            and "key_change=f" in case and "hash=same" in case and case.endswith("attempts0"))


def test_the_guard_decides_every_case_as_before_migration_0003(db: DB) -> None:
    _before_0003(db, "guard_ref")
    with psycopg.connect(db.dsn) as conn:  # the reference fires for every row
        events = conn.execute(
            "SELECT t.tgname, t.tgtype, t.tgqual IS NULL FROM pg_trigger t "
            "WHERE t.tgrelid = 'guard_ref.task_idempotency'::regclass AND NOT t.tgisinternal"
        ).fetchall()
    assert events == [("guard_transitions", 31, True)]  # ROW BEFORE INSERT|UPDATE|DELETE
    before = _outcomes(db, "guard_ref")
    after = _outcomes(db, STORE)
    assert len(before) == len(after) == 4 * (4 * (6 * 4 * 2 * 3 * 3 + 1) + 6)
    different = {case: (before[case], after[case]) for case in before
                 if before[case] != after[case]}
    # Migration 0004's one change: failed -> failed with the key, the hash and the
    # attempts unchanged (a dead letter sent again) is legal now, whoever asks.
    allowed = {case for case in before if _dead_again(case)}
    assert allowed and set(different) == allowed, sorted(set(different) ^ allowed)[:10]
    for case in allowed:
        assert before[case].startswith("KI001: kafka_idem: illegal transition failed -> failed")
        assert not after[case].startswith("KI001"), (case, after[case])
    # The matrix is not vacuous: it has legal cases and every kind of refusal.
    kinds = {outcome.split(":")[0] for outcome in after.values()}
    assert {"ok, rows", "KI001", "KI002"} <= kinds
    assert after["update admin= processing->succeeded token=other key_change=f "
                 "hash=same attempts0"].startswith(
        "KI002: kafka_idem: stale owner cannot complete k-processing")
    assert after["update admin= succeeded->processing token=keep key_change=f "
                 "hash=same attempts1"] == (
        "KI001: kafka_idem: illegal transition succeeded -> processing for k-succeeded")
    assert after["update admin=rerun failed->retryable_failed token=keep key_change=f "
                 "hash=same attempts0"] == "ok, rows: 1"
    assert after["update admin= failed->retryable_failed token=keep key_change=f "
                 "hash=same attempts0"].startswith("KI001")
    assert after["update admin= processing->failed token=keep key_change=f "
                 "hash=same attempts-1"] == (
        "KI001: kafka_idem: attempts never decrease (k-processing)")
    assert after["update admin= processing->processing token=keep key_change=t "
                 "hash=same attempts1"] == (
        "KI001: kafka_idem: key and request hash are immutable (k-processing)")
    assert after["delete admin=purge succeeded"] == "ok, rows: 1"
    assert after["delete admin= succeeded"].startswith("KI001")
    assert after["insert admin= (new)->succeeded"] == (
        "KI001: kafka_idem: illegal transition (new) -> succeeded for k-new")


ILLEGAL_UPDATES = [
    # (status the record is in, SET clause, SQLSTATE, message start)
    ("succeeded", "status = 'processing', owner_token = gen_random_uuid(), "
     "lease_until = now() + interval '1 minute'", "KI001",
     "kafka_idem: illegal transition succeeded -> processing"),
    ("succeeded", "result_json = '2'", "KI001",
     "kafka_idem: illegal transition succeeded -> succeeded"),
    ("failed", "status = 'retryable_failed'", "KI001",
     "kafka_idem: illegal transition failed -> retryable_failed"),
    ("retryable_failed", "status = 'succeeded', completed_token = gen_random_uuid()", "KI001",
     "kafka_idem: illegal transition retryable_failed -> succeeded"),
    ("processing", "status = 'succeeded', completed_token = gen_random_uuid(), "
     "owner_token = NULL", "KI002", "kafka_idem: stale owner cannot complete"),
    ("processing", "status = 'succeeded'", "KI002",  # no completed token at all
     "kafka_idem: stale owner cannot complete"),
    ("processing", "idempotency_key = idempotency_key || '-other'", "KI001",
     "kafka_idem: key and request hash are immutable"),
    ("processing", "request_hash = 'v1:other'", "KI001",
     "kafka_idem: key and request hash are immutable"),
    ("processing", "attempts = attempts - 1", "KI001", "kafka_idem: attempts never decrease"),
    ("retryable_failed", "status = 'processing', attempts = 0, owner_token = gen_random_uuid(), "
     "lease_until = now() + interval '1 minute'", "KI001", "kafka_idem: attempts never decrease"),
]


@pytest.mark.parametrize(("status", "change", "sqlstate", "message"), ILLEGAL_UPDATES)
def test_every_illegal_update_is_refused_with_its_sqlstate(
    db: DB, status: str, change: str, sqlstate: str, message: str
) -> None:
    key = record_in(db, status)
    before = db.record(key)
    with psycopg.connect(db.dsn) as conn, pytest.raises(psycopg.Error) as err:
        conn.execute(f"UPDATE kafka_idem.task_idempotency SET {change} "
                     "WHERE idempotency_key = %s", (key,))
    assert err.value.sqlstate == sqlstate
    assert err.value.diag.message_primary is not None
    assert err.value.diag.message_primary.startswith(message)
    assert db.record(key) == before


def _guard_calls(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions "
        "WHERE schemaname = %s AND funcname = %s", (STORE, f"{TABLE}_guard")).fetchone()
    assert row is not None
    return int(row[0])


def test_the_guard_function_runs_only_for_rows_that_need_checking(db: DB) -> None:
    store = Store(schema=STORE, table=TABLE, namespace="tests")
    conn = connect(db.dsn)
    try:
        conn.execute("SET track_functions = 'pl'")
        keys = [f"k:{i}" for i in range(21)]
        delivery = Delivery("t", 0, 0, "h")
        claims = [store.claim(conn, key=k, request_hash="v1:x", delivery=delivery,
                              lease_seconds=30, max_attempts=5, max_elapsed_seconds=3600)
                  for k in keys]
        for c in claims[:10]:
            assert c.token is not None
            assert store.extend_lease(conn, key=c.key, token=c.token, lease_seconds=30)
            store.complete(conn, key=c.key, token=c.token, result=1)
        for c in claims[10:20]:
            assert c.token is not None
            store.fail(conn, key=c.key, token=c.token, status="retryable_failed",
                       kind="transient", error_class="E", error_message="m", delay=0)
        # claims, lease extensions, completions by the owner, failures: no call at all
        assert _guard_calls(conn) == 0
        # A stale completion (k:20 is still processing), an admin re-run and a purge
        # do run it.
        with pytest.raises(psycopg.Error) as err, conn.transaction():
            conn.execute("UPDATE kafka_idem.task_idempotency SET status = 'succeeded', "
                         "completed_token = gen_random_uuid() WHERE idempotency_key = 'k:20'")
        assert err.value.sqlstate == "KI002"
        conn.execute("UPDATE kafka_idem.task_idempotency SET status = 'failed' "
                     "WHERE idempotency_key = 'k:18'")
        assert _guard_calls(conn) == 0  # retryable_failed -> failed is legal as it stands
        conn.execute("SELECT set_config('kafka_idem.admin_action', 'rerun', true)")
        conn.execute("UPDATE kafka_idem.task_idempotency SET status = 'retryable_failed' "
                     "WHERE idempotency_key = 'k:18'")
        conn.execute("SELECT set_config('kafka_idem.admin_action', 'purge', true)")
        conn.execute("DELETE FROM kafka_idem.task_idempotency WHERE idempotency_key = 'k:0'")
        assert _guard_calls(conn) >= 2
        conn.rollback()
    finally:
        conn.close()


NEW_ROWS = [
    # (status, owner_token, lease_until, completed_token, namespace, refusal or None)
    ("succeeded", "NULL", "NULL", "gen_random_uuid()", "'tests'", None),  # migration 0010
    ("succeeded", "gen_random_uuid()", "NULL", "gen_random_uuid()", "'tests'",
     "KI001: kafka_idem: illegal transition (new) -> succeeded"),
    ("succeeded", "NULL", "now() + interval '1 minute'", "gen_random_uuid()", "'tests'",
     "KI001: kafka_idem: illegal transition (new) -> succeeded"),
    ("succeeded", "NULL", "NULL", "gen_random_uuid()", "''",
     "KI001: kafka_idem: a new record needs a namespace"),
    ("succeeded", "NULL", "NULL", "NULL", "'tests'",  # a success names its token
     "KI001: kafka_idem: illegal transition (new) -> succeeded"),
    ("failed", "NULL", "NULL", "NULL", "'tests'",
     "KI001: kafka_idem: illegal transition (new) -> failed"),
    ("retryable_failed", "NULL", "NULL", "NULL", "'tests'",
     "KI001: kafka_idem: illegal transition (new) -> retryable_failed"),
]


@pytest.mark.parametrize(("status", "owner", "lease", "completed", "ns", "refusal"), NEW_ROWS)
def test_a_new_row_is_processing_or_a_success_in_one_row_and_nothing_else(
    db: DB, status: str, owner: str, lease: str, completed: str, ns: str, refusal: str | None
) -> None:
    """(new) -> succeeded is a claim and its completion by one transaction (the batch
    path): legal with its completed token and no lease, without a call of the guard
    function; every other new state stays refused."""
    with psycopg.connect(db.dsn) as conn:
        conn.execute("SET track_functions = 'pl'")
        insert = ("INSERT INTO kafka_idem.task_idempotency (namespace, idempotency_key, "
                  "request_hash, status, owner_token, lease_until, completed_token, attempts) "
                  f"VALUES ({ns}, 'k-new', 'v1:x', %s, {owner}, {lease}, {completed}, 1)")
        if refusal is None:
            assert conn.execute(insert, (status,)).rowcount == 1
            assert _guard_calls(conn) == 0
            return
        with pytest.raises(psycopg.Error) as err:
            conn.execute(insert, (status,))
        assert f"{err.value.sqlstate}: {err.value.diag.message_primary}".startswith(refusal)
    assert db.record("k-new") is None


def _unassigned(db: DB, schema: str) -> None:
    """A store at 0004 with records 'u1', 'u2' (succeeded), migrated to 0005: unassigned."""
    table = sql.Identifier(schema, TABLE)
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        for migration in migrations():
            if migration.version <= 4:
                conn.execute(render(migration, schema, TABLE))
        for key in ("u1", "u2"):
            conn.execute(sql.SQL(
                "INSERT INTO {} (idempotency_key, request_hash, status, owner_token, "
                "lease_until, attempts) VALUES (%s, 'v1:x', 'processing', gen_random_uuid(), "
                "now() + interval '1 minute', 1)").format(table), (key,))
            conn.execute(sql.SQL(
                "UPDATE {} SET status = 'succeeded', completed_token = owner_token, "
                "owner_token = NULL, lease_until = NULL WHERE idempotency_key = %s"
            ).format(table), (key,))
        for migration in migrations():
            if migration.version > 4:
                conn.execute(render(migration, schema, TABLE))


IMMUTABLE = "kafka_idem: the namespace of u1 is immutable"
NAMESPACE_CHANGES = [
    # (admin action, SET clause, the refusal's message start or None when allowed)
    ("", "namespace = 'app'", IMMUTABLE),
    ("rerun", "namespace = 'app'", IMMUTABLE),
    ("adopt", "namespace = 'app', status = 'processing', owner_token = gen_random_uuid(), "
     "lease_until = now() + interval '1 minute'", IMMUTABLE),
    ("adopt", "namespace = 'app', attempts = attempts + 1", IMMUTABLE),
    # no namespace change: the usual rules (a succeeded record never changes)
    ("adopt", "namespace = ''", "kafka_idem: illegal transition succeeded -> succeeded"),
    ("adopt", "namespace = 'app', result_json = '1'", IMMUTABLE),
    ("adopt", "namespace = 'app'", None),
]


@pytest.mark.parametrize(("admin", "change", "refusal"), NAMESPACE_CHANGES)
def test_only_an_audited_adoption_assigns_an_unassigned_record(
    db: DB, admin: str, change: str, refusal: str | None
) -> None:
    schema = f"ns_{uuid.uuid4().hex[:8]}"
    _unassigned(db, schema)
    table = sql.Identifier(schema, TABLE)
    with psycopg.connect(db.dsn) as conn:
        conn.execute("SELECT set_config('kafka_idem.admin_action', %s, true)", (admin,))
        stmt = sql.SQL(f"UPDATE {{}} SET {change} WHERE idempotency_key = 'u1'").format(table)
        if refusal is not None:
            with pytest.raises(psycopg.Error) as err:
                conn.execute(stmt)
            assert err.value.sqlstate == "KI001"
            assert (err.value.diag.message_primary or "").startswith(refusal)
        else:
            assert conn.execute(stmt).rowcount == 1
            conn.commit()
            assert db.value(sql.SQL("SELECT namespace FROM {} WHERE idempotency_key = 'u1'")
                            .format(table).as_string()) == "app"


def test_an_assigned_record_never_changes_namespace(db: DB) -> None:
    schema = f"ns_{uuid.uuid4().hex[:8]}"
    _unassigned(db, schema)
    table = sql.Identifier(schema, TABLE)
    with psycopg.connect(db.dsn) as conn:
        conn.execute("SELECT set_config('kafka_idem.admin_action', 'adopt', true)")
        conn.execute(sql.SQL("UPDATE {} SET namespace = 'app' WHERE idempotency_key = 'u1'")
                     .format(table))
        conn.commit()
        for target in ("", "other"):
            with conn.transaction():
                conn.execute("SELECT set_config('kafka_idem.admin_action', 'adopt', true)")
                with pytest.raises(psycopg.Error) as err, conn.transaction():
                    conn.execute(sql.SQL("UPDATE {} SET namespace = %s "
                                         "WHERE idempotency_key = 'u1'").format(table), (target,))
                assert err.value.sqlstate == "KI001"
        # a new record cannot be unassigned
        with pytest.raises(psycopg.Error) as err:
            conn.execute(sql.SQL(
                "INSERT INTO {} (namespace, idempotency_key, request_hash, status, owner_token, "
                "lease_until) VALUES ('', 'new', 'v1:x', 'processing', gen_random_uuid(), "
                "now() + interval '1 minute')").format(table))
        assert err.value.sqlstate == "KI001"
        assert (err.value.diag.message_primary or "").startswith(
            "kafka_idem: a new record needs a namespace")
