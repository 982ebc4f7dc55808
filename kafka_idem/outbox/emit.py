"""What ``ctx.emit`` does: an event encoded with its topic's codec, given its slot
and shard, kept on the context, and written with the handler's transaction right
before the fenced completion (:meth:`Emitter.flush`), so it exists if and only if
the effect committed.

Buffering the events until the completion lets a transaction lock its key slots in
one sorted statement: two transactions (e.g. two batches) emitting the same keys
in different orders cannot deadlock on them.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from kafka_idem.codecs.base import Codec, validation_reasons
from kafka_idem.errors import ConfigError, InvalidEvent
from kafka_idem.observe.tracing import current_trace
from kafka_idem.store import AsyncConn, Conn, Delivery, Event, Store

if TYPE_CHECKING:
    from kafka_idem.handler import Context

# Key slots: the lock that orders same-key transactions. Many more than shards, so
# transactions emitting different keys rarely wait for each other: two batches of 500
# keys share a slot about one time in five (with 1024 slots, always), and the slot
# rows (created on first use) stay a small table.
SLOTS = 1 << 20

RESERVED = "idem."  # header names the relay sets


def slot_of(key: bytes | None, idem_key: str) -> int:
    """The slot of an event: of its Kafka key, else of the intent's idempotency key
    (a stable hash: every process agrees)."""
    return zlib.crc32(key if key is not None else idem_key.encode()) % SLOTS


def shard_of(slot: int, shards: int) -> int:
    """Same slot, same shard: a key's events are published by one relay, in order."""
    return slot % shards


class EventTopic(Protocol):
    """An ``app.event_topic`` declaration: its codec, bound on first use (a
    :class:`~kafka_idem.handler.Handler`)."""

    @property
    def codec(self) -> Codec: ...


class Emitter:
    """An app's side of the outbox (``app.outbox``): the codecs of its event topics,
    the events' shards, the statements that write them.

    ``event_topics``: the app's declarations by topic (read at each ``ctx.emit``, so a
    topic declared later is seen); ``store``: the app's store, in its namespace;
    ``shards``: the ``outbox_shards`` setting; ``app``: the app's name, for errors."""

    def __init__(self, event_topics: Mapping[str, EventTopic], *, store: Store, shards: int,
                 app: str) -> None:
        self.event_topics = event_topics
        self.store = store
        self.shards = shards
        self.app_name = app

    def codec(self, topic: str) -> Codec:
        """``topic``'s codec: its ``app.event_topic`` declaration's (bound on first use)."""
        declared = self.event_topics.get(topic)
        if declared is None:
            raise ConfigError(
                f"ctx.emit: topic {topic!r} is not an event topic of app {self.app_name!r}: "
                f"declare it with app.event_topic({topic!r}, format=..., model=...)",
                setting="event_topic")
        return declared.codec

    def event(
        self, ctx: Context, topic: str, value: Any, *, key: str | bytes | None,
        headers: Mapping[str, str | bytes] | None,
    ) -> Event:
        """The event ``ctx``'s handler emits (encoded now: a value its codec refuses
        fails the handler, like any of its errors; ``None`` is a tombstone)."""
        codec = self.codec(topic)
        if key is not None and not isinstance(key, str | bytes):
            raise TypeError(f"ctx.emit({topic!r}): key= must be str, bytes or None, "
                            f"not {type(key).__name__}")
        try:
            data = value if value is None or isinstance(value, bytes) else codec.encode(value)
        except ValidationError as exc:
            # pydantic's own text quotes the input values: the reason names paths only
            raise InvalidEvent(f"ctx.emit({topic!r}): the event does not validate against "
                               f"{exc.title}: {validation_reasons(exc)}") from None
        raw_key = key.encode() if isinstance(key, str) else key
        if headers is not None and not isinstance(headers, Mapping):
            raise TypeError(f"ctx.emit({topic!r}): headers= must be a mapping of str to "
                            f"str or bytes, not {type(headers).__name__}")
        pairs: list[tuple[str, bytes]] = []
        for name, v in (headers or {}).items():
            if not isinstance(name, str):
                raise TypeError(f"ctx.emit({topic!r}): header names must be str, "
                                f"not {type(name).__name__}")
            if name.startswith(RESERVED):
                raise ConfigError(f"ctx.emit: header {name!r}: names starting with "
                                  f"{RESERVED!r} are set by kafka_idem", setting="headers")
            if not isinstance(v, str | bytes):
                raise TypeError(f"ctx.emit({topic!r}): header {name!r} must be str or bytes, "
                                f"not {type(v).__name__}")
            pairs.append((name, v.encode() if isinstance(v, str) else v))
        if not any(n in ("traceparent", "tracestate") for n, _ in pairs):
            pairs.extend(current_trace(ctx.headers))
        slot = slot_of(raw_key, ctx.idempotency_key)
        return Event(topic=topic, key=raw_key, value=data, headers=tuple(pairs),
                     idem_key=ctx.idempotency_key, slot=slot,
                     shard=shard_of(slot, self.shards),
                     source=Delivery(ctx.topic, ctx.partition, ctx.offset, ctx.handler),
                     shard_key=ctx.shard_key)

    def flush(self, conn: Conn, *contexts: Context, wake: set[str] | None = None) -> None:
        """Write the events of ``contexts`` in the open transaction (right before the
        completion) and forget them: a rollback removes them with the effect, and a
        re-run of the handler emits again. ``wake``: notify the relays later, not at
        this commit (see :meth:`~kafka_idem.store.Store.outbox_write`)."""
        events = _take(contexts)
        if events:
            self.store.outbox_write(conn, events, wake=wake)

    async def flush_async(self, conn: AsyncConn, ctx: Context) -> None:
        """:meth:`flush` on an async connection."""
        events = _take((ctx,))
        if events:
            await self.store.outbox_write_async(conn, events)


def _take(contexts: tuple[Context, ...]) -> list[Event]:
    events: list[Event] = []
    for ctx in contexts:
        events.extend(ctx.take_events())
    return events
