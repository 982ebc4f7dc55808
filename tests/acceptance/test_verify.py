"""``kafka-idem verify`` as users run it: the installed command, as a subprocess, against
the local Kafka and PostgreSQL. It must pass all seven scenarios (5b too: the example
gateway is importable from the repository), report its durable figures, and leave
nothing behind unless asked to keep it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient
from psycopg import sql

from tests.acceptance.conftest import KAFKA_IDEM
from tests.conftest import ADMIN_DSN, BOOTSTRAP, ROOT

ALL = ["1", "2", "3", "4", "5a", "5b", "6", "7"]


def verify(*args: str, timeout: float = 300.0,
           database: str = ADMIN_DSN) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAFKA_IDEM_")}
    env["COLUMNS"] = "200"
    cmd = [*KAFKA_IDEM, "--bootstrap-servers", BOOTSTRAP, "--database-url", database,
           "verify", *args]
    # From the repository root, like a user of a checkout: consumers.gateway is importable.
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def schemas_of(run_id: str, database: str = ADMIN_DSN) -> list[str]:
    with psycopg.connect(database) as conn:
        rows = conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE %s",
                            (f"verify\\_{run_id}%",)).fetchall()
    return sorted(r[0] for r in rows)


def topics_of(admin: AdminClient, run_id: str) -> list[str]:
    return sorted(t for t in admin.list_topics(timeout=10).topics if run_id in t)


def groups_of(admin: AdminClient, run_id: str) -> list[str]:
    listed = admin.list_consumer_groups(request_timeout=10).result()
    return sorted(g.group_id for g in listed.valid if run_id in g.group_id)


def by_id(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["id"]: s for s in report["scenarios"]}


def test_verify_passes_all_seven_scenarios_and_cleans_up(tmp_path: Path,
                                                         admin: AdminClient) -> None:
    path = tmp_path / "report.json"
    proc = verify("--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(path.read_text())
    s = by_id(report)
    assert report["passed"] is True
    assert list(s) == ALL
    failed = {i: [c for c in o["checks"] if not c["ok"]] or o["error"]
              for i, o in s.items() if o["status"] != "PASS"}
    assert not failed, failed
    assert all(c["ok"] for o in s.values() for c in o["checks"])
    assert "PASS" in proc.stdout and f"run {report['run_id']}: 8 PASS" in proc.stdout

    # The durable figures behind the verdicts are in the report.
    f = {i: o["figures"] for i, o in s.items()}
    assert f["1"]["outcomes"]["succeeded"] == 1 and f["1"]["business_rows"] == 1
    assert f["1"]["tokens_seen"] == 1 and f["1"]["handler_calls"] == 1
    assert f["2"]["dlq_records"] == {"payload_conflict": 2} and f["2"]["business_rows"] == 1
    assert f["3"]["replayed_metric"] >= 1 and f["3"]["business_rows"] == 1
    tokens = f["4"]["tokens_seen"]
    assert len(tokens) == 2 and len(set(tokens)) == 2
    assert tokens[0] == f["4"]["first_owner_token"]
    assert f["4"]["completed_token"] == tokens[1]
    assert f["4"]["attempts"] == 2 and f["4"]["killed_exit_status"] == -9
    assert f["4"]["api_rows_from_a"] == 0
    assert f["5a"]["killed_txid_status"] == "aborted"
    assert f["5a"]["business_rows"] == {"o1": 1, "o2": 1, "o3": 1}
    assert f["5b"]["remote_charges"] == 1 and f["5b"]["charge_posts"] == 1
    assert f["5b"]["attempts"] == 2
    assert f["6"]["attempts"] == 4 and f["6"]["dlq_records"] == 2
    assert f["6"]["metrics"]["exhausted_total"] >= 1
    assert len(f["6"]["retry_delays_s"]) == 3
    # 7: 6 + 4 + 2 + 3 succeeded intents, one event each; the killed relays' rows waited
    assert f["7"]["events"] == 15 and f["7"]["records"] == {"failed": 1, "succeeded": 15}
    assert f["7"]["pending_after_kill"] == 3 and f["7"]["killed_relays"] == [-9, -9]
    assert any("outbox control topic" in line for line in f["7"]["topics_create"])

    # Each scenario had artefacts of its own, and none is left.
    run_id = report["run_id"]
    for o in s.values():
        assert all(run_id in name for kind in ("schemas", "topics", "groups")
                   for name in o["artefacts"][kind])
        assert o["cleanup_errors"] == []
    assert s["4"]["artefacts"]["schemas"] == [f"verify_{run_id}_s4", f"verify_{run_id}_s4_biz"]
    assert schemas_of(run_id) == []
    assert topics_of(admin, run_id) == []
    assert groups_of(admin, run_id) == []
    assert report["logs"] is None  # member logs removed after a clean pass


def test_verify_passes_all_seven_scenarios_on_a_citus_cluster(
        tmp_path: Path, admin: AdminClient, citus: str) -> None:
    """On a Citus coordinator each scenario's store is distributed (records by shard_key,
    its business tables co-located) and every scenario passes as on one server."""
    path = tmp_path / "report.json"
    proc = verify("--json", str(path), database=citus, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(path.read_text())
    s = by_id(report)
    assert report["passed"] is True and list(s) == ALL
    assert all(c["ok"] for o in s.values() for c in o["checks"])
    assert {o["figures"]["store"] for o in s.values()} == {
        "distributed on Citus (records by shard_key)"}
    f = {i: o["figures"] for i, o in s.items()}
    assert f["1"]["outcomes"]["succeeded"] == 1 and f["1"]["business_rows"] == 1
    assert f["4"]["attempts"] == 2 and f["5a"]["killed_txid_status"] == "aborted"
    assert f["7"]["events"] == 15
    assert schemas_of(report["run_id"], citus) == []


def test_one_scenario_with_keep_leaves_its_artefacts_named_inside_the_prefix(
        tmp_path: Path, admin: AdminClient) -> None:
    """--prefix (a cluster whose ACLs grant names by prefix): every topic and consumer
    group the run made on the broker starts with it (scripts/acl_check.py runs verify on
    a broker with such ACLs)."""
    path = tmp_path / "report.json"
    proc = verify("--scenario", "3", "--keep", "--prefix", "team-a.", "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(path.read_text())
    run_id = report["run_id"]
    try:
        assert [o["id"] for o in report["scenarios"]] == ["3"]
        assert report["scenarios"][0]["status"] == "PASS"
        names = report["scenarios"][0]["artefacts"]
        assert schemas_of(run_id) == sorted(names["schemas"]) == [
            f"verify_{run_id}_s3", f"verify_{run_id}_s3_biz"]
        assert topics_of(admin, run_id) == sorted(names["topics"])
        assert names["topics"] == [f"team-a.kafka-idem-verify.{run_id}.s3",
                                   f"team-a.kafka-idem-verify.{run_id}.s3.dlq"]
        on_broker = groups_of(admin, run_id)
        assert on_broker and all(g.startswith("team-a.") for g in on_broker), on_broker
        assert "kept for inspection" in proc.stdout
        # piped: the report is plain lines, not a table squeezed to COLUMNS
        assert re.search(r"^3\. repeat after success \(\d+\.\ds\): PASS$", proc.stdout,
                         re.MULTILINE), proc.stdout
        assert "│" not in proc.stdout
        assert all(name in proc.stdout for name in names["schemas"] + names["topics"])
        assert report["logs"] and Path(report["logs"]).is_dir()
    finally:
        _remove(admin, run_id, report)


def test_unknown_scenario_is_a_usage_error() -> None:
    proc = verify("--scenario", "8", timeout=60)
    assert proc.returncode == 2
    assert "unknown scenario" in proc.stderr


def _remove(admin: AdminClient, run_id: str, report: dict[str, Any]) -> None:
    with psycopg.connect(ADMIN_DSN) as conn:
        for schema in schemas_of(run_id):
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    topics = topics_of(admin, run_id)
    if topics:
        for fut in admin.delete_topics(topics, operation_timeout=30).values():
            fut.result(timeout=30)
    groups = groups_of(admin, run_id)
    if groups:
        for fut in admin.delete_consumer_groups(groups, request_timeout=30).values():
            with contextlib.suppress(KafkaException):
                fut.result(timeout=30)
    if report.get("logs"):
        for log in Path(report["logs"]).glob("*.log"):
            log.unlink()
        Path(report["logs"]).rmdir()
