"""The anomaly checker: exactly-once effects judged from durable state only.

It reads the source topic (every record from the low watermark to the end),
the DLQ topic, the consumer group's committed offsets and PostgreSQL (the
idempotency records, the payments example's ledger and balances). It never asks
the producer or the consumers what they did, so it can judge any run after the
fact, including one whose processes were killed.

    report = check(bootstrap="127.0.0.1:39092", dsn=..., topic="t", group="g")
    Console().print(report.table())
    assert report.ok

This module is the checker's public face and command line (``python -m
tools.chaos.checker --topic T --group G``); the parts are:

* :mod:`~tools.chaos.checks`: :func:`check`, the checks (listed there);
* :mod:`~tools.chaos.evidence`: :func:`gather`, the durable state read once,
  decoded and indexed (:class:`Evidence`);
* :mod:`~tools.chaos.report`: :class:`Check`, :class:`Report` (tables,
  JSON) and :class:`Liveness`, the run's measurement for check 9;
* :mod:`~tools.kafka_state`: :func:`read_topic`,
  :func:`committed_offsets`, :class:`KafkaRecord`, :class:`CheckerError`;
* :mod:`~tools.chaos.db_state`: the records, ledger, balances and guard
  triggers (:data:`GUARD_TRIGGERS`), in one snapshot;
* :mod:`~tools.chaos.intents`: :class:`PaymentsDecoder`, decoding a source
  message into an :class:`Intent` exactly as the payments handler does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from tools.chaos.checks import FAILED_KINDS, TITLES, Pos, check
from tools.chaos.db_state import GUARD_TRIGGERS
from tools.chaos.intents import ROOT, Intent, PaymentsDecoder
from tools.chaos.report import EXAMPLES, Check, Liveness, Report
from tools.kafka_state import CheckerError, KafkaRecord, committed_offsets, read_topic

__all__ = [
    "EXAMPLES",
    "FAILED_KINDS",
    "GUARD_TRIGGERS",
    "ROOT",
    "TITLES",
    "Check",
    "CheckerError",
    "Intent",
    "KafkaRecord",
    "Liveness",
    "PaymentsDecoder",
    "Pos",
    "Report",
    "check",
    "committed_offsets",
    "main",
    "read_topic",
]


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.chaos.checker``: check a (kept) run again."""
    from kafka_idem.settings import load_settings

    ap = argparse.ArgumentParser(prog="python -m tools.chaos.checker",
                                 description="Check a payments run from durable state.")
    ap.add_argument("--topic", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--dlq", help="DLQ topic (default: <topic>.dlq)")
    ap.add_argument("--max-attempts", type=int, help="default: KAFKA_IDEM_MAX_ATTEMPTS")
    ap.add_argument("--ordered-by", choices=("tenant",),
                    help="also check that each tenant's effects followed offset order")
    ap.add_argument("--events", help="the outbox's event topic: also check its events "
                    "(check 11)")
    ap.add_argument("--no-event-order", action="store_true",
                    help="with --events: one Kafka key's charges ran concurrently, skip order")
    ap.add_argument("--json", type=Path, help="write the report here")
    args = ap.parse_args(argv)
    s = load_settings()
    report = check(bootstrap=s.bootstrap_servers, dsn=s.dsn, topic=args.topic, group=args.group,
                   dlq_topic=args.dlq, schema=s.schema_name, table=s.table,
                   max_attempts=args.max_attempts or s.max_attempts, kafka=s.kafka,
                   ordered_by=args.ordered_by, events_topic=args.events,
                   event_order=not args.no_event_order)
    console = Console()
    console.print(report.figures_table())
    console.print(report.table())
    if args.json:
        args.json.write_text(json.dumps(report.to_json(), indent=2, default=str))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
