"""``async def`` handlers in the test kit: run through the framework's async leased path
(the handler awaited on an async connection, the claim and the failure record on the
sync path), delivered and checked as sync ones are; a mistake is caught; a reference
that does not succeed is said in the report's headline.

One harness for the module (tests/apps/kit_async.py), the mistake switched on per test."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest

from kafka_idem.testing import Harness
from tests.apps import kit_async
from tests.conftest import ADMIN_DSN

BOOKING = {"warehouse": "w1", "pickup_id": "p-1", "carrier": "dhl", "note": "first"}
KEY = "w1:pickup:p-1"


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    with Harness(kit_async.app, database_url=ADMIN_DSN,
                 remotes={"carrier": kit_async.carrier}) as h:
        yield h


@pytest.fixture
def mistake(harness: Harness) -> Iterator[dict[str, str]]:
    harness.reset()
    yield kit_async.MISTAKE
    kit_async.MISTAKE["now"] = "none"


def failed(harness: Harness, mistake: dict[str, str], name: str) -> str:
    mistake["now"] = name
    with pytest.raises(AssertionError) as caught:
        harness.check(kit_async.BOOK, BOOKING)
    return str(caught.value)


def failing_scenarios(report: str) -> set[str]:
    return {line.split()[1] for line in report.splitlines() if line.startswith("FAILED ")}


def test_an_async_handler_is_awaited_its_row_and_event_committed(
    harness: Harness, mistake: dict[str, str]
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" fails the test
        first = harness.deliver(kit_async.BOOK, BOOKING)
        again = harness.deliver(kit_async.BOOK, {**BOOKING, "note": "again"})
    assert (first.outcome, first.steps, first.key, first.status) == (
        "succeeded", ("succeeded",), KEY, "succeeded")
    assert first.result == {"ok": True, "booking": "carrier-1"}
    assert first.dead_letters == () and harness.dead_letters == []
    assert [(r["key"], r["pickup_id"], r["booking"]) for r in harness.rows("pickups.booked")] \
        == [(KEY, "p-1", "carrier-1")]
    [event] = first.events
    assert (event.topic, event.key, event.decoded) == (
        kit_async.BOOKED, b"p-1", {"pickup_id": "p-1", "booking": "carrier-1"})
    assert (again.outcome, again.result, again.events) == ("replayed", first.result, ())
    # a message that cannot be decoded gets what the sync path gives it
    bad = harness.deliver(kit_async.BOOK, b"{not json")
    assert (bad.outcome, bad.record, [x.kind for x in bad.dead_letters]) == (
        "dead_lettered", None, ["undecodable"])


def test_an_async_handler_passes_every_scenario(harness: Harness,
                                                mistake: dict[str, str]) -> None:
    report = harness.check(kit_async.BOOK, BOOKING)
    assert report.passed
    ran = {r.name for r in report.results if not r.skipped}
    assert ran == {"twice", "crash_before_commit", "crash_before_offset_commit",
                   "concurrent", "conflict", "retries_exhausted", "unknown_outcome",
                   "lease_takeover"}
    lines = str(report).splitlines()
    assert lines[0].endswith("all 8 scenarios passed in " + lines[0].rsplit(" in ", 1)[1])
    assert ("  reference: delivered once on the leased path: succeeded; record succeeded, "
            "attempts 1; 1 row(s) in pickups.booked") in lines
    assert "  reference: events: 1 to x.booked" in lines
    # the kit's faults reached the coroutine: the crash, the takeover's reconciler, the race
    crash = report.result("crash_before_commit")
    assert any("process died before" in line for line in crash.story), crash.story
    takeover = report.result("lease_takeover")
    assert any("reconcile x1" in line for line in takeover.story), takeover.story
    concurrent = report.result("concurrent")
    assert any(line.startswith("finally: replayed x3, succeeded x1")
               for line in concurrent.story), concurrent.story
    assert not any("did not arrive" in line for line in concurrent.story), concurrent.story


def test_an_emit_without_await_is_seen_by_the_kit_once_and_passes(
    harness: Harness, mistake: dict[str, str]
) -> None:
    mistake["now"] = "forgot_await"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" fails the test
        first = harness.deliver(kit_async.BOOK, BOOKING)
        again = harness.deliver(kit_async.BOOK, {**BOOKING, "note": "again"})
    [event] = harness.events(kit_async.BOOKED)
    assert first.events == (event,) and again.events == ()
    assert (event.key, event.decoded) == (b"p-1", {"pickup_id": "p-1", "booking": "carrier-1"})
    harness.reset()
    report = harness.check(kit_async.BOOK, BOOKING)
    assert report.passed and "  reference: events: 1 to x.booked" in str(report).splitlines()


def test_an_async_handlers_random_event_id_is_left_out_and_said(
    harness: Harness, mistake: dict[str, str]
) -> None:
    # made anew by every delivery: left out as a column that differs would be
    mistake["now"] = "event_random_id"
    report = harness.check(kit_async.BOOK, BOOKING)
    assert report.passed, str(report)
    line = ("event x.booked field event_id (differs between two deliveries of the reference: "
            "a value the handler makes anew, e.g. now(), a random id or a counter of the "
            "process)")
    assert report.left_out == [line]
    lines = str(report).splitlines()
    assert lines[0].endswith("; 1 value(s) LEFT OUT of the comparison (listed below)")
    assert lines[lines.index("  LEFT OUT: 1 value(s) no scenario compares (a mistake in them "
                             "would not fail this check):") + 1] == f"    - {line}"


def test_an_async_handler_writing_through_its_own_connection_fails(
    harness: Harness, mistake: dict[str, str]
) -> None:
    report = failed(harness, mistake, "own_connection")
    assert {"crash_before_commit", "retries_exhausted"} <= failing_scenarios(report)
    assert "table pickups.booked: 1 row(s) more than the reference" in report


def test_a_reference_that_fails_as_a_code_defect_fails_the_check(
    harness: Harness, mistake: dict[str, str]
) -> None:
    mistake["now"] = "not_json"  # a ResultNotJSON (a TypeError): a code defect
    with pytest.raises(AssertionError) as caught:
        harness.check(kit_async.BOOK, BOOKING)  # every scenario agrees with it...
    lines = str(caught.value).splitlines()
    # ... but the check fails, the headline and the first line saying why
    assert lines[0].startswith(
        "kafka_idem check of handler 'book' (topic x.book, leased mode): FAILED: the "
        "reference delivery failed with a code defect (dead_lettered (permanent): "
        "ResultNotJSON); 4 scenarios agree with it")
    assert lines[1].startswith("  ! the reference delivery failed: ResultNotJSON: a code "
                               "defect, not retried: ")


def test_the_apps_on_loop_close_runs_when_the_kit_closes_a_process() -> None:
    """What an app's ``async def`` handlers made on an event loop (a shared client) is
    released by ``app.on_loop_close`` in the kit as in a member: once per loop that ran
    them, on that loop, when the harness closes."""
    before = len(kit_async.CLOSED_LOOPS)
    with Harness(kit_async.app, database_url=ADMIN_DSN,
                 remotes={"carrier": kit_async.carrier}) as h:
        assert h.deliver(kit_async.BOOK, BOOKING).outcome == "succeeded"
        assert len(kit_async.CLOSED_LOOPS) == before  # not before the process closes
    closed = kit_async.CLOSED_LOOPS[before:]
    assert len(closed) >= 1 and len(set(closed)) == len(closed)
