"""The consumer group under test: ``kafka-idem run consumers.payments:app`` processes
(each also runs the outbox relay), and the standalone relays
(``kafka-idem relay consumers.payments:app``); with ``--orm``, of
``consumers.payments_orm:app`` (:data:`ORM_APP`) instead.

:class:`Pool` starts members (or relays) with the chaos settings (:data:`MEMBER_ENV`,
short session and poll intervals), signals them (SIGKILL, SIGSTOP/SIGCONT, SIGTERM),
notices the ones that exit on their own, and reads their logs for evidence of
the faults (:data:`LOG_SIGNS`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

from kafka_idem.settings import Settings
from tools.chaos.checker import ROOT

APP = "consumers.payments:app"
ORM_APP = "consumers.payments_orm:app"  # the same example on ctx.session (--orm)
MIN_MEMBERS, MAX_MEMBERS = 2, 4
SESSION_TIMEOUT_MS, MAX_POLL_INTERVAL_MS = 6000, 10000
# The members' settings (environment variables set before the caller's own).
MEMBER_ENV = {
    "KAFKA_IDEM_SESSION_TIMEOUT_MS": str(SESSION_TIMEOUT_MS),
    "KAFKA_IDEM_MAX_POLL_INTERVAL_MS": str(MAX_POLL_INTERVAL_MS),
    "KAFKA_IDEM_BACKOFF_BASE_SECONDS": "0.1",
    "KAFKA_IDEM_BACKOFF_CAP_SECONDS": "2",
    "KAFKA_IDEM_BUSY_RETRY_SECONDS": "0.2",
    "KAFKA_IDEM_LEASE_SECONDS": "5",
    # A stopped member's open transaction would block the others' writes to the same
    # rows (the balances); the server ends it after this long idle in a transaction.
    "KAFKA_IDEM_IDLE_IN_TRANSACTION_TIMEOUT_SECONDS": "4",
    "KAFKA_IDEM_BATCH_MAX_WAIT_SECONDS": "0.05",
    "KAFKA_IDEM_METRICS_SAMPLE_SECONDS": "5",
}
LOG_SIGNS = {  # what the members' logs say about the faults (evidence, not verdicts)
    "dlq_produce_failed": "dead-letter produce failed",
    "commit_refused": "commit refused, ownership lost",
    "commit_failed": "commit failed, will retry",
    "store_errors": "the message will be retried",
    "batch_failed": "batch transaction failed",
    "relay_takeovers": " taken over by ",  # a shard's publisher changed (kill, zombie, rebalance)
    "relay_fenced": ") stops publishing it",  # a resumed zombie found itself fenced
    "relay_retries": "retrying with backoff",  # a round failed (broker, database): retried
    "tracebacks": "Traceback (most recent call last)",
    "deadlocks": "deadlock detected",  # 40P01 between members (issue: none by construction)
    "lock_timeouts": "lock timeout",  # a wait for another's row lock ended (55P03)
    "max_poll_exceeded": "_MAX_POLL_EXCEEDED",  # a member dropped for not polling in time
    "stops_overran": "the stop did not end within",  # a stop ended at its bound
}
# Signs read from a line's structured fields (``name=value``, docs/how-to/deploying.md,
# "Logs"), not its text.
FIELD_SIGNS = {
    "partitions_lost": ("action", "lost"),  # a member lost partitions without revoking them
}


def member_env(s: Settings, dsn: str, topic: str, mode: str) -> dict[str, str]:
    kafka = dict(s.kafka)
    kafka.setdefault("heartbeat.interval.ms", 1000)
    env = {**MEMBER_ENV, **os.environ}
    env.update({
        "PAYMENTS_TOPIC": topic,
        "PAYMENTS_MODE": mode,
        "KAFKA_IDEM_BOOTSTRAP_SERVERS": s.bootstrap_servers,
        "KAFKA_IDEM_DATABASE_URL": dsn,
        "KAFKA_IDEM_KAFKA": json.dumps(kafka),
        "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
    })
    for name in ("KAFKA_IDEM_SESSION_TIMEOUT_MS", "KAFKA_IDEM_MAX_POLL_INTERVAL_MS"):
        env[name] = MEMBER_ENV[name]  # the zombie fault depends on these two
    return env


class Member:
    """One ``kafka-idem run`` process (its own session: our Ctrl-C is not its)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        self.stopped = False  # SIGSTOPped, not yet SIGCONTed
        self.gone: str | None = None  # killed | terminated | crashed
        self.exit_code: int | None = None

    def __repr__(self) -> str:
        return f"{self.name}({self.pid})"

    def wait_started(self, timeout: float = 30.0) -> bool:
        """Wait (bounded) until the member's log says its consumer started: only then
        does its SIGTERM mean a drain. A process told to stop while still importing
        Python is not a member yet."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                text = self.log.read_bytes()
                if b"action=started" in text or b'"action": "started"' in text:
                    return True
            time.sleep(0.1)
        return False


class Pool:
    def __init__(self, cmd: list[str], env: dict[str, str], logs: Path,
                 prefix: str = "m", app: str = APP) -> None:
        self.cmd, self.env, self.logs, self.prefix = cmd, env, logs, prefix
        self.app = app  # MODULE:APP the processes run (the pause fault pauses its handler)
        self.members: list[Member] = []
        self.crashed: list[Member] = []
        self.slow_stops: list[str] = []
        self._waiters: list[threading.Thread] = []

    def alive(self) -> list[Member]:
        return [m for m in self.members if m.gone is None]

    def running(self) -> list[Member]:
        return [m for m in self.alive() if not m.stopped]

    def start(self) -> Member:
        name = f"{self.prefix}{len(self.members) + 1}"
        m = Member(name, self.cmd, self.env, self.logs / f"{name}.log")
        self.members.append(m)
        return m

    def kill(self, m: Member) -> None:
        m.proc.send_signal(signal.SIGKILL)
        m.exit_code = m.proc.wait()
        m.gone, m.stopped = "killed", False

    def sigstop(self, m: Member) -> None:
        m.proc.send_signal(signal.SIGSTOP)
        m.stopped = True

    def sigcont(self, m: Member) -> None:
        if m.gone is None:
            m.proc.send_signal(signal.SIGCONT)
        m.stopped = False

    def terminate(self, m: Member, *, wait: bool = False, timeout: float = 60.0) -> None:
        """SIGTERM (graceful); the exit code is collected by a thread unless ``wait``."""
        m.gone = "terminated"

        def collect() -> None:
            try:
                m.exit_code = m.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.slow_stops.append(f"{m} did not stop within {timeout:.0f}s of SIGTERM")
                m.proc.kill()
                m.exit_code = m.proc.wait()

        m.proc.send_signal(signal.SIGTERM)
        if wait:
            collect()
        else:
            t = threading.Thread(target=collect, daemon=True)
            t.start()
            self._waiters.append(t)

    def reap(self) -> list[Member]:
        """Members that exited without being told to."""
        out = []
        for m in self.alive():
            code = m.proc.poll()
            if code is not None:
                m.gone, m.exit_code, m.stopped = "crashed", code, False
                self.crashed.append(m)
                out.append(m)
        return out

    def stop_all(self) -> None:
        for m in self.alive():
            self.sigcont(m)
        for m in self.alive():
            self.terminate(m, wait=False, timeout=45)
        for t in self._waiters:
            t.join(60)

    def scan_logs(self) -> tuple[dict[str, int], dict[str, int]]:
        """Counts of :data:`LOG_SIGNS` and, per exception, the tracebacks in the logs."""
        counts: Counter[str] = Counter()
        errors: Counter[str] = Counter()
        for m in self.members:
            try:
                lines = m.log.read_text(errors="replace").splitlines()
            except OSError:
                continue
            for name, sign in LOG_SIGNS.items():
                counts[name] += sum(1 for line in lines if sign in line)
            for name, (field, value) in FIELD_SIGNS.items():
                token = f"{field}={value}"
                counts[name] += sum(1 for line in lines if token in line.split(" "))
            for i, line in enumerate(lines):
                if not line.startswith("Traceback (most recent call last)"):
                    continue
                said = re.sub(r"^\S+ \S+ ", "", lines[i - 1])[:120] if i else ""
                raised = next((ln for ln in lines[i + 1:] if ln and not ln[0].isspace()), "?")
                errors[f"{raised[:160]} (after: {said})"] += 1
        return dict(counts), dict(errors)
