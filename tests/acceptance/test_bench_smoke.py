"""``python -m bench`` as a subprocess at the tiniest sizes, on a few rows (raw, the
batch path, ``kafka-idem run`` of its app, the leased path and its ORM twins, the batch
path's ORM rows, the outbox relay, the gateway at concurrency 1, the ORM gateway rows
and the minimal keyed SQL), against the shared services: it exits 0 and every row's
exactly-once check passed; and ``python -m bench.floor`` (the gateway rows' work with
no framework) and ``python -m bench.rate`` (a handler's ``max_rate``) the same way;
``python -m bench.console``'s store and dead letters (checked as the framework writes
them) and its page timings against a real console process.

The figures mean nothing at these sizes and nothing asserts on them: the test exists
because the bench is code too (a bench-only bug once broke every framework row and
no test saw it). The results go to ``tmp_path``; the bench's folder is left as it was.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from confluent_kafka.admin import AdminClient
from psycopg import sql

from tests.conftest import ADMIN_DSN, BOOTSTRAP, ROOT

ROWS = ("raw", "batch", "cli", "leased", "leased_orm", "leased_orm_core", "batch_orm",
        "batch_orm_core", "relay", "gateway", "gateway_c64_orm", "gateway_async_orm")
# the latency phase leaves its first second out: two seconds leave it something
SIZES = ("--messages", "40", "--slow-messages", "20", "--gateway-messages", "40",
         "--latency-seconds", "2", "--pairs", "1", "--timeout", "120")


def _files(folder: Path) -> dict[str, float]:
    return {str(p.relative_to(folder)): p.stat().st_mtime for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def test_the_bench_runs_its_rows_exactly_once(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    env = {**os.environ, "KAFKA_IDEM_BOOTSTRAP_SERVERS": BOOTSTRAP,
           "KAFKA_IDEM_DATABASE_URL": ADMIN_DSN, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    before = _files(ROOT / "bench")
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--paths", ",".join((*ROWS, "keyed_sql")), *SIZES,
         "--results", str(results)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    said = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, said
    assert _files(ROOT / "bench") == before, "the bench wrote into its folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    run = json.loads(results.read_text())
    paths = {p["path"]: p for p in run["paths"]}
    assert sorted(paths) == sorted(ROWS), said
    for name, row in paths.items():
        throughput = row["throughput"]
        assert throughput["ok"], f"{name}: {throughput.get('check')}"
        # the cli row's 40 messages may all be committed before its first poll: no rate
        assert row["messages"] >= 1 and (row["msgs_per_s"] > 0 or name == "cli"), (
            name, row["msgs_per_s"])
        latency = row["latency"]
        if name not in ("relay", "cli"):  # the rows without a latency run
            assert latency["ok"], f"{name} latency: {latency.get('check')}"
    assert paths["batch"]["throughput"]["check"].startswith("ok: 40 ledger rows / 40 keys")
    assert paths["cli"]["throughput"]["check"].startswith("ok: 40 ledger rows / 40 keys")
    assert paths["leased"]["throughput"]["check"].startswith("ok: 20 ledger rows / 20 keys")
    assert "0 outbox rows twice" in paths["relay"]["throughput"]["check"]
    for orm_row in ("leased_orm", "leased_orm_core", "batch_orm", "batch_orm_core"):
        assert paths[orm_row]["throughput"]["check"].startswith(
            f"ok: {paths[orm_row]['messages']} ledger rows"), paths[orm_row]["throughput"]
    for orm_row in ("gateway_c64_orm", "gateway_async_orm"):
        assert paths[orm_row]["throughput"]["check"].startswith(
            "ok: 40 rows / 40 keys, 40 gateway charges"), paths[orm_row]["throughput"]
    # the ORM rows next to their raw row (the leased ones; the others' raw rows not asked)
    assert [(c["raw"], c["orm"], len(c["pairs"])) for c in run["orm"]] == [
        ("leased", "leased_orm", 1), ("leased", "leased_orm_core", 1)]
    assert all(c["cpu_ratio"] > 0 for c in run["orm"]), run["orm"]
    # the minimal keyed SQL (no Kafka): its own check, its schema gone; the database's work
    # per message next to it (the batch row: a ledger row and a record per message at least)
    keyed = run["keyed_sql"]
    assert keyed["ok"] and keyed["check"].startswith("ok: 40 key rows / 40 ledger rows"), keyed
    work = {r["row"]: r for r in run["db_work"]}
    assert work["keyed_sql"]["ins_per_msg"] >= 2 and work["batch"]["ins_per_msg"] >= 2, work
    assert work["batch"]["x_keyed_msgs_per_s"] > 0 and work["batch"]["wal_bytes_per_msg"] > 0
    with psycopg.connect(ADMIN_DSN) as conn:
        left = conn.execute("SELECT count(*) FROM information_schema.schemata"
                            " WHERE schema_name = %s", (f"bench_{run['run_id']}_keyed",)
                            ).fetchone()
    assert left == (0,), "the keyed SQL's schema was left behind"


def test_the_floor_runs_its_work_exactly_once() -> None:
    """``python -m bench.floor``: both runs (threads, asyncio tasks) charge and record
    every key once, and its schema is dropped afterwards."""
    env = {**os.environ, "KAFKA_IDEM_DATABASE_URL": ADMIN_DSN, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.floor", "--messages", "30", "--concurrency", "4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    said = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, said
    lines = proc.stdout.splitlines()
    assert [line.split(",")[1].strip() for line in lines] == [
        "threads", "asyncio tasks"], said
    assert all(line.endswith("; ok") for line in lines), said
    with psycopg.connect(ADMIN_DSN) as conn:
        left = conn.execute("SELECT count(*) FROM information_schema.schemata"
                            " WHERE schema_name LIKE 'bench_floor_%'").fetchone()
    assert left == (0,), "the floor's schema was left behind"


@pytest.mark.parametrize("mode", ["local", "keyed"])
def test_the_rate_bench_measures_a_limited_handler_and_checks_exactly_once(mode: str) -> None:
    """``python -m bench.rate`` at its tiniest (one member, a 2 s window): it prints the
    member's rate, the group's and the raw handler's, its exactly-once check passes, and
    its database and topics are dropped afterwards. The figures are not asserted on."""
    env = {**os.environ, "KAFKA_IDEM_DATABASE_URL": ADMIN_DSN,
           "KAFKA_IDEM_BOOTSTRAP_SERVERS": BOOTSTRAP, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.rate", "--seconds", "2", "--members", "1",
         "--rate", "20", "--raw-messages", "100", "--mode", mode],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    said = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, said
    lines = proc.stdout.splitlines()
    assert sum(1 for line in lines if line.strip().startswith("member ")) == 1, said
    assert any(line.strip().startswith("group: ") for line in lines), said
    assert any(line.strip().startswith("raw handler") for line in lines), said
    assert any(line.strip().startswith("exactly once: ok") for line in lines), said
    with psycopg.connect(ADMIN_DSN) as conn:
        left = conn.execute("SELECT count(*) FROM pg_database WHERE datname LIKE 'rate\\_%'"
                            ).fetchone()
    assert left == (0,), "the rate bench's database was left behind"


def test_the_retention_bench_purges_the_old_records_and_keeps_the_rest() -> None:
    """``python -m bench.retention`` at a tiny size: both runs drain their charges, the
    member's background retention removes every old record and keeps every one inside
    the window (it exits 1 otherwise), and its database is dropped afterwards."""
    env = {**os.environ, "KAFKA_IDEM_BOOTSTRAP_SERVERS": BOOTSTRAP,
           "KAFKA_IDEM_DATABASE_URL": ADMIN_DSN, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.retention", "--records", "3000", "--keep", "50",
         "--messages", "300", "--timeout", "120", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    said = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, said
    run = json.loads(proc.stdout)
    assert run["ok"], run["check"]
    assert run["check"].startswith("old records left 0 (expected 0); inside the window kept "
                                   "50 of 50; charges succeeded 600 of 600"), run["check"]
    (pair,) = run["pairs"]
    assert pair["without"]["msgs_per_s"] > 0 and pair["with"]["msgs_per_s"] > 0, said
    with psycopg.connect(ADMIN_DSN) as conn:
        left = conn.execute("SELECT count(*) FROM pg_database WHERE datname = %s",
                            (run["database"],)).fetchone()
    assert left == (0,), "the bench's database was left behind"


def test_the_dead_letter_bench_checks_every_letter_and_its_signature(tmp_path: Path) -> None:
    """``python -m bench.deadletters`` at its tiniest: one unsigned and one signed run,
    each message dead-lettered once and every signed letter verified (it exits 1
    otherwise), its figures in the JSON it writes."""
    results = tmp_path / "dl.json"
    env = {**os.environ, "KAFKA_IDEM_BOOTSTRAP_SERVERS": BOOTSTRAP,
           "KAFKA_IDEM_DATABASE_URL": ADMIN_DSN, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    env.pop("KAFKA_IDEM_DLQ_SIGNING_KEYS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.deadletters", "--messages", "40", "--pairs", "1",
         "--micro-calls", "200", "--timeout", "120", "--results", str(results)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    said = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, said
    assert results.exists(), said


# --- the console benchmark (python -m bench.console) -------------------------------------

CONSOLE_SIZES = {"records": 2000, "letters": 200}


def test_the_console_bench_makes_the_store_and_the_dlq_the_framework_would() -> None:
    """``bench.console``'s data steps at a tiny size: the store holds every status in
    about the mix asked for, made by the product's migration with its insert guard on
    again afterwards; the DLQ holds one letter per letter asked for, each with the
    ``idem.*`` headers ``DlqRecord.from_message`` reads, some of them the failed
    records' own; everything is gone after the clean-up."""
    from bench import console as bench_console
    from kafka_idem.settings import load_settings

    s = load_settings(bootstrap_servers=BOOTSTRAP, database_url=ADMIN_DSN)
    admin = AdminClient(s.admin_config())
    schema, topics = bench_console.names(uuid.uuid4().hex[:8])
    data = bench_console.Data("smoke", schema, topics)
    table = sql.Identifier(schema, bench_console.TABLE)
    try:
        bench_console.make_data(s, admin, data, seed=7, **CONSOLE_SIZES)
        assert data.store is not None and not data.problems, data.problems
        with psycopg.connect(ADMIN_DSN) as conn:
            counts = dict(conn.execute(sql.SQL(
                "SELECT status, count(*) FROM {} GROUP BY 1").format(table)).fetchall())
            failed = {k: (kind, cls, msg, first, last) for k, kind, cls, msg, first, last in
                      conn.execute(sql.SQL(
                          "SELECT idempotency_key, error_kind, error_class, error_message, "
                          "first_failure_at, last_failure_at FROM {} WHERE namespace = 'shop' "
                          "AND status = 'failed'").format(table)).fetchall()}
            spread = conn.execute(sql.SQL(
                "SELECT count(DISTINCT namespace), count(DISTINCT handler), "
                "max(created_at) - min(created_at) FROM {}").format(table)).fetchone()
            audited = conn.execute(sql.SQL(
                "SELECT count(*), count(*) FILTER (WHERE r.status = 'failed') "
                "FROM {}.admin_audit a JOIN {} r USING (namespace, idempotency_key)").format(
                sql.Identifier(schema), table)).fetchone()
            guard = conn.execute(
                "SELECT tgenabled FROM pg_trigger WHERE tgname = 'guard_transitions_insert' "
                "AND tgrelid = %s::regclass", (f"{schema}.{bench_console.TABLE}",)).fetchone()
            with pytest.raises(psycopg.Error, match="illegal transition"):
                conn.execute(sql.SQL(
                    "INSERT INTO {} (namespace, idempotency_key, request_hash, status) "
                    "VALUES ('shop', 'x', 'h', 'failed')").format(table))
        assert sum(counts.values()) == CONSOLE_SIZES["records"] == sum(
            data.store.by_status.values())
        assert 0.92 < counts["succeeded"] / CONSOLE_SIZES["records"] < 0.99, counts
        assert all(counts.get(st, 0) >= 1 for st in (
            "failed", "retryable_failed", "processing")), counts
        assert all(kind in ("exhausted", "permanent") and cls and msg and first and last
                   for kind, cls, msg, first, last in failed.values())
        assert spread is not None and spread[0] == 2 and spread[1] == 3
        assert spread[2] > dt.timedelta(days=20)
        assert audited is not None and audited[0] >= 1 and audited[0] == audited[1]
        assert guard == ("O",), "the insert guard was left disabled"

        letters = bench_console.read_letters(s, topics["dlq"])
        assert len(letters) == data.letters == CONSOLE_SIZES["letters"]
        assert bench_console.check_letters(letters) == []
        assert {r.kind for r in letters} == {
            "exhausted", "permanent", "undecodable", "payload_conflict"}
        for r in letters:
            names = [k for k, _ in r.headers if k.startswith("idem.")]
            assert names[:4] == ["idem.original.topic", "idem.original.partition",
                                 "idem.original.offset", "idem.original.timestamp"], names
            assert r.original_topic == topics["orders"] and r.consumer_group == "shop"
        theirs = [r for r in letters if r.idempotency_key in failed]
        assert theirs, "no letter is a failed record's"
        for r in theirs:
            kind, cls, msg, first, _last = failed[r.idempotency_key or ""]
            assert (r.kind, r.error_class, r.error_message, r.first_failure_at) == (
                kind, cls, msg, first)
        assert data.record_key in failed
        assert any(r.idempotency_key == data.record_key for r in letters)
        assert any(b"<script>" in (r.value or b"") for r in letters)
        assert any(r.value and not _utf8(r.value) for r in letters)
        assert any(r.key and not _utf8(r.key) for r in letters)
    finally:
        problems = bench_console.cleanup(s, admin, data)
    assert problems == []
    with psycopg.connect(ADMIN_DSN) as conn:
        left = conn.execute("SELECT count(*) FROM information_schema.schemata "
                            "WHERE schema_name = %s", (schema,)).fetchone()
    assert left == (0,)
    assert not set(topics.values()) & set(admin.list_topics(timeout=10).topics)


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_the_console_bench_times_every_page_of_a_real_console(tmp_path: Path) -> None:
    """``python -m bench.console`` end to end at a tiny size: a real console process gets
    ready, every page answers 200 with its ``Server-Timing`` server time (the next-page
    links found, each letter its own), the figures are in the JSON, and the schema and
    the topics are dropped afterwards."""
    results = tmp_path / "console.json"
    env = {**os.environ, "KAFKA_IDEM_BOOTSTRAP_SERVERS": BOOTSTRAP,
           "KAFKA_IDEM_DATABASE_URL": ADMIN_DSN, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.console", "--records", str(CONSOLE_SIZES["records"]),
         "--letters", str(CONSOLE_SIZES["letters"]), "--requests", "3", "--warmup", "1",
         "--ready-timeout", "120", "--json", str(results)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    said = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, said
    run = json.loads(results.read_text())
    assert run["failure"] is None, said
    setup = run["setup"]
    assert setup["ready_s"] > 0 and setup["rss_ready_mb"] > 0, setup
    pages = {p["page"]: p for p in run["pages"]}
    assert "letter (a different one each time)" in pages and "dlq, next page" in pages
    for name, page in pages.items():
        assert page["ok"], (name, page)
        if name.startswith("overview while indexing"):
            continue
        assert page["requests"] == 3 and page["server_ms"]["p95"] is not None, (name, page)
    assert "?" in pages["records, next page"]["url"], "the next page is the first page"
    assert "p95 < 300 ms" in proc.stdout
    with psycopg.connect(ADMIN_DSN) as conn:
        left = conn.execute("SELECT count(*) FROM information_schema.schemata "
                            "WHERE schema_name = %s", (setup["schema"],)).fetchone()
    assert left == (0,), "the bench's schema was left behind"
