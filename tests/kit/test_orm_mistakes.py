"""Negative controls of Harness.check for ORM handlers (``ctx.session``): the ORM
variants of the classic mistakes, each caught with a report that names it; the same
handlers without the mistake pass every scenario, local (per-message and batch) and
leased.

One harness for the module (tests/apps/kit_orm.py), the mistake switched on per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, Table, Text, Uuid, func

from kafka_idem import App
from kafka_idem.testing import Harness
from kafka_idem.testing.orm_defaults import client_defaults
from tests.apps import kit_orm
from tests.conftest import ADMIN_DSN
from tests.kit.test_check_catches_mistakes import difference, failing_scenarios

ORDER = {"tenant_id": "t1", "order_id": "o-1", "amount": "12.50"}
TOPICS = {"local": kit_orm.ORDERS, "leased": kit_orm.PAYMENTS}
REF = uuid.uuid5(kit_orm.NAMESPACE, "t1:order:o-1")  # the local handler's, from its key
SERIAL = "shop.orders.id (default nextval('shop.orders_id_seq'::regclass))"
MADE = "made by SQLAlchemy's client-side default uuid.uuid4 of shop.orders.ref"


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    with Harness(kit_orm.app, database_url=ADMIN_DSN) as h:
        yield h


@pytest.fixture
def mistake() -> Iterator[dict[str, str]]:
    yield kit_orm.MISTAKE
    kit_orm.MISTAKE["now"] = "none"


def failed(harness: Harness, mode: str, mistake: dict[str, str], name: str) -> str:
    mistake["now"] = name
    with pytest.raises(AssertionError) as caught:
        harness.check(TOPICS[mode], ORDER)
    return str(caught.value)


@pytest.mark.parametrize("mode", list(TOPICS))
def test_an_orm_handler_without_a_mistake_passes_every_scenario(harness: Harness,
                                                                mode: str) -> None:
    report = harness.check(TOPICS[mode], ORDER)
    assert report.passed and report.reference_succeeded and not report.faults, str(report)
    ran = {r.name for r in report.results if not r.skipped}
    assert {"crash_before_commit", "retries_exhausted", "concurrent", "conflict"} <= ran
    if mode == "local":
        assert {r.path for r in report.results} == {"per-message", "batch"}
        assert report.result("batch").passed
    else:
        assert {"unknown_outcome", "lease_takeover"} <= ran
    # the key-derived reference is compared, in the row and in the event; only the
    # serial id, the database's, is left out
    assert report.left_out == [SERIAL]
    assert report.tables == ["shop.orders"]
    assert "  reference: events: 1 to shop.order-placed" in str(report).splitlines()


# --- a session of its own ---------------------------------------------------------------


def test_a_session_on_an_engine_of_its_own_fails_as_a_connection_of_its_own_does(
    harness: Harness, mistake: dict[str, str]
) -> None:
    report = failed(harness, "local", mistake, "own_session")
    assert failing_scenarios(report) == {
        "crash_before_commit [per-message]:", "crash_before_commit [batch]:",
        "concurrent [batch]:",  # every process that ran the handler wrote its row
        "retries_exhausted [per-message]:", "retries_exhausted [batch]:"}
    row = (f"{{ref: UUID('{REF}'), key: 't1:order:o-1', order_id: 'o-1', amount: 12.50}}")
    block, where = difference(report, "table shop.orders: 1 row(s) more than the reference")
    assert where == ["crash_before_commit [per-message]", "crash_before_commit [batch]"]
    assert block.splitlines()[1:] == [f"        extra   {row}"]
    # every failed attempt's row stayed: the retry budget is three attempts
    exhausted = report.split("FAILED   retries_exhausted [per-message]")[1].split("FAILED")[0]
    assert "! table shop.orders: 3 row(s) more than the clean database (no effect)" \
        in exhausted
    assert report.splitlines()[0].split(": ", 1)[1].startswith("5 of 14 scenarios FAILED")


# --- ending the transaction -------------------------------------------------------------


@pytest.mark.parametrize("mode", list(TOPICS))
@pytest.mark.parametrize("name, error", [
    ("session_commit", "session.commit() inside a handler: kafka_idem commits the "
                       "handler's writes together with its idempotency record"),
    ("session_rollback", "session.rollback() inside a handler: kafka_idem commits"),
    ("tx_commit", "Explicit commit() forbidden within a Transaction context"),
])
def test_ending_the_transaction_fails_the_check_naming_the_error(
    harness: Harness, mistake: dict[str, str], mode: str, name: str, error: str
) -> None:
    report = failed(harness, mode, mistake, name)
    lines = report.splitlines()
    assert lines[0].split(": ", 1)[1].startswith(
        "FAILED: the reference delivery failed with a code defect (dead_lettered "
        "(permanent): ProgrammingError); ")
    assert lines[1].startswith("  ! the reference delivery failed: ProgrammingError: a code "
                               f"defect, not retried: {error}"), lines[1]
    assert lines[2] == ("      no scenario can show what the handler does until a delivery "
                        "succeeds: fix the handler (the scenarios below are compared with "
                        "this failure)")
    # nothing of the attempt committed: no row, no event
    path = "per-message" if mode == "local" else "leased"
    assert (f"  reference: delivered once on the {path} path: dead_lettered (permanent); "
            "record failed, attempts 1; 0 row(s) in shop.orders") in lines
    assert "  reference: events: none" in lines
    assert any(line.startswith("  reference: error: ProgrammingError: ") and error in line
               for line in lines)


def test_a_reference_refused_on_purpose_is_said_but_does_not_fail(
    harness: Harness, mistake: dict[str, str]
) -> None:
    # a handler that dead-letters a message by design (Permanent) is no code defect
    mistake["now"] = "rejects"
    report = harness.check(kit_orm.PAYMENTS, ORDER)
    assert report.passed and not report.reference_succeeded and not report.faults
    lines = str(report).splitlines()
    assert lines[0].split(": ", 1)[1].startswith(
        "the reference delivery did not succeed (dead_lettered (permanent)); 4 scenarios "
        "agree with it in ")
    assert "  reference: error: Permanent: no orders for t1" in lines


# --- values an ORM default makes ----------------------------------------------------------


FIX = ("      fix: derive it from the idempotency key and set it yourself, e.g. ref="
       "uuid.uuid5(NAMESPACE, ctx.idempotency_key), instead of the default")


@pytest.mark.parametrize("mode", list(TOPICS))
def test_an_orm_default_sent_in_an_event_fails(harness: Harness, mistake: dict[str, str],
                                               mode: str) -> None:
    report = failed(harness, mode, mistake, "default_ref_in_event")
    lines = report.splitlines()
    verdict = lines[0].split(": ", 1)[1]
    assert verdict.startswith("FAILED: a value made by an SQLAlchemy client-side default "
                              "leaves the transaction; all "), verdict
    assert "scenarios passed in " in verdict  # the scenarios themselves agree
    assert lines[1:4] == [
        "  ! shop.orders.ref is made by SQLAlchemy's client-side default uuid.uuid4 (a new "
        "value in every delivery) and leaves the transaction: in event shop.order-placed "
        "field ref",
        "      a re-run of the message after its record is purged, or a replay, sends a "
        "value nothing downstream has seen",
        FIX]
    # left out of the scenarios' comparison, the reason naming the default
    assert f"    - shop.orders.ref ({MADE})" in lines
    assert f"    - event shop.order-placed field ref ({MADE})" in lines


def test_an_orm_default_in_the_stored_result_fails(harness: Harness,
                                                  mistake: dict[str, str]) -> None:
    report = failed(harness, "local", mistake, "default_ref_in_result")
    lines = report.splitlines()
    assert lines[1] == ("  ! shop.orders.ref is made by SQLAlchemy's client-side default "
                        "uuid.uuid4 (a new value in every delivery) and leaves the "
                        "transaction: in the stored result['ref']")
    assert lines[3] == FIX
    assert f"    - the stored result['ref'] ({MADE})" in lines
    assert not any(" field ref " in line for line in lines)  # the event has no ref


def test_an_orm_default_kept_in_its_column_is_left_out_naming_the_default(
    harness: Harness, mistake: dict[str, str]
) -> None:
    mistake["now"] = "default_ref_in_column"
    report = harness.check(kit_orm.ORDERS, ORDER)
    assert report.passed and not report.faults, str(report)
    assert report.left_out == [SERIAL, f"shop.orders.ref ({MADE})"]


def test_a_random_id_the_handler_makes_itself_is_left_out_as_before(
    harness: Harness, mistake: dict[str, str]
) -> None:
    # no column's value, not the ORM's: left out as a value the handler makes anew
    mistake["now"] = "own_uuid_in_event"
    report = harness.check(kit_orm.ORDERS, ORDER)
    assert report.passed and not report.faults, str(report)
    assert report.left_out == [SERIAL, (
        "event shop.order-placed field event_id (differs between two deliveries of the "
        "reference: a value the handler makes anew, e.g. now(), a random id or a counter "
        "of the process)")]


def test_only_python_callable_defaults_count_as_the_orms() -> None:
    metadata = MetaData()
    Table("things", metadata,
          Column("id", Integer, primary_key=True),
          Column("ref", Uuid, default=uuid.uuid4),
          Column("tag", Text, default=lambda: "x"),
          Column("kind", Text, default="plain"),
          Column("at", Text, default=func.now()),
          Column("sid", Uuid, server_default=func.gen_random_uuid()),
          schema="inv")
    Table("loose", metadata, Column("ref", Uuid, default=uuid.uuid4))
    app = App("orm-defaults")
    assert client_defaults(app) == {}  # no app.sqlalchemy(metadata=...): no models known
    app.sqlalchemy(metadata=metadata)
    found: dict[str, Any] = client_defaults(app)
    assert found == {"inv.things.ref": "uuid.uuid4", "public.loose.ref": "uuid.uuid4",
                     "inv.things.tag": f"{__name__}.test_only_python_callable_defaults_"
                                       "count_as_the_orms.<locals>.<lambda>"}
