"""``async def`` handlers: the member's event loop, its async connections, and the
one part of the leased protocol that runs on them.

Leased mode has three transactions per attempt: the claim (committed alone), the
handler's (``BEGIN``, handler, fenced completion, ``COMMIT``) and, on a failure,
the failure record (committed alone). Only the second holds the handler, so only
it is async: :class:`AsyncLeasedPath` runs it on an ``AsyncConnection``, with the
same decisions as the sync path (:mod:`~kafka_idem.consume.verdicts`) and the same
statements (:meth:`Store.complete_async <kafka_idem.store.Store.complete_async>`).
The claim of a key that already exists (the full claim protocol) and the failure
record stay the sync path's own code, run on a few threads: a thread hop instead of a
second copy of those decisions. A new key's claim, alone or in its dispatch round's
statement (:mod:`~kafka_idem.consume.rounds`), is one statement: with a pumped loop
(``claims_here``) it runs on the loop's async connections, no hop; on a loop thread of
its own it goes to the threads too.
The event loop (:class:`EventLoop`) runs on the member's loop thread while it waits
(``pumped``), or on a thread of its own (``event_loop_thread``).
Many keys in flight hold one async connection each while their handler runs;
:class:`AsyncConnections` keeps the idle ones (the dispatcher bounds how many are
in use, so no pool library is needed).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
import weakref
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import psycopg
from psycopg.pq import TransactionStatus

from kafka_idem.app import App
from kafka_idem.consume.leased import LeasedPath, around_failure, note_withdrawal
from kafka_idem.consume.outcome import Ended, Finished, Message, Prepared, Result
from kafka_idem.consume.rounds import RoundClaim, Tokens, Wanted, answer, claim_round_async
from kafka_idem.consume.slots import CallNotStarted, Gate
from kafka_idem.consume.steps import Steps, delivery, log, own_code
from kafka_idem.consume.verdicts import last_chance_spent, reconcile_first
from kafka_idem.errors import (
    FrameworkError,
    MessageError,
    StaleOwner,
    StoreUnavailable,
    TransientStoreError,
)
from kafka_idem.handler import AsyncContext, Done, Handler
from kafka_idem.lease import Hold, LeaseKeeper
from kafka_idem.settings import Settings
from kafka_idem.store import (
    AsyncAttemptTransaction,
    AsyncConn,
    Claim,
    Outcome,
    classify_db_error,
    connect_async,
    raise_failed_attempt,
)

T = TypeVar("T")


class EventLoop:
    """An asyncio loop for the member's ``async def`` handlers; :meth:`submit` from
    any thread.

    Threaded (the default here): the loop runs on a thread of its own. ``pumped``
    (the member's default): no thread; the loop runs on the caller's thread while it
    waits (:meth:`run_for`), so the member's loop thread and the tasks are not two
    threads taking turns at the GIL."""

    def __init__(self, name: str = "kafka-idem-async", *, pumped: bool = False) -> None:
        self.loop = asyncio.new_event_loop()
        self.pumped = pumped
        self._owner = threading.get_ident()  # pumped: the one thread that runs the loop
        self._wake: asyncio.Future[None] | None = None
        self._thread: threading.Thread | None = None
        if not pumped:
            self._thread = threading.Thread(target=self.loop.run_forever, name=name,
                                            daemon=True)
            self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        if self._here():
            return start_here(self.loop, coro)
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def _here(self) -> bool:
        """Pumped, and called by the thread that runs the loop: the loop can be used
        directly, without the thread-safe hand-off (a write to its wake-up pipe, and
        one more round before anything happens)."""
        return self.pumped and threading.get_ident() == self._owner

    @property
    def pending(self) -> bool:
        """Pumped: tasks that have not ended (abandoned ones rolling back too)."""
        return self.pumped and bool(asyncio.all_tasks(self.loop))

    def poke(self) -> None:
        """From any thread: a pumped :meth:`run_for` checks its condition again."""
        if self.pumped and not self.loop.is_closed():
            if self._here():  # a job ending on the loop: no hand-off
                self._woken()
                return
            with contextlib.suppress(RuntimeError):  # closed meanwhile: nobody waits
                self.loop.call_soon_threadsafe(self._woken)

    def _woken(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def run_for(self, timeout: float, until: Callable[[], bool] | None = None) -> None:
        """Pumped: run the loop here for one round of what is ready, then until
        ``until()`` holds (checked when :meth:`poke` is called) or ``timeout`` ends.
        Only the thread that made the loop runs it."""
        assert threading.get_ident() == self._owner, "a pumped loop runs on its own thread"
        pump = self.loop.create_task(self._run_for(max(timeout, 0.0), until))
        _PUMPS.add(pump)  # not one of the member's tasks: settle() does not wait for it
        self.loop.run_until_complete(pump)

    async def _run_for(self, timeout: float, until: Callable[[], bool] | None) -> None:
        loop = self.loop
        end = loop.time() + timeout
        await asyncio.sleep(0)
        while not (until is not None and until()) and (left := end - loop.time()) > 0:
            self._wake = loop.create_future()
            timer = loop.call_later(left, self._woken)
            try:
                await self._wake
            finally:
                timer.cancel()
                self._wake = None

    def result(self, future: Future[T], timeout: float) -> T:
        """``future``'s result, running the loop meanwhile when it is pumped."""
        if self.pumped:
            future.add_done_callback(lambda _f: self.poke())
            self.run_for(timeout, until=future.done)
            return future.result(timeout=0)
        return future.result(timeout)

    def stop(self, timeout: float) -> None:
        """Stop the loop (its tasks were waited for or cancelled by the caller)."""
        if self._thread is None:
            self.loop.close()
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


_PUMPS: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()  # EventLoop.run_for's tasks


def start_here(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> Future[T]:
    """``asyncio.run_coroutine_threadsafe`` for the thread that runs ``loop``: the
    task is made now (its first step runs at the loop's next round) and its outcome
    copied into the returned future; cancelling that future cancels the task."""
    future: Future[T] = Future()
    task = loop.create_task(coro)

    def copy(done: asyncio.Task[T]) -> None:
        if done.cancelled():
            future.cancel()
            return
        if not future.set_running_or_notify_cancel():
            return  # cancelled first
        exc = done.exception()
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(done.result())

    def cancel(f: Future[T]) -> None:
        if f.cancelled() and not loop.is_closed():
            loop.call_soon_threadsafe(task.cancel)  # from whichever thread cancelled it

    task.add_done_callback(copy)
    future.add_done_callback(cancel)
    return future


async def settled(future: Future[Any]) -> None:
    """Wait for a concurrent ``future`` to end, without its outcome. Ended on this
    loop's own thread, its waiter wakes with no hand-off (``asyncio.wrap_future``
    always takes the thread-safe way, one per waiter); ended on another thread, through
    the loop's thread-safe call."""
    if future.done():
        return
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    here = threading.get_ident()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    def ended(_f: Future[Any]) -> None:
        if threading.get_ident() == here:
            wake()
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(wake)

    future.add_done_callback(ended)
    await waiter


async def settle(timeout: float) -> None:
    """Wait up to ``timeout`` for the loop's other tasks to end (cancelled ones
    rolling back and releasing their leases) before the loop stops."""
    others = asyncio.all_tasks() - {asyncio.current_task()} - set(_PUMPS)
    if others:
        await asyncio.wait(others, timeout=timeout)


class AsyncConnections:
    """Idle async connections, reused; one in use per handler call, claim or
    completion. In autocommit: :class:`AsyncLeasedPath` sends ``BEGIN`` and
    ``COMMIT`` itself, pipelined with the statements (see :meth:`Steps._run_pipelined
    <kafka_idem.consume.steps.Steps._run_pipelined>`).

    ``limit``: at most that many open at once (:func:`connection_limit`); a task
    wanting one more waits for one to come back. Nothing holds a connection while it
    waits for anything but the server (a call takes its slot first, then its
    connection), so every holder gives its connection back and no wait is forever."""

    def __init__(self, settings: Settings, *, application_name: str,
                 limit: int | None = None) -> None:
        self.settings = settings
        self.application_name = application_name
        self.limit = limit
        self._idle: list[AsyncConn] = []
        self._room = asyncio.Semaphore(limit) if limit is not None else None

    async def take(self) -> AsyncConn:
        if self._room is not None:
            await self._room.acquire()
        try:
            while self._idle:
                conn = self._idle.pop()
                if not conn.closed and not conn.broken:
                    return conn
            conn = await connect_async(
                self.settings.dsn, application_name=self.application_name,
                idle_in_transaction_timeout=self.settings.idle_in_transaction_timeout_seconds,
                lock_timeout=self.settings.lock_wait_seconds,
            )
            await conn.set_autocommit(True)
        except BaseException:
            if self._room is not None:
                self._room.release()
            raise
        return conn

    async def give_back(self, conn: AsyncConn) -> None:
        try:
            if (conn.closed or conn.broken
                    or conn.info.transaction_status != TransactionStatus.IDLE):
                with contextlib.suppress(psycopg.Error):
                    await conn.close()
                return
            self._idle.append(conn)
        finally:
            if self._room is not None:
                self._room.release()

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            with contextlib.suppress(psycopg.Error):
                await conn.close()


def connection_limit(max_concurrency: int) -> int:
    """The async connections a member opens at most: one per handler call
    (``max_concurrency``), and a quarter more (at least 2) for the claims of the
    messages waiting for a call and the completions of those whose call returned."""
    return max_concurrency + max(2, max_concurrency // 4)


class AsyncLeasedPath:
    """One message of an ``async def`` leased handler, on the event loop.

    ``on_thread(fn)`` runs ``fn(path)`` with a sync :class:`LeasedPath` of a worker
    thread (its own connection) and returns its answer: the claim and the failure
    record go there."""

    def __init__(
        self, app: App, *, steps: Steps, leases: LeaseKeeper | None,
        on_thread: Callable[[Callable[[LeasedPath], Any]], Future[Any]],
        conns: AsyncConnections, claims_here: bool = False,
    ) -> None:
        self.app = app
        self.claims_here = claims_here
        self.steps = steps
        self.store = steps.store
        self.leases = leases
        self.on_thread = on_thread
        self.conns = conns

    async def _thread(self, fn: Callable[[LeasedPath], T]) -> T:
        result: T = await asyncio.wrap_future(self.on_thread(fn))
        return result

    async def run(
        self, msg: Message, prep: Prepared, reentrant: uuid.UUID | None,
        shared: RoundClaim | None = None, gate: Gate | None = None,
    ) -> Result:
        """``shared``: the claim of the keys started with ``msg``'s
        (:mod:`~kafka_idem.consume.rounds`), sent on a claim thread by the first.
        ``gate``: the handler slot the call waits for once the key is claimed
        (:mod:`~kafka_idem.consume.slots`); none, the call runs at once."""
        steps = self.steps
        handler = steps.handler(msg)
        gate = gate if gate is not None else Gate()
        claim: Claim | None = None
        try:
            claim = await self._claim(msg, prep, reentrant, shared)
            if claim.outcome is not Outcome.CLAIMED:
                verdict = steps.not_claimed(handler, msg, prep, claim)
                verdict.note.write(log)
                return verdict.result
            assert claim.token is not None
            if self.leases is None:
                return await self._execute(handler, msg, prep, claim, None, gate)
            with self.leases.hold(claim.key, claim.token) as hold:  # renewed while it waits
                return await self._execute(handler, msg, prep, claim, hold, gate)
        except (MessageError, FrameworkError, psycopg.Error) as exc:
            return around_failure(steps, exc, msg, prep,
                                  claim.token if claim is not None else reentrant)
        except CallNotStarted:  # its partition is leaving, or the member stopping
            if claim is not None and claim.withdrawable:
                await self._withdraw(claim)
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
                    await self._withdraw(claim)
            raise

    async def _withdraw(self, claim: Claim) -> None:
        key, token = claim.key, claim.token
        assert token is not None
        try:
            conn = await self.conns.take()
            try:
                withdrawn = await self.store.withdraw_claim_async(
                    conn, key=key, token=token, took_over=claim.took_over)
            finally:
                await self.conns.give_back(conn)
        except Exception as exc:
            note_withdrawal(key, failed=exc)
            return
        if withdrawn:
            note_withdrawal(key)

    async def _claim(
        self, msg: Message, prep: Prepared, reentrant: uuid.UUID | None,
        shared: RoundClaim | None,
    ) -> Claim:
        """The round's token for a new key, else the claim alone (on a thread)."""
        new = True
        if (reentrant is None and shared is not None
                and shared.covers(prep.key, delivery(self.steps.handler(msg), msg))):
            if self.claims_here:  # on this loop, which its thread runs: no hand-offs
                loop = asyncio.get_running_loop()
                round_claim = shared.future(lambda todo: start_here(loop, self._round(todo)))
            else:
                round_claim = shared.future(
                    lambda todo: self.on_thread(lambda p: p.claim_round(todo)))
            await settled(round_claim)  # its error is read (and logged) next
            tokens = answer(round_claim)
            if tokens is not None and prep.key in tokens:
                return Claim.new_key(prep.key, tokens[prep.key])
            new = tokens is None  # else the key existed: the full claim at once
        if new and reentrant is None and self.claims_here:
            claim = await self._claim_new(msg, prep)
            if claim is not None:
                return claim
            new = False
        return await self._thread(lambda p: p.claim_alone(msg, prep, reentrant, new=new))

    async def _round(self, todo: list[Wanted]) -> Tokens:
        conn = await self.conns.take()
        try:
            return await claim_round_async(self.store, conn, todo,
                                           self.steps.settings.lease_seconds)
        finally:
            await self.conns.give_back(conn)

    async def _claim_new(self, msg: Message, prep: Prepared) -> Claim | None:
        """A new key claimed and committed in one round trip here, or ``None``."""
        conn = await self.conns.take()
        try:
            with self.steps.tracing.step(msg, "claim"):
                return await self.store.claim_new_async(
                    conn, key=prep.key, request_hash=prep.request_hash,
                    delivery=delivery(self.steps.handler(msg), msg),
                    lease_seconds=self.steps.settings.lease_seconds)
        finally:
            await self.conns.give_back(conn)

    async def _execute(
        self, handler: Handler[Any], msg: Message, prep: Prepared, claim: Claim,
        hold: Hold | None, gate: Gate,
    ) -> Result:
        """BEGIN, the handler, the fenced completion, COMMIT, in the sync path's one
        round trip (:meth:`Steps._run_pipelined`); on the handler's error, the failure
        is recorded in its own transaction on a thread. The handler's call holds a slot
        of ``gate`` (taken before the connection, given back as the call returns)."""
        assert claim.token is not None
        await gate.enter_async()
        try:
            conn = await self.conns.take()
        except BaseException:
            gate.leave()
            raise
        try:
            ctx = self.steps.context(conn, handler, msg, prep, claim, cls=AsyncContext)
            assert isinstance(ctx, AsyncContext)
            if hold is not None:
                ctx._lease_lost = hold.lost
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
        verdict = await self._thread(
            lambda p: p.steps.record_failure_alone(handler, msg, prep, claim, failure))
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
                    await self.store.complete_async(
                        conn, key=prep.key, token=claim.token, result=result, wait=False)
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
        if handler.reconcile is not None and reconcile_first(claim, reconciler=True):
            done = await handler.reconcile(prep.model, ctx)  # type: ignore[misc]
            if isinstance(done, Done):
                log.info("reconciled", extra={"action": "reconciled", "key": prep.key})
                return done.result, "reconciled"
        spent = last_chance_spent(claim, prep.key)
        if spent is not None:
            raise spent
        return await handler(prep.model, ctx), "succeeded"
