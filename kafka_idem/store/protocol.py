"""The idempotency store: the claim / complete protocol with fencing tokens.

Claim, inside the caller's transaction:

1. ``claim_insert``: a new key is inserted as ``processing`` with a fresh owner
   token and lease, ``ON CONFLICT DO NOTHING``. A returned row means **claimed**.
2. Otherwise ``claim_lock`` locks the existing row (``FOR UPDATE``; a new
   statement, so a row whose insert we just lost a race to is visible) and,
   holding the lock, decides:

   a. request hash differs            -> **conflict** (the record is untouched)
   b. ``succeeded``                   -> **replay** the stored result
   c. ``failed``                      -> **dead**: already dead-lettered, do it again
   d. ``processing`` with a live lease
      or ``retryable_failed`` not yet due -> **busy**, retry in ``retry_in`` seconds
   e. attempts or elapsed time used up -> **exhausted** (moved to ``failed`` here)
   f. otherwise                        -> ``claim_take``: new token, new lease,
                                          attempts + 1: **claimed**

Complete, in the transaction that holds the handler's business writes:
``UPDATE ... SET status='succeeded' WHERE owner_token = mine``. No row means the
lease was taken over; the caller must roll back, and the business writes go
with it. The database's transition guard enforces the same rule.

Every database error leaves this module as a :mod:`kafka_idem.errors` class,
translated in :func:`translate_errors` only.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from kafka_idem.errors import ResultNotJSON, StaleOwner, TransientStoreError
from kafka_idem.sql import compile_queries
from kafka_idem.store.errors import storable, translate_errors
from kafka_idem.store.outbox import OutboxQueries
from kafka_idem.store.types import AsyncConn, Claim, Conn, Delivery, Failure, Outcome


def result_dumps(obj: Any) -> str:
    """``json.dumps`` of a handler's result, whose failure names what to fix: without it
    the user sees psycopg's bare ``TypeError`` and a stack trace from the batch path."""
    try:
        return json.dumps(obj)
    except (TypeError, ValueError) as exc:
        raise ResultNotJSON(
            f"the handler's result is not JSON-serialisable ({exc}): return only dict, "
            "list, str, int, float, bool or None (it is stored in result_json and given "
            "back to every duplicate)") from None


class Store(OutboxQueries):
    """Runs the protocol's SQL (and, through :class:`AdminQueries`, the admin tools')
    on a connection the caller owns (and, through :class:`OutboxQueries`, the outbox's).

    Methods never commit: the caller decides the transaction boundaries (one
    for claim+handler+complete in local mode, two in leased mode).
    """

    def __init__(self, *, schema: str, table: str, namespace: str | None = None) -> None:
        self.schema = schema
        self.table = table
        # Records are identified by (namespace, key). A consumer's store has its app's
        # namespace; an admin tool's store may have none (``scoped`` gives one).
        self.namespace = namespace
        self.q = compile_queries(schema, table)

    def scoped(self, namespace: str) -> Store:
        """This store (same queries) for ``namespace``."""
        other = Store.__new__(Store)
        other.schema, other.table, other.q = self.schema, self.table, self.q
        other.namespace = namespace
        return other


    # --- claim ---------------------------------------------------------------

    def claim(
        self,
        conn: Conn,
        *,
        key: str,
        request_hash: str,
        delivery: Delivery,
        lease_seconds: float,
        max_attempts: int,
        max_elapsed_seconds: float,
        reentrant_token: uuid.UUID | None = None,
        reconcile_first: bool = False,
    ) -> Claim:
        params = self._claim_params(key, request_hash, delivery, lease_seconds)
        with translate_errors(key=key):
            row = conn.execute(self.q["claim_insert"], params).fetchone()
            if row is not None:
                return Claim(Outcome.CLAIMED, key, token=params["token"], attempts=int(row[0]))
            cur = conn.cursor(row_factory=dict_row)
            rec = cur.execute(self.q["claim_lock"], {"ns": self.ns, "key": key}).fetchone()
            if rec is None:
                # Purged between our insert and our lock: a new key again.
                row = conn.execute(self.q["claim_insert"], params).fetchone()
                if row is None:
                    raise TransientStoreError("claim raced with a purge", key=key)
                return Claim(Outcome.CLAIMED, key, token=params["token"], attempts=int(row[0]))
            return self._decide(
                conn, rec, params, max_attempts, max_elapsed_seconds, reentrant_token,
                reconcile_first,
            )

    def claim_new(
        self, conn: Conn, *, key: str, request_hash: str, delivery: Delivery, lease_seconds: float
    ) -> Claim | None:
        """Step 1 alone: claim ``key`` if it is new, else ``None`` (then call :meth:`claim`).

        On an autocommit connection this is a whole claim in one round trip."""
        params = self._claim_params(key, request_hash, delivery, lease_seconds)
        with translate_errors(key=key):
            row = conn.execute(self.q["claim_insert"], params).fetchone()
        if row is None:
            return None
        return Claim(Outcome.CLAIMED, key, token=params["token"], attempts=int(row[0]))

    async def claim_new_async(
        self, conn: AsyncConn, *, key: str, request_hash: str, delivery: Delivery,
        lease_seconds: float,
    ) -> Claim | None:
        """:meth:`claim_new` on an autocommit async connection: the same statement."""
        params = self._claim_params(key, request_hash, delivery, lease_seconds)
        with translate_errors(key=key):
            row = await (await conn.execute(self.q["claim_insert"], params)).fetchone()
        if row is None:
            return None
        return Claim(Outcome.CLAIMED, key, token=params["token"], attempts=int(row[0]))

    def _claim_params(
        self, key: str, request_hash: str, delivery: Delivery, lease_seconds: float
    ) -> dict[str, Any]:
        return {
            "ns": self.ns,
            "key": key,
            "hash": request_hash,
            "token": uuid.uuid4(),
            "lease": lease_seconds,
            "handler": delivery.handler,
            "topic": delivery.topic,
            "partition": delivery.partition,
            "offset": delivery.offset,
        }

    def _decide(
        self,
        conn: Conn,
        rec: dict[str, Any],
        params: dict[str, Any],
        max_attempts: int,
        max_elapsed_seconds: float,
        reentrant_token: uuid.UUID | None,
        reconcile_first: bool,
    ) -> Claim:
        """The claim's decision on an existing, locked record (the module doc's 2a-f)."""
        key: str = params["key"]
        status: str = rec["status"]
        errors = {
            "error_kind": rec["error_kind"],
            "error_class": rec["error_class"],
            "error_message": rec["error_message"],
            "first_failure_at": rec["first_failure_at"],
            "last_failure_at": rec["last_failure_at"],
        }
        if rec["request_hash"] != params["hash"]:
            return Claim(Outcome.CONFLICT, key, attempts=rec["attempts"], **errors)
        if status == "succeeded":
            return Claim(Outcome.REPLAY, key, attempts=rec["attempts"], result=rec["result_json"])
        if status == "failed":
            return self._dead_again(conn, rec, params, errors)
        reentrant = reentrant_token is not None and rec["owner_token"] == reentrant_token
        busy = _busy(rec, key, reentrant)
        if busy is not None:
            return busy
        return self._take(conn, rec, params, errors, reentrant=reentrant,
                          max_attempts=max_attempts, max_elapsed_seconds=max_elapsed_seconds,
                          reconcile_first=reconcile_first)

    def dead(self, conn: Conn, rec: dict[str, Any], delivery: Delivery) -> Claim:
        """A locked ``failed`` record met again (the batch path): dead-lettered again,
        exactly as :meth:`claim` decides it (its failure time and last delivery move)."""
        params = {"ns": self.ns, "key": rec["idempotency_key"], "topic": delivery.topic,
                  "partition": delivery.partition, "offset": delivery.offset}
        errors = {name: rec[name] for name in (
            "error_kind", "error_class", "error_message", "first_failure_at", "last_failure_at")}
        with translate_errors(key=params["key"]):
            return self._dead_again(conn, rec, params, errors)

    def _dead_again(self, conn: Conn, rec: dict[str, Any], params: dict[str, Any],
                    errors: dict[str, Any]) -> Claim:
        again = conn.execute(self.q["dead_again"], params).fetchone()
        if again is not None:  # the dead letter about to be sent says "now"
            errors["first_failure_at"], errors["last_failure_at"] = again
        return Claim(Outcome.DEAD, params["key"], attempts=rec["attempts"], **errors)

    def _take(
        self,
        conn: Conn,
        rec: dict[str, Any],
        params: dict[str, Any],
        errors: dict[str, Any],
        *,
        reentrant: bool,
        max_attempts: int,
        max_elapsed_seconds: float,
        reconcile_first: bool,
    ) -> Claim:
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
                return self._exhaust(conn, rec, key, took_over)
            last_chance = True
        charge = 0 if reentrant or last_chance else 1
        taken = conn.execute(self.q["claim_take"], {**params, "charge": charge})
        row = taken.fetchone()
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

    def _exhaust(self, conn: Conn, rec: dict[str, Any], key: str, took_over: bool) -> Claim:
        kind = "exhausted"
        message = rec["error_message"] or (
            "lease expired on the last attempt (its owner died, stalled, or abandoned it "
            "at a stop or a revoke)" if took_over else None
        )
        error_class = rec["error_class"] or ("LeaseExpired" if took_over else None)
        row = conn.execute(
            self.q["exhaust"],
            {"ns": self.ns, "key": key, "error_class": error_class, "error_message": message},
        ).fetchone()
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

    # --- complete / fail / heartbeat -----------------------------------------

    def complete(
        self, conn: Conn, *, key: str, token: uuid.UUID, result: Any, wait: bool = True
    ) -> None:
        """Mark succeeded if ``token`` still owns ``key``; else raise :class:`StaleOwner`
        (the statement fails with KI002 on the server). ``wait=False``, in pipeline
        mode: the statement is only queued, to be sent with the ``COMMIT``; a stale
        token then aborts the transaction, and its error (KI002) comes at the next
        sync, for the caller to translate (:func:`~kafka_idem.store.translated`)."""
        with translate_errors(key=key):
            cur = conn.execute(self.q["complete"], self._complete_params(key, token, result))
            if wait:
                cur.fetchone()

    async def complete_async(
        self, conn: AsyncConn, *, key: str, token: uuid.UUID, result: Any, wait: bool = True
    ) -> None:
        """:meth:`complete` on an async connection (an ``async def`` handler's
        transaction): the same statement, the same fencing."""
        with translate_errors(key=key):
            cur = await conn.execute(self.q["complete"], self._complete_params(key, token, result))
            if wait:
                await cur.fetchone()

    def _complete_params(self, key: str, token: uuid.UUID, result: Any) -> dict[str, Any]:
        return {"ns": self.ns, "key": key, "token": token,
                "result": Jsonb(result, dumps=result_dumps)}

    def fail(
        self,
        conn: Conn,
        *,
        key: str,
        token: uuid.UUID,
        status: str,
        kind: str,
        error_class: str,
        error_message: str,
        delay: float = 0.0,
    ) -> Failure:
        """Record a failure as ``retryable_failed`` (due in ``delay`` s) or ``failed``."""
        with translate_errors(key=key):
            row = conn.execute(
                self.q["fail"],
                {
                    "ns": self.ns,
                    "key": key,
                    "token": token,
                    "status": status,
                    "kind": kind,
                    "error_class": storable(error_class),
                    "error_message": storable(error_message),
                    "delay": delay,
                },
            ).fetchone()
        if row is None:
            raise StaleOwner(key=key)
        return Failure(int(row[0]), row[1], row[2], row[3])

    def extend_lease(self, conn: Conn, *, key: str, token: uuid.UUID, lease_seconds: float) -> bool:
        with translate_errors(key=key):
            row = conn.execute(
                self.q["extend_lease"],
                {"ns": self.ns, "key": key, "token": token, "lease": lease_seconds},
            ).fetchone()
        return row is not None

    def withdraw_claim(self, conn: Conn, *, key: str, token: uuid.UUID,
                       took_over: bool) -> bool:
        """Withdraw our claim of ``key`` (fenced by ``token``) whose handler never ran:
        its lease ends now and it is not counted against the retry limit. False when
        the claim was not ours any more (or its lease already over). The next claim is
        no takeover (no reconcile first for it) unless this one was (``took_over``:
        the attempt before it died mid-call, and nobody has reconciled it yet)."""
        with translate_errors(key=key):
            row = conn.execute(self.q["withdraw_claim"],
                               self._withdraw_params(key, token, took_over)).fetchone()
        return row is not None

    async def withdraw_claim_async(self, conn: AsyncConn, *, key: str,
                                   token: uuid.UUID, took_over: bool) -> bool:
        """:meth:`withdraw_claim` on an async connection."""
        with translate_errors(key=key):
            cur = await conn.execute(self.q["withdraw_claim"],
                                     self._withdraw_params(key, token, took_over))
            return await cur.fetchone() is not None

    def _withdraw_params(self, key: str, token: uuid.UUID, took_over: bool) -> dict[str, Any]:
        return {"ns": self.ns, "key": key, "token": token, "took_over": took_over}

    def expire_leases(self, conn: Conn, *, key: str | None = None) -> list[str]:
        """The test kit's clock: every live lease of this namespace (or only ``key``'s)
        ends now, as if its owner had stalled past it; returns the keys. The next claim
        of such a key takes it over (a new token, ``attempts + 1``, reconcile first)
        and the stalled owner's completion finds no row. Never called by a consumer."""
        with translate_errors(key=key):
            rows = conn.execute(self.q["expire_leases"], {"ns": self.ns, "key": key}).fetchall()
        return [r[0] for r in rows]

    def wipe(self, conn: Conn) -> None:
        """The test kit's clean slate: every record and audit row of the store gone, in
        one of the kit's throwaway databases only (``kafka_idem_kit_*``; refused
        elsewhere with :class:`IllegalTransition`). Never called by a consumer."""
        with translate_errors():
            conn.execute(self.q["wipe"])

    # --- the batch path (kafka_idem.consume.batch) ---------------------------------------

    def claim_batch(
        self, conn: Conn, *, lease_seconds: float, keys: Sequence[str],
        hashes: Sequence[str], deliveries: Sequence[Delivery],
    ) -> dict[str, uuid.UUID]:
        """Claim every new key of ``keys`` (sorted: a stable lock order) in one
        statement; ``{key: owner token}`` for the keys that were new."""
        rows = conn.execute(
            self.q["batch_claim_insert"],
            self._batch_claim_params(lease_seconds, keys, hashes, deliveries),
        ).fetchall()
        return {key: token for key, token in rows}

    def _batch_claim_params(
        self, lease_seconds: float, keys: Sequence[str], hashes: Sequence[str],
        deliveries: Sequence[Delivery],
    ) -> dict[str, Any]:
        return {
            "ns": self.ns,
            "lease": lease_seconds,
            "keys": list(keys),
            "hashes": list(hashes),
            "handlers": [d.handler for d in deliveries],
            "topics": [d.topic for d in deliveries],
            "parts": [d.partition for d in deliveries],
            "offs": [d.offset for d in deliveries],
        }

    async def claim_batch_async(
        self, conn: AsyncConn, *, lease_seconds: float, keys: Sequence[str],
        hashes: Sequence[str], deliveries: Sequence[Delivery],
    ) -> dict[str, uuid.UUID]:
        """:meth:`claim_batch` on an autocommit async connection: the same statement."""
        cur = await conn.execute(
            self.q["batch_claim_insert"],
            self._batch_claim_params(lease_seconds, keys, hashes, deliveries))
        return {key: token for key, token in await cur.fetchall()}

    def lock_batch(self, conn: Conn, keys: Sequence[str]) -> list[dict[str, Any]]:
        """Lock the records of ``keys`` in key order and read what to decide on."""
        cur = conn.cursor(row_factory=dict_row)
        return cur.execute(self.q["batch_lock"], {"ns": self.ns, "keys": list(keys)}).fetchall()

    def complete_batch(
        self, conn: Conn, *, keys: Sequence[str], tokens: Sequence[uuid.UUID | None],
        results: Sequence[Any],
    ) -> psycopg.Cursor[Any]:
        """Every success of a batch in one fenced statement; the cursor's rowcount
        (read after the pipeline ends) is how many completions kept their fence."""
        return conn.execute(
            self.q["batch_complete"],
            {"ns": self.ns, "keys": list(keys), "tokens": list(tokens),
             "results": Jsonb(list(results), dumps=result_dumps)},
        )

    # --- reads -----------------------------------------------------------------

    def get(self, conn: Conn, key: str) -> dict[str, Any] | None:
        """The record of ``key`` in this store's namespace."""
        found = self.find(conn, key, [self.ns])
        return found[0] if found else None

    def succeeded(self, conn: Conn, keys: Sequence[str]) -> dict[str, tuple[str, Any]]:
        """``{key: (request_hash, result)}`` for the keys among ``keys`` (distinct) that
        succeeded."""
        with translate_errors():
            rows = conn.execute(
                self.q["succeeded_results"], {"ns": self.ns, "keys": list(keys)}
            ).fetchall()
        return {r[0]: (r[1], r[2]) for r in rows if r[3] == "succeeded"}


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


def connect(
    dsn: str, *, application_name: str = "kafka_idem", idle_in_transaction_timeout: float = 0.0,
    lock_timeout: float = 0.0,
) -> Conn:
    """A connection fit for the protocol: synchronous commit on (an
    acknowledged commit must survive a server crash).

    ``idle_in_transaction_timeout`` (seconds, 0 = off) lets the server end the
    session of a member stalled inside a transaction (a zombie), releasing the
    row locks that would otherwise block the member that took its lease over.
    ``lock_timeout`` (seconds, 0 = off) bounds each wait for a lock: a member waiting on
    another's rows gets ``55P03`` (transient: retried, never charged) instead of
    waiting past its poll interval.
    """
    with translate_errors():
        conn = psycopg.connect(dsn, autocommit=False, application_name=application_name)
        for sql, params in _session(idle_in_transaction_timeout, lock_timeout):
            conn.execute(sql, params)
        conn.commit()
    return conn


async def connect_async(
    dsn: str, *, application_name: str = "kafka_idem", idle_in_transaction_timeout: float = 0.0,
    lock_timeout: float = 0.0,
) -> AsyncConn:
    """:func:`connect` for ``async def`` handlers: the same session settings."""
    with translate_errors():
        conn = await psycopg.AsyncConnection.connect(
            dsn, autocommit=False, application_name=application_name
        )
        for sql, params in _session(idle_in_transaction_timeout, lock_timeout):
            await conn.execute(sql, params)
        await conn.commit()
    return conn


def _session(idle_in_transaction_timeout: float,
             lock_timeout: float = 0.0) -> list[tuple[str, tuple[Any, ...]]]:
    # An asynchronously committed success could vanish in a crash after its
    # Kafka offset was committed; insist on synchronous commit.
    return [
        ("SET synchronous_commit = on", ()),
        ("SELECT set_config('idle_in_transaction_session_timeout', %s, false)",
         (f"{int(idle_in_transaction_timeout * 1000)}ms",)),
        ("SELECT set_config('lock_timeout', %s, false)", (f"{int(lock_timeout * 1000)}ms",)),
    ]
