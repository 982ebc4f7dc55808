"""The operator surfaces on a store distributed on a real Citus cluster (a coordinator and
two workers), through the documented CLI: ``status``, ``inspect``, ``rerun`` of one key
and in bulk, ``dlq list`` / ``show`` / ``replay``, ``pause`` / ``resume``, ``purge`` and a
member's background retention, and the console's records query. Each test has a Citus
database of its own (tools/citus.py), the payments example migrated there and distributed
by tenant, and asserts outcomes: record states and attempts, audit rows, rows deleted,
dead letters and their headers, republished messages run exactly once."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from consumers.payments import encode_charge
from kafka_idem.store import Store, connect
from kafka_idem.store.citus import fit
from tests.conftest import (
    BOOTSTRAP,
    ROOT,
    Members,
    Topics,
    caught_up,
    end_offsets,
    headers,
    produce,
    read_topic,
    wait_for,
)
from tools.citus import create_database, drop_database

APP = "consumers.payments:app"
PAUSED = "handler charge paused on this member"
RESUMED = "handler charge resumed on this member"


class Cluster:
    """A test's Citus database: its URL, the payments app's environment, queries."""

    def __init__(self, url: str, topic: str) -> None:
        self.url = url
        self.topic = topic
        self.env = {"KAFKA_IDEM_DATABASE_URL": url, "KAFKA_IDEM_BOOTSTRAP_SERVERS": BOOTSTRAP,
                    "KAFKA_IDEM_SESSION_TIMEOUT_MS": "6000", "PYTHONUNBUFFERED": "1",
                    "KAFKA_IDEM_BATCH_MAX_WAIT_SECONDS": "0.05", "KAFKA_IDEM_ACTOR": "citus-ops",
                    "PAYMENTS_TOPIC": topic, "PYTHONPATH": str(ROOT)}

    def cli(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([sys.executable, "-m", "kafka_idem.cli", *args], cwd=ROOT,
                              env={**os.environ, **self.env}, capture_output=True, text=True,
                              timeout=120, check=False)
        if ok:
            assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
        return done

    def json(self, *args: str) -> Any:
        return json.loads(self.cli(*args).stdout)

    def rows(self, query: str, params: Any = None) -> list[dict[str, Any]]:
        with psycopg.connect(self.url, row_factory=dict_row) as conn:
            return conn.execute(query, params).fetchall()  # type: ignore[arg-type]

    def records(self) -> dict[str, dict[str, Any]]:
        return {r["idempotency_key"]: r for r in self.rows(
            "SELECT idempotency_key, status, attempts, attempt_base, shard_key, created_at, "
            "updated_at FROM kafka_idem.task_idempotency")}

    def states(self) -> dict[str, tuple[str, int]]:
        return {k: (r["status"], r["attempts"]) for k, r in self.records().items()}

    def audit(self, action: str) -> list[dict[str, Any]]:
        return self.rows("SELECT * FROM kafka_idem.admin_audit WHERE action = %s ORDER BY id",
                         (action,))

    def ledger(self) -> Counter[str]:
        return Counter(r["idempotency_key"] for r in self.rows(
            "SELECT idempotency_key FROM payments.ledger"))


@pytest.fixture
def cluster(citus: str, topics: Topics) -> Iterator[Cluster]:
    name = f"kica_{uuid.uuid4().hex[:10]}"
    made = create_database(citus, name)
    info = psycopg.conninfo.conninfo_to_dict(made)
    url = f"postgresql://{info['user']}@{info['host']}:{info['port']}/{name}"
    c = Cluster(url, topics(partitions=2))
    try:
        c.cli("migrate", "--app", APP)
        c.cli("topics", "create", APP)
        topics.created.append(f"{c.topic}.charge-completed")
        yield c
    finally:
        drop_database(citus, name)


def charges(c: Cluster, orders: dict[str, str]) -> None:
    """One charge per order ``o<N>`` of tenant ``t<N % 4>`` (tenants spread over the
    shards); a negative amount fails permanently (dead-lettered, record failed)."""
    produce(c.topic, [(o.encode(), encode_charge(tenant(o), o, amount))
                      for o, amount in orders.items()])


def tenant(order: str) -> str:
    return f"t{int(order[1:]) % 4}"


def key(order: str) -> str:
    return f"{tenant(order)}:charge:{order}"


def settled(c: Cluster, group: str, want: dict[str, tuple[str, int]]) -> None:
    wait_for(lambda: c.states() == want and caught_up(group, c.topic), timeout=60,
             what=f"records {want}")


def test_status_inspect_and_rerun_one_key_and_in_bulk(
        cluster: Cluster, members: Members, group: str) -> None:
    c = cluster
    orders = {f"o{i}": ("-3.00" if i in (1, 4, 6) else "5.00") for i in range(8)}
    failed = [key(o) for o in ("o1", "o4", "o6")]
    charges(c, orders)
    members.start(APP, c.env, group=group)
    want = {key(o): ("failed" if key(o) in failed else "succeeded", 1) for o in orders}
    settled(c, group, want)
    assert {r["shard_key"] for r in c.records().values()} == {"t0", "t1", "t2", "t3"}

    status = c.json("status", "--json")
    assert status["by_status"] == {"processing": 0, "succeeded": 5, "retryable_failed": 0,
                                   "failed": 3}
    assert status["failed_by_kind"] == {"permanent": 3}
    shown = c.json("inspect", failed[0], "--json")
    assert (shown["namespace"], shown["status"], shown["attempts"], shown["error_kind"]) == (
        "payments", "failed", 1, "permanent")
    assert shown["audit"] == [] and shown["shard_key"] == failed[0].split(":")[0]
    text = c.cli("inspect", failed[0], "--namespace", "payments").stdout
    assert re.search(rf"^shard_key +{failed[0].split(':')[0]}$", text, re.MULTILINE), text
    missing = c.cli("inspect", "t9:charge:nope", ok=False)
    assert missing.returncode == 1, missing.stderr

    # one key: audited failed -> retryable_failed, its dead letter republished and run once
    done = c.cli("rerun", failed[0], "--reason", "PSP fixed")
    assert f"{failed[0]}: failed -> retryable_failed by citus-ops" in done.stdout
    refused = c.cli("rerun", key("o0"), "--reason", "again", ok=False)
    assert refused.returncode == 1 and "already succeeded" in refused.stderr
    want[failed[0]] = ("failed", 2)
    settled(c, group, want)
    [row] = c.audit("rerun")
    assert (row["idempotency_key"], row["namespace"], row["previous_status"], row["actor"],
            row["reason"]) == (failed[0], "payments", "failed", "citus-ops", "PSP fixed")
    assert row["previous_error"].startswith("permanent: Permanent: amount must be positive")

    # in bulk: every failed record of the namespace, one audit row each
    dry = c.json("rerun", "--kind", "permanent", "--namespace", "payments", "--dry-run",
                 "--json")
    assert (dry["selected"], dry["would_rerun"]) == (3, 3)
    assert c.states() == want  # a dry run changes nothing
    bulk = c.json("rerun", "--kind", "permanent", "--namespace", "payments", "--reason",
                  "bulk fix", "--no-progress", "--json")
    assert bulk["selected"] == 3 and bulk["rerun"] == 3, bulk
    want.update({failed[0]: ("failed", 3), failed[1]: ("failed", 2), failed[2]: ("failed", 2)})
    settled(c, group, want)
    reruns = c.audit("rerun")
    assert Counter(r["idempotency_key"] for r in reruns) == Counter(
        {failed[0]: 2, failed[1]: 1, failed[2]: 1})
    assert all(r["reason"] == "bulk fix" for r in reruns[1:])
    assert all(r["attempt_base"] == r["attempts"] - 1 for k, r in c.records().items()
               if k in failed)

    # each republished message ran once: one more dead letter per re-run, nothing else
    assert sum(end_offsets(c.topic).values()) == 8 + 1 + 3
    letters = Counter((headers(m)["idem.attempts"], m.key().decode())
                      for m in read_topic(f"{c.topic}.dlq"))
    assert letters == Counter({("1", "o1"): 1, ("1", "o4"): 1, ("1", "o6"): 1, ("2", "o1"): 1,
                               ("3", "o1"): 1, ("2", "o4"): 1, ("2", "o6"): 1})
    assert c.ledger() == Counter({key(o): 1 for o in orders if key(o) not in failed})
    console_smoke(c)


def console_smoke(c: Cluster) -> None:
    """The console's records pages and key lookup run on the distributed store."""
    store = Store(schema="kafka_idem", table="task_idempotency")
    conn = connect(c.url)
    try:
        assert fit(conn, store)
        page = store.browse(conn, statuses=["failed", "succeeded"], limit=4)
        assert len(page) == 4
        assert [r["updated_at"] for r in page] == sorted(
            (r["updated_at"] for r in page), reverse=True)
        last = page[-1]
        rest = store.browse(conn, statuses=["failed", "succeeded"], limit=10,
                            after=(last["updated_at"], last["namespace"],
                                   last["idempotency_key"]))
        assert len(page) + len(rest) == 8
        assert {r["idempotency_key"] for r in page + rest} == set(c.records())
        t1 = store.browse_prefix(conn, prefix="t1:", namespaces=["payments"],
                                 statuses=["failed", "succeeded"])
        assert [r["idempotency_key"] for r in t1] == ["t1:charge:o1", "t1:charge:o5"]
        assert store.namespaces(conn) == ["payments"]
        assert [r["status"] for r in store.find(conn, key("o4"), ["payments"])] == ["failed"]
    finally:
        conn.close()


def test_dlq_list_show_replay_while_paused_then_resume(
        cluster: Cluster, members: Members, group: str) -> None:
    c = cluster
    orders = {"o0": "5.00", "o1": "-2.00", "o2": "-2.00", "o3": "7.00"}
    charges(c, orders)
    members.start(APP, c.env, group=group)
    want = {key("o0"): ("succeeded", 1), key("o1"): ("failed", 1), key("o2"): ("failed", 1),
            key("o3"): ("succeeded", 1)}
    settled(c, group, want)

    listed = c.json("dlq", "list", "--topic", c.topic, "--json")
    assert sorted(r["idempotency_key"] for r in listed) == [key("o1"), key("o2")]
    first = listed[0]
    shown = c.json("dlq", "show", "--topic", c.topic, "--partition", str(first["partition"]),
                   "--offset", str(first["offset"]), "--json")
    assert dict(shown["headers"])["idem.error.kind"] == "permanent"
    assert dict(shown["headers"])["idem.attempts"] == "1"

    # paused: the replay re-runs the keys (audited) and sends their dead letters, which wait
    done = c.cli("pause", APP, "--handler", "charge", "--reason", "maintenance")
    assert "charge: paused by citus-ops" in done.stdout
    wait_for(lambda: PAUSED in members.logs(), timeout=10, what="the member holding the pause")
    assert [p["handler"] for p in c.json("status", "--json")["paused_handlers"]] == ["charge"]
    summary = c.json("dlq", "replay", "--topic", c.topic, "--app", APP, "--include-permanent",
                     "--reason", "card network back", "--no-progress", "--json")
    assert (summary["sent"], summary["rerun"], summary["matched"]) == (2, 2, 2), summary
    assert {k: c.states()[k] for k in (key("o1"), key("o2"))} == {
        key("o1"): ("retryable_failed", 1), key("o2"): ("retryable_failed", 1)}
    reruns = c.audit("rerun")
    assert sorted(r["idempotency_key"] for r in reruns) == [key("o1"), key("o2")]
    assert {r["selection"]["via"] for r in reruns} == {"dlq replay"}
    [replayed] = c.audit("replay")
    assert replayed["counts"]["sent"] == 2 and replayed["reason"] == "card network back"
    charges(c, {"o5": "9.00"})  # new work while paused

    done = c.cli("resume", APP, "--handler", "charge", "--reason", "maintenance over")
    assert "charge: resumed by citus-ops" in done.stdout
    want.update({key("o1"): ("failed", 2), key("o2"): ("failed", 2),
                 key("o5"): ("succeeded", 1)})
    # (not caught_up: the replay's Kafka transaction left a commit marker at the end)
    wait_for(lambda: c.states() == want, timeout=60, what=f"records {want}")
    assert RESUMED in members.logs()
    [resumed] = c.audit("resume")
    assert len(c.audit("pause")) == 1
    # nothing of the handler ran before the resume
    records = c.records()
    assert all(records[k]["updated_at"] > resumed["at"]
               for k in (key("o1"), key("o2"), key("o5")))
    assert c.json("status", "--json")["paused_handlers"] == []
    sent = [m for m in read_topic(c.topic) if "idem.replay.source_topic" in headers(m)]
    assert sorted(m.key().decode() for m in sent) == ["o1", "o2"]
    assert c.ledger() == Counter({key("o0"): 1, key("o3"): 1, key("o5"): 1})


def test_background_retention_and_purge(cluster: Cluster, members: Members,
                                        group: str) -> None:
    c = cluster
    orders = {f"o{i}": ("-1.00" if i in (2, 5) else "4.00") for i in range(8)}
    env = {**c.env, "KAFKA_IDEM_RETENTION": "1s", "KAFKA_IDEM_RETENTION_FORCE": "true",
           "KAFKA_IDEM_RETENTION_INTERVAL_SECONDS": "1"}
    members.start(APP, env, group=group)
    charges(c, orders)
    # the member's retention removes the succeeded records (audited), never the failed
    wait_for(lambda: c.states() == {key("o2"): ("failed", 1), key("o5"): ("failed", 1)}
             and caught_up(group, c.topic), timeout=60, what="succeeded records purged")
    purged = c.audit("purge")
    assert sum(r["counts"]["deleted"] for r in purged) == 6
    assert all(r["actor"].startswith("retention:") for r in purged)
    assert c.audit("retention") and c.ledger() == Counter(
        {key(o): 1 for o in orders if o not in ("o2", "o5")})
    members.stop_all()
    assert c.json("status", "--json")["retention"]["payments"]["removed"] >= 1

    # by hand: a re-run key (retryable_failed) stays, the other failed record goes
    c.cli("rerun", key("o2"), "--reason", "kept")
    dry = c.cli("purge", "--older-than", "1s", "--include-failed", "--dry-run")
    assert "would purge 1 records older than 1s (succeeded 0, failed 1)" in dry.stdout
    done = c.cli("purge", "--older-than", "1s", "--include-failed", "--force",
                 "--batch-size", "1", "--reason", "cleanup")
    assert "purged 1 records" in done.stdout, done.stdout
    assert c.states() == {key("o2"): ("retryable_failed", 1)}
    [by_hand] = [r for r in c.audit("purge") if r["actor"] == "citus-ops"]
    assert (by_hand["counts"], by_hand["reason"]) == ({"deleted": 1}, "cleanup")
    assert by_hand["selection"]["statuses"] == ["succeeded", "failed"]
