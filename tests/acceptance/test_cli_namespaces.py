"""Keys scoped per app, through the CLI against the real broker and database.

Two apps (``tests.apps.twin``: same topic, same key template, same handler name)
on one store each run their own handler for every key; a third that shares the
first one's namespace on purpose runs none. A store from before namespaces is
migrated without losing, duplicating or re-running a record: the app is refused
at start until ``migrate --app`` adopted its records. Outcomes are durable state:
effect rows per app, records per namespace, audit rows, committed offsets.
"""

from __future__ import annotations

import uuid
from collections import Counter
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import sql

from consumers.payments import encode_charge
from kafka_idem.admin.migrate import migrations, render
from tests.acceptance.conftest import headers_of, kafka_idem, read_all
from tests.acceptance.test_cli_redrive import consumed_all
from tests.apps.twin import CREATE
from tests.conftest import (
    DB,
    Members,
    Topics,
    caught_up,
    member_env,
    produce,
    wait_for,
)

TWIN = "tests.apps.twin:app"
TABLE = "task_idempotency"


def effects(db: DB) -> Counter[tuple[str, str]]:
    """How many times each app ran each key."""
    return Counter((r["app"], r["idempotency_key"])
                   for r in db.rows("SELECT app, idempotency_key FROM twin.effects"))


def records(db: DB, schema: str = "kafka_idem") -> dict[tuple[str, str], dict[str, Any]]:
    rows = db.rows(sql.SQL("SELECT * FROM {}").format(sql.Identifier(schema, TABLE))
                   .as_string())
    return {(r["namespace"], r["idempotency_key"]): r for r in rows}


def orders(n: int) -> list[str]:
    return [f"o{i:02d}" for i in range(n)]


def produce_orders(topic: str, names: list[str]) -> None:
    produce(topic, [(o.encode(), encode_charge("t1", o, "10.00")) for o in names])


def twin_env(db: DB, topic: str, name: str, **extra: str) -> dict[str, str]:
    return member_env(db, topic, TWIN_APP=name, **extra)


def test_two_apps_on_one_store_each_run_their_own_handler_for_every_key(
    db: DB, topics: Topics, members: Members
) -> None:
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(CREATE)
    topic = topics(partitions=2)
    names = orders(10)
    keys = [f"t1:charge:{o}" for o in names]
    produce_orders(topic, names)
    groups = {app: f"{app}-{uuid.uuid4().hex[:8]}" for app in ("twin-a", "twin-b", "twin-c")}
    for app in ("twin-a", "twin-b"):
        members.start(TWIN, twin_env(db, topic, app), group=groups[app])
    wait_for(lambda: all(caught_up(groups[a], topic) for a in ("twin-a", "twin-b")),
             timeout=90, what="both apps caught up")

    # Each app ran its handler once for every key, and has its own record of it.
    assert effects(db) == {(app, k): 1 for app in ("twin-a", "twin-b") for k in keys}
    recs = records(db)
    assert set(recs) == {(app, k) for app in ("twin-a", "twin-b") for k in keys}
    assert {(ns, r["status"], r["result_json"]["by"]) for (ns, _), r in recs.items()} == {
        ("twin-a", "succeeded", "twin-a"), ("twin-b", "succeeded", "twin-b")}

    # A third app sharing twin-a's namespace on purpose is answered from its records.
    members.start(TWIN, twin_env(db, topic, "twin-c", KAFKA_IDEM_NAMESPACE="twin-a"),
                  group=groups["twin-c"])
    wait_for(lambda: caught_up(groups["twin-c"], topic), timeout=90, what="twin-c caught up")
    assert not [e for e in effects(db) if e[0] == "twin-c"]
    assert records(db) == recs

    # status: totals, and one row of counts per namespace
    st = kafka_idem("status", "--json", db=db)
    assert st.code == 0, st.err
    assert st.json()["by_status"]["succeeded"] == 20
    assert st.json()["by_namespace"] == {
        ns: {"processing": 0, "succeeded": 10, "retryable_failed": 0, "failed": 0}
        for ns in ("twin-a", "twin-b")}
    one = kafka_idem("status", "--json", "--namespace", "twin-b", db=db)
    assert one.code == 0, one.err
    assert (one.json()["namespace"], one.json()["by_status"]["succeeded"]) == ("twin-b", 10)
    table = kafka_idem("status", db=db)
    assert table.code == 0 and "twin-a" in table.out and "twin-b" in table.out

    # inspect: every namespace by default; JSON needs one record
    human = kafka_idem("inspect", keys[0], db=db)
    assert human.code == 0, human.err
    assert "namespace twin-a" in human.out and "namespace twin-b" in human.out
    ambiguous = kafka_idem("inspect", keys[0], "--json", db=db)
    assert ambiguous.code == 1 and ambiguous.out == ""
    assert "'twin-a', 'twin-b'" in ambiguous.err and "--namespace" in ambiguous.err
    scoped = kafka_idem("inspect", keys[0], "--json", "--namespace", "twin-b", db=db)
    assert scoped.code == 0, scoped.err
    assert (scoped.json()["namespace"], scoped.json()["result_json"]) == (
        "twin-b", {"by": "twin-b"})

    # rerun of a key two namespaces hold: refused, naming them
    rerun = kafka_idem("rerun", keys[0], "--reason", "x", db=db)
    assert rerun.code == 1 and "twin-a" in rerun.err and "twin-b" in rerun.err

    # a namespace that does not exist: one line, exit 1, nothing changed
    for args in (("status", "--namespace", "nope"), ("inspect", keys[0], "--namespace", "nope"),
                 ("rerun", "--kind", "exhausted", "--namespace", "nope", "--reason", "x"),
                 ("purge", "--older-than", "0s", "--namespace", "nope")):
        r = kafka_idem(*args, db=db)
        assert r.code == 1, (args, r.out, r.err)
        assert len(r.err.strip().splitlines()) == 1, (args, r.err)
        assert "no records in namespace 'nope'" in r.err, (args, r.err)

    # purge of one namespace leaves the other alone (--force: a window of 0s is shorter
    # than the topic's retention)
    purged = kafka_idem("purge", "--older-than", "0s", "--namespace", "twin-b", "--force",
                        db=db)
    assert purged.code == 0, purged.err
    assert "purged 10 records" in purged.out
    assert {ns for ns, _ in records(db)} == {"twin-a"}
    [audit] = db.rows("SELECT * FROM kafka_idem.admin_audit WHERE action = 'purge'")
    assert (audit["namespace"], audit["counts"]) == ("twin-b", {"deleted": 10})


def test_replay_re_drives_one_app_s_failed_keys_when_another_app_did_them(
    db: DB, topics: Topics, members: Members
) -> None:
    """Both apps dead-letter into the same DLQ topic; each dead letter names its
    namespace, so the replay re-runs twin-a's failed keys although twin-b's records of
    the same keys succeeded (looked up by key alone, they would be skipped)."""
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(CREATE)
        conn.execute("INSERT INTO twin.blocked VALUES ('twin-a')")
    topic = topics(partitions=1)
    names = orders(5)
    keys = [f"t1:charge:{o}" for o in names]
    produce_orders(topic, names)
    groups = {app: f"{app}-{uuid.uuid4().hex[:8]}" for app in ("twin-a", "twin-b")}
    fast = {"KAFKA_IDEM_MAX_ATTEMPTS": "2", "KAFKA_IDEM_BACKOFF_BASE_SECONDS": "0.05",
            "KAFKA_IDEM_BACKOFF_CAP_SECONDS": "0.1"}
    procs = {app: members.start(TWIN, twin_env(db, topic, app, **fast), group=groups[app])
             for app in ("twin-a", "twin-b")}
    wait_for(lambda: all(caught_up(g, topic) for g in groups.values())
             and all(records(db).get(("twin-a", k), {}).get("status") == "failed"
                     for k in keys), timeout=90, what="twin-a exhausted, twin-b done")
    letters = read_all(f"{topic}.dlq")
    assert sorted(headers_of(m)["idem.key"] for m in letters) == keys
    assert {headers_of(m)["idem.namespace"] for m in letters} == {"twin-a"}
    assert effects(db) == {("twin-b", k): 1 for k in keys}

    with psycopg.connect(db.dsn, autocommit=True) as conn:  # the fix
        conn.execute("DELETE FROM twin.blocked")
    r = kafka_idem("dlq", "replay", "--dlq", f"{topic}.dlq", "--kind", "exhausted",
                   "--namespace", "twin-a", "--reason", "unblocked", "--no-progress", "--json",
                   db=db)
    assert r.code == 0, r.err
    assert (r.json()["rerun"], r.json()["skipped_succeeded"], r.json()["sent"]) == (5, 0, 5)
    # (the replay's records come in a Kafka transaction: its marker is never consumed)
    wait_for(lambda: consumed_all(groups["twin-a"], topic)
             and all(records(db)[("twin-a", k)]["status"] == "succeeded" for k in keys),
             timeout=90, what="twin-a's keys succeeded")
    wait_for(lambda: consumed_all(groups["twin-b"], topic), timeout=60,
             what="twin-b consumed the replayed messages")
    # each app ran each key exactly once; twin-b answered the replayed messages itself
    assert effects(db) == {(app, k): 1 for app in ("twin-a", "twin-b") for k in keys}
    audit = db.rows("SELECT namespace, idempotency_key FROM kafka_idem.admin_audit "
                    "WHERE action = 'rerun'")
    assert sorted((a["namespace"], a["idempotency_key"]) for a in audit) == [
        ("twin-a", k) for k in keys]
    assert len(read_all(f"{topic}.dlq")) == 5
    for proc in procs.values():
        assert proc.poll() is None


# --- a store from before namespaces -----------------------------------------------------


def legacy_store(db: DB, schema: str) -> None:
    """A store at migration 0004 (before namespaces), as an older version built it."""
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        conn.execute(sql.SQL("CREATE TABLE {} (version integer PRIMARY KEY, name text NOT NULL, "
                             "applied_at timestamptz NOT NULL DEFAULT now())")
                     .format(sql.Identifier(schema, "schema_migrations")))
        for m in migrations():
            if m.version <= 4:
                conn.execute(render(m, schema, TABLE))
                conn.execute(sql.SQL("INSERT INTO {} (version, name) VALUES (%s, %s)")
                             .format(sql.Identifier(schema, "schema_migrations")),
                             (m.version, m.name))


def legacy_record(conn: psycopg.Connection[Any], schema: str, key: str, status: str, *,
                  topic: str, handler: str, request_hash: str) -> None:
    """One record written the way the 0004 store's consumers wrote it (legal transitions)."""
    table = sql.Identifier(schema, TABLE)
    conn.execute(sql.SQL(
        "INSERT INTO {} (idempotency_key, request_hash, status, owner_token, lease_until, "
        "attempts, handler, kafka_topic, kafka_partition, kafka_offset) VALUES (%s, %s, "
        "'processing', gen_random_uuid(), now() + interval '1 minute', 1, %s, %s, 0, 0)"
    ).format(table), (key, request_hash, handler, topic))
    if status == "succeeded":
        conn.execute(sql.SQL(
            "UPDATE {} SET status = 'succeeded', completed_token = owner_token, "
            "owner_token = NULL, lease_until = NULL, result_json = '{{\"by\": \"legacy\"}}' "
            "WHERE idempotency_key = %s").format(table), (key,))
    elif status in ("failed", "retryable_failed"):
        conn.execute(sql.SQL(
            "UPDATE {} SET status = %s, owner_token = NULL, lease_until = NULL, "
            "error_kind = 'exhausted', error_class = 'Retryable', error_message = 'no stock', "
            "last_failure_at = now() WHERE idempotency_key = %s").format(table), (status, key))


def test_a_store_from_before_namespaces_is_carried_over_without_rerunning_a_key(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    from kafka_idem.keys import request_hash

    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(CREATE)
    schema = f"legacy_{uuid.uuid4().hex[:8]}"
    legacy_store(db, schema)
    topic = topics(partitions=1)
    names = orders(6)
    digest = request_hash({"amount": Decimal("10.00"), "currency": "EUR"})
    with psycopg.connect(db.dsn) as conn:
        for o in names[:4]:
            legacy_record(conn, schema, f"t1:charge:{o}", "succeeded", topic=topic,
                          handler="charge", request_hash=digest)
        legacy_record(conn, schema, "t1:charge:o04", "failed", topic=topic, handler="charge",
                      request_hash=digest)
        # another app's records (another topic and handler) stay unassigned
        for k in ("x:1", "x:2"):
            legacy_record(conn, schema, k, "succeeded", topic="elsewhere", handler="other",
                          request_hash="v1:x")
    before = db.rows(sql.SQL("SELECT * FROM {} ORDER BY idempotency_key")
                     .format(sql.Identifier(schema, TABLE)).as_string())
    store = ("--schema", schema)

    up = kafka_idem(*store, "migrate", db=db)
    assert up.code == 0, up.err
    assert "0005_namespaces" in up.out
    after = db.rows(sql.SQL("SELECT * FROM {} ORDER BY idempotency_key")
                    .format(sql.Identifier(schema, TABLE)).as_string())
    # every record kept, unchanged, and unassigned (with no shard key: migration 0009)
    new = ("namespace", "shard_key")
    assert [{k: v for k, v in r.items() if k not in new} for r in after] == before
    assert {(r["namespace"], r["shard_key"]) for r in after} == {("", None)}

    env = twin_env(db, topic, "twin-a", KAFKA_IDEM_SCHEMA_NAME=schema)
    refused = members.start(TWIN, env, group=group)
    assert refused.wait(timeout=60) == 2
    log = members.logs()
    assert "5 record(s) of this app's handlers written before keys were scoped" in log
    assert f"{topic}/charge: 5" in log and "kafka-idem migrate --app" in log
    assert effects(db) == Counter()

    adopt = kafka_idem(*store, "migrate", "--app", TWIN, db=db,
                       env={"TWIN_APP": "twin-a", "PAYMENTS_TOPIC": topic})
    assert adopt.code == 0, adopt.err
    assert f"namespace twin-a: adopted 5 record(s) of {topic}/charge" in adopt.out
    again = kafka_idem(*store, "migrate", "--app", TWIN, db=db,
                       env={"TWIN_APP": "twin-a", "PAYMENTS_TOPIC": topic})
    assert again.code == 0 and "adopted" not in again.out
    recs = records(db, schema)
    assert {k for k in recs} == {("twin-a", f"t1:charge:{o}") for o in names[:5]} | {
        ("", "x:1"), ("", "x:2")}
    moved = {r["idempotency_key"]: r for r in after}
    for (_, key), rec in recs.items():  # nothing but the namespace changed
        assert {k: v for k, v in rec.items() if k != "namespace"} == {
            k: v for k, v in moved[key].items() if k != "namespace"}
    [audit] = db.rows(sql.SQL("SELECT * FROM {} WHERE action = 'adopt'")
                      .format(sql.Identifier(schema, "admin_audit")).as_string())
    assert (audit["namespace"], audit["counts"]["adopted"]) == ("twin-a", 5)

    # The messages of the done keys arrive again, with a new one: only the new one runs.
    produce_orders(topic, names)
    members.start(TWIN, env, group=group)
    wait_for(lambda: caught_up(group, topic), timeout=90, what="the app caught up")
    assert effects(db) == {("twin-a", "t1:charge:o05"): 1}
    recs = records(db, schema)
    assert recs[("twin-a", "t1:charge:o04")]["status"] == "failed"  # dead-lettered again
    for o in names[:4]:  # answered from the adopted records: same hash, no conflict
        rec = recs[("twin-a", f"t1:charge:{o}")]
        assert (rec["status"], rec["result_json"], rec["attempts"]) == (
            "succeeded", {"by": "legacy"}, 1)
    letters = read_all(f"{topic}.dlq")
    assert [headers_of(m)["idem.key"] for m in letters] == ["t1:charge:o04"]
    assert headers_of(letters[0])["idem.namespace"] == "twin-a"
