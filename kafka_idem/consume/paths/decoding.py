"""Every path's first step: a message decoded by its handler's codec, validated, its
key and request hash built (:class:`~kafka_idem.consume.outcome.Prepared`), or the
:class:`~kafka_idem.errors.MessageError` that says why it never can be. A base of
:class:`~kafka_idem.consume.paths.steps.Steps`, which adds what becomes of such a
message (its dead letter)."""

from __future__ import annotations

from typing import Any

from kafka_idem.consume.outcome import Ahead, Message, Prepared
from kafka_idem.errors import FrameworkError, InvalidPayload, MessageError
from kafka_idem.handler import Handler
from kafka_idem.keys import check_key, hash_payload
from kafka_idem.settings import Settings


class Decoding:
    """Decoding a message as its handler says (needs only ``settings``)."""

    settings: Settings

    def prepare(self, handler: Handler[Any], msg: Message) -> Prepared:
        """Decode, validate, build key and hash; raise a MessageError when impossible."""
        model = handler.decode(msg.value())  # the handler's codec: bytes -> validated payload
        key = check_key(handler.key.build(model), self.settings.key_max_bytes,
                        escaped=handler.key.escapes)
        try:
            digest = hash_payload(model, handler.hash_fields)
        except (ValueError, TypeError, ArithmeticError) as exc:  # NaN, infinity, naive datetime
            raise InvalidPayload(f"the request hash cannot be computed: {exc}") from exc
        shard = None if handler.shard is None else check_key(
            handler.shard.build(model, key), self.settings.key_max_bytes,
            escaped=handler.shard.escapes)
        return Prepared(model, key, digest, shard)

    def prepare_ahead(self, handler: Handler[Any], msg: Message) -> Prepared | MessageError | None:
        """:meth:`prepare` in the loop thread as the message is queued, so a batch worker
        need not decode it (``local_workers > 0``). ``None`` (decoded again where it
        runs, as without this) for anything but a result or a message's own fault: a
        framework error there is retried or held, never charged."""
        try:
            return self.prepare(handler, msg)
        except MessageError as exc:
            return exc
        except Exception:
            return None

    def prepared(self, handler: Handler[Any], msg: Message, ahead: Ahead | None) -> Prepared:
        """:meth:`prepare`, or what the loop thread made of ``msg`` ahead (raised again
        when it is why the message cannot be decoded)."""
        got = None if ahead is None else ahead.get(
            (msg.topic(), msg.partition()), {}).get(msg.offset())
        if got is None:
            return self.prepare(handler, msg)
        if isinstance(got, MessageError):
            raise got
        return got

    def key_of(self, handler: Handler[Any], msg: Message) -> str | None:
        """``msg``'s key, or ``None`` when none can be built."""
        try:
            return self.prepare(handler, msg).key
        except (MessageError, FrameworkError):
            return None
