"""One message of an ``async def`` leased handler, every step of it on the member's
event loop (:mod:`~kafka_idem.consume.concurrency.event_loop`) and its async
connections (:mod:`~kafka_idem.consume.paths.async_connections`), with the sync
path's decisions and statements.

The path of one message (a task the key-ordered dispatch started,
:mod:`~kafka_idem.consume.concurrency.keyed_units`), module by module:

1. **The claim**, committed alone, before anything else (:meth:`AsyncLeasedPath._claim`).
   A new key: its dispatch round's one statement
   (:mod:`~kafka_idem.consume.paths.round_claim`, ``batch_claim_insert``; sent by the
   round's first task, :func:`~kafka_idem.consume.concurrency.event_loop.start_here`,
   awaited by the others) or its own (``claim_insert``, ``Store.claim_new_async``),
   autocommit. A key that exists (or a re-entry): the whole claim
   (:meth:`Steps.claim_async <kafka_idem.consume.paths.steps.Steps.claim_async>`, the
   store's claim plan, :mod:`~kafka_idem.store.claim_plan`) in ``BEGIN`` ...
   ``COMMIT``: ``claim_insert``, ``claim_lock``, then ``dead_again``, ``exhaust``,
   ``claim_take`` or nothing, as the record decides; exactly the sync path's statements.
2. **The slot**: a claimed message waits for one of its handler's
   (:mod:`~kafka_idem.consume.paths.slots`), its lease renewed meanwhile
   (:mod:`~kafka_idem.consume.paths.lease_keeper`).
3. **The handler's transaction**, in one pipeline sync: ``BEGIN``, the handler, its
   events, the fenced completion (``Store.complete_async``), ``COMMIT``
   (:meth:`AsyncLeasedPath._transaction`, the twin of :meth:`Steps._run_pipelined
   <kafka_idem.consume.paths.steps.Steps._run_pipelined>`, with the same decisions,
   :mod:`~kafka_idem.consume.paths.verdicts`).
4. **The failure record**, on the handler's error, after its connection went back:
   ``BEGIN``, ``fail``, ``COMMIT`` (:meth:`Steps.record_failure_async
   <kafka_idem.consume.paths.steps.Steps.record_failure_async>`, the store's fail plan),
   then the verdict (:mod:`~kafka_idem.consume.paths.failure_record`).

Nothing goes to a thread: each step takes a connection of the loop's, uses it and
gives it back, and none holds one while it waits for another or for a slot, so a wait
for a connection ends however the loop runs (pumped by the member's loop thread or on
a thread of its own) and whatever the limit (the module doc of
:mod:`~kafka_idem.consume.paths.async_connections`). The price of a pumped loop: a
transaction of steps 1 and 4 stays open (the record's row lock held) while the loop
thread works elsewhere between two of its statements, as the handler's transaction
always could; another member's claim of that key waits for it (at most
``lock_timeout``, then retried, never charged).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg

from kafka_idem.app import App
from kafka_idem.consume.outcome import Ended, Finished, Message, Prepared, Result
from kafka_idem.consume.paths.async_connections import AsyncConnections
from kafka_idem.consume.paths.calls import delivery, own_code
from kafka_idem.consume.paths.futures import settled, start_here
from kafka_idem.consume.paths.lease_keeper import Hold, LeaseKeeper
from kafka_idem.consume.paths.leased_path import around_failure, note_withdrawal
from kafka_idem.consume.paths.round_claim import (
    RoundClaim,
    Tokens,
    Wanted,
    answer,
    claim_round_async,
)
from kafka_idem.consume.paths.slots import CallNotStarted, Gate
from kafka_idem.consume.paths.steps import Steps, log
from kafka_idem.consume.paths.verdicts import Verdict, last_chance_spent, reconcile_first
from kafka_idem.errors import (
    FrameworkError,
    MessageError,
    StaleOwner,
    StoreUnavailable,
    TransientStoreError,
)
from kafka_idem.handler import AsyncContext, Done, Handler
from kafka_idem.orm.causes import orm_cause
from kafka_idem.store import (
    AsyncAttemptTransaction,
    AsyncConn,
    Claim,
    Outcome,
    classify_db_error,
    raise_failed_attempt,
)


class AsyncLeasedPath:
    """One message of an ``async def`` leased handler, on the event loop, every
    statement on a connection of ``conns``."""

    def __init__(
        self, app: App, *, steps: Steps, leases: LeaseKeeper | None,
        conns: AsyncConnections,
    ) -> None:
        self.app = app
        self.steps = steps
        self.store = steps.store
        self.leases = leases
        self.conns = conns

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[AsyncConn]:
        """A connection for one step, given back after it. An error that means it is
        lost leaves as :class:`StoreUnavailable` and the connection is dropped (the
        sync path's :meth:`Database.unavailable
        <kafka_idem.consume.paths.database.Database.unavailable>`)."""
        conn = await self.conns.take()
        try:
            yield conn
        except psycopg.Error as exc:
            if classify_db_error(exc) is StoreUnavailable or conn.closed or conn.broken:
                with contextlib.suppress(psycopg.Error):
                    await conn.close()
                raise StoreUnavailable(str(exc)) from exc
            raise
        finally:
            await self.conns.give_back(conn)

    async def run(
        self, msg: Message, prep: Prepared, reentrant: uuid.UUID | None,
        shared: RoundClaim | None = None, gate: Gate | None = None,
    ) -> Result:
        """``shared``: the claim of the keys started with ``msg``'s
        (:mod:`~kafka_idem.consume.paths.round_claim`), sent on this loop by the first.
        ``gate``: the handler slot the call waits for once the key is claimed
        (:mod:`~kafka_idem.consume.paths.slots`); none, the call runs at once."""
        steps = self.steps
        handler = steps.handler(msg)
        gate = gate if gate is not None else Gate()
        claim: Claim | None = None
        token = reentrant or uuid.uuid4()  # known before the claim is sent (LeasedPath.run)
        try:
            claim = await self._claim(msg, prep, reentrant, shared, token)
            if claim.outcome is not Outcome.CLAIMED:
                verdict = steps.not_claimed(handler, msg, prep, claim)
                verdict.note.write(log)
                return verdict.result
            assert claim.token is not None
            if self.leases is None:
                return await self._execute(handler, msg, prep, claim, None, gate)
            with self.leases.hold(claim.key, claim.token, prep.shard) as hold:  # renewed
                return await self._execute(handler, msg, prep, claim, hold, gate)
        except (MessageError, FrameworkError, psycopg.Error) as exc:
            return around_failure(steps, exc, msg, prep,
                                  claim.token if claim is not None else token)
        except CallNotStarted:  # its partition is leaving, or the member stopping
            if claim is not None and claim.withdrawable:
                await self._withdraw(claim, prep.shard)
            raise
        except asyncio.CancelledError:
            # Abandoned by a stop or a revoke (rolled back, no longer renewed). A claim
            # whose handler never ran is withdrawn: the next owner takes the key over at
            # once, no attempt charged. A call that had started keeps its lease until it
            # runs out: its request may still be in flight at the remote system, and no
            # one may call for this key (or the next ones of its ordering key) before.
            if claim is not None and claim.outcome is Outcome.CLAIMED and claim.token:
                if gate.called or not claim.charged:  # (a re-entry: an earlier claim's)
                    log.info("abandoned key %r %s; its lease runs out on its own", claim.key,
                             "mid-call" if gate.called else "re-entered",
                             extra={"action": "abandoned", "key": claim.key})
                else:
                    await self._withdraw(claim, prep.shard)
            raise

    async def _withdraw(self, claim: Claim, shard: str | None) -> None:
        key, token = claim.key, claim.token
        assert token is not None
        try:
            async with self._connection() as conn:
                withdrawn = await self.store.withdraw_claim_async(
                    conn, key=key, token=token, took_over=claim.took_over, shard=shard)
        except Exception as exc:
            note_withdrawal(key, failed=exc)
            return
        if withdrawn:
            note_withdrawal(key)

    async def _claim(
        self, msg: Message, prep: Prepared, reentrant: uuid.UUID | None,
        shared: RoundClaim | None, token: uuid.UUID | None = None,
    ) -> Claim:
        """The round's token for a new key, else its claim alone (one statement), else
        the whole claim: each on a connection of this loop's, given back before the
        message waits for a slot (so never held while waiting for anything but the
        server), the round's sent by its first task as a task of its own."""
        new = True
        if (reentrant is None and shared is not None
                and shared.covers(prep.key, delivery(self.steps.handler(msg), msg))):
            loop = asyncio.get_running_loop()  # this task's: its thread runs the loop
            round_claim = shared.future(lambda todo: start_here(loop, self._round(todo)))
            await settled(round_claim)  # its error is read (and logged) next
            tokens = answer(round_claim)
            if tokens is not None and prep.key in tokens:
                return Claim.new_key(prep.key, tokens[prep.key])
            new = tokens is None  # else the key existed: the whole claim at once
        if new and reentrant is None:
            claim = await self._claim_new(msg, prep, token)
            if claim is not None:
                return claim
        return await self._claim_existing(msg, prep, reentrant, token)

    async def _round(self, todo: list[Wanted]) -> Tokens:
        """The round's new keys in one statement (``batch_claim_insert``, autocommit)."""
        async with self._connection() as conn:
            return await claim_round_async(self.store, conn, todo,
                                           self.steps.settings.lease_seconds)

    async def _claim_new(self, msg: Message, prep: Prepared,
                         token: uuid.UUID | None = None) -> Claim | None:
        """A new key claimed and committed in one round trip (``claim_insert``,
        autocommit), or ``None`` when the key exists."""
        async with self._connection() as conn:
            with self.steps.tracing.step(msg, "claim"):
                return await self.store.claim_new_async(
                    conn, key=prep.key, request_hash=prep.request_hash,
                    delivery=delivery(self.steps.handler(msg), msg),
                    lease_seconds=self.steps.settings.lease_seconds, shard=prep.shard,
                    token=token)

    async def _claim_existing(
        self, msg: Message, prep: Prepared, reentrant: uuid.UUID | None,
        token: uuid.UUID | None = None,
    ) -> Claim:
        """The whole claim, committed in a transaction of its own (the sync path's
        ``LeasedPath._claim_existing``): ``BEGIN``, the claim plan's statements,
        ``COMMIT``."""
        async with self._connection() as conn, conn.transaction():
            return await self.steps.claim_async(conn, self.steps.handler(msg), msg, prep,
                                                reentrant=reentrant, token=token)

    async def _record_failure(
        self, handler: Handler[Any], msg: Message, prep: Prepared, claim: Claim,
        exc: Exception,
    ) -> Verdict:
        """``exc``, the handler's error, recorded in a transaction of its own: ``BEGIN``,
        ``fail``, ``COMMIT`` (the sync path's, :meth:`Steps._failed
        <kafka_idem.consume.paths.steps.Steps._failed>`)."""
        async with self._connection() as conn, conn.transaction():
            return await self.steps.record_failure_async(conn, handler, msg, prep, claim, exc)

    async def _execute(
        self, handler: Handler[Any], msg: Message, prep: Prepared, claim: Claim,
        hold: Hold | None, gate: Gate,
    ) -> Result:
        """BEGIN, the handler, the fenced completion, COMMIT, in the sync path's one
        round trip (:meth:`Steps._run_pipelined`); on the handler's error, the failure
        is recorded in its own transaction once the handler's connection is given back.
        The handler's call holds a slot of ``gate`` (taken before the connection, given
        back as the call returns)."""
        assert claim.token is not None
        await gate.enter_async()
        try:
            conn = await self.conns.take()
        except BaseException:
            gate.leave()
            raise
        try:
            ctx = self.steps.context(conn, handler, msg, prep, claim.attempts, cls=AsyncContext,
                                     hold=hold)
            assert isinstance(ctx, AsyncContext)
            with self.steps.handler_time(handler):
                try:
                    how = await self._transaction(conn, handler, prep, ctx, claim, hold, gate)
                except (FrameworkError, StaleOwner):
                    raise
                except Exception as exc:
                    if hold is not None:
                        hold.release()
                    failure = exc
                else:
                    log.debug(how, extra={"action": how, "key": prep.key,
                                          "attempts": claim.attempts})
                    return Finished(Ended.SUCCEEDED, key=prep.key)
            lost = classify_db_error(failure) is StoreUnavailable or conn.closed or conn.broken
            if lost:
                raise StoreUnavailable(str(failure)) from failure
            if classify_db_error(failure) is TransientStoreError:
                raise TransientStoreError(str(failure), key=prep.key) from failure
        finally:
            gate.leave()
            await self.conns.give_back(conn)
        verdict = await self._record_failure(handler, msg, prep, claim, failure)
        verdict.note.write(log)
        return verdict.result

    async def _transaction(
        self, conn: AsyncConn, handler: Handler[Any], prep: Prepared, ctx: AsyncContext,
        claim: Claim, hold: Hold | None, gate: Gate,
    ) -> str:
        """The attempt's transaction on the autocommit ``conn``; rolled back on any
        error (a cancelled task's too), so ``conn`` goes back idle. The call's slot is
        given back as the call returns: the completion is the framework's work."""
        assert claim.token is not None
        completing = False
        try:
            async with conn.pipeline(), AsyncAttemptTransaction(conn):  # BEGIN, queued
                gate.calling()
                try:
                    result, how = await self._call(handler, prep, ctx, claim)
                finally:
                    gate.leave()  # the call's slot: what follows is ours, not the handler's
                completing = True  # errors from here on may be any statement's
                with own_code(prep.key):
                    await self.steps.emitter.flush_async(conn, ctx)  # its events, in this tx
                    if self.store.distributed:
                        await self.store.refuse_local_writes_async(conn, ctx.handler)
                    await self.store.complete_async(
                        conn, key=prep.key, token=claim.token, result=result, wait=False,
                        shard=prep.shard)
                    if hold is not None:
                        hold.release()  # before the commit (see LeaseKeeper.hold)
            # COMMIT was queued as the block ended, and sent with the pipeline's one sync
        except BaseException as exc:
            with contextlib.suppress(psycopg.Error):
                await conn.rollback()
            raise_failed_attempt(exc, completing=completing, key=prep.key)
        return how

    async def _call(
        self, handler: Handler[Any], prep: Prepared, ctx: AsyncContext, claim: Claim
    ) -> tuple[Any, str]:
        """:meth:`Steps._call`'s twin for coroutines (the decisions are shared)."""
        try:
            called = await self._reconcile_or_handle(handler, prep, ctx, claim)
            await ctx.settle_session_async()
        except BaseException as exc:
            await ctx.discard_session_async()
            cause = orm_cause(exc)
            if cause is None:
                raise
            raise cause from exc
        return called

    async def _reconcile_or_handle(
        self, handler: Handler[Any], prep: Prepared, ctx: AsyncContext, claim: Claim
    ) -> tuple[Any, str]:
        if handler.reconcile is not None and reconcile_first(claim, reconciler=True):
            done = await handler.reconcile(prep.model, ctx)  # type: ignore[misc]
            if isinstance(done, Done):
                log.info("reconciled", extra={"action": "reconciled", "key": prep.key})
                return done.result, "reconciled"
        spent = last_chance_spent(claim, prep.key)
        if spent is not None:
            raise spent
        return await handler(prep.model, ctx), "succeeded"
