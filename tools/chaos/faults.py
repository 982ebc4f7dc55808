"""The fault injector: seeded faults on the members, PostgreSQL and Kafka, and their undoing.

Fault types (:data:`FAULTS`): ``kill`` (SIGKILL a member, start a replacement),
``zombie`` (SIGSTOP a member past max.poll.interval.ms, SIGCONT later), ``add`` /
``remove`` (start a member / SIGTERM one, keeping 2-4), ``pg_terminate``
(``pg_terminate_backend`` of the members' sessions), ``dlq_outage`` (the DLQ
topic's ``max.message.bytes`` set to 1 byte, restored later), ``relay_kill``
(SIGKILL a standalone outbox relay, start a replacement), ``relay_zombie``
(SIGSTOP a relay past its shards' session timeout, so another publisher takes its
shards over, then SIGCONT: it must find itself fenced) and ``broker_restart``
(``scripts/kafka.sh restart``, in a thread), ``worker_restart`` (on a Citus cluster:
``scripts/citus.sh restart-worker N`` of one of its two workers, in a thread), ``pause``
(``kafka-idem pause`` of the handler for 3-12 s, then ``kafka-idem resume``: every
member must stop starting its messages and go on after). The members run a relay too, so
``kill``, ``zombie`` and ``pg_terminate`` hit publishers as well. Every chosen type
is injected once first, in a seeded order, then weighted at random
(:data:`WEIGHTS`); what is not possible right now is skipped. :meth:`Injector.tick`
undoes what is due and replaces members that exited on their own.
"""

from __future__ import annotations

import random
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from confluent_kafka.admin import AdminClient

from tools.chaos.members import (
    MAX_MEMBERS,
    MAX_POLL_INTERVAL_MS,
    MIN_MEMBERS,
    SESSION_TIMEOUT_MS,
    Member,
    Pool,
)
from tools.chaos.output import say
from tools.chaos.services import admin_cli, citus_sh, dlq_limit, kafka_sh, terminate_backends

FAULTS = ("kill", "zombie", "add", "remove", "pg_terminate", "dlq_outage", "relay_kill",
          "relay_zombie", "broker_restart", "pause", "worker_restart")
WEIGHTS = {"kill": 2.0, "zombie": 2.0, "add": 1.0, "remove": 1.0, "pg_terminate": 2.0,
           "dlq_outage": 1.0, "relay_kill": 1.0, "relay_zombie": 1.0, "broker_restart": 0.6,
           "worker_restart": 1.0,
           "pause": 1.0}
HANDLER = "charge"  # the payments example's handler, which the pause fault pauses


@dataclass
class Fault:
    n: int
    at: float  # seconds since the producer started
    fault: str
    pids: list[int]
    detail: str
    took: float = 0.0


@dataclass
class Undo:
    due: float  # monotonic
    what: str  # sigcont | dlq_restore | resume
    member: Member | None = None
    pool: Pool | None = None  # the member's pool (members or relays)


@dataclass
class Injector:
    rng: random.Random
    pool: Pool
    admin: AdminClient
    dsn: str
    dbname: str
    dlq_topic: str
    types: tuple[str, ...]
    log: list[Fault] = field(default_factory=list)
    undo: list[Undo] = field(default_factory=list)
    queue: list[str] = field(default_factory=list)
    restart: threading.Thread | None = None
    restart_result: list[str] = field(default_factory=list)
    dlq_down: bool = False
    paused: bool = False
    t_start: float = 0.0
    health: list[str] = field(default_factory=list)
    relays: Pool | None = None  # the standalone relays (relay_kill, relay_zombie)

    def __post_init__(self) -> None:
        self.queue = list(self.types)
        self.rng.shuffle(self.queue)  # every type once first, then weighted at random

    def busy(self) -> bool:
        return self.restart is not None and self.restart.is_alive()

    def choose(self) -> str:
        if not self.queue:
            self.queue.append(self.rng.choices(self.types, [WEIGHTS[t] for t in self.types])[0])
        for i, kind in enumerate(self.queue):
            if self.feasible(kind):
                return self.queue.pop(i)
        # Nothing queued is possible now (e.g. remove at the minimum): a rebalance instead.
        return "add" if len(self.pool.alive()) < MAX_MEMBERS else "remove"

    def feasible(self, kind: str) -> bool:
        alive, running = self.pool.alive(), self.pool.running()
        if kind == "kill":
            return bool(alive)
        if kind == "zombie":
            return len(running) >= 2
        if kind == "add":
            return len(alive) < MAX_MEMBERS
        if kind == "remove":
            return len(alive) > MIN_MEMBERS and bool(running)
        if kind == "dlq_outage":
            return not self.dlq_down
        if kind == "pause":
            return not self.paused
        if kind in ("relay_kill", "relay_zombie"):
            return self.relays is not None and bool(self.relays.running())
        return True

    def inject(self, n: int) -> Fault:
        kind = self.choose()
        started = time.monotonic()
        fault = Fault(n, round(started - self.t_start, 1), kind, [], "")
        getattr(self, f"_{kind}")(fault)
        fault.took = round(time.monotonic() - started, 2)
        self.log.append(fault)
        say(f"fault {n:3d} [bold]{kind}[/] {fault.detail}")
        return fault

    def _pick(self, members: list[Member]) -> Member:
        return self.rng.choice(sorted(members, key=lambda m: m.name))

    def _kill(self, f: Fault, pool: Pool | None = None) -> None:
        pool = pool or self.pool
        victim = self._pick(pool.alive())
        pool.kill(victim)
        new = pool.start()
        f.pids = [victim.pid, new.pid]
        f.detail = f"SIGKILL {victim}{' (was stopped)' if victim.stopped else ''}; started {new}"

    def _zombie(self, f: Fault, pool: Pool | None = None) -> None:
        pool = pool or self.pool
        victim = self._pick(pool.running())
        seconds = MAX_POLL_INTERVAL_MS / 1000 + self.rng.uniform(1.0, 4.0)
        pool.sigstop(victim)
        self.undo.append(Undo(time.monotonic() + seconds, "sigcont", victim, pool))
        f.pids = [victim.pid]
        f.detail = f"SIGSTOP {victim} for {seconds:.1f}s (max.poll.interval.ms " \
                   f"{MAX_POLL_INTERVAL_MS}, session timeout {SESSION_TIMEOUT_MS} ms)"

    def _relay_kill(self, f: Fault) -> None:
        self._kill(f, self.relays)

    def _relay_zombie(self, f: Fault) -> None:
        self._zombie(f, self.relays)

    def _add(self, f: Fault) -> None:
        new = self.pool.start()
        f.pids = [new.pid]
        f.detail = f"started {new}; {len(self.pool.alive())} members"

    def _remove(self, f: Fault) -> None:
        victim = self._pick(self.pool.running())
        victim.wait_started()  # a member just added may still be importing
        self.pool.terminate(victim)
        f.pids = [victim.pid]
        f.detail = f"SIGTERM {victim}; {len(self.pool.alive())} members"

    def _pg_terminate(self, f: Fault) -> None:
        pids = terminate_backends(self.dsn, self.dbname)
        f.pids = pids
        f.detail = f"pg_terminate_backend: {len(pids)} member sessions"

    def _dlq_outage(self, f: Fault) -> None:
        seconds = self.rng.uniform(8.0, 20.0)
        try:
            dlq_limit(self.admin, self.dlq_topic, "1")
        except Exception as exc:  # the broker may be away: the fault did not happen
            f.detail = f"could not limit the DLQ: {exc}"
            return
        self.dlq_down = True
        self.undo.append(Undo(time.monotonic() + seconds, "dlq_restore"))
        f.detail = f"{self.dlq_topic} max.message.bytes=1 for {seconds:.1f}s"

    def _pause(self, f: Fault) -> None:
        seconds = self.rng.uniform(3.0, 12.0)
        out = admin_cli(self.pool.env, "pause", self.pool.app, "--handler", HANDLER, "--reason",
                        f"chaos fault {f.n}", "--actor", "chaos")
        if out.returncode:  # the database may be away: the fault did not happen
            f.detail = f"kafka-idem pause failed: {(out.stderr or out.stdout).strip()[-200:]}"
            return
        self.paused = True
        self.undo.append(Undo(time.monotonic() + seconds, "resume"))
        f.detail = f"kafka-idem pause --handler {HANDLER} for {seconds:.1f}s"

    def _broker_restart(self, f: Fault) -> None:
        self._restart_in_thread("broker", "", lambda: kafka_sh("restart"))
        f.detail = "scripts/kafka.sh restart"

    def _worker_restart(self, f: Fault) -> None:
        worker = self.rng.choice(("1", "2"))
        self._restart_in_thread(f"Citus worker {worker}", f"worker {worker}: ",
                                lambda: citus_sh("restart-worker", worker))
        f.detail = f"scripts/citus.sh restart-worker {worker}"

    def _restart_in_thread(self, what: str, label: str,
                           run: Callable[[], subprocess.CompletedProcess[str]]) -> None:
        """Restart a service in a thread (:meth:`busy` until it is back); how long it
        took goes to ``restart_result`` (``label`` first), a failure to the health."""
        def restart() -> None:
            t = time.monotonic()
            out = run()
            took = time.monotonic() - t
            if out.returncode:
                self.health.append(f"{what} restart failed: {out.stderr.strip()[-300:]}")
            self.restart_result.append(f"{label}{took:.1f}s")
            say(f"{what} back after {took:.1f}s (exit {out.returncode})")

        self.restart = threading.Thread(target=restart, daemon=True)
        self.restart.start()

    def tick(self, *, everything: bool = False) -> None:
        """Undo what is due (everything when healing); replace crashed members."""
        now = time.monotonic()
        for u in sorted(self.undo, key=lambda u: u.due):
            if not everything and u.due > now:
                continue
            if u.what == "sigcont" and u.member is not None:
                (u.pool or self.pool).sigcont(u.member)
                self.undo.remove(u)
                say(f"SIGCONT {u.member}")
            elif u.what == "dlq_restore" and not self.busy():
                try:
                    dlq_limit(self.admin, self.dlq_topic, None)
                except Exception as exc:  # retried on the next tick
                    say(f"[yellow]DLQ restore failed, will retry: {exc}[/]")
                    continue
                self.dlq_down = False
                self.undo.remove(u)
                say(f"{self.dlq_topic} max.message.bytes restored")
            elif u.what == "resume":
                out = admin_cli(self.pool.env, "resume", self.pool.app, "--handler", HANDLER,
                                "--reason", "chaos: the fault ends", "--actor", "chaos")
                if out.returncode:  # retried on the next tick
                    say(f"[yellow]resume failed, will retry: {out.stderr.strip()[-200:]}[/]")
                    continue
                self.paused = False
                self.undo.remove(u)
                say(f"kafka-idem resume --handler {HANDLER}")
        for pool in filter(None, (self.pool, self.relays)):
            for m in pool.reap():
                self.health.append(f"{m} exited on its own with code {m.exit_code}")
                new = pool.start()
                say(f"[red]{m} exited on its own (code {m.exit_code})[/]; started {new}")
