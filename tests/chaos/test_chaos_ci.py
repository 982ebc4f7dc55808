"""The CI-sized chaos run: a 3-member group of ``kafka-idem run`` processes (each with
its outbox relay) and one standalone relay under 22 seeded faults of every type (the
relays' kills and zombies and the local broker restarted included: in CI the broker
is ours), then the checker on durable state, the outbox's events included (check 11).
Zero anomalies, in about 2-4 minutes.

The seed is random unless ``CHAOS_SEED`` is set; a failure prints it, with the
command that replays the same faults and messages.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tools.chaos.run import FAULTS

FAULT_COUNT = 22
DURATION = 100


@pytest.mark.slow
@pytest.mark.exclusive("it restarts the shared broker, and its heal deadline wants the machine")
@pytest.mark.timeout(480)
def test_chaos_run_has_no_anomaly(tmp_path: Path) -> None:
    seed = int(os.environ.get("CHAOS_SEED") or random.randrange(1_000_000_000))
    report = tmp_path / "chaos.json"
    cmd = [sys.executable, "-m", "tools.chaos.run", "--duration", str(DURATION),
           "--faults", str(FAULT_COUNT), "--seed", str(seed), "--members", "3",
           "--rate", "100", "--heal-timeout", "120", "--allow-broker-restart",
           "--json", str(report)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    started = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420,
                         check=False)
    took = time.monotonic() - started
    tail = "\n".join(line for line in out.stdout.splitlines()[-120:])
    context = f"seed {seed}, exit {out.returncode}, {took:.0f}s\n{tail}\n{out.stderr[-3000:]}"
    assert report.exists(), context
    result = json.loads(report.read_text())

    by_type = result["faults_by_type"]
    print(f"chaos run: seed {seed}, {took:.0f}s, faults {by_type}, "
          f"{result.get('messages', {}).get('sent')} messages, healed in "
          f"{result.get('heal', {}).get('healed_in')}s, "
          f"{result.get('checker', {}).get('anomalies')} anomalies, "
          f"tracebacks {result.get('member_log_tracebacks')}")
    assert sum(by_type.values()) >= 20, context
    # every type, the broker restart included (a worker restart needs --citus)
    assert set(by_type) == set(FAULTS) - {"worker_restart"}, context
    assert result["checker"]["anomalies"] == 0, context
    assert all(h["ok"] for h in result["health"]), context
    assert result["heal"]["healed_in"] is not None, context
    assert result["messages"]["acknowledged"] > 5000, context
    assert out.returncode == 0 and result["passed"], context
    assert took < 300, context
