"""``python -m bench`` as a subprocess at the tiniest sizes, on a few rows (raw, the
batch path, the leased path, the outbox relay, the gateway at concurrency 1), against
the shared services: it exits 0 and every row's exactly-once check passed; and
``python -m bench.floor`` (the gateway rows' work with no framework) the same way.

The figures mean nothing at these sizes and nothing asserts on them: the test exists
because the bench is code too (a bench-only bug once broke every framework row and
no test saw it). The results go to ``tmp_path``; the bench's folder is left as it was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg

from tests.conftest import ADMIN_DSN, BOOTSTRAP, ROOT

ROWS = ("raw", "batch", "leased", "relay", "gateway")
# the latency phase leaves its first second out: two seconds leave it something
SIZES = ("--messages", "40", "--slow-messages", "20", "--gateway-messages", "40",
         "--latency-seconds", "2", "--timeout", "120")


def _files(folder: Path) -> dict[str, float]:
    return {str(p.relative_to(folder)): p.stat().st_mtime for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def test_the_bench_runs_its_rows_exactly_once(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    env = {**os.environ, "KAFKA_IDEM_BOOTSTRAP_SERVERS": BOOTSTRAP,
           "KAFKA_IDEM_DATABASE_URL": ADMIN_DSN, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    before = _files(ROOT / "bench")
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--paths", ",".join(ROWS), *SIZES,
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
        assert row["messages"] >= 1 and row["msgs_per_s"] > 0, (name, row["msgs_per_s"])
        latency = row["latency"]
        if name != "relay":  # the relay row has no latency run
            assert latency["ok"], f"{name} latency: {latency.get('check')}"
    assert paths["batch"]["throughput"]["check"].startswith("ok: 40 ledger rows / 40 keys")
    assert paths["leased"]["throughput"]["check"].startswith("ok: 20 ledger rows / 20 keys")
    assert "0 outbox rows twice" in paths["relay"]["throughput"]["check"]


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
