"""Negative controls of Harness.check: handlers with the mistakes that break
exactly-once effects, each caught, the report naming the scenario (and the table or
remote that shows it); the same handlers without the mistake pass.

One harness for the module (tests/apps/kit_shop.py, an app written as a user would),
the mistake switched on per test."""

from __future__ import annotations

import re
from collections.abc import Iterator
from decimal import Decimal

import pytest

from kafka_idem.testing import Harness
from tests.apps import kit_shop
from tests.conftest import ADMIN_DSN

ORDER = {"tenant_id": "t1", "order_id": "o-1", "amount": Decimal("12.50"), "note": "first"}


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    with Harness(kit_shop.app, database_url=ADMIN_DSN, remotes={"bank": kit_shop.bank}) as h:
        yield h


@pytest.fixture
def mistake() -> Iterator[dict[str, str]]:
    yield kit_shop.MISTAKE
    kit_shop.MISTAKE["now"] = "none"


def failed(harness: Harness, topic: str, mistake: dict[str, str], name: str) -> str:
    mistake["now"] = name
    with pytest.raises(AssertionError) as caught:
        harness.check(topic, ORDER)
    return str(caught.value)


def failing_scenarios(report: str) -> set[str]:
    return {line.split()[1] + " " + line.split()[2] for line in report.splitlines()
            if line.startswith("FAILED ")}


def difference(report: str, head: str) -> tuple[str, list[str]]:
    """The report's difference that begins ``head`` (said once, at the top): its lines,
    and the scenarios it names."""
    lines = report.splitlines()
    [start] = [i for i, line in enumerate(lines)
               if re.fullmatch(rf"  ! \d+\. {re.escape(head)}", line)]
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("    in "))
    return "\n".join(lines[start:end]) + "\n", lines[end].split(": ", 1)[1].split(", ")


def test_the_handlers_without_a_mistake_pass_every_scenario(harness: Harness) -> None:
    local = harness.check(kit_shop.ORDERS, ORDER)
    leased = harness.check(kit_shop.PAYMENTS, ORDER)
    assert local.passed and leased.passed
    ran = {(r.name, r.path) for r in local.results if not r.skipped}
    assert ran == {("once", "batch")} | {
        (n, p) for n in ("twice", "crash_before_commit", "crash_before_offset_commit",
                         "concurrent", "conflict", "retries_exhausted")
        for p in ("per-message", "batch")} | {("batch", "batch")}
    assert {r.name for r in leased.results if not r.skipped} == {
        "twice", "crash_before_commit", "crash_before_offset_commit", "concurrent",
        "conflict", "retries_exhausted", "unknown_outcome", "lease_takeover"}
    takeover = leased.result("lease_takeover")
    assert any("reconcile x1" in line for line in takeover.story), takeover.story
    # the events are compared too; the order row's id in the event is the database's
    assert "  reference: events: 1 to shop.order-placed" in str(local).splitlines()
    assert "  reference: events: 1 to shop.order-paid" in str(leased).splitlines()
    assert ("event shop.order-placed field row (a value the database makes: "
            "shop.orders.id)") in local.left_out


def test_a_write_through_a_second_connection_fails(harness: Harness,
                                                   mistake: dict[str, str]) -> None:
    report = failed(harness, kit_shop.ORDERS, mistake, "own_connection")
    assert failing_scenarios(report) == {
        "crash_before_commit [per-message]:", "crash_before_commit [batch]:",
        # on the batch path every process that read the key before the first one's
        # commit ran the handler (one commits): each wrote its row outside the transaction
        "concurrent [batch]:",
        "retries_exhausted [per-message]:", "retries_exhausted [batch]:"}
    assert "table shop.orders: 1 row(s) more than the reference" in report
    assert "extra   {key: 't1:order:o-1', order_id: 'o-1', amount: 12.50, invoice: None}" \
        in report


def test_a_counter_incremented_without_the_key_fails(harness: Harness,
                                                     mistake: dict[str, str]) -> None:
    report = failed(harness, kit_shop.ORDERS, mistake, "counter_own_connection")
    assert "crash_before_commit [per-message]:" in failing_scenarios(report)
    assert "retries_exhausted [batch]:" in failing_scenarios(report)
    assert "missing {name: 'orders', n: 1}" in report
    assert "extra   {name: 'orders', n: 2}" in report  # counted twice for one order


def test_a_counter_drawn_from_a_sequence_fails(harness: Harness,
                                               mistake: dict[str, str]) -> None:
    # nextval() is not rolled back: the crashed attempt's number is lost, the
    # redelivery's invoice is 2 where a single delivery's is 1.
    report = failed(harness, kit_shop.ORDERS, mistake, "sequence_counter")
    crashes = {"crash_before_commit [per-message]:", "crash_before_commit [batch]:"}
    # concurrent [batch] too when the process that commits is not the first to draw a
    # number (every process runs the handler there, and each draws one)
    assert crashes <= failing_scenarios(report) <= crashes | {"concurrent [batch]:"}
    assert "invoice: 1}" in report and "invoice: 2}" in report


@pytest.mark.parametrize("topic", [kit_shop.ORDERS, kit_shop.PAYMENTS])
def test_a_remote_call_without_the_key_fails(harness: Harness, mistake: dict[str, str],
                                             topic: str) -> None:
    report = failed(harness, topic, mistake, "remote_without_key")
    scenarios = {s.split(" [")[0] for s in failing_scenarios(report)}
    expected = {"crash_before_commit", "retries_exhausted"} | (
        {"unknown_outcome", "lease_takeover"} if topic == kit_shop.PAYMENTS
        else {"concurrent"})  # the batch path's processes each called (one committed)
    assert scenarios == expected
    assert "remote 'bank': 2 effect(s), the reference has 1" in report


def test_a_bulk_handler_unlike_the_handler_fails(harness: Harness,
                                                 mistake: dict[str, str]) -> None:
    report = failed(harness, kit_shop.ORDERS, mistake, "bulk_skips_counter")
    assert {"once [batch]:", "batch [batch]:"} <= failing_scenarios(report)
    assert "table shop.counters" in report
    assert all("[per-message]" not in s for s in failing_scenarios(report))


def test_a_reconciler_that_records_nothing_fails(harness: Harness,
                                                 mistake: dict[str, str]) -> None:
    report = failed(harness, kit_shop.PAYMENTS, mistake, "reconcile_forgets_row")
    assert failing_scenarios(report) == {"crash_before_commit [leased]:",
                                         "unknown_outcome [leased]:",
                                         "lease_takeover [leased]:"}
    assert "table shop.charges: 1 row(s) of the reference missing" in report


# --- the events (ctx.emit) --------------------------------------------------------------


WHY = ("differs between two deliveries of the reference: a value the handler makes anew, "
       "e.g. now(), a random id or a counter of the process")


@pytest.mark.parametrize("made, field", [("event_counter", "n"), ("event_random_id", "event_id")])
def test_an_event_field_the_process_makes_anew_is_left_out_as_a_column_is(
    harness: Harness, mistake: dict[str, str], made: str, field: str
) -> None:
    # a counter of the process or a random id differs between two deliveries of the
    # reference: left out of the event's comparison, as it would be of a column, and said
    mistake["now"] = made
    report = harness.check(kit_shop.ORDERS, ORDER)
    assert report.passed, str(report)
    line = f"event shop.order-placed field {field} ({WHY})"
    assert line in report.left_out
    text = str(report)
    assert f"\n    - {line}\n" in text
    assert " LEFT OUT of the comparison (listed below)" in text.splitlines()[0]
    # the event itself is still compared, less that field
    assert "  reference: events: 1 to shop.order-placed" in text.splitlines()


def test_a_field_left_out_by_the_user_is_said_once_as_ignored(harness: Harness,
                                                              mistake: dict[str, str]) -> None:
    mistake["now"] = "event_random_id"
    with Harness(kit_shop.app, database_url=ADMIN_DSN, remotes={"bank": kit_shop.bank},
                 ignore={kit_shop.PLACED: ["event_id"]}) as lenient:
        allowed = lenient.check(kit_shop.ORDERS, ORDER)
    assert allowed.passed
    assert [x for x in allowed.left_out if " field event_id " in x] == [
        "event shop.order-placed field event_id (ignored)"]


def test_a_reconciler_that_emits_again_fails(harness: Harness,
                                             mistake: dict[str, str]) -> None:
    report = failed(harness, kit_shop.PAYMENTS, mistake, "reconcile_emits_twice")
    assert failing_scenarios(report) == {"crash_before_commit [leased]:",
                                         "unknown_outcome [leased]:",
                                         "lease_takeover [leased]:"}
    assert "events to shop.order-paid: 2 event(s), the reference has 1" in report
    assert "extra   no key: {key: 't1:pay:o-1', amount: '12.50'}" in report
    assert "table shop" not in report  # the tables are right: only the events are not


def test_an_event_written_through_a_second_connection_fails(
    harness: Harness, mistake: dict[str, str]
) -> None:
    # it survives the crash and every failed attempt (five: the retry budget)
    report = failed(harness, kit_shop.ORDERS, mistake, "event_own_connection")
    assert failing_scenarios(report) == {
        "crash_before_commit [per-message]:", "crash_before_commit [batch]:",
        # on the batch path every process that read the key before the first one's
        # commit ran the handler (one commits): each wrote its row outside the transaction
        "concurrent [batch]:",
        "retries_exhausted [per-message]:", "retries_exhausted [batch]:"}
    problem = report.split("FAILED   retries_exhausted [per-message]")[1].split("FAILED")[0]
    assert ("! events to shop.order-placed: 5 event(s), the clean database (no event) has 0"
            in problem), problem
    block, where = difference(
        report, "events to shop.order-placed: 5 event(s), the clean database (no event) has 0")
    assert where == ["retries_exhausted [per-message]"]
    # the order row's id, a value the database makes, is left out (and not shown)
    assert block.count("extra   key 'o-1': {order_id: 'o-1', amount: '12.50'}\n") == 5
    crash = report.split("FAILED   crash_before_commit [per-message]")[1]
    assert "events to shop.order-placed: 2 event(s), the reference has 1" in crash


def test_a_difference_seen_in_several_scenarios_is_said_once_naming_them(
    harness: Harness, mistake: dict[str, str]
) -> None:
    report = failed(harness, kit_shop.ORDERS, mistake, "own_connection")
    lines = report.splitlines()
    head = "table shop.orders: 1 row(s) more than the reference"
    block, where = difference(report, head)
    assert where == ["crash_before_commit [per-message]", "crash_before_commit [batch]"]
    assert block.splitlines()[1:] == [
        "        extra   {key: 't1:order:o-1', order_id: 'o-1', amount: 12.50, invoice: None}"]
    # the row is shown once; each of the scenarios names the difference in one line
    # ... and the other differences list their own rows: retries_exhausted's 5 and 6,
    # and concurrent [batch]'s (a row per process that ran the handler but the first)
    assert report.count("extra   {key: 't1:order:o-1', order_id: 'o-1', amount: 12.50, "
                        "invoice: None}") >= 1 + 5 + 6 + 1
    number = re.fullmatch(r"  ! (\d+)\. .*", block.splitlines()[0])
    assert number is not None
    named = [line for line in lines if line.endswith(f"(difference {number[1]} above)")]
    assert named == [f"  ! {head}  (difference {number[1]} above)"] * len(where)
    # what differs comes first, right after the verdict; the context and each scenario after
    assert lines[0].endswith("5 of 14 scenarios FAILED in " + lines[0].rsplit(" in ", 1)[1])
    assert lines[1].startswith("  ! 1. table shop.orders: ")
    assert lines.index("  compared: shop.charges, shop.counters, shop.orders; remotes: bank") \
        > max(i for i, line in enumerate(lines) if line.startswith("    in "))
