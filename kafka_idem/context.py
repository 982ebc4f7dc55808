"""What a handler is given besides its message: :class:`Context` (``ctx``), and
:class:`AsyncContext` for an ``async def`` handler.

``ctx.tx`` is the open psycopg transaction the idempotency record's completion and the
outbox's events share; ``ctx.session`` is a SQLAlchemy ORM session on that same
transaction (:mod:`kafka_idem.orm`, the ``sqlalchemy`` extra).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Generator, Mapping
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import psycopg

from kafka_idem.errors import ConfigError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

    from kafka_idem.orm.sessions import AsyncOpened, Opened, Sessions
    from kafka_idem.store import Event


class EventSink(Protocol):
    """What ``ctx.emit`` encodes its events with: an app's outbox emitter
    (:class:`kafka_idem.outbox.emit.Emitter`, ``app.outbox``)."""

    def event(self, ctx: Context, topic: str, value: Any, *, key: str | bytes | None,
              headers: Mapping[str, str | bytes] | None) -> Event: ...


@dataclass
class Context:
    """What a handler knows about the message it is processing.

    ``tx`` is the open transaction (a psycopg connection inside ``BEGIN``):
    write business rows through it. ``idempotency_key`` is the key to pass
    downstream (e.g. as an ``Idempotency-Key`` HTTP header) so remote side
    effects are deduplicated by the remote side too. ``attempt`` is 1, 2, ...: the
    key's claims so far (the record's ``attempts``), a withdrawn one and those before
    an audited re-run included.

    The framework builds it with its collaborators: ``lost``, the event a leased-mode
    heartbeat sets when the lease is taken over (:attr:`lease_lost`), ``emitter``,
    the app's outbox (``ctx.emit``; :meth:`take_events` hands its events over), and
    ``sessions``, the app's ORM configuration (:attr:`session`).
    """

    tx: psycopg.Connection[Any]
    idempotency_key: str
    request_hash: str
    attempt: int
    handler: str
    topic: str
    partition: int
    offset: int
    timestamp: int | None
    kafka_key: bytes | None
    headers: Mapping[str, bytes] = field(default_factory=dict)
    # the handler's shard_key= for this message (None without one: the key places it)
    shard_key: str | None = None
    lost: InitVar[threading.Event | None] = None
    emitter: InitVar[EventSink | None] = None
    sessions: InitVar[Sessions | None] = None
    _lease_lost: threading.Event | None = field(default=None, init=False, repr=False)
    _emitter: EventSink | None = field(default=None, init=False, repr=False)
    _events: list[Event] = field(default_factory=list, init=False, repr=False)
    _sessions: Sessions | None = field(default=None, init=False, repr=False)
    _opened: Opened | None = field(default=None, init=False, repr=False)

    def __post_init__(self, lost: threading.Event | None, emitter: EventSink | None,
                      sessions: Sessions | None) -> None:
        self._lease_lost = lost
        self._emitter = emitter
        self._sessions = sessions

    @property
    def session(self) -> Session:
        """A SQLAlchemy ORM ``Session`` on :attr:`tx`, inside its transaction (the
        ``sqlalchemy`` extra; options: ``app.sqlalchemy(...)``): what it writes commits
        with the idempotency record and the outbox's events, or not at all. Made at the
        first use, flushed when the handler returns (a flush error is the handler's) and
        closed then; ``commit()``, ``rollback()`` and ``begin()`` raise, as
        ``ctx.tx.commit()`` does (``begin_nested()`` is a savepoint)."""
        if self._opened is None:
            if self._sessions is None:
                raise ConfigError("ctx.session needs the context of a kafka_idem app's "
                                  "handler", setting="sqlalchemy")
            self._opened = self._sessions.open(self.tx)
        return self._opened.session

    def settle_session(self) -> None:
        """The handler returned: flush its session, if it used one, and close it (the
        framework's step before the completion; an error here is the handler's)."""
        opened, self._opened = self._opened, None
        if opened is not None:
            opened.settle()

    def discard_session(self) -> None:
        """The handler raised: close its session, if any, without a statement."""
        opened, self._opened = self._opened, None
        if opened is not None:
            with contextlib.suppress(Exception):  # the handler's own error is what counts
                opened.discard()

    @property
    def lease_lost(self) -> bool:
        """True once a heartbeat found the lease taken over (leased mode): stop early."""
        return self._lease_lost is not None and self._lease_lost.is_set()

    def emit(self, topic: str, value: Any, *, key: str | bytes | None = None,
             headers: Mapping[str, str | bytes] | None = None) -> None:
        """Publish an event to ``topic`` if and only if this handler's effect commits
        (the transactional outbox, docs/OUTBOX.md): the event is encoded now with the
        topic's codec (``app.event_topic``; ``bytes`` pass through as they are, ``None``
        is a tombstone) and
        written to the outbox in this transaction, right before the completion; the
        relay publishes it exactly once, with ``idem.*`` headers naming this intent.
        ``key`` (``str`` is UTF-8) is the Kafka key; events with the same key are
        published in the order their transactions committed."""
        if self._emitter is None:
            raise ConfigError("ctx.emit needs the context of a kafka_idem app's handler",
                              setting="event_topic")
        self._events.append(self._emitter.event(self, topic, value, key=key,
                                                headers=headers))

    def take_events(self) -> list[Event]:
        """The events :meth:`emit` kept, handed over once (the emitter writes them with
        the completion; a re-run of the handler emits again)."""
        events, self._events = self._events, []
        return events


@dataclass
class AsyncContext(Context):
    """An ``async def`` handler's :class:`Context`: ``tx`` is a
    ``psycopg.AsyncConnection`` inside ``BEGIN`` (``await ctx.tx.execute(...)``);
    everything else is the same."""

    tx: psycopg.AsyncConnection[Any]  # type: ignore[assignment]
    _async_opened: AsyncOpened | None = field(default=None, init=False, repr=False)

    @property
    def session(self) -> AsyncSession:  # type: ignore[override]
        """:attr:`Context.session` for an ``async def`` handler: a SQLAlchemy
        ``AsyncSession`` on the handler's async connection (``await
        ctx.session.execute(...)``, ``ctx.session.add(...)``)."""
        if self._async_opened is None:
            if self._sessions is None:
                raise ConfigError("ctx.session needs the context of a kafka_idem app's "
                                  "handler", setting="sqlalchemy")
            self._async_opened = self._sessions.open_async(self.tx)
        return self._async_opened.session

    async def settle_session_async(self) -> None:
        """:meth:`Context.settle_session`, awaited."""
        opened, self._async_opened = self._async_opened, None
        if opened is not None:
            await opened.settle()

    async def discard_session_async(self) -> None:
        """:meth:`Context.discard_session`, awaited."""
        opened, self._async_opened = self._async_opened, None
        if opened is not None:
            with contextlib.suppress(Exception):
                await opened.discard()

    def emit(  # type: ignore[override]
        self, topic: str, value: Any, *, key: str | bytes | None = None,
        headers: Mapping[str, str | bytes] | None = None,
    ) -> Emitted:
        """:meth:`Context.emit`, done at the call: the event is registered now and written
        with the handler's transaction on its async connection, right before the
        completion. It returns an :class:`Emitted` that awaiting does nothing more with,
        so ``await ctx.emit(...)`` and ``ctx.emit(...)`` both emit exactly once (a
        forgotten ``await`` neither drops the event nor warns)."""
        Context.emit(self, topic, value, key=key, headers=headers)
        return EMITTED


class Emitted:
    """What :meth:`AsyncContext.emit` returns: its event is already registered, so
    awaiting it completes at once, with ``None`` (awaiting it is optional, and can be
    done any number of times)."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        yield from ()

    def __repr__(self) -> str:
        return "<emitted>"


EMITTED = Emitted()
