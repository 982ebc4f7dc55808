"""The examples in consumers/ checked with the test kit, through its pytest fixture
(``kafka_idem_harness``, the plugin's): payments (local mode, bulk handler, an event
per charge), orders_json (JSON payloads), gateway (leased mode, reconcile, a real HTTP
gateway as the remote)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from consumers import gateway, orders_json, payments
from kafka_idem.testing import Harness

Make = Callable[..., Harness]


def test_payments_local_and_bulk_pass_every_scenario(kafka_idem_harness: Make) -> None:
    harness = kafka_idem_harness(payments.app)
    report = harness.check(payments.TOPIC, payments.charge_payload("t1", "o-1", "10.00"))
    assert report.passed and report.tables == ["payments.balances", "payments.ledger"]
    assert "payments.ledger.id (default nextval('payments.ledger_id_seq'::regclass))" \
        in report.left_out
    assert {r.path for r in report.results} == {"per-message", "batch"}
    # its ChargeCompleted is compared in every scenario, less the ledger entry's id and
    # time, which the database makes (a crashed attempt used up ledger id 1)
    assert "events: 1 to payments.charge-completed" in report.reference
    made = "(a value the database makes: payments.ledger."
    assert [x for x in report.left_out if x.startswith("event ")] == [
        f"event payments.charge-completed field ledger_entry.created_at {made}created_at)",
        f"event payments.charge-completed field ledger_entry.id {made}id)"]
    batch = report.result("batch")
    assert "(the bulk handler ran 1 time(s))" in batch.story[0], batch.story
    assert batch.story[0].startswith("5 messages in one batch: succeeded, succeeded, "
                                     "replayed, conflict (payload_conflict), succeeded")
    crash = report.result("crash_before_commit", "batch")
    assert crash.story[-1] == "redelivered: succeeded; record succeeded, attempts 1"


def test_orders_json_passes_every_scenario(kafka_idem_harness: Make) -> None:
    harness = kafka_idem_harness(orders_json.app)
    order = {"tenant_id": "t1", "order_id": "o-1", "amount": "10.00", "currency": "EUR",
             "items": 2, "request_id": "r-1", "placed_at": dt.datetime.now(dt.UTC)}
    report = harness.check(orders_json.TOPIC, order)
    assert report.passed
    conflict = report.result("conflict", "per-message")
    assert conflict.story[0].endswith("conflict (payload_conflict); record succeeded, "
                                      "attempts 1")


@pytest.fixture
def gw() -> Iterator[gateway.Gateway]:
    with gateway.Gateway() as g:
        yield g


def test_gateway_leased_with_reconcile_passes_every_scenario(
    kafka_idem_harness: Make, gw: gateway.Gateway
) -> None:
    app = gateway.build_app(gateway_url=gw.url, timeout=5)
    # The gateway makes up each charge's id: not the handler's to keep equal.
    harness = kafka_idem_harness(app, remotes={"gateway": gw},
                                 ignore={"payments.gateway_charges": ["charge_id"]})
    report = harness.check(gateway.TOPIC, payments.charge_payload("t1", "o-1", "10.00"))
    assert report.passed
    names = {r.name for r in report.results if not r.skipped}
    assert {"lease_takeover", "unknown_outcome", "crash_before_commit"} <= names
    takeover = report.result("lease_takeover")
    assert "reconcile x1" in takeover.story[1], takeover.story
    assert report.result("unknown_outcome").story[0].endswith("reconcile ran 1 time(s)")
    crash = report.result("crash_before_commit")
    assert "(the dead owner's lease is still live)" in crash.story[1]
    assert crash.story[-1] == "redelivered: succeeded; record succeeded, attempts 2"


def test_the_gateway_is_charged_once_per_key_however_often_it_is_asked(
    kafka_idem_harness: Make, gw: gateway.Gateway
) -> None:
    harness = kafka_idem_harness(gateway.build_app(gateway_url=gw.url, timeout=5),
                                 remotes={"gateway": gw})
    charge = payments.charge_payload("t1", "o-9", "4.00")
    first = harness.deliver(gateway.TOPIC, charge)
    again = harness.redeliver(first.message)
    assert (first.outcome, again.outcome) == ("succeeded", "replayed")
    assert gw.effects() == [("t1:charge:o-9", "t1", "o-9", "4.00", "EUR")]
    assert len(gw.requests("POST")) == 1
    rows: list[dict[str, Any]] = harness.rows("payments.gateway_charges")
    assert [r["charge_id"] for r in rows] == [first.result["charge_id"]]
