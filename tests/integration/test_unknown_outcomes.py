"""Seed scenario 5: a crash after the business write, before the success state.

Local effects roll back with the transaction; a remote effect (a charge at the
payment gateway of ``consumers/gateway.py``) can't, so an unanswered request is an
*unknown outcome*: the next attempt asks the gateway by idempotency key first
(reconcile), and only retries the request, with the same key, if it was never applied.
Checks read the gateway's own state (charges, requests received), the local rows,
the idempotency records and the committed offsets."""

from __future__ import annotations

import random
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from consumers import gateway as gateway_example
from consumers.gateway import Gateway
from consumers.payments import encode_charge
from kafka_idem import RetryPolicy
from tests.conftest import (
    DB,
    InProcess,
    Members,
    Topics,
    app_settings,
    caught_up,
    committed,
    headers,
    member_env,
    produce,
    read_topic,
    wait_for,
)
from tests.integration.support import claims, migrate_app, record_history, seeded

# Each test runs on one PostgreSQL and on Citus (the store distributed; the gateway
# example's table co-located with the records by its migration).
pytestmark = pytest.mark.both_stores

VARIANTS = "tests.apps.variants:app"
GATEWAY_APP = "consumers.gateway:app"
KEY = "t1:charge:o1"


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    with Gateway() as gw:
        yield gw


def local_rows(db: DB) -> list[dict[str, Any]]:
    return db.rows("SELECT * FROM payments.gateway_charges ORDER BY id")


def charge_path(key: str) -> str:
    return "/charges/" + key.replace(":", "%3A")


def gateway_app(db: DB, topic: str, group: str, gw: Gateway, *, first_delay: float = 0.0,
                max_attempts: int = 5, use_async: bool = False, **settings: Any) -> Any:
    """The example app on ``topic``; the first retry waits ``first_delay`` s or more
    (a seeded draw), long enough to look at the state between the attempts."""
    bound = max(first_delay * 1.25, 0.1)
    seed = seeded(bound, at_least=first_delay)
    policy = RetryPolicy(base=bound, cap=bound, max_attempts=max_attempts,
                         rng=random.Random(seed))
    app = gateway_example.build_app(topic=topic, gateway_url=gw.url, timeout=1.0, retry=policy,
                                    use_async=use_async,
                                    **app_settings(db, group_id=group, **settings))
    migrate_app(db, app)
    return app


# --- local effects -------------------------------------------------------------------------


def _processing(db: DB, key: str) -> dict[str, Any] | None:
    rec = db.record(key)
    return rec if rec and rec["status"] == "processing" else None


@pytest.mark.parametrize("mode", ["local", "leased"])
def test_kill_after_the_business_write_leaves_nothing_and_the_retry_has_one_effect(
    db: DB, topics: Topics, members: Members, group: str, mode: str
) -> None:
    topic = topics(partitions=1)
    orders = [f"o{i}" for i in range(1, 6)]
    produce(topic, [(o.encode(), encode_charge("t1", o, "2.00")) for o in orders])
    env = member_env(db, topic, PAYMENTS_MODE=mode, KAFKA_IDEM_LEASE_SECONDS="1.5")
    killed = members.start(VARIANTS, {**env, "KILL_AFTER_WRITE_ORDERS": "o3"}, group=group)
    assert killed.wait(timeout=60) == -signal.SIGKILL

    # The write made by the killed attempt did not survive, nor did its success.
    key = "t1:charge:o3"
    assert key not in db.ledger_counts()
    rec = db.record(key)
    if mode == "local":
        assert rec is None  # claim, write and completion were one transaction
    else:
        assert rec is not None and rec["status"] == "processing" and rec["attempts"] == 1
    assert all(n == 1 for n in db.ledger_counts().values())
    assert committed(group, topic)[0] <= 2

    # In leased mode the replacement keeps the kill switch: it only fires on attempt 1.
    replacement_env = env if mode == "leased" else member_env(db, topic, PAYMENTS_MODE=mode)
    members.start(VARIANTS, replacement_env, group=group)
    wait_for(lambda: caught_up(group, topic), timeout=90, what="the replacement to catch up")
    assert db.ledger_counts() == {f"t1:charge:{o}": 1 for o in orders}
    final = db.record(key)
    assert final is not None and final["status"] == "succeeded"
    if mode == "leased":
        assert final["attempts"] == 2  # the killed attempt was charged
        assert final["completed_token"] != rec["owner_token"]  # type: ignore[index]
    else:
        assert final["attempts"] == 1  # nothing of the killed attempt was recorded


# --- remote effects: the payment gateway ---------------------------------------------------


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fault", ["drop_after_apply", "reset_after_apply", "delay_after_apply"])
def test_applied_but_unanswered_charge_is_reconciled_not_repeated(
    db: DB, topics: Topics, group: str, gateway: Gateway, fault: str, use_async: bool
) -> None:
    """Both clients of the example (``async def``: asyncio streams and a timeout)."""
    topic = topics(partitions=1)
    gateway.faults(**{fault: 1}, delay_seconds=3.0)  # delay: past the client's 1 s timeout
    produce(topic, [(b"o1", encode_charge("t1", "o1", "12.50"))])
    app = gateway_app(db, topic, group, gateway, first_delay=1.5, use_async=use_async)
    with InProcess(app):
        rec = wait_for(lambda: (r := db.record(KEY)) and r["status"] == "retryable_failed" and r,
                       what="the unknown outcome to be recorded")
        assert rec["error_kind"] == "unknown_outcome"
        assert rec["error_class"] == "UnknownOutcome"
        assert rec["attempts"] == 1
        assert len(gateway.charges()) == 1  # the gateway did apply it ...
        assert local_rows(db) == []  # ... but nothing local committed for it
        wait_for(lambda: caught_up(group, topic), what="the message to be reconciled")

    (charge,) = gateway.charges()
    rec = db.record(KEY)
    assert rec is not None and rec["status"] == "succeeded"
    assert rec["attempts"] == 2
    assert rec["result_json"] == {"charge_id": charge["id"]}
    rows = local_rows(db)
    assert [(r["idempotency_key"], r["charge_id"]) for r in rows] == [(KEY, charge["id"])]
    assert len(gateway.requests("POST", key=KEY)) == 1  # the charge was not sent again
    assert len(gateway.requests("GET", path=charge_path(KEY))) == 1  # reconcile asked once
    assert read_topic(f"{topic}.dlq") == []


def test_unanswered_charge_never_applied_is_retried_with_the_same_key(
    db: DB, topics: Topics, group: str, gateway: Gateway
) -> None:
    topic = topics(partitions=1)
    gateway.faults(drop_before_apply=1)
    produce(topic, [(b"o1", encode_charge("t1", "o1", "8.00"))])
    with InProcess(gateway_app(db, topic, group, gateway, first_delay=0.2)):
        wait_for(lambda: caught_up(group, topic), what="the charge to go through")

    (charge,) = gateway.charges()
    posts = gateway.requests("POST")
    assert [p["idempotency_key"] for p in posts] == [KEY, KEY]  # retried, same key
    assert len(gateway.requests("GET", path=charge_path(KEY))) == 1  # asked first: not found
    rec = db.record(KEY)
    assert rec is not None and rec["status"] == "succeeded" and rec["attempts"] == 2
    assert rec["result_json"] == {"charge_id": charge["id"]}
    assert [r["charge_id"] for r in local_rows(db)] == [charge["id"]]


def test_gateway_5xx_is_retried_and_4xx_is_dead_lettered(
    db: DB, topics: Topics, group: str, gateway: Gateway
) -> None:
    topic = topics(partitions=1)
    gateway.faults(fail_before_apply=2)
    produce(topic, [(b"o1", encode_charge("t1", "o1", "5.00")),
                    (b"o2", encode_charge("t1", "o2", "0"))])  # the gateway answers 422
    with InProcess(gateway_app(db, topic, group, gateway, first_delay=0.0)):
        wait_for(lambda: caught_up(group, topic), what="both messages to be decided")

    (charge,) = gateway.charges()
    assert charge["idempotency_key"] == KEY
    assert len(gateway.requests("POST", key=KEY)) == 3  # 503, 503, 201
    assert gateway.requests("GET") == []  # a 5xx is known not applied: nothing to reconcile
    rec = db.record(KEY)
    assert rec is not None and (rec["status"], rec["attempts"]) == ("succeeded", 3)
    rejected = db.record("t1:charge:o2")
    assert rejected is not None
    assert (rejected["status"], rejected["error_kind"], rejected["attempts"]) == (
        "failed", "permanent", 1)
    (letter,) = read_topic(f"{topic}.dlq")
    assert headers(letter)["idem.error.kind"] == "permanent"
    assert [r["idempotency_key"] for r in local_rows(db)] == [KEY]
    assert committed(group, topic) == {0: 2}


@pytest.mark.parametrize("max_attempts", [5, 1], ids=["retries-left", "last-attempt"])
def test_member_killed_while_its_charge_is_in_flight_is_reconciled_by_the_new_owner(
    db: DB, topics: Topics, members: Members, group: str, gateway: Gateway, max_attempts: int
) -> None:
    """With attempts left, or on the last one: the member died mid-call, so the charge
    may have happened, and the new owner must ask before retrying or giving up."""
    topic = topics(partitions=1)
    record_history(db)
    migrate_app(db, gateway_example.build_app(topic=topic))
    gateway.faults(hold_after_apply=1)  # applied, the answer held until released
    produce(topic, [(b"o1", encode_charge("t1", "o1", "30.00"))])
    env = member_env(db, topic, GATEWAY_URL=gateway.url, GATEWAY_TIMEOUT_SECONDS="60",
                     KAFKA_IDEM_LEASE_SECONDS="1.5", KAFKA_IDEM_MAX_ATTEMPTS=str(max_attempts))
    first = members.start(GATEWAY_APP, env, group=group)
    wait_for(lambda: gateway.held == 1, what="the charge to be applied, its answer in flight")
    owner = db.record(KEY)
    assert owner is not None and owner["status"] == "processing" and owner["attempts"] == 1
    first.send_signal(signal.SIGKILL)
    assert first.wait(timeout=10) == -signal.SIGKILL

    members.start(GATEWAY_APP, env, group=group)
    wait_for(lambda: caught_up(group, topic), timeout=90, what="the new owner to decide")
    (charge,) = gateway.charges()
    rec = db.record(KEY)
    assert rec is not None
    assert rec["status"] == "succeeded", (rec["status"], rec["error_kind"], rec["error_message"])
    assert rec["completed_token"] != owner["owner_token"]
    assert rec["result_json"] == {"charge_id": charge["id"]}
    if max_attempts > 1:
        assert rec["attempts"] == 2
        assert [c["attempts"] for c in claims(db, KEY)] == [1, 2]
    assert len(gateway.requests("POST", key=KEY)) == 1  # the new owner did not charge again
    assert len(gateway.requests("GET", path=charge_path(KEY))) == 1
    assert [r["charge_id"] for r in local_rows(db)] == [charge["id"]]
    assert read_topic(f"{topic}.dlq") == []


def test_unknown_outcome_on_the_last_attempt_is_reconciled_before_giving_up(
    db: DB, topics: Topics, group: str, gateway: Gateway
) -> None:
    """The retry limit must not turn a charge that went through into a dead letter:
    with the limit reached on an unknown outcome, the framework still asks the
    reconciler before recording the key as failed."""
    topic = topics(partitions=1)
    gateway.faults(fail_before_apply=1, drop_after_apply=1)  # attempt 1: 503; 2: unanswered
    produce(topic, [(b"o1", encode_charge("t1", "o1", "9.00"))])
    with InProcess(gateway_app(db, topic, group, gateway, max_attempts=2)):
        wait_for(lambda: caught_up(group, topic), what="the message to be decided")

    (charge,) = gateway.charges()
    assert len(gateway.requests("POST", key=KEY)) == 2
    rec = db.record(KEY)
    assert rec is not None
    assert (rec["status"], rec["attempts"]) == ("succeeded", 2), (
        rec["status"], rec["error_kind"], rec["error_message"])
    assert rec["result_json"] == {"charge_id": charge["id"]}
    assert [r["charge_id"] for r in local_rows(db)] == [charge["id"]]
    assert read_topic(f"{topic}.dlq") == []


def test_last_attempt_reconcile_that_finds_nothing_exhausts_without_charging_again(
    db: DB, topics: Topics, group: str, gateway: Gateway
) -> None:
    """The other side of the rule above: when the gateway says the charge never
    happened, the key is exhausted (once, into the DLQ), and not charged a third time."""
    topic = topics(partitions=1)
    gateway.faults(fail_before_apply=1, drop_before_apply=1)  # 503, then unanswered, not applied
    produce(topic, [(b"o1", encode_charge("t1", "o1", "9.00"))])
    with InProcess(gateway_app(db, topic, group, gateway, max_attempts=2)):
        wait_for(lambda: caught_up(group, topic), what="the message to be decided")

    assert gateway.charges() == []
    assert len(gateway.requests("POST", key=KEY)) == 2
    rec = db.record(KEY)
    assert rec is not None
    assert (rec["status"], rec["error_kind"], rec["attempts"]) == ("failed", "exhausted", 2)
    (letter,) = read_topic(f"{topic}.dlq")
    assert headers(letter)["idem.error.kind"] == "exhausted"
    assert headers(letter)["idem.key"] == KEY
    assert local_rows(db) == []
