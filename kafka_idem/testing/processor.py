"""The kit's processor: one consumer process of the test kit, a
:class:`~kafka_idem.consume.paths.processor.Processor` that also runs ``async def`` handlers.

A consumer runs an ``async def`` leased handler on its event loop through
:class:`~kafka_idem.consume.paths.async_leased_path.AsyncLeasedPath`: the claim, the
handler's transaction and the failure record, each on an async connection of the
loop's. The kit does the same with one event loop per processor (a thread of its own,
so a test that is itself ``async`` can deliver too) and its own async connections
(one message at a time, so one connection), and the processor waits for the answer.
A fault of the kit (a crash, a held key) blocks that loop only, as it blocks the one
process it belongs to.
"""

from __future__ import annotations

import contextlib
import uuid

from kafka_idem.app import App
from kafka_idem.consume.concurrency.event_loop import EventLoop, run_closers
from kafka_idem.consume.outcome import Message, Prepared, Result
from kafka_idem.consume.paths.async_connections import AsyncConnections
from kafka_idem.consume.paths.async_leased_path import AsyncLeasedPath
from kafka_idem.consume.paths.processor import Processor
from kafka_idem.consume.paths.round_claim import RoundClaim
from kafka_idem.consume.paths.slots import Gate
from kafka_idem.observe.metrics import Metrics
from kafka_idem.store import Store

STOP_SECONDS = 5.0


class KitProcessor(Processor):
    """A processor of the kit: sync handlers as :class:`Processor` runs them, an
    ``async def`` leased one on the framework's async path, on an event loop of its own."""

    def __init__(self, app: App, *, store: Store, metrics: Metrics) -> None:
        super().__init__(app, store=store, metrics=metrics)
        self._loop: EventLoop | None = None
        self._conns: AsyncConnections | None = None
        self._aio: AsyncLeasedPath | None = None

    @property
    def has_async(self) -> bool:
        return any(h.is_async for h in self.app.handlers.values())

    def run_leased(
        self, msg: Message, *, reentrant: uuid.UUID | None = None,
        prepared: Prepared | None = None, round: RoundClaim | None = None,
        gate: Gate | None = None,
    ) -> Result:
        if not self.steps.handler(msg).is_async:
            return super().run_leased(msg, reentrant=reentrant, prepared=prepared, round=round,
                                      gate=gate)
        # decoded as the sync path decodes (a message that cannot be: the same result)
        prep = prepared if prepared is not None else self.leased_path.prepare(msg, reentrant)
        if not isinstance(prep, Prepared):
            return prep
        loop, aio = self._async()
        return loop.submit(aio.run(msg, prep, reentrant, round, gate)).result()

    def backends(self) -> frozenset[int]:
        """The server process ids of this processor's connections (opened now): its sync
        one and, when the app has ``async def`` handlers, the async one they run on
        (one at a time in the kit, so always the same while it stays open)."""
        pids = {self.connection().info.backend_pid}
        if self.has_async:
            loop, _ = self._async()
            pids.add(loop.submit(self._async_backend()).result())
        return frozenset(pids)

    async def _async_backend(self) -> int:
        assert self._conns is not None
        conn = await self._conns.take()
        try:
            return conn.info.backend_pid
        finally:
            await self._conns.give_back(conn)

    def _async(self) -> tuple[EventLoop, AsyncLeasedPath]:
        if self._loop is None or self._aio is None:
            self._conns = AsyncConnections(
                self.settings, application_name=f"kafka_idem:{self.app.name}")
            self._aio = AsyncLeasedPath(self.app, steps=self.steps, leases=self.leases,
                                        conns=self._conns)
            self._loop = EventLoop(name="kafka-idem-kit-async")
        return self._loop, self._aio

    def close(self) -> None:
        """Close the async connections and stop the loop, then the sync connection."""
        loop, conns = self._loop, self._conns
        self._loop = self._aio = self._conns = None
        if loop is not None and conns is not None:
            with contextlib.suppress(Exception):  # the app's on_loop_close, as a member's
                loop.submit(run_closers(self.app.loop_closers)).result(STOP_SECONDS)
            with contextlib.suppress(Exception):
                loop.submit(conns.close()).result(STOP_SECONDS)
            loop.stop(STOP_SECONDS)
        super().close()
