"""The chaos run: a consumer group under seeded faults, then the anomaly checker.

    python -m kafka_idem.chaos.run --duration 120 --faults 24 --seed 7 --members 3 \\
        [--relays 1] [--format avro|json] [--json report.json] [--allow-broker-restart] [--keep]

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
   key-ordered (``--async-handler``: as ``async def``).
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
5. Run the checker (:mod:`kafka_idem.chaos.checker`) on durable state, the event
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

from kafka_idem.chaos.checker import ROOT, Liveness, Report, check
from kafka_idem.chaos.faults import FAULTS, Injector
from kafka_idem.chaos.members import APP, MAX_MEMBERS, MIN_MEMBERS, Pool, member_env
from kafka_idem.chaos.output import T0, console, print_summary, progress, say
from kafka_idem.chaos.services import (
    QUIET,
    Offsets,
    cleanup,
    create_database,
    create_outbox_topics,
    dlq_limit,
    drained,
    local_bootstrap,
    migrate_database,
    wait_assigned,
)
from kafka_idem.chaos.traffic import Feed
from kafka_idem.redact import redact
from kafka_idem.settings import load_settings

__all__ = ["FAULTS", "main", "parse"]  # FAULTS: the tests choose fault types from it


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m kafka_idem.chaos.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=120.0,
                    help="seconds over which the faults are spread (default 120)")
    ap.add_argument("--faults", type=int, default=24, help="faults to inject (default 24)")
    ap.add_argument("--seed", type=int, help="random seed (default: a new one, printed)")
    ap.add_argument("--members", type=int, default=3, help="group members at the start (2-4)")
    ap.add_argument("--relays", type=int, default=1,
                    help="standalone outbox relays besides the members' own (default 1; 0: "
                    "none, and no relay_kill / relay_zombie faults)")
    ap.add_argument("--rate", type=float, default=150.0, help="messages per second (default 150)")
    ap.add_argument("--partitions", type=int, default=6, help="source topic partitions")
    ap.add_argument("--format", choices=("avro", "json"), default=None,
                    help="payload format of the charges (PAYMENTS_FORMAT: default avro, "
                    "Avro single-object; json: validated by pydantic's JSON parser)")
    ap.add_argument("--mode", choices=("local", "leased"), default="local",
                    help="the payments handler's processing mode (default local)")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="leased mode: the handler's concurrency (key-ordered above 1)")
    ap.add_argument("--order-by-tenant", action="store_true",
                    help="leased mode: ordering_key='{tenant_id}' (with --concurrency > 1)")
    ap.add_argument("--async-handler", action="store_true",
                    help="leased mode: the payments handler as async def (PAYMENTS_ASYNC=1)")
    ap.add_argument("--heal-timeout", type=float, default=180.0,
                    help="liveness bound: seconds for the lag to reach 0 after healing")
    ap.add_argument("--fault-types", default=",".join(FAULTS),
                    help=f"comma-separated subset of {','.join(FAULTS)}")
    ap.add_argument("--allow-broker-restart", action="store_true",
                    help="allow restarting the local broker (scripts/kafka.sh restart)")
    ap.add_argument("--json", type=Path, help="write the report to this file")
    ap.add_argument("--keep", action="store_true", help="keep topics, database and logs")
    args = ap.parse_args(argv)
    types = tuple(t.strip() for t in args.fault_types.split(",") if t.strip())
    unknown = set(types) - set(FAULTS)
    if unknown or not types:
        ap.error(f"unknown fault types {sorted(unknown)}; choose from {','.join(FAULTS)}")
    if not args.allow_broker_restart:
        types = tuple(t for t in types if t != "broker_restart")
    if args.relays == 0:
        types = tuple(t for t in types if not t.startswith("relay_"))
    args.types = types
    if not MIN_MEMBERS <= args.members <= MAX_MEMBERS:
        ap.error(f"--members must be between {MIN_MEMBERS} and {MAX_MEMBERS}")
    if args.relays < 0:
        ap.error("--relays must be >= 0")
    if args.duration <= 0 or args.faults < 0 or args.rate <= 0 or args.partitions < 1:
        ap.error("--duration, --rate and --partitions must be positive, --faults >= 0")
    if (args.concurrency != 1 or args.order_by_tenant or args.async_handler) \
            and args.mode != "leased":
        ap.error("--concurrency, --order-by-tenant and --async-handler need --mode leased")
    if args.concurrency < 1:
        ap.error("--concurrency must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not (ROOT / "consumers" / "payments.py").exists():
        console.print(f"[red]the chaos run needs a checkout: no consumers/payments.py in {ROOT}[/]")
        return 2
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # the payments example, from any working directory
    if args.format:  # before consumers.payments is imported; the members inherit it
        os.environ["PAYMENTS_FORMAT"] = args.format
    fmt = os.environ.get("PAYMENTS_FORMAT", "avro")
    s = load_settings()
    seed = args.seed if args.seed is not None else random.randrange(1_000_000_000)
    run_id = uuid.uuid4().hex[:8]
    topic, group, dbname = f"chaos.{run_id}.charge-requested", f"chaos-{run_id}", f"chaos_{run_id}"
    dlq_topic = f"{topic}{s.dlq_suffix}"
    from consumers.payments import events_topic

    events, prefix = events_topic(topic), f"chaos.{run_id}."
    if "broker_restart" in args.types and not local_bootstrap(s.bootstrap_servers):
        console.print("[red]--allow-broker-restart needs the local broker (scripts/kafka.sh); "
                      f"{s.bootstrap_servers} is not it[/]")
        return 2
    logs = Path(tempfile.mkdtemp(prefix=f"kafka-idem-chaos-{run_id}-"))
    console.rule(f"kafka_idem chaos run {run_id}: seed {seed}, {args.faults} faults over "
                 f"{args.duration:.0f}s, {args.members} members, {args.mode} mode, {fmt} "
                 "payloads")
    say(f"Kafka {s.bootstrap_servers}, PostgreSQL {s.redacted()['database_url']}, "
        f"faults: {', '.join(args.types)}")
    admin = AdminClient({**s.admin_config(), **QUIET})
    pool: Pool | None = None
    relays: Pool | None = None
    injector: Injector | None = None
    feed: Feed | None = None
    offsets: Offsets | None = None
    report: Report | None = None
    result: dict[str, Any] = {"seed": seed, "run_id": run_id, "topic": topic,
                              "dlq_topic": dlq_topic, "events_topic": events,
                              "group": group, "database": dbname,
                              "options": {k: (str(v) if isinstance(v, Path) else v)
                                          for k, v in vars(args).items()},
                              "started_at": dt.datetime.now(dt.UTC).isoformat()}
    health: list[tuple[str, bool, str]] = []
    passed = False
    created_db = created_topics = False
    outbox_topics: list[str] = []
    try:
        # -- set-up
        dsn = create_database(s.dsn, dbname)
        created_db = True
        migrate_database(dsn, s.schema_name, s.table)
        brokers = len(admin.list_topics(timeout=15).brokers)
        rf = min(3, brokers)
        for f in admin.create_topics([NewTopic(t, args.partitions, rf)
                                      for t in (topic, dlq_topic)]).values():
            f.result(timeout=30)
        created_topics = True
        env = member_env(s, dsn, topic, args.mode)
        env["KAFKA_IDEM_NAME_PREFIX"] = prefix  # the relays' control topic and ids: ours
        outbox_topics = create_outbox_topics(admin, env, APP, prefix, args.partitions)
        if events not in outbox_topics:
            raise RuntimeError(f"kafka-idem topics create made no {events}: {outbox_topics}")
        outbox_topics = [t for t in outbox_topics if t not in (topic, dlq_topic)]
        say(f"database {dbname} migrated; topics {topic} (+ .dlq), {args.partitions} "
            f"partitions, replication factor {rf}; kafka-idem topics create made "
            f"{', '.join(outbox_topics)}; group {group}")
        cmd = [sys.executable, "-m", "kafka_idem.cli", "run", APP, "--group-id", group]
        env["PAYMENTS_CONCURRENCY"] = str(args.concurrency)
        if args.order_by_tenant:
            env["PAYMENTS_ORDERING_KEY"] = "{tenant_id}"
        if args.async_handler:
            env["PAYMENTS_ASYNC"] = "1"
        pool = Pool(cmd, env, logs)
        for _ in range(args.members):
            pool.start()
        relays = Pool([sys.executable, "-m", "kafka_idem.cli", "relay", APP], env, logs, "r")
        for _ in range(args.relays):
            relays.start()
        say(f"members {pool.alive()}, relays {relays.alive()} starting; logs in {logs}")
        offsets = Offsets(s.admin_config(), group, topic, args.partitions)
        wait_assigned(admin, group, args.partitions, timeout=60)
        say("every partition assigned")

        # -- load and faults
        feed = Feed(s.bootstrap_servers, topic, args.rate, seed + 1, s.kafka)
        injector = Injector(random.Random(seed), pool, admin, s.dsn, dbname, dlq_topic,
                            args.types, relays=relays)
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
        last_fault = time.monotonic()

        # -- heal
        say("[bold]healing[/]: SIGCONT everyone, DLQ restored, producing stopped")
        deadline = time.monotonic() + 120
        while injector.undo and time.monotonic() < deadline:
            injector.tick(everything=True)
            time.sleep(0.5)
        if injector.undo:
            health.append(("faults undone", False, f"{len(injector.undo)} not undone"))
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
                    and drained(dsn, s.schema_name):
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
        codes = {m.name: m.exit_code for m in alive}
        say(f"members and relays stopped: {codes}")

        # -- check
        report = check(bootstrap=s.bootstrap_servers, dsn=dsn, topic=topic, group=group,
                       dlq_topic=dlq_topic, schema=s.schema_name, table=s.table,
                       max_attempts=s.max_attempts,
                       liveness=Liveness(healed_in, args.heal_timeout),
                       acknowledged=feed.acked, kafka=s.kafka,
                       ordered_by=_ordered_by(args), events_topic=events,
                       event_order=_events_ordered(args))
        by_type = Counter(f.fault for f in injector.log)
        evidence, tracebacks = pool.scan_logs()
        for mine, theirs in zip((evidence, tracebacks), relays.scan_logs(), strict=True):
            for name, n in theirs.items():
                mine[name] = mine.get(name, 0) + n
        health += [
            ("every planned fault injected", len(injector.log) == args.faults,
             f"{len(injector.log)} of {args.faults}"),
            ("every fault type injected", set(by_type) >= set(args.types) or
             len(injector.log) < len(args.types),
             ", ".join(f"{t} {by_type[t]}" for t in args.types)),
            ("no member or relay exited on its own", not pool.crashed + relays.crashed,
             "; ".join(f"{m} code {m.exit_code}" for m in pool.crashed + relays.crashed)
             or "none"),
            ("members and relays exit 0 on SIGTERM",
             all(m.exit_code == 0 for m in pool.members + relays.members
                 if m.gone == "terminated") and not pool.slow_stops + relays.slow_stops,
             "; ".join(pool.slow_stops + relays.slow_stops) or ", ".join(
                 f"{m.name} {m.exit_code}" for m in pool.members + relays.members
                 if m.gone == "terminated")),
            *(("injector", False, h) for h in injector.health if "exited on its own" not in h),
        ]
        result.update({
            "seconds": round(time.monotonic() - T0, 1),
            "faults": [asdict(f) for f in injector.log],
            "faults_by_type": dict(sorted(by_type.items())),
            "fault_span_seconds": round(last_fault - t_start, 1),
            "broker_restarts_took": injector.restart_result,
            "messages": {"sent": sum(feed.sent.values()), "sent_by_kind": dict(feed.sent),
                         "acknowledged": len(feed.acked), "delivery_errors": dict(feed.errors)},
            "heal": {"healed_in": healed_in, "bound": args.heal_timeout},
            "member_log_evidence": evidence,
            "member_log_tracebacks": tracebacks,
            "members_started": len(pool.members),
            "relays_started": len(relays.members),
            "health": [{"check": n_, "ok": ok, "detail": d} for n_, ok, d in health],
            "checker": report.to_json(),
        })
        print_summary(injector, feed, report, health, evidence, tracebacks, result)
        passed = report.ok and all(ok for _, ok, _ in health)
        result["anomalies"] = report.anomalies + sum(1 for _, ok, _ in health if not ok)
        result["passed"] = passed
    except KeyboardInterrupt:
        say("[red]interrupted[/]")
    except Exception as exc:  # set-up or the broker failed us: report, clean up, exit 1
        console.print_exception()
        result["error"] = repr(exc)
    finally:
        if feed is not None:
            feed.stopping.set()
        for group_of in (pool, relays):
            if group_of is not None:
                group_of.stop_all()
        if injector is not None and injector.dlq_down:
            try:
                dlq_limit(admin, dlq_topic, None)
            except Exception as exc:  # best effort; the topic is removed unless kept
                say(f"[yellow]could not restore the DLQ limit: {exc}[/]")
        if offsets is not None:
            offsets.close()
        if args.json:
            result.setdefault("passed", False)
            args.json.write_text(json.dumps(result, indent=2, default=str))
        keep = args.keep or not passed
        verdict = "[bold green]PASSED[/]" if passed else "[bold red]FAILED[/]"
        console.print(f"{verdict}: seed {seed}; replay the same faults and messages with "
                      f"[bold]python -m kafka_idem.chaos.run {_replay_args(args, seed)}[/]")
        if keep:
            console.print(f"kept: database {dbname}, topics {topic} (+ .dlq), "
                          f"{', '.join(outbox_topics)}, group {group}, "
                          f"member logs {logs}. Check again with: KAFKA_IDEM_DATABASE_URL="
                          f"'{redact(make_conninfo(s.dsn, dbname=dbname), s.secret_values())}' "
                          f"python -m kafka_idem.chaos.checker --topic {topic} --group {group}"
                          f" --events {events}", markup=False)
        else:
            cleanup(s, dbname if created_db else None,
                    [topic, dlq_topic, *outbox_topics] if created_topics else [],
                    group, logs)
    return 0 if passed else 1


def _ordered_by(args: argparse.Namespace) -> str | None:
    """Per-message runs keep each tenant's charges of a partition in offset order: a
    partition run as prefixes, or key-ordered by tenant (check 10). Local batches
    and key order by idempotency key alone do not."""
    if args.mode != "leased":
        return None
    prefix = args.concurrency == 1 and not args.async_handler
    return "tenant" if prefix or args.order_by_tenant else None


def _events_ordered(args: argparse.Namespace) -> bool:
    """One Kafka key's (order id's) charges are applied one transaction after another,
    so their events' order is known (check 11), unless leased runs them concurrently
    (key-ordered by idempotency key or by tenant: two tenants may share an order id)."""
    return args.mode == "local" or (args.concurrency == 1 and not args.async_handler)


def _replay_args(args: argparse.Namespace, seed: int) -> str:
    parts = [f"--duration {args.duration:g}", f"--faults {args.faults}", f"--seed {seed}",
             f"--members {args.members}", f"--relays {args.relays}", f"--rate {args.rate:g}",
             f"--partitions {args.partitions}", f"--mode {args.mode}",
             f"--concurrency {args.concurrency}", f"--fault-types {','.join(args.types)}"]
    if args.order_by_tenant:
        parts.append("--order-by-tenant")
    if args.async_handler:
        parts.append("--async-handler")
    if args.allow_broker_restart:
        parts.append("--allow-broker-restart")
    if args.format:
        parts.append(f"--format {args.format}")
    return " ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
