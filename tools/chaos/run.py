"""The chaos run: a consumer group under seeded faults, then the anomaly checker.

    python -m tools.chaos.run --duration 120 --faults 24 --seed 7 --members 3 \\
        [--relays 1] [--format avro|json] [--orm] [--json report.json] [--allow-broker-restart]
        [--keep]

Everything is fresh and named after a run id: the topic ``chaos.<id>.charge-requested``
(6 partitions) and its ``.dlq``, the event topic ``chaos.<id>.charge-completed`` (the
outbox's), the database ``chaos_<id>`` (store, outbox and ``payments`` tables,
migrated here), the group ``chaos-<id>``, and the name prefix ``chaos.<id>.`` of the
relays' control topic and transactional ids. They are removed at the end unless
``--keep`` is given or an anomaly was found.

1. ``--members`` ``kafka-idem run consumers.payments:app`` processes join the group
   (session timeout 6 s, max.poll.interval 10 s, short backoffs), each with its
   outbox relay, and ``--relays`` standalone ``kafka-idem relay`` processes compete
   with them for the outbox's shards; ``--mode leased
   --concurrency N [--order-by-tenant] [--async-handler]`` runs the handler
   key-ordered (``--async-handler``: as ``async def``). ``--orm`` runs
   ``consumers.payments_orm:app`` instead: the same example written with SQLAlchemy's
   ORM (``ctx.session``) on the same tables, its tables made by its models' metadata
   (``kafka-idem migrate --app``'s app migration); everything else is the same.
2. A producer thread sends charge intents at ``--rate`` per second (idempotent,
   acks=all): originals, re-sends of earlier intents (new request id), payload
   conflicts, invalid charges (amount <= 0, unknown currency), undecodable bytes.
3. A fault injector, seeded by ``--seed`` and logged, injects ``--faults``
   faults spread over ``--duration`` seconds, each type at least once first:
   ``kill`` (SIGKILL a member, start a replacement), ``zombie`` (SIGSTOP a member
   past max.poll.interval.ms, then SIGCONT), ``add`` / ``remove`` (start a member
   / SIGTERM one, keeping 2-4), ``pg_terminate`` (``pg_terminate_backend`` of the
   members' and relays' sessions), ``relay_kill`` / ``relay_zombie`` (the same two
   on a standalone relay: SIGSTOPped past its session timeout, its shards are
   taken over; resumed, it must be fenced), ``dlq_outage`` (the DLQ topic's
   ``max.message.bytes`` set to 1 byte, so every dead-letter produce fails with
   MSG_SIZE_TOO_LARGE, records kept; restored later), ``broker_restart``
   (``scripts/kafka.sh restart``: only with ``--allow-broker-restart`` and the
   local broker).
4. Heal: SIGCONT everyone, restore the DLQ, keep at least one member, stop
   producing; wait until the group's committed offsets equal the end offsets and
   the outbox is empty (bounded by ``--heal-timeout``: liveness); SIGTERM the
   members and relays.
   Meanwhile the members' background retention purges ``--old-records`` (200,000)
   succeeded records older than its window, seeded before they start
   (:mod:`tools.chaos.retention`): a purge under load and faults.
5. Run the checker (:mod:`tools.chaos.checker`) on durable state, the event
   topic included (check 11, read_committed); print
   the fault log, the checker's table and the seed. Exit 1 on any anomaly.

Kafka and PostgreSQL come from ``KAFKA_IDEM_BOOTSTRAP_SERVERS`` and
``KAFKA_IDEM_DATABASE_URL`` (the local services by default); the database user
must be allowed to create databases and to terminate the members' sessions.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from psycopg.conninfo import make_conninfo

from kafka_idem.observe.redact import redact
from kafka_idem.settings import Settings, load_settings
from tools.chaos import retention
from tools.chaos.checker import Liveness, check
from tools.chaos.faults import FAULTS, Injector
from tools.chaos.members import APP, ORM_APP, Pool, member_env
from tools.chaos.options import events_ordered, ordered_by, parse, replay_args
from tools.chaos.output import T0, console, print_summary, progress, say
from tools.chaos.services import (
    QUIET,
    Offsets,
    citus_url,
    cleanup,
    create_database,
    create_outbox_topics,
    dlq_limit,
    drained,
    local_bootstrap,
    migrate_database,
    prepared_left,
    wait_assigned,
)
from tools.chaos.traffic import Feed

__all__ = ["FAULTS", "main", "parse"]  # FAULTS: the tests choose fault types from it


def main(argv: list[str] | None = None) -> int:
    args = parse(argv, __doc__ or "")
    if args.format:  # before consumers.payments is imported; the members inherit it
        os.environ["PAYMENTS_FORMAT"] = args.format
    if args.citus:  # the run's database on the Citus cluster (its coordinator's URL)
        os.environ["KAFKA_IDEM_DATABASE_URL"] = citus_url()
    s = load_settings()
    if "broker_restart" in args.types and not local_bootstrap(s.bootstrap_servers):
        console.print("[red]--allow-broker-restart needs the local broker (scripts/kafka.sh); "
                      f"{s.bootstrap_servers} is not it[/]")
        return 2
    run = Run(args, s)
    try:
        run.go()
    except KeyboardInterrupt:
        say("[red]interrupted[/]")
    except Exception as exc:  # set-up or the broker failed us: report, clean up, exit 1
        console.print_exception()
        run.result["error"] = repr(exc)
    finally:
        run.finish()
    return 0 if run.passed else 1


class Run:
    """One chaos run's names, processes and findings, phase by phase (:meth:`go`), and
    what :meth:`finish` must undo or keep whatever happened."""

    def __init__(self, args: argparse.Namespace, s: Settings) -> None:
        from consumers.payments import events_topic

        self.args, self.s = args, s
        self.app = ORM_APP if args.orm else APP
        self.seed = args.seed if args.seed is not None else random.randrange(1_000_000_000)
        run_id = uuid.uuid4().hex[:8]
        self.topic = f"chaos.{run_id}.charge-requested"
        self.group, self.dbname = f"chaos-{run_id}", f"chaos_{run_id}"
        self.dlq_topic = f"{self.topic}{s.dlq_suffix}"
        self.events, self.prefix = events_topic(self.topic), f"chaos.{run_id}."
        self.logs = Path(tempfile.mkdtemp(prefix=f"kafka-idem-chaos-{run_id}-"))
        self.admin = AdminClient({**s.admin_config(), **QUIET})
        self.dsn = ""
        self.pool: Pool | None = None
        self.relays: Pool | None = None
        self.injector: Injector | None = None
        self.feed: Feed | None = None
        self.offsets: Offsets | None = None
        self.health: list[tuple[str, bool, str]] = []
        self.passed = self.created_db = self.created_topics = False
        self.outbox_topics: list[str] = []
        self.result: dict[str, Any] = {
            "seed": self.seed, "run_id": run_id, "topic": self.topic,
            "dlq_topic": self.dlq_topic, "events_topic": self.events, "group": self.group,
            "database": self.dbname,
            "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "started_at": dt.datetime.now(dt.UTC).isoformat()}

    def go(self) -> None:
        args, s = self.args, self.s
        console.rule(f"kafka_idem chaos run {self.result['run_id']}: seed {self.seed}, "
                     f"{args.faults} faults over {args.duration:.0f}s, {args.members} members, "
                     f"{args.mode} mode, {os.environ.get('PAYMENTS_FORMAT', 'avro')} payloads, "
                     f"{self.app}")
        say(f"Kafka {s.bootstrap_servers}, PostgreSQL {s.redacted()['database_url']}, "
            f"faults: {', '.join(args.types)}")
        pool, relays = self.set_up()
        feed = Feed(s.bootstrap_servers, self.topic, args.rate, self.seed + 1, s.kafka)
        injector = Injector(random.Random(self.seed), pool, self.admin, s.dsn, self.dbname,
                            self.dlq_topic, args.types, relays=relays)
        self.feed, self.injector = feed, injector
        t_start, last_fault = self.load_and_faults(feed, injector, pool)
        healed_in = self.heal(feed, injector, pool, relays)
        self.result.update({"fault_span_seconds": round(last_fault - t_start, 1),
                            "heal": {"healed_in": healed_in, "bound": args.heal_timeout}})
        self.check(feed, injector, pool, relays, healed_in)

    def set_up(self) -> tuple[Pool, Pool]:
        """The database, the topics, the members and relays, until every partition is
        assigned."""
        args, s, admin = self.args, self.s, self.admin
        self.dsn = create_database(s.dsn, self.dbname, citus=args.citus)
        self.created_db = True
        migrate_database(self.dsn, s.schema_name, s.table, self.app)
        rf = min(3, len(admin.list_topics(timeout=15).brokers))
        for f in admin.create_topics([NewTopic(t, args.partitions, rf)
                                      for t in (self.topic, self.dlq_topic)]).values():
            f.result(timeout=30)
        self.created_topics = True
        env = member_env(s, self.dsn, self.topic, args.mode)
        env["KAFKA_IDEM_NAME_PREFIX"] = self.prefix  # the relays' control topic and ids: ours
        purge_env, self.result["retention"] = retention.seed(s, self.dsn, self.topic,
                                                             args.old_records)
        env.update(purge_env)  # a purge under load: the members remove the old records
        say(f"retention: {self.result['retention']}")
        made = create_outbox_topics(admin, env, self.app, self.prefix, args.partitions)
        if self.events not in made:
            raise RuntimeError(f"kafka-idem topics create made no {self.events}: {made}")
        self.outbox_topics = [t for t in made if t not in (self.topic, self.dlq_topic)]
        say(f"database {self.dbname} migrated; topics {self.topic} (+ .dlq), {args.partitions} "
            f"partitions, replication factor {rf}; kafka-idem topics create made "
            f"{', '.join(self.outbox_topics)}; group {self.group}")
        env["PAYMENTS_CONCURRENCY"] = str(args.concurrency)
        if args.order_by_tenant:
            env["PAYMENTS_ORDERING_KEY"] = "{tenant_id}"
        if args.async_handler:
            env["PAYMENTS_ASYNC"] = "1"
        cli = [sys.executable, "-m", "kafka_idem.cli"]
        self.pool = pool = Pool([*cli, "run", self.app, "--group-id", self.group], env,
                                self.logs, app=self.app)
        for _ in range(args.members):
            pool.start()
        self.relays = relays = Pool([*cli, "relay", self.app], env, self.logs, "r", app=self.app)
        for _ in range(args.relays):
            relays.start()
        say(f"members {pool.alive()}, relays {relays.alive()} starting; logs in {self.logs}")
        self.offsets = Offsets(s.admin_config(), self.group, self.topic, args.partitions)
        wait_assigned(admin, self.group, args.partitions, timeout=60)
        say("every partition assigned")
        return pool, relays

    def load_and_faults(self, feed: Feed, injector: Injector, pool: Pool) -> tuple[float, float]:
        """Produce while injecting the planned faults; the start and the last fault's end."""
        args, offsets = self.args, self.offsets
        assert offsets is not None
        feed.start()
        injector.t_start = t_start = time.monotonic()
        say(f"producing ~{args.rate:.0f} messages/s")
        spacing = args.duration / max(args.faults, 1)
        plan = [t_start + 2.0 + i * spacing + injector.rng.uniform(0, 0.4 * spacing)
                for i in range(args.faults)]
        last_progress = 0.0
        n = 0
        while n < len(plan) or time.monotonic() < t_start + args.duration:
            injector.tick()
            if n < len(plan) and time.monotonic() >= plan[n] and not injector.busy():
                n += 1
                injector.inject(n)
            if time.monotonic() - last_progress >= 10:
                last_progress = time.monotonic()
                progress(feed, offsets, pool)
            time.sleep(0.1)
        while injector.busy():  # a broker restart still in progress
            injector.tick()
            time.sleep(0.2)
        return t_start, time.monotonic()

    def heal(self, feed: Feed, injector: Injector, pool: Pool, relays: Pool) -> float | None:
        """Undo the faults, stop producing, and wait for lag 0 and an empty outbox
        (liveness, bounded by --heal-timeout); then SIGTERM everyone. Seconds it took."""
        args, offsets = self.args, self.offsets
        assert offsets is not None
        say("[bold]healing[/]: SIGCONT everyone, DLQ restored, producing stopped")
        deadline = time.monotonic() + 120
        while injector.undo and time.monotonic() < deadline:
            injector.tick(everything=True)
            time.sleep(0.5)
        if injector.undo:
            self.health.append(("faults undone", False, f"{len(injector.undo)} not undone"))
        if not pool.running():
            say(f"started {pool.start()} (no member left)")
        if args.relays and not relays.running():
            say(f"started {relays.start()} (no relay left)")
        feed.stopping.set()
        feed.join(150)
        heal_start = time.monotonic()
        healed_in: float | None = None
        last_progress = 0.0
        while time.monotonic() - heal_start < args.heal_timeout:
            injector.tick()
            state = offsets.lag()
            if state is not None and state[1] == 0 and not feed.is_alive() \
                    and drained(self.dsn, self.s.schema_name):
                healed_in = round(time.monotonic() - heal_start, 1)
                break
            if time.monotonic() - last_progress >= 10:
                last_progress = time.monotonic()
                progress(feed, offsets, pool)
            time.sleep(0.5)
        say(f"lag 0 and the outbox empty after {healed_in}s" if healed_in is not None
            else f"[red]lag not 0 or the outbox not empty after {args.heal_timeout:.0f}s[/]")
        alive = pool.alive() + relays.alive()
        pool.stop_all()
        relays.stop_all()
        say(f"members and relays stopped: { {m.name: m.exit_code for m in alive} }")
        return healed_in

    def check(self, feed: Feed, injector: Injector, pool: Pool, relays: Pool,
              healed_in: float | None) -> None:
        """The checker on durable state, the run's own health, and the report."""
        args, s = self.args, self.s
        report = check(bootstrap=s.bootstrap_servers, dsn=self.dsn, topic=self.topic,
                       group=self.group, dlq_topic=self.dlq_topic, schema=s.schema_name,
                       table=s.table, max_attempts=s.max_attempts,
                       liveness=Liveness(healed_in, args.heal_timeout),
                       acknowledged=feed.acked, kafka=s.kafka,
                       ordered_by=ordered_by(args), events_topic=self.events,
                       event_order=events_ordered(args))
        by_type = Counter(f.fault for f in injector.log)
        evidence, tracebacks = pool.scan_logs()
        for mine, theirs in zip((evidence, tracebacks), relays.scan_logs(), strict=True):
            for name, n in theirs.items():
                mine[name] = mine.get(name, 0) + n
        self.health += _run_health(args, injector, by_type, pool, relays)
        if self.result["retention"].get("retention"):
            old = self.result["retention"]["old_records"]
            kept = retention.left(self.dsn, s)
            self.health.append(("retention purged every old record", kept == 0,
                                f"{old - kept} of {old} removed under load"))
        self.health.append(_traffic_health(feed))
        if args.citus:
            self.health.append(prepared_left(self.dsn))
        self.result.update({
            "seconds": round(time.monotonic() - T0, 1),
            "faults": [asdict(f) for f in injector.log],
            "faults_by_type": dict(sorted(by_type.items())),
            "broker_restarts_took": injector.restart_result,
            "messages": {"sent": sum(feed.sent.values()), "sent_by_kind": dict(feed.sent),
                         "acknowledged": len(feed.acked), "delivery_errors": dict(feed.errors),
                         "producer_errors": dict(feed.client_errors)},
            "member_log_evidence": evidence,
            "member_log_tracebacks": tracebacks,
            "members_started": len(pool.members),
            "relays_started": len(relays.members),
            "health": [{"check": n_, "ok": ok, "detail": d} for n_, ok, d in self.health],
            "checker": report.to_json(),
        })
        print_summary(injector, feed, report, self.health, evidence, tracebacks, self.result)
        self.passed = report.ok and all(ok for _, ok, _ in self.health)
        self.result["anomalies"] = report.anomalies + sum(1 for _, ok, _ in self.health if not ok)
        self.result["passed"] = self.passed

    def finish(self) -> None:
        """Stop what runs, restore the DLQ, write the report; keep everything of a failed
        (or --keep) run, remove everything of a passed one."""
        args, s = self.args, self.s
        if self.feed is not None:
            self.feed.stopping.set()
        for group_of in (self.pool, self.relays):
            if group_of is not None:
                group_of.stop_all()
        if self.injector is not None and self.injector.dlq_down:
            try:
                dlq_limit(self.admin, self.dlq_topic, None)
            except Exception as exc:  # best effort; the topic is removed unless kept
                say(f"[yellow]could not restore the DLQ limit: {exc}[/]")
        if self.offsets is not None:
            self.offsets.close()
        if args.json:
            self.result.setdefault("passed", False)
            args.json.write_text(json.dumps(self.result, indent=2, default=str))
        verdict = "[bold green]PASSED[/]" if self.passed else "[bold red]FAILED[/]"
        console.print(f"{verdict}: seed {self.seed}; replay the same faults and messages with "
                      f"[bold]python -m tools.chaos.run {replay_args(args, self.seed)}[/]")
        if args.keep or not self.passed:
            console.print(f"kept: database {self.dbname}, topics {self.topic} (+ .dlq), "
                          f"{', '.join(self.outbox_topics)}, group {self.group}, "
                          f"member logs {self.logs}. Check again with: KAFKA_IDEM_DATABASE_URL="
                          f"'{redact(make_conninfo(s.dsn, dbname=self.dbname), s.secret_values())}"
                          f"' python -m tools.chaos.checker --topic {self.topic} --group "
                          f"{self.group} --events {self.events}", markup=False)
        else:
            cleanup(s, self.dbname if self.created_db else None,
                    [self.topic, self.dlq_topic, *self.outbox_topics] if self.created_topics
                    else [], self.group, self.logs, citus=args.citus)


def _run_health(args: argparse.Namespace, injector: Injector, by_type: Counter[str], pool: Pool,
                relays: Pool) -> list[tuple[str, bool, str]]:
    """The run's own checks, beside the checker's: the faults happened as planned, no
    process died on its own, and SIGTERM stopped each one cleanly."""
    crashed = pool.crashed + relays.crashed
    slow = pool.slow_stops + relays.slow_stops
    terminated = [m for m in pool.members + relays.members if m.gone == "terminated"]
    return [
        ("every planned fault injected", len(injector.log) == args.faults,
         f"{len(injector.log)} of {args.faults}"),
        ("every fault type injected", set(by_type) >= set(args.types) or
         len(injector.log) < len(args.types),
         ", ".join(f"{t} {by_type[t]}" for t in args.types)),
        ("no member or relay exited on its own", not crashed,
         "; ".join(f"{m} code {m.exit_code}" for m in crashed) or "none"),
        ("members and relays exit 0 on SIGTERM",
         all(m.exit_code == 0 for m in terminated) and not slow,
         "; ".join(slow) or ", ".join(f"{m.name} {m.exit_code}" for m in terminated)),
        *(("injector", False, h) for h in injector.health if "exited on its own" not in h),
    ]


def _traffic_health(feed: Feed) -> tuple[str, bool, str]:
    """The run's own producer delivered what it sent: a run whose traffic stopped (its
    sends timed out) would run its faults on an idle group and pass unseen."""
    sent = sum(feed.sent.values())
    said = "; ".join(f"{e} x{n}" for e, n in feed.errors.most_common(2))
    return ("every message sent was acknowledged", not feed.errors,
            f"{len(feed.acked)} of {sent}" + (f" ({said})" if said else ""))


if __name__ == "__main__":
    sys.exit(main())
