"""The claim's decisions (:class:`~kafka_idem.store.Store`'s ``claim``, the module doc
of :mod:`~kafka_idem.store.protocol` and docs/PROTOCOL.md, "The claim"), written once as
a plan (:mod:`~kafka_idem.store.plans`): ``Store.claim`` runs it on a sync connection,
``Store.claim_async`` on the event loop's, both in the caller's transaction.

Its statements, in order: ``claim_insert``; when no row came back, ``claim_lock``
(the record, locked); when that found none (purged meanwhile), ``claim_insert``
again; else at most one of ``dead_again`` (2c), ``exhaust`` (2e) or ``claim_take``
(2f), as the locked record decides (2a, 2b and 2d send nothing more).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping
from typing import Any

from psycopg import sql

from kafka_idem.errors import TransientStoreError
from kafka_idem.store.plans import Plan, Statement
from kafka_idem.store.types import Claim, Outcome

Queries = Mapping[str, sql.SQL]
ERROR_FIELDS = ("error_kind", "error_class", "error_message", "first_failure_at",
                "last_failure_at")


def claim_plan(
    q: Queries, params: dict[str, Any], *, max_attempts: int, max_elapsed_seconds: float,
    reentrant_token: uuid.UUID | None, reconcile_first: bool,
) -> Plan[Claim]:
    """The whole claim of ``params["key"]`` (``params``: :meth:`Store._claim_params`)."""
    key: str = params["key"]
    row = yield Statement(q["claim_insert"], params)
    if row is not None:
        return _claimed(key, params, row)
    rec = yield Statement(q["claim_lock"], {"ns": params["ns"], "key": key,
                                               "shard": params["shard"]}, dicts=True)
    if rec is None:
        # Purged between our insert and our lock: a new key again.
        row = yield Statement(q["claim_insert"], params)
        if row is None:
            raise TransientStoreError("claim raced with a purge", key=key)
        return _claimed(key, params, row)
    return (yield from _decide(q, rec, params, max_attempts, max_elapsed_seconds,
                               reentrant_token, reconcile_first))


def _claimed(key: str, params: dict[str, Any], row: Any) -> Claim:
    return Claim(Outcome.CLAIMED, key, token=params["token"], attempts=int(row[0]))


def _decide(
    q: Queries,
    rec: dict[str, Any],
    params: dict[str, Any],
    max_attempts: int,
    max_elapsed_seconds: float,
    reentrant_token: uuid.UUID | None,
    reconcile_first: bool,
) -> Plan[Claim]:
    """The claim's decision on an existing, locked record (the module doc's 2a-f)."""
    key: str = params["key"]
    status: str = rec["status"]
    errors = {name: rec[name] for name in ERROR_FIELDS}
    if rec["request_hash"] != params["hash"]:
        return Claim(Outcome.CONFLICT, key, attempts=rec["attempts"], **errors)
    if status == "succeeded":
        return Claim(Outcome.REPLAY, key, attempts=rec["attempts"], result=rec["result_json"])
    if status == "failed":
        return (yield from dead_again(q, rec, params, errors))
    reentrant = reentrant_token is not None and rec["owner_token"] == reentrant_token
    busy = _busy(rec, key, reentrant)
    if busy is not None:
        return busy
    return (yield from _take(q, rec, params, errors, reentrant=reentrant,
                             max_attempts=max_attempts,
                             max_elapsed_seconds=max_elapsed_seconds,
                             reconcile_first=reconcile_first))


def dead_again(q: Queries, rec: dict[str, Any], params: dict[str, Any],
               errors: dict[str, Any]) -> Plan[Claim]:
    """A locked ``failed`` record met again: dead-lettered again, its failure time and
    last delivery moved (2c; also the batch path's, :meth:`Store.dead`)."""
    again = yield Statement(q["dead_again"], params)
    if again is not None:  # the dead letter about to be sent says "now"
        errors["first_failure_at"], errors["last_failure_at"] = again
    return Claim(Outcome.DEAD, params["key"], attempts=rec["attempts"], **errors)


def _take(
    q: Queries,
    rec: dict[str, Any],
    params: dict[str, Any],
    errors: dict[str, Any],
    *,
    reentrant: bool,
    max_attempts: int,
    max_elapsed_seconds: float,
    reconcile_first: bool,
) -> Plan[Claim]:
    """Take the record over (2f), or exhaust it when its budget is used up (2e)."""
    key: str = params["key"]
    # A processing record not ours: its owner's lease ran out, perhaps mid-call;
    # unless the owner withdrew its claim before calling (withdraw_claim's mark).
    withdrawn = rec["status"] == "processing" and rec["next_attempt_at"] is not None
    took_over = rec["status"] == "processing" and not reentrant and not withdrawn
    first = rec["first_failure_at"]
    failing_for = (rec["db_now"] - first).total_seconds() if first is not None else 0.0
    elapsed_out = first is not None and failing_for >= max_elapsed_seconds
    used = rec["attempts"] - rec["attempt_base"]  # since the last audited re-run
    last_chance = False
    if not reentrant and (used >= max_attempts or elapsed_out):
        # The limit is reached; but if the last attempt's outcome is unknown (it
        # died mid-flight, or said so), the effect may have happened: a handler
        # with a reconciler asks first, and only then is the key exhausted.
        unknown = took_over or rec["error_kind"] == "unknown_outcome"
        if not (reconcile_first and unknown):
            return (yield from _exhaust(q, rec, params, took_over))
        last_chance = True
    charge = 0 if reentrant or last_chance else 1
    row = yield Statement(q["claim_take"], {**params, "charge": charge})
    assert row is not None  # we hold the row lock
    previous = "lease_expired" if took_over else rec["error_kind"]
    return Claim(
        Outcome.CLAIMED,
        key,
        token=params["token"],
        attempts=int(row[0]),
        budget_used=int(row[0]) - rec["attempt_base"],
        took_over=took_over,
        failing_for=failing_for,
        last_chance=last_chance,
        charged=charge == 1,
        previous_error_kind=previous,
        **{k: v for k, v in errors.items() if k != "error_kind"},
    )


def _exhaust(q: Queries, rec: dict[str, Any], params: dict[str, Any],
             took_over: bool) -> Plan[Claim]:
    key: str = params["key"]
    kind = "exhausted"
    message = rec["error_message"] or (
        "lease expired on the last attempt (its owner died, stalled, or abandoned it "
        "at a stop or a revoke)" if took_over else None
    )
    error_class = rec["error_class"] or ("LeaseExpired" if took_over else None)
    row = yield Statement(
        q["exhaust"],
        {"ns": params["ns"], "key": key, "shard": params["shard"], "error_class": error_class,
         "error_message": message},
    )
    assert row is not None
    return Claim(
        Outcome.EXHAUSTED,
        key,
        attempts=rec["attempts"],
        error_kind=kind,
        error_class=error_class,
        error_message=message,
        first_failure_at=row[0],
        last_failure_at=row[1],
    )


def _busy(rec: dict[str, Any], key: str, reentrant: bool) -> Claim | None:
    """Someone else's live lease, or a retry not due yet: busy for that long (2d)."""
    now: dt.datetime = rec["db_now"]
    if rec["status"] == "processing" and rec["lease_until"] > now and not reentrant:
        wait = (rec["lease_until"] - now).total_seconds()
        return Claim(Outcome.BUSY, key, attempts=rec["attempts"], retry_in=wait)
    due = rec["next_attempt_at"]
    if rec["status"] == "retryable_failed" and due and due > now:
        return Claim(Outcome.BUSY, key, attempts=rec["attempts"],
                     retry_in=(due - now).total_seconds(), backoff=True)
    return None
