"""The claim and the failure record written once as plans (:mod:`kafka_idem.store.plans`,
:mod:`kafka_idem.store.claim_plan`): on a sync and on an async connection they send the
same statements in the same order, read the same rows and decide the same, for every
case of the claim's table (docs/PROTOCOL.md). No PostgreSQL: a scripted connection
answers each statement with the next row of its script."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import uuid
from typing import Any

import pytest

from kafka_idem.errors import StaleOwner, TransientStoreError
from kafka_idem.store import Claim, Delivery, Failure, Outcome, Store
from tests.unit.scripted import AsyncConn, Script, Sent, SyncConn

STORE = Store(schema="kafka_idem", table="task_idempotency", namespace="ns")
KEY = "t1:charge:o1"
HASH = "v1:sha256:abc"
DELIVERY = Delivery("payments", 0, 7, "charge")
NOW = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)
MINE = uuid.uuid4()


def record(**changes: Any) -> dict[str, Any]:
    rec = {"idempotency_key": KEY, "status": "processing", "request_hash": HASH,
           "attempts": 1, "attempt_base": 0, "result_json": None, "owner_token": uuid.uuid4(),
           "lease_until": NOW - dt.timedelta(seconds=1), "db_now": NOW,
           "next_attempt_at": None, "first_failure_at": None, "last_failure_at": None,
           "error_kind": None, "error_class": None, "error_message": None}
    return {**rec, **changes}


FAILED_AT = (NOW, NOW + dt.timedelta(seconds=1))
RETRY_DUE = {"status": "retryable_failed", "first_failure_at": NOW - dt.timedelta(seconds=5),
             "error_kind": "retryable", "error_class": "Boom", "error_message": "boom"}
# case -> (rows the statements get, the claim's keyword arguments)
CASES: dict[str, tuple[list[Any], dict[str, Any]]] = {
    "new": ([(1,)], {}),
    "purged_then_new": ([None, None, (1,)], {}),
    "conflict": ([None, record(request_hash="v1:sha256:other")], {}),
    "replay": ([None, record(status="succeeded", result_json={"ok": True})], {}),
    "dead_again": ([None, record(status="failed", error_kind="permanent"), FAILED_AT], {}),
    "busy_lease": ([None, record(lease_until=NOW + dt.timedelta(seconds=9))], {}),
    "busy_backoff": ([None, record(**RETRY_DUE, next_attempt_at=NOW + dt.timedelta(seconds=3))],
                     {}),
    "retry": ([None, record(**RETRY_DUE), (2,)], {}),
    "takeover": ([None, record(), (2,)], {}),
    "withdrawn": ([None, record(next_attempt_at=NOW - dt.timedelta(seconds=1)), (2,)], {}),
    "reentrant": ([None, record(owner_token=MINE, lease_until=NOW + dt.timedelta(seconds=9)),
                   (1,)], {"reentrant_token": MINE}),
    "exhausted": ([None, record(**RETRY_DUE, attempts=3), FAILED_AT], {}),
    "elapsed_out": ([None, record(**RETRY_DUE), FAILED_AT], {"max_elapsed_seconds": 1.0}),
    "last_chance": ([None, record(attempts=3), (3,)], {"reconcile_first": True}),
    "lease_expired_exhausted": ([None, record(attempts=3), FAILED_AT], {}),
}


def claim_args(**changes: Any) -> dict[str, Any]:
    return {"key": KEY, "request_hash": HASH, "delivery": DELIVERY, "lease_seconds": 30.0,
            "max_attempts": 3, "max_elapsed_seconds": 3600.0, **changes}


def both_claims(rows: list[Any], **changes: Any) -> tuple[tuple[Claim, list[Sent]], ...]:
    sync, aio = Script(STORE, rows), Script(STORE, rows)
    got_sync = STORE.claim(SyncConn(sync), **claim_args(**changes))  # type: ignore[arg-type]
    got_async = asyncio.run(STORE.claim_async(AsyncConn(aio),  # type: ignore[arg-type]
                                              **claim_args(**changes)))
    assert not sync.rows and not aio.rows  # every scripted row read
    return (got_sync, sync.sent), (got_async, aio.sent)


def without_token(claim: Claim, sent: list[Sent]) -> tuple[Claim, list[Sent]]:
    """The claim and the statements, less the fresh owner token each claim makes."""
    token = sent[0][1]["token"]
    assert claim.token in (None, token)
    if claim.token is not None:
        claim = dataclasses.replace(claim, token=None)
    return claim, [(name, {k: v for k, v in params.items() if k != "token"}, dicts)
                   for name, params, dicts in sent]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_sync_and_the_async_claim_send_the_same_statements_and_decide_the_same(
    case: str,
) -> None:
    rows, changes = CASES[case]
    (sync, sync_sent), (aio, aio_sent) = both_claims(rows, **changes)
    assert without_token(sync, sync_sent) == without_token(aio, aio_sent)


EXPECTED = {  # case -> (outcome, the statements after claim_insert)
    "new": (Outcome.CLAIMED, []),
    "purged_then_new": (Outcome.CLAIMED, ["claim_lock", "claim_insert"]),
    "conflict": (Outcome.CONFLICT, ["claim_lock"]),
    "replay": (Outcome.REPLAY, ["claim_lock"]),
    "dead_again": (Outcome.DEAD, ["claim_lock", "dead_again"]),
    "busy_lease": (Outcome.BUSY, ["claim_lock"]),
    "busy_backoff": (Outcome.BUSY, ["claim_lock"]),
    "retry": (Outcome.CLAIMED, ["claim_lock", "claim_take"]),
    "takeover": (Outcome.CLAIMED, ["claim_lock", "claim_take"]),
    "withdrawn": (Outcome.CLAIMED, ["claim_lock", "claim_take"]),
    "reentrant": (Outcome.CLAIMED, ["claim_lock", "claim_take"]),
    "exhausted": (Outcome.EXHAUSTED, ["claim_lock", "exhaust"]),
    "elapsed_out": (Outcome.EXHAUSTED, ["claim_lock", "exhaust"]),
    "last_chance": (Outcome.CLAIMED, ["claim_lock", "claim_take"]),
    "lease_expired_exhausted": (Outcome.EXHAUSTED, ["claim_lock", "exhaust"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_case_of_the_claim_sends_what_the_protocol_says(case: str) -> None:
    rows, changes = CASES[case]
    (claim, sent), _ = both_claims(rows, **changes)
    outcome, then = EXPECTED[case]
    assert claim.outcome is outcome
    assert [name for name, _, _ in sent] == ["claim_insert", *then]
    assert [dicts for _, _, dicts in sent] == [name == "claim_lock" for name, _, _ in sent]
    if claim.outcome is Outcome.CLAIMED:
        assert claim.token == sent[0][1]["token"]


def test_the_decisions_carry_what_the_record_says() -> None:
    (takeover, sent), _ = both_claims(CASES["takeover"][0])
    assert takeover.took_over and takeover.charged and takeover.attempts == 2
    assert takeover.previous_error_kind == "lease_expired"
    assert sent[-1][1]["charge"] == 1
    (withdrawn, _), _ = both_claims(CASES["withdrawn"][0])
    assert not withdrawn.took_over and withdrawn.charged
    (reentrant, sent), _ = both_claims(CASES["reentrant"][0], reentrant_token=MINE)
    assert not reentrant.charged and sent[-1][1]["charge"] == 0
    (last, sent), _ = both_claims(CASES["last_chance"][0], reconcile_first=True)
    assert last.last_chance and not last.charged and sent[-1][1]["charge"] == 0
    (exhausted, sent), _ = both_claims(CASES["lease_expired_exhausted"][0])
    assert exhausted.error_class == "LeaseExpired" and exhausted.error_kind == "exhausted"
    assert sent[-1][1]["error_class"] == "LeaseExpired"
    assert (exhausted.first_failure_at, exhausted.last_failure_at) == FAILED_AT
    (dead, _), _ = both_claims(CASES["dead_again"][0])
    assert (dead.first_failure_at, dead.last_failure_at) == FAILED_AT
    (busy, _), _ = both_claims(CASES["busy_backoff"][0])
    assert busy.backoff and busy.retry_in == 3.0


def test_a_claim_that_races_a_purge_twice_is_transient_on_both_drivers() -> None:
    with pytest.raises(TransientStoreError):
        STORE.claim(SyncConn(Script(STORE, [None, None, None])),  # type: ignore[arg-type]
                    **claim_args())
    with pytest.raises(TransientStoreError):
        asyncio.run(STORE.claim_async(AsyncConn(Script(STORE, [None, None, None])),  # type: ignore[arg-type]
                                      **claim_args()))


FAIL = {"key": KEY, "token": MINE, "status": "retryable_failed", "kind": "retryable",
        "error_class": "Boom", "error_message": "nul\x00inside", "delay": 2.5}


def test_the_sync_and_the_async_failure_record_send_the_same_statement() -> None:
    row = (2, NOW + dt.timedelta(seconds=2.5), NOW, NOW)
    sync, aio = Script(STORE, [row]), Script(STORE, [row])
    got = STORE.fail(SyncConn(sync), **FAIL)  # type: ignore[arg-type]
    got_async = asyncio.run(STORE.fail_async(AsyncConn(aio), **FAIL))  # type: ignore[arg-type]
    assert got == got_async == Failure(2, row[1], NOW, NOW)
    assert sync.sent == aio.sent
    [(name, params, dicts)] = sync.sent
    assert (name, dicts) == ("fail", False)
    assert params["error_message"] == "nul\\x00inside"  # storable, as before


def test_a_failure_record_whose_token_lost_the_key_is_a_stale_owner_on_both_drivers() -> None:
    with pytest.raises(StaleOwner):
        STORE.fail(SyncConn(Script(STORE, [None])), **FAIL)  # type: ignore[arg-type]
    with pytest.raises(StaleOwner):
        asyncio.run(STORE.fail_async(AsyncConn(Script(STORE, [None])), **FAIL))  # type: ignore[arg-type]


def test_the_batch_paths_dead_again_is_the_claims() -> None:
    rec = record(status="failed", error_kind="permanent", error_class="Boom")
    script = Script(STORE, [FAILED_AT])
    dead = STORE.dead(SyncConn(script), rec, DELIVERY)  # type: ignore[arg-type]
    assert dead.outcome is Outcome.DEAD and dead.error_class == "Boom"
    assert (dead.first_failure_at, dead.last_failure_at) == FAILED_AT
    assert script.sent == [("dead_again", {"ns": "ns", "key": KEY, "shard": None,
                                           "topic": "payments", "partition": 0, "offset": 7},
                            False)]


def test_new_tokens_are_distinct_version_4_uuids() -> None:
    """The batch path's owner tokens, made in one read of the system's randomness, are
    what ``uuid.uuid4()`` makes: version 4, the RFC 4122 variant, none alike."""
    from kafka_idem.store.types import new_tokens

    tokens = new_tokens(2_000)
    assert len(tokens) == len(set(tokens)) == 2_000
    assert {len(t) for t in tokens} == {16}
    uuids = [uuid.UUID(bytes=t) for t in tokens]
    assert {(u.version, u.variant) for u in uuids} == {(4, uuid.RFC_4122)}
    # every bit but the version's four and the variant's two is random
    assert all(any(u.int >> bit & 1 for u in uuids) and not all(u.int >> bit & 1 for u in uuids)
               for bit in range(128) if bit not in {76, 77, 78, 79, 62, 63})
    assert new_tokens(0) == []
