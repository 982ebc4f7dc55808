"""What the test kit does around a handler's calls: the faults of a scenario.

The harness runs a copy of the app whose handlers (the function, the bulk form and
the reconciler) are wrapped once; each scenario sets a :class:`Plan` saying what
happens right after the user's code returns: a crash (:class:`Crash`), an error
(``Retryable`` every time, ``UnknownOutcome`` once), or a callback (another owner
taking the lease over). Everything else is the framework's own code.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import psycopg

from kafka_idem.app import App
from kafka_idem.handler import Context, Handler


class Crash(BaseException):
    """The simulated death of the process at this point.

    A ``BaseException``: the message path catches ``Exception`` (a handler's failure)
    and never this, so it leaves the processor the way a killed process leaves the
    database: every transaction open in it rolls back (its context managers send the
    ``ROLLBACK`` a dead session gets from the server), and whatever committed before
    stays, a leased claim and its lease included."""


Kind = Literal["handler", "bulk", "reconcile"]


@dataclass(frozen=True)
class Call:
    """One call of user code the kit saw."""

    kind: Kind
    handler: str
    tx: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]  # the handler's (ctx.tx)
    keys: tuple[str, ...]
    attempt: int | None  # the context's attempt (None for a bulk call)


@dataclass
class Plan:
    """What happens after the user's code returns, for the next ``times`` calls of the
    handler or its bulk form (``None``: every call). ``entered`` is told of every
    call, reconcilers included, before the user's code runs."""

    after: Callable[[Call], None] | None = None
    times: int | None = 1
    entered: Callable[[Call], None] | None = None


class Hooks:
    """The wrappers of one harness's handlers, and the plan they follow."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plan: Plan | None = None
        self.calls: list[Call] = []

    def install(self, app: App) -> None:
        """Wrap every handler of ``app`` (a copy: see :meth:`App.derived`)."""
        for handler in app.handlers.values():
            self._wrap(handler)

    @contextmanager
    def using(self, plan: Plan) -> Iterator[Plan]:
        with self._lock:
            self._plan = plan
        try:
            yield plan
        finally:
            with self._lock:
                self._plan = None

    def forget(self) -> None:
        with self._lock:
            self.calls.clear()

    def count(self, kind: Kind | None = None) -> int:
        with self._lock:
            return sum(1 for c in self.calls if kind is None or c.kind == kind)

    # --- the wrappers -------------------------------------------------------------

    def _enter(self, call: Call) -> Plan | None:
        with self._lock:
            self.calls.append(call)
            plan = self._plan
        if plan is not None and plan.entered is not None:
            plan.entered(call)
        return plan

    def _after(self, plan: Plan | None, call: Call) -> None:
        if plan is None or plan.after is None or call.kind == "reconcile":
            return
        with self._lock:
            if plan.times is not None:
                if plan.times <= 0:
                    return
                plan.times -= 1
        plan.after(call)

    def _wrap(self, handler: Handler[Any]) -> None:
        fn, bulk, reconcile = handler.fn, handler.bulk, handler.reconcile

        if handler.is_async:  # wrapped as coroutines: the plan follows the await
            self._wrap_async(handler)
            return

        def run(msg: Any, ctx: Context) -> Any:
            call = Call("handler", handler.name, ctx.tx, (ctx.idempotency_key,), ctx.attempt)
            plan = self._enter(call)
            result = fn(msg, ctx)
            self._after(plan, call)
            return result

        handler.fn = run
        if bulk is not None:
            def run_bulk(batch: list[tuple[Any, Context]], tx: psycopg.Connection[Any]) -> Any:
                call = Call("bulk", handler.name, tx,
                            tuple(ctx.idempotency_key for _, ctx in batch), None)
                plan = self._enter(call)
                results = bulk(batch, tx)
                self._after(plan, call)
                return results

            handler.bulk = run_bulk
        if reconcile is not None:
            def run_reconcile(msg: Any, ctx: Context) -> Any:
                self._enter(Call("reconcile", handler.name, ctx.tx, (ctx.idempotency_key,),
                                 ctx.attempt))
                return reconcile(msg, ctx)

            handler.reconcile = run_reconcile

    def _wrap_async(self, handler: Handler[Any]) -> None:
        """An ``async def`` handler's wrappers (leased: no batch path runs a bulk form):
        the plan runs after the user's coroutine returned, on the processor's loop."""
        fn, reconcile = handler.fn, handler.reconcile

        async def run(msg: Any, ctx: Context) -> Any:
            call = Call("handler", handler.name, ctx.tx, (ctx.idempotency_key,), ctx.attempt)
            plan = self._enter(call)
            result = await fn(msg, ctx)
            self._after(plan, call)
            return result

        handler.fn = run
        if reconcile is not None:
            async def run_reconcile(msg: Any, ctx: Context) -> Any:
                self._enter(Call("reconcile", handler.name, ctx.tx, (ctx.idempotency_key,),
                                 ctx.attempt))
                return await reconcile(msg, ctx)  # type: ignore[misc]

            handler.reconcile = run_reconcile
