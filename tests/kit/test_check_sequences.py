"""Harness.check on a handler that writes rows to two tables with ``bigserial`` ids in
one transaction and emits the second's id: on an empty database both ids are 1, so the
kit tells which column a field carries by delivering the reference once more with
every sequence moved to a range of its own. The report names the column the value
comes from: the right one, and for a handler that sends the wrong table's id, that
table's (what the field was meant to carry, the kit cannot know)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel

from kafka_idem import App, Context
from kafka_idem.testing import Harness
from kafka_idem.testing.reset import CleanState
from tests.conftest import ADMIN_DSN, dsn_for, empty_database


class Signup(BaseModel):
    email: str
    plan: str


app = App("kit-seqs")
app.event_topic("seqs.subscribed", format="json")
MISTAKE = {"now": False}  # send the customer's id as sub_id


@app.migration
def tables(conn: Any) -> None:
    conn.execute("CREATE SCHEMA IF NOT EXISTS seqs")
    conn.execute("CREATE TABLE IF NOT EXISTS seqs.customers (id bigserial PRIMARY KEY,"
                 " email text NOT NULL, at timestamptz NOT NULL DEFAULT now())")
    conn.execute("CREATE TABLE IF NOT EXISTS seqs.subscriptions (id bigserial PRIMARY KEY,"
                 " customer_id bigint NOT NULL REFERENCES seqs.customers,"
                 " plan text NOT NULL, at timestamptz NOT NULL DEFAULT now())")


@app.handler(topic="seqs.signups", model=Signup, key="signup:{email}",
             hash_fields=("plan",))
def signup(msg: Signup, ctx: Context) -> None:
    customer = ctx.tx.execute("INSERT INTO seqs.customers (email) VALUES (%s)"
                              " RETURNING id", (msg.email,)).fetchone()
    assert customer is not None
    sub = ctx.tx.execute("INSERT INTO seqs.subscriptions (customer_id, plan)"
                         " VALUES (%s, %s) RETURNING id, at",
                         (customer[0], msg.plan)).fetchone()
    assert sub is not None
    at: dt.datetime = sub[1]
    ctx.emit("seqs.subscribed", {"sub_id": customer[0] if MISTAKE["now"] else sub[0],
                                 "customer_id": customer[0], "plan": msg.plan,
                                 "at": at.isoformat()})


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    with Harness(app, database_url=ADMIN_DSN) as h:
        yield h


@pytest.fixture
def mistake() -> Iterator[dict[str, bool]]:
    yield MISTAKE
    MISTAKE["now"] = False


SIGNUP = {"email": "a@example.com", "plan": "gold"}
MADE = "a value the database makes"
TABLES = [
    "seqs.customers.id (default nextval('seqs.customers_id_seq'::regclass))",
    "seqs.customers.at (default now())",
    "seqs.subscriptions.id (default nextval('seqs.subscriptions_id_seq'::regclass))",
    "seqs.subscriptions.customer_id (references seqs.customers.id)",
    "seqs.subscriptions.at (default now())"]


def test_a_field_is_said_to_carry_the_column_its_value_comes_from(harness: Harness) -> None:
    report = harness.check("seqs.signups", SIGNUP)
    assert report.passed, str(report)
    # both ids are 1 in the reference: still each field is the right table's; the two
    # now() defaults are one value in one transaction: the field is said to be either;
    # customer_id is subscriptions.customer_id too, which only references customers.id
    assert report.left_out == [
        *TABLES,
        f"event seqs.subscribed field at ({MADE}: seqs.customers.at or "
        "seqs.subscriptions.at)",
        f"event seqs.subscribed field customer_id ({MADE}: seqs.customers.id)",
        f"event seqs.subscribed field sub_id ({MADE}: seqs.subscriptions.id)"]


def test_a_field_carrying_the_wrong_tables_id_is_said_to_carry_that_tables(
        harness: Harness, mistake: dict[str, bool]) -> None:
    mistake["now"] = True
    report = harness.check("seqs.signups", SIGNUP)
    # every delivery sends the same (wrong) value: no scenario differs, but the report
    # names the column the value really comes from, for the reader to see
    assert report.passed, str(report)
    assert (f"event seqs.subscribed field sub_id ({MADE}: seqs.customers.id)"
            in report.left_out)
    assert (f"    - event seqs.subscribed field sub_id ({MADE}: seqs.customers.id)"
            in str(report).splitlines())


def test_every_sequence_is_moved_to_a_range_of_its_own() -> None:
    with empty_database("kit_seqs") as name, psycopg.connect(dsn_for(name),
                                                            autocommit=True) as conn:
        conn.execute("CREATE SEQUENCE a; CREATE SEQUENCE b START 40; SELECT setval('b', 70)"
                     "; CREATE SEQUENCE c AS smallint; CREATE SEQUENCE d INCREMENT -1")
        state = CleanState.capture(conn, set(), store=set())
        state.move_apart(conn)
        drawn = {s: [conn.execute(f"SELECT nextval('{s}')").fetchone()[0] for _ in range(3)]
                 for s in "abcd"}
        # counting up: above the highest clean position (b's 70), a step apart that
        # fits the smallint's maximum ((32767 - 70) // 4 = 8174); counting down: a
        # million below the lowest (-1)
        assert drawn == {"a": [8245, 8246, 8247], "b": [16419, 16420, 16421],
                         "c": [24593, 24594, 24595], "d": [-1000002, -1000003, -1000004]}
