"""Harness.check on a correct handler whose first attempt fails (``Retryable``: the
remote side was busy) and whose second succeeds: every scenario passes. The crash is
injected after the first attempt that returns (the retry), and the batch scenario,
which the batch path cannot run (a handler that raises makes it leave the batch to the
per-message path, where the retry runs), is skipped saying why, not failed.

The same handler failing on the batch path only (every call there raises, none on the
per-message path) is still a failure of the batch scenario."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from kafka_idem import App, Context, Retryable
from kafka_idem.testing import Harness
from tests.conftest import ADMIN_DSN

TOPIC = "loyalty.redeem"
FLAKY = {"mode": "first_attempt"}  # or "in_pipeline": only where statements are pipelined


class Redeem(BaseModel):
    member_id: str
    redemption_id: str
    cost: int


app = App("loyalty")


@app.migration
def tables(conn: Any) -> None:
    conn.execute("CREATE SCHEMA IF NOT EXISTS loyalty")
    conn.execute("CREATE TABLE IF NOT EXISTS loyalty.redemptions (key text PRIMARY KEY, "
                 "member_id text NOT NULL, cost integer NOT NULL)")


@app.handler(topic=TOPIC, model=Redeem, key="{member_id}:redeem:{redemption_id}",
             hash_fields=("cost",))
def redeem(msg: Redeem, ctx: Context) -> dict[str, Any]:
    if FLAKY["mode"] == "first_attempt" and ctx.attempt == 1:
        raise Retryable("the rewards service is busy")
    if FLAKY["mode"] == "in_pipeline" and ctx.tx.pgconn.pipeline_status:
        raise Retryable("a mistake that shows on the batch path only")
    ctx.tx.execute("INSERT INTO loyalty.redemptions (key, member_id, cost) VALUES (%s, %s, %s)",
                   (ctx.idempotency_key, msg.member_id, msg.cost))
    return {"redeemed": msg.redemption_id}


EARN = "loyalty.earn"


@app.handler(topic=EARN, model=Redeem, key="{member_id}:earn:{redemption_id}",
             hash_fields=("cost",))
def earn(msg: Redeem, ctx: Context) -> dict[str, Any]:
    if ctx.attempt == 1:
        raise Retryable("the points service is busy")
    ctx.tx.execute("INSERT INTO loyalty.redemptions (key, member_id, cost) VALUES (%s, %s, %s)",
                   (ctx.idempotency_key, msg.member_id, -msg.cost))
    return {"earned": msg.redemption_id}


@earn.bulk_handler
def earn_many(batch: list[tuple[Redeem, Context]], tx: Any) -> list[Any]:
    """The bulk form fails an item transiently on its first attempt too (it returns the
    exception, as a bulk handler reports one item's failure)."""
    out: list[Any] = []
    for msg, ctx in batch:
        if ctx.attempt == 1:
            out.append(Retryable("the points service is busy"))
            continue
        tx.execute("INSERT INTO loyalty.redemptions (key, member_id, cost) VALUES (%s, %s, %s)",
                   (ctx.idempotency_key, msg.member_id, -msg.cost))
        out.append({"earned": msg.redemption_id})
    return out


TOUR = "loyalty.tour"


@app.handler(topic=TOUR, model=Redeem, key="{member_id}:tour:{redemption_id}",
             hash_fields=("cost",), mode="leased")
def tour(msg: Redeem, ctx: Context) -> dict[str, Any]:
    """Leased: the guide desk is busy at the first attempt of every key."""
    if ctx.attempt == 1:
        raise Retryable("the guide desk is busy")
    ctx.tx.execute("INSERT INTO loyalty.redemptions (key, member_id, cost) VALUES (%s, %s, %s)",
                   (ctx.idempotency_key, msg.member_id, msg.cost))
    return {"toured": msg.redemption_id, "attempt": ctx.attempt}


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    with Harness(app, database_url=ADMIN_DSN) as h:
        yield h


@pytest.fixture
def flaky() -> Iterator[dict[str, str]]:
    yield FLAKY
    FLAKY["mode"] = "first_attempt"


def test_a_handler_whose_first_attempt_is_retried_passes_every_scenario(
        harness: Harness) -> None:
    report = harness.check(TOPIC, {"member_id": "m-1", "redemption_id": "r-1", "cost": 300})
    assert report.passed, str(report)
    for path in ("per-message", "batch"):
        crash = report.result("crash_before_commit", path)
        assert not crash.skipped and not crash.problems, crash.story
        assert any(line == "a try before the crash: retry"
                   for line in crash.story), crash.story
    batch = report.result("batch", "batch")
    assert batch.skipped is not None and batch.skipped.startswith(
        "the handler raised on its first attempt (Retryable('the rewards service is busy')), "
        "as it did on the per-message path"), batch.skipped


def test_a_handler_that_fails_on_the_batch_path_only_fails_the_batch_scenario(
        harness: Harness, flaky: dict[str, str]) -> None:
    flaky["mode"] = "in_pipeline"
    with pytest.raises(AssertionError) as caught:
        harness.check(TOPIC, {"member_id": "m-2", "redemption_id": "r-2", "cost": 100},
                      scenarios=["batch"])
    assert ("the batch path left this batch to the per-message path (handler raised "
            "Retryable) though on the per-message path that message's handler call returned"
            ) in str(caught.value)


def test_a_bulk_form_that_fails_an_item_transiently_on_its_first_attempt_passes(
        harness: Harness) -> None:
    report = harness.check(EARN, {"member_id": "m-3", "redemption_id": "e-3", "cost": 50})
    assert report.passed, str(report)
    batch = report.result("batch", "batch")
    assert batch.skipped is not None and batch.skipped.startswith(
        "the handler raised on its first attempt (Retryable('the points service is busy'))"
    ), batch.skipped


def test_a_leased_handler_whose_first_attempt_is_retried_passes_the_lease_takeover(
        harness: Harness) -> None:
    """The lease expires while the first attempt that returns runs (the retry): the
    second owner takes the key over, and the first owner's completion is refused."""
    report = harness.check(TOUR, {"member_id": "m-4", "redemption_id": "t-4", "cost": 20},
                           scenarios=["lease_takeover", "crash_before_commit"])
    assert report.passed, str(report)
    takeover = report.result("lease_takeover", "leased")
    assert not takeover.skipped and not takeover.problems, takeover.story
    assert takeover.story[0] == "a try before the lease expired: retry", takeover.story
    assert any(line.startswith("the first owner's handler ran; then its lease expired")
               for line in takeover.story), takeover.story
