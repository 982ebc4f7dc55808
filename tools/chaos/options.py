"""The chaos run's command line: its options, checked, and what they imply for the
checker (which orders hold) and for replaying a run."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tools.chaos.faults import FAULTS
from tools.chaos.members import MAX_MEMBERS, MIN_MEMBERS


def parse(argv: list[str] | None, description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.chaos.run", description=description,
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
                    help="leased mode: ordering_key='{tenant_id}' (then check 10 checks "
                    "each tenant's order)")
    ap.add_argument("--async-handler", action="store_true",
                    help="leased mode: the payments handler as async def (PAYMENTS_ASYNC=1)")
    ap.add_argument("--orm", action="store_true",
                    help="run consumers.payments_orm:app (the same example on SQLAlchemy's "
                    "ORM, ctx.session; its tables made by its models' metadata) instead of "
                    "consumers.payments:app")
    ap.add_argument("--heal-timeout", type=float, default=180.0,
                    help="liveness bound: seconds for the lag to reach 0 after healing")
    ap.add_argument("--fault-types", default=",".join(FAULTS),
                    help=f"comma-separated subset of {','.join(FAULTS)}")
    ap.add_argument("--allow-broker-restart", action="store_true",
                    help="allow restarting the local broker (scripts/kafka.sh restart)")
    ap.add_argument("--citus", action="store_true",
                    help="run on a Citus cluster (KAFKA_IDEM_TEST_CITUS_URL, else the local one "
                    "of scripts/citus.sh, started): a database of the run's own there, the "
                    "store distributed; with the local cluster, worker_restart faults "
                    "(scripts/citus.sh restart-worker N) join the chosen types")
    ap.add_argument("--old-records", type=int, default=200_000,
                    help="succeeded records older than the members' retention window, "
                    "purged by them under load (0: retention off)")
    ap.add_argument("--json", type=Path, help="write the report to this file")
    ap.add_argument("--keep", action="store_true", help="keep topics, database and logs")
    args = ap.parse_args(argv)
    types = tuple(t.strip() for t in args.fault_types.split(",") if t.strip())
    unknown = set(types) - set(FAULTS)
    if unknown or not types:
        ap.error(f"unknown fault types {sorted(unknown)}; choose from {','.join(FAULTS)}")
    if not args.allow_broker_restart:
        types = tuple(t for t in types if t != "broker_restart")
    if not args.citus or os.environ.get("KAFKA_IDEM_TEST_CITUS_URL"):
        types = tuple(t for t in types if t != "worker_restart")  # the local cluster's only
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


def ordered_by(args: argparse.Namespace) -> str | None:
    """Per-message runs with the tenant as ordering key keep each tenant's charges of a
    partition in offset order (check 10). Without it a charge waiting for a retry holds
    only its own key (other tenants' and its tenant's other charges go on), and local
    batches number their ledger rows in claim order, not offset order."""
    return "tenant" if args.mode == "leased" and args.order_by_tenant else None


def events_ordered(args: argparse.Namespace) -> bool:
    """One Kafka key's (order id's) charges are applied one transaction after another,
    so their events' order is known (check 11), unless leased runs them concurrently
    (key-ordered by idempotency key or by tenant: two tenants may share an order id)."""
    return args.mode == "local" or (args.concurrency == 1 and not args.async_handler)


def replay_args(args: argparse.Namespace, seed: int) -> str:
    parts = [f"--duration {args.duration:g}", f"--faults {args.faults}", f"--seed {seed}",
             f"--members {args.members}", f"--relays {args.relays}", f"--rate {args.rate:g}",
             f"--partitions {args.partitions}", f"--mode {args.mode}",
             f"--concurrency {args.concurrency}", f"--fault-types {','.join(args.types)}",
             f"--old-records {args.old_records}"]
    if args.order_by_tenant:
        parts.append("--order-by-tenant")
    if args.async_handler:
        parts.append("--async-handler")
    if args.allow_broker_restart:
        parts.append("--allow-broker-restart")
    if args.format:
        parts.append(f"--format {args.format}")
    if args.orm:
        parts.append("--orm")
    if args.citus:
        parts.append("--citus")
    return " ".join(parts)
