"""The ORM payments example (consumers/payments_orm.py) checked with the test kit: the
sync handler in local mode (per-message and batch path: it has no bulk handler) and in
leased mode, and the ``async def`` variant on an ``AsyncSession``; every scenario
passes and the tables, results and events are those of payments.py's handler.
The environment knobs reach the module's ``app`` as they reach payments.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from consumers import payments, payments_orm
from kafka_idem.testing import Harness
from tests.conftest import ROOT

Make = Callable[..., Harness]
CHARGE = payments.charge_payload("t1", "o-1", "10.00")
ALL_LEASED = {"twice", "crash_before_commit", "crash_before_offset_commit", "concurrent",
              "conflict", "retries_exhausted", "unknown_outcome", "lease_takeover"}


def made_by_the_database(report: Any) -> None:
    """The ledger's id and time, in the table and in the event, are the database's."""
    assert report.tables == ["payments.balances", "payments.ledger"]
    assert "payments.ledger.id (default nextval('payments.ledger_id_seq'::regclass))" \
        in report.left_out
    assert "events: 1 to payments.charge-completed" in report.reference
    made = "(a value the database makes: payments.ledger."
    assert [x for x in report.left_out if x.startswith("event ")] == [
        f"event payments.charge-completed field ledger_entry.created_at {made}created_at)",
        f"event payments.charge-completed field ledger_entry.id {made}id)"]


def test_the_sync_handler_in_local_mode_passes_every_scenario_on_both_paths(
    kafka_idem_harness: Make,
) -> None:
    app = payments_orm.build_app(mode="local")
    assert app.handlers[payments_orm.TOPIC].bulk is None  # the batch path calls it per item
    report = kafka_idem_harness(app).check(payments_orm.TOPIC, CHARGE)
    assert report.passed, report
    made_by_the_database(report)
    assert {r.path for r in report.results} == {"per-message", "batch"}
    batch = report.result("batch")
    assert batch.story[0].startswith("5 messages in one batch: succeeded, succeeded, "
                                     "replayed, conflict (payload_conflict), succeeded")
    crash = report.result("crash_before_commit", "batch")
    assert crash.story[-1] == "redelivered: succeeded; record succeeded, attempts 1"


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_the_leased_handlers_pass_every_scenario(kafka_idem_harness: Make,
                                                 asynchronous: bool) -> None:
    app = payments_orm.build_app(mode="leased", asynchronous=asynchronous)
    handler = app.handlers[payments_orm.TOPIC]
    assert handler.mode == "leased" and handler.is_async == asynchronous
    report = kafka_idem_harness(app).check(payments_orm.TOPIC, CHARGE)
    assert report.passed, report
    made_by_the_database(report)
    assert {r.name for r in report.results if not r.skipped} == ALL_LEASED
    crash = report.result("crash_before_commit")
    assert crash.story[-1] == "redelivered: succeeded; record succeeded, attempts 2"


def test_its_effects_equal_those_of_payments_sql_handler(kafka_idem_harness: Make) -> None:
    """The same charges through both examples: the same rows, results and events."""
    charges = [payments.charge_payload(*c) for c in (
        ("t1", "o-1", "10.00"), ("t1", "o-2", "2.50"), ("t2", "o-3", "1.00", "USD"),
        ("t1", "o-1", "10.00"), ("t1", "o-4", "0"))]
    seen = []
    for app in (payments.build_app(mode="local"), payments_orm.build_app(mode="local")):
        harness = kafka_idem_harness(app)
        out = [harness.deliver(payments.TOPIC, c) for c in charges]
        ledger = [{k: v for k, v in r.items() if k not in ("id", "created_at")}
                  for r in sorted(harness.rows("payments.ledger"), key=lambda r: r["id"])]
        events = [e.decoded.model_dump(exclude={"ledger_entry", "request_id"})
                  for d in out for e in d.events]
        seen.append(([(d.outcome, d.result) for d in out], ledger,
                     sorted(harness.rows("payments.balances"), key=repr), events))
    assert seen[0] == seen[1]
    outcomes, _, balances, events = seen[1]
    assert [o for o, _ in outcomes] == ["succeeded", "succeeded", "succeeded", "replayed",
                                        "dead_lettered"]
    assert sorted((b["tenant_id"], b["currency"], b["balance"]) for b in balances) == [
        ("t1", "EUR", Decimal("12.50")), ("t2", "USD", Decimal("1.00"))]
    assert len(events) == 3


def test_a_ledger_entry_reaches_its_balance(kafka_idem_harness: Make) -> None:
    """``LedgerEntry.balance``, the relationship without a foreign key."""
    harness = kafka_idem_harness(payments_orm.build_app(mode="local"))
    for order, amount in (("o-1", "10.00"), ("o-2", "5.00")):
        assert harness.deliver(payments.TOPIC, payments.charge_payload(
            "t1", order, amount)).outcome == "succeeded"
    engine = create_engine("postgresql+psycopg://",
                           creator=lambda: psycopg.connect(harness.dsn))
    with Session(engine) as session:
        entries = session.scalars(select(payments_orm.LedgerEntry)
                                  .order_by(payments_orm.LedgerEntry.id)).all()
        assert [(e.order_id, e.balance.balance) for e in entries] == [
            ("o-1", Decimal("15.00")), ("o-2", Decimal("15.00"))]
    engine.dispose()


KNOBS = """
import json
from consumers import payments_orm as m
h = m.app.handlers[m.TOPIC]
print(json.dumps({"topic": m.TOPIC, "mode": h.mode, "async": h.is_async,
                  "concurrency": h.concurrency,
                  "ordering_key": h.ordering.spec if h.ordering else None,
                  "format": h.format, "events": sorted(m.app.event_topics)}))
"""


@pytest.mark.parametrize(("env", "want"), [
    ({}, {"topic": "payments.charge-requested", "mode": "local", "async": False,
          "concurrency": 1, "ordering_key": None, "format": "avro",
          "events": ["payments.charge-completed"]}),
    ({"PAYMENTS_TOPIC": "x.charge-requested", "PAYMENTS_MODE": "leased",
      "PAYMENTS_CONCURRENCY": "8", "PAYMENTS_ORDERING_KEY": "{tenant_id}", "PAYMENTS_ASYNC": "1",
      "PAYMENTS_FORMAT": "json", "PAYMENTS_EVENTS": "off"},
     {"topic": "x.charge-requested", "mode": "leased", "async": True, "concurrency": 8,
      "ordering_key": "{tenant_id}", "format": "json", "events": []}),
], ids=["defaults", "every-knob"])
def test_the_environment_knobs_are_payments_ones(env: dict[str, str],
                                                  want: dict[str, Any]) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PAYMENTS_")}
    out = subprocess.run([sys.executable, "-c", KNOBS], env={**clean, **env,
                         "PYTHONPATH": str(ROOT)}, cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == want
