"""The seven verification scenarios (docs/VERIFICATION.md) and the loop that runs them.

Each scenario gets a :class:`~kafka_idem.verify.workspace.Workspace` of its own (fresh
schemas, topics and group, named after the run id), decides on durable state only,
and cleans up after itself (unless ``keep``), pass or fail.
"""

from __future__ import annotations

import datetime as dt
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import psycopg

from kafka_idem.errors import StoreUnavailable
from kafka_idem.settings import Settings
from kafka_idem.verify.concurrency import concurrent_duplicates, payload_conflict
from kafka_idem.verify.crash import crash_after_local_write, crash_after_remote_write
from kafka_idem.verify.kafka import Kafka, Timeout
from kafka_idem.verify.limits import retry_limits
from kafka_idem.verify.outbox import outbox_exactly_once
from kafka_idem.verify.repeat import repeat_after_success
from kafka_idem.verify.report import FAIL, Outcome, Report
from kafka_idem.verify.takeover import sigkill_after_claim
from kafka_idem.verify.workspace import Workspace


@dataclass(frozen=True)
class Scenario:
    """One verification scenario: its id (``kafka-idem verify 5b``), title and run."""

    id: str
    title: str
    run: Callable[[Workspace, Outcome], None]


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("1", "concurrent duplicates behind a barrier", concurrent_duplicates),
    Scenario("2", "same key, different payload, concurrently", payload_conflict),
    Scenario("3", "repeat after success", repeat_after_success),
    Scenario("4", "SIGKILL after claim: lease expiry and fencing", sigkill_after_claim),
    Scenario("5a", "crash after the business write (local effect)", crash_after_local_write),
    Scenario("5b", "crash after the remote write: unknown outcome, reconcile",
             crash_after_remote_write),
    Scenario("6", "retry limits and permanent errors", retry_limits),
    Scenario("7", "outbox: events exactly once through relay kills and a zombie relay",
             outbox_exactly_once),
)
"""The scenarios ``kafka-idem verify`` runs, in order (docs/VERIFICATION.md)."""


def select(specs: Iterable[str]) -> list[Scenario]:
    """Scenarios named by ``specs`` ("1", "5", "5b", "2,3"...), in their own order.
    Empty: all of them. Raise ValueError on an unknown name."""
    wanted: set[str] = set()
    for spec in specs:
        for part in spec.split(","):
            name = part.strip().lower()
            if not name:
                continue
            found = {s.id for s in SCENARIOS if s.id == name or s.id.rstrip("ab") == name}
            if not found:
                known = ", ".join(s.id for s in SCENARIOS)
                raise ValueError(f"unknown scenario {part.strip()!r} (known: {known}; "
                                 "5 means 5a and 5b)")
            wanted |= found
    return [s for s in SCENARIOS if not wanted or s.id in wanted]


def _check_database(settings: Settings) -> None:
    try:
        with psycopg.connect(settings.dsn, connect_timeout=10) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        raise StoreUnavailable(f"PostgreSQL is not reachable: {str(exc).strip()}") from exc


def run(settings: Settings, scenarios: list[Scenario], *, keep: bool = False,
        progress: Callable[[str], None] = lambda _line: None) -> Report:
    """Run ``scenarios`` against the Kafka and PostgreSQL of ``settings``, each in fresh
    topics and schemas removed afterwards (``keep``: left for a look); ``progress`` is
    given a line as each starts and ends. Raises :class:`BrokerError` or
    :class:`StoreUnavailable` when Kafka or PostgreSQL is not reachable."""
    run_id = uuid.uuid4().hex[:8]
    kafka = Kafka(settings, run_id)
    kafka.check()
    _check_database(settings)
    logdir = Path(tempfile.mkdtemp(prefix=f"kafka-idem-verify-{run_id}-"))
    report = Report(run_id=run_id, bootstrap_servers=settings.bootstrap_servers,
                    database=settings.redacted()["database_url"], kept=keep,
                    secrets=tuple(settings.secret_values()),
                    started_at=dt.datetime.now(dt.UTC))
    started = time.monotonic()
    try:
        for n, scenario in enumerate(scenarios, 1):
            progress(f"[{n}/{len(scenarios)}] scenario {scenario.id}: {scenario.title} ...")
            out = run_one(settings, kafka, run_id, scenario, logdir, keep=keep)
            report.outcomes.append(out)
            note = f" ({out.skipped})" if out.skipped and out.status != FAIL else ""
            progress(f"    {out.status} in {out.seconds:.1f}s{note}")
            for problem in out.cleanup_errors:
                progress(f"    warning: clean-up: {problem}")
    finally:
        report.seconds = time.monotonic() - started
        if keep or not report.passed:
            report.logs = str(logdir)
        else:
            shutil.rmtree(logdir, ignore_errors=True)
    return report


def run_one(settings: Settings, kafka: Kafka, run_id: str, scenario: Scenario, logdir: Path,
            *, keep: bool) -> Outcome:
    ws = Workspace(settings, kafka, run_id, scenario.id, logdir=logdir)
    out = Outcome(scenario.id, scenario.title)
    started = time.monotonic()
    try:
        scenario.run(ws, out)
    except Timeout as exc:
        out.error = str(exc)
    except Exception as exc:  # the verdict says what went wrong; clean-up still runs
        out.error = f"{type(exc).__name__}: {str(exc).strip()}"
    finally:
        ws.stop_members()
        if ws.distributed:  # the store this scenario proved, when it was not one server's
            out.figures.setdefault("store", "distributed on Citus (records by shard_key)")
        if out.status == FAIL:
            for name, value in ws.snapshot().items():
                out.figures.setdefault(name, value)
            if ws.members:
                out.figures.setdefault("member_logs", [str(m.log) for m in ws.members])
        out.artefacts = ws.artefacts()
        if not keep:
            out.cleanup_errors = ws.cleanup()
        out.seconds = time.monotonic() - started
    return out
