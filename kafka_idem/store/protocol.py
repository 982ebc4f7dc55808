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

The decisions live in :mod:`~kafka_idem.store.claim_plan`, written once as a plan
(:mod:`~kafka_idem.store.plans`): :meth:`Store.claim` runs it on a sync connection,
:meth:`Store.claim_async` on an ``async def`` handler's (the event loop's), with the
same statements in the same order. :meth:`Store.fail` and :meth:`Store.fail_async`
share the failure record's plan the same way.

Complete, in the transaction that holds the handler's business writes:
``UPDATE ... SET status='succeeded' WHERE owner_token = mine``. No row means the
lease was taken over; the caller must roll back, and the business writes go
with it. The database's transition guard enforces the same rule.

Every database error leaves this module as a :mod:`kafka_idem.errors` class,
translated in :func:`translate_errors` only. Connections fit for the protocol:
:mod:`~kafka_idem.store.connection`.
"""

from __future__ import annotations

import uuid
from typing import Any

from psycopg.types.json import Jsonb

from kafka_idem.errors import StaleOwner
from kafka_idem.store.batch import BatchQueries, result_dumps
from kafka_idem.store.claim_plan import ERROR_FIELDS, claim_plan, dead_again
from kafka_idem.store.errors import local_write_error, storable, translate_errors
from kafka_idem.store.plans import Plan, Statement, run_plan, run_plan_async
from kafka_idem.store.queries import compile_queries
from kafka_idem.store.types import AsyncConn, Claim, Conn, Delivery, Failure, Outcome


class Store(BatchQueries):
    """Runs the protocol's SQL (and, through :class:`AdminQueries`, the admin tools')
    on a connection the caller owns (and, through :class:`OutboxQueries`, the outbox's).

    Methods never commit: the caller decides the transaction boundaries (one
    for claim+handler+complete in local mode, two in leased mode).
    """

    def __init__(self, *, schema: str, table: str, namespace: str | None = None,
                 distributed: bool = False) -> None:
        self.schema = schema
        self.table = table
        # Records are identified by (namespace, key). A consumer's store has its app's
        # namespace; an admin tool's store may have none (``scoped`` gives one).
        self.namespace = namespace
        self.distributed = distributed
        self.q = compile_queries(schema, table, distributed=distributed)

    def scoped(self, namespace: str) -> Store:
        """This store (same queries) for ``namespace``."""
        other = Store.__new__(Store)
        other.schema, other.table, other.q = self.schema, self.table, self.q
        other.distributed = self.distributed
        other.namespace = namespace
        return other

    def distribute(self) -> None:
        """From now on, the queries of a store distributed on Citus (a member learns it
        at start: :func:`kafka_idem.store.citus.check_layout`)."""
        self.distributed = True
        self.q = compile_queries(self.schema, self.table, distributed=True)

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
        shard: str | None = None,
        token: uuid.UUID | None = None,
    ) -> Claim:
        """The whole claim of ``key`` (the module doc's 1 and 2a-f), in the caller's
        transaction: :func:`~kafka_idem.store.claim_plan.claim_plan` run on ``conn``.
        ``token``: the owner token a claim made now takes (default a new one)."""
        plan = self._claim_plan(key, request_hash, delivery, lease_seconds, max_attempts,
                                max_elapsed_seconds, reentrant_token, reconcile_first, shard,
                                token)
        with translate_errors(key=key):
            return run_plan(conn, plan)

    async def claim_async(
        self,
        conn: AsyncConn,
        *,
        key: str,
        request_hash: str,
        delivery: Delivery,
        lease_seconds: float,
        max_attempts: int,
        max_elapsed_seconds: float,
        reentrant_token: uuid.UUID | None = None,
        reconcile_first: bool = False,
        shard: str | None = None,
        token: uuid.UUID | None = None,
    ) -> Claim:
        """:meth:`claim` on an async connection (in the caller's transaction,
        ``async with conn.transaction()``): the same plan, so the same statements in
        the same order, and the same decisions."""
        plan = self._claim_plan(key, request_hash, delivery, lease_seconds, max_attempts,
                                max_elapsed_seconds, reentrant_token, reconcile_first, shard,
                                token)
        with translate_errors(key=key):
            return await run_plan_async(conn, plan)

    def _claim_plan(
        self, key: str, request_hash: str, delivery: Delivery, lease_seconds: float,
        max_attempts: int, max_elapsed_seconds: float, reentrant_token: uuid.UUID | None,
        reconcile_first: bool, shard: str | None, token: uuid.UUID | None,
    ) -> Plan[Claim]:
        return claim_plan(
            self.q, self._claim_params(key, request_hash, delivery, lease_seconds, shard,
                                       token),
            max_attempts=max_attempts, max_elapsed_seconds=max_elapsed_seconds,
            reentrant_token=reentrant_token, reconcile_first=reconcile_first)

    def claim_new(
        self, conn: Conn, *, key: str, request_hash: str, delivery: Delivery,
        lease_seconds: float, shard: str | None = None, token: uuid.UUID | None = None,
    ) -> Claim | None:
        """Step 1 alone: claim ``key`` if it is new, else ``None`` (then call :meth:`claim`).

        On an autocommit connection this is a whole claim in one round trip."""
        params = self._claim_params(key, request_hash, delivery, lease_seconds, shard, token)
        with translate_errors(key=key):
            row = conn.execute(self.q["claim_insert"], params).fetchone()
        if row is None:
            return None
        return Claim(Outcome.CLAIMED, key, token=params["token"], attempts=int(row[0]))

    async def claim_new_async(
        self, conn: AsyncConn, *, key: str, request_hash: str, delivery: Delivery,
        lease_seconds: float, shard: str | None = None, token: uuid.UUID | None = None,
    ) -> Claim | None:
        """:meth:`claim_new` on an autocommit async connection: the same statement."""
        params = self._claim_params(key, request_hash, delivery, lease_seconds, shard, token)
        with translate_errors(key=key):
            row = await (await conn.execute(self.q["claim_insert"], params)).fetchone()
        if row is None:
            return None
        return Claim(Outcome.CLAIMED, key, token=params["token"], attempts=int(row[0]))

    def _claim_params(
        self, key: str, request_hash: str, delivery: Delivery, lease_seconds: float,
        shard: str | None = None, token: uuid.UUID | None = None,
    ) -> dict[str, Any]:
        return {
            "ns": self.ns,
            "key": key,
            "shard": self.shard_of(key, shard),
            "hash": request_hash,
            "token": token or uuid.uuid4(),
            "lease": lease_seconds,
            "handler": delivery.handler,
            "topic": delivery.topic,
            "partition": delivery.partition,
            "offset": delivery.offset,
        }

    def dead(self, conn: Conn, rec: dict[str, Any], delivery: Delivery) -> Claim:
        """A locked ``failed`` record met again (the batch path): dead-lettered again,
        exactly as :meth:`claim` decides it (its failure time and last delivery move)."""
        params = {"ns": self.ns, "key": rec["idempotency_key"],
                  "shard": self.shard_of(rec["idempotency_key"], None), "topic": delivery.topic,
                  "partition": delivery.partition, "offset": delivery.offset}
        errors = {name: rec[name] for name in ERROR_FIELDS}
        with translate_errors(key=params["key"]):
            return run_plan(conn, dead_again(self.q, rec, params, errors))

    # --- complete / fail / heartbeat -----------------------------------------

    def complete(
        self, conn: Conn, *, key: str, token: uuid.UUID, result: Any, wait: bool = True,
        shard: str | None = None,
    ) -> None:
        """Mark succeeded if ``token`` still owns ``key``; else raise :class:`StaleOwner`
        (the statement fails with KI002 on the server). ``wait=False``, in pipeline
        mode: the statement is only queued, to be sent with the ``COMMIT``; a stale
        token then aborts the transaction, and its error (KI002) comes at the next
        sync, for the caller to translate (:func:`~kafka_idem.store.translated`)."""
        with translate_errors(key=key):
            cur = conn.execute(self.q["complete"], self._complete_params(key, token, result, shard))
            if wait:
                cur.fetchone()

    async def complete_async(
        self, conn: AsyncConn, *, key: str, token: uuid.UUID, result: Any, wait: bool = True,
        shard: str | None = None,
    ) -> None:
        """:meth:`complete` on an async connection (an ``async def`` handler's
        transaction): the same statement, the same fencing."""
        with translate_errors(key=key):
            cur = await conn.execute(self.q["complete"],
                                     self._complete_params(key, token, result, shard))
            if wait:
                await cur.fetchone()

    def refuse_local_writes(self, conn: Conn, handler: str) -> None:
        """A distributed store: raise :class:`ConfigError` when the open transaction
        wrote a table local to the Citus coordinator (``local_writes``): its writes
        would not commit atomically with the record, which lives on a worker."""
        with translate_errors():
            found = [r[0] for r in conn.execute(self.q["local_writes"]).fetchall()]
        if found:
            raise local_write_error(handler, found, f"{self.schema}.{self.table}")

    async def refuse_local_writes_async(self, conn: AsyncConn, handler: str) -> None:
        """:meth:`refuse_local_writes` on an async connection."""
        with translate_errors():
            cur = await conn.execute(self.q["local_writes"])
            found = [r[0] for r in await cur.fetchall()]
        if found:
            raise local_write_error(handler, found, f"{self.schema}.{self.table}")

    def _complete_params(self, key: str, token: uuid.UUID, result: Any,
                         shard: str | None) -> dict[str, Any]:
        return {"ns": self.ns, "key": key, "token": token, "shard": self.shard_of(key, shard),
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
        shard: str | None = None,
    ) -> Failure:
        """Record a failure as ``retryable_failed`` (due in ``delay`` s) or ``failed``;
        :class:`StaleOwner` when ``token`` no longer owns ``key``."""
        plan = self._fail_plan(key, token, status, kind, error_class, error_message, delay,
                               shard)
        with translate_errors(key=key):
            return run_plan(conn, plan)

    async def fail_async(
        self,
        conn: AsyncConn,
        *,
        key: str,
        token: uuid.UUID,
        status: str,
        kind: str,
        error_class: str,
        error_message: str,
        delay: float = 0.0,
        shard: str | None = None,
    ) -> Failure:
        """:meth:`fail` on an async connection: the same statement, the same answer."""
        plan = self._fail_plan(key, token, status, kind, error_class, error_message, delay,
                               shard)
        with translate_errors(key=key):
            return await run_plan_async(conn, plan)

    def _fail_plan(self, key: str, token: uuid.UUID, status: str, kind: str,
                   error_class: str, error_message: str, delay: float,
                   shard: str | None) -> Plan[Failure]:
        row = yield Statement(self.q["fail"], {
            "ns": self.ns,
            "key": key,
            "shard": self.shard_of(key, shard),
            "token": token,
            "status": status,
            "kind": kind,
            "error_class": storable(error_class),
            "error_message": storable(error_message),
            "delay": delay,
        })
        if row is None:
            raise StaleOwner(key=key)
        return Failure(int(row[0]), row[1], row[2], row[3])

    def extend_lease(self, conn: Conn, *, key: str, token: uuid.UUID, lease_seconds: float,
                     shard: str | None = None) -> bool:
        with translate_errors(key=key):
            row = conn.execute(
                self.q["extend_lease"],
                {"ns": self.ns, "key": key, "token": token, "lease": lease_seconds,
                 "shard": self.shard_of(key, shard)},
            ).fetchone()
        return row is not None

    def withdraw_claim(self, conn: Conn, *, key: str, token: uuid.UUID,
                       took_over: bool, shard: str | None = None) -> bool:
        """Withdraw our claim of ``key`` (fenced by ``token``) whose handler never ran:
        its lease ends now and it is not counted against the retry limit. False when
        the claim was not ours any more (or its lease already over). The next claim is
        no takeover (no reconcile first for it) unless this one was (``took_over``:
        the attempt before it died mid-call, and nobody has reconciled it yet)."""
        with translate_errors(key=key):
            row = conn.execute(self.q["withdraw_claim"],
                               self._withdraw_params(key, token, took_over, shard)).fetchone()
        return row is not None

    async def withdraw_claim_async(self, conn: AsyncConn, *, key: str, token: uuid.UUID,
                                   took_over: bool, shard: str | None = None) -> bool:
        """:meth:`withdraw_claim` on an async connection."""
        with translate_errors(key=key):
            cur = await conn.execute(self.q["withdraw_claim"],
                                     self._withdraw_params(key, token, took_over, shard))
            return await cur.fetchone() is not None

    def _withdraw_params(self, key: str, token: uuid.UUID, took_over: bool,
                         shard: str | None) -> dict[str, Any]:
        return {"ns": self.ns, "key": key, "token": token, "took_over": took_over,
                "shard": self.shard_of(key, shard)}

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

    # --- reads -----------------------------------------------------------------

    def get(self, conn: Conn, key: str) -> dict[str, Any] | None:
        """The record of ``key`` in this store's namespace."""
        found = self.find(conn, key, [self.ns])
        return found[0] if found else None
