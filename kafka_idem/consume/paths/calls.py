"""What a handler's call is given and how the framework's steps around it are judged:
the context (:func:`context`), where the message came from (:func:`delivery`), and
:func:`own_code` around the completion after the handler."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kafka_idem.consume.outcome import Message, Prepared
from kafka_idem.consume.paths.lease_keeper import Hold
from kafka_idem.consume.paths.verdicts import text_of
from kafka_idem.context import Context, EventSink
from kafka_idem.errors import InternalError, ResultNotJSON
from kafka_idem.handler import CODE_DEFECTS, Handler
from kafka_idem.orm.sessions import Sessions
from kafka_idem.store import Delivery


@contextmanager
def own_code(key: str) -> Iterator[None]:
    """Around kafka_idem's own steps of an attempt (the completion after the handler):
    a code defect raised there (:data:`~kafka_idem.handler.CODE_DEFECTS`: a
    ``TypeError`` of kafka_idem, of psycopg or confluent-kafka under it) is no fault of
    the message, so it leaves as :class:`InternalError`, a framework error (the
    partition waits, nothing is charged), never as the handler's permanent failure.
    :class:`ResultNotJSON` stays the handler's: its result cannot be stored."""
    try:
        yield
    except ResultNotJSON:
        raise
    except CODE_DEFECTS as exc:
        raise InternalError(f"{type(exc).__name__}: {text_of(exc)}", key=key) from exc


def delivery(handler: Handler[Any], msg: Message) -> Delivery:
    """Where ``msg`` came from, as the record keeps it (its last delivery)."""
    return Delivery(msg.topic(), msg.partition(), msg.offset(), handler.name)


def context(
    conn: Any, handler: Handler[Any], msg: Message, prep: Prepared, attempt: int,
    cls: type[Context] = Context, *, emitter: EventSink | None = None, hold: Hold | None = None,
    sessions: Sessions | None = None,
) -> Context:
    """What the handler gets for ``msg``: the open transaction and the message's facts
    (``cls`` :class:`AsyncContext` for an ``async def`` handler's async connection),
    the outbox ``emitter`` for ``ctx.emit``, ``hold``'s lease for ``ctx.lease_lost``
    and the app's ``sessions`` for ``ctx.session``."""
    ts_type, ts = msg.timestamp()
    return cls(
        tx=conn,
        idempotency_key=prep.key,
        request_hash=prep.request_hash,
        attempt=attempt,
        handler=handler.name,
        topic=msg.topic(),
        partition=msg.partition(),
        offset=msg.offset(),
        timestamp=ts if ts_type else None,
        kafka_key=msg.key(),
        headers={k: v or b"" for k, v in (msg.headers() or [])}, shard_key=prep.shard,
        lost=hold.lost if hold is not None else None, emitter=emitter, sessions=sessions,
    )
