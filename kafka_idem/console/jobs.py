"""The console's long operations (a re-drive's dry run and run, a bulk re-run): each
runs on a thread of its own while its page shows the progress; the page of a job
that ended shows its result. Jobs live in memory: a restarted console forgets them
(the audit trail keeps what they did)."""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kafka_idem.observe.redact import redact

log = logging.getLogger(__name__)

KEEP = 200  # jobs kept (the oldest ended ones are forgotten first)


@dataclass
class Job:
    """One operation: what it is, how far it got, and how it ended."""

    id: str
    kind: str  # "redrive-dry-run", "redrive", "rerun-dry-run", "rerun", "rerun-keys"
    title: str
    params: dict[str, Any]
    actor: str
    started: float = field(default_factory=time.time)
    ended: float | None = None
    state: str = "running"  # running, done, failed
    done: int = 0
    total: int = 0
    sent: int = 0
    result: dict[str, Any] | None = None
    error: str | None = None
    audit_after: int = 0  # the audit rows this job wrote have larger ids

    @property
    def via(self) -> str:
        """What the job's audit rows name as their caller (``selection.via``)."""
        return f"console job {self.id}"

    @property
    def runs(self) -> list[str]:
        """The replay runs of this job (their audit rows name them)."""
        return list((self.result or {}).get("totals", {}).get("runs", []))

    def report(self, done: int, total: int, sent: int) -> None:
        self.done, self.total, self.sent = done, total, sent


class Jobs:
    """Runs jobs on threads and keeps the latest :data:`KEEP` of them."""

    def __init__(self, secrets: list[str] | None = None) -> None:
        self.secrets = secrets or []  # masked in a failed job's error, with what looks secret
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._seq = itertools.count(1)

    def start(self, kind: str, title: str, params: dict[str, Any], actor: str,
              work: Callable[[Job], dict[str, Any]], *, audit_after: int = 0) -> Job:
        job = Job(f"{next(self._seq)}-{secrets.token_hex(4)}", kind, title, params, actor,
                  audit_after=audit_after)
        with self._lock:
            self._jobs[job.id] = job
            ended = [j for j in self._jobs.values() if j.state != "running"]
            for old in sorted(ended, key=lambda j: j.started)[:max(len(self._jobs) - KEEP, 0)]:
                del self._jobs[old.id]

        def run() -> None:
            try:
                job.result = work(job)
                job.state = "done"
            except Exception as exc:  # shown on the job's page, never lost
                job.error = redact(f"{type(exc).__name__}: {exc}", self.secrets)
                job.state = "failed"
                log.warning("console job %s (%s) failed: %s", job.id, kind, job.error)
            finally:
                job.ended = time.time()

        threading.Thread(target=run, name=f"kafka-idem-console-{kind}", daemon=True).start()
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def recent(self, n: int = 20) -> list[Job]:
        with self._lock:
            return sorted(self._jobs.values(), key=lambda j: j.started, reverse=True)[:n]

    def running(self) -> list[Job]:
        with self._lock:
            return [j for j in self._jobs.values() if j.state == "running"]
