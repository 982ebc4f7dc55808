"""The one exception hierarchy of kafka_idem.

Three groups users catch or raise:

* :class:`HandlerError` and its leaves are what a *handler* raises to say how
  its failure must be treated: :class:`Retryable`, :class:`Permanent`,
  :class:`UnknownOutcome`.
* :class:`MessageError` covers what is wrong with a *message* before any handler
  runs (undecodable bytes, a missing key field). Always permanent.
* :class:`FrameworkError` covers what is wrong with the framework's own
  surroundings (configuration, store, broker). These are never charged to a
  message: the partition waits and the work is retried.

Each class docstring is its default message. Errors carry the context an
operator needs (topic, partition, offset, key), never secrets or payloads.
"""

from __future__ import annotations

from typing import Any


class KafkaIdemError(Exception):
    """kafka_idem error."""

    def __init__(self, message: str | None = None, **context: Any) -> None:
        self.message = message or (self.__class__.__doc__ or "").strip().splitlines()[0]
        self.context = {k: v for k, v in context.items() if v is not None}
        super().__init__(self.message)

    def __str__(self) -> str:
        if not self.context:
            return self.message
        ctx = ", ".join(f"{k}={v}" for k, v in sorted(self.context.items()))
        return f"{self.message} ({ctx})"


# --- raised by handlers -------------------------------------------------------


class HandlerError(KafkaIdemError):
    """The handler failed."""


class Retryable(HandlerError):
    """Transient failure known to have happened before any side effect; retry with the same key."""


class Permanent(HandlerError):
    """Permanent failure (validation, business rule): dead-letter, never retry."""


class InvalidEvent(Permanent):
    """An event a handler emits (``ctx.emit``) does not validate against its topic's model."""


class RetryLimitReached(HandlerError):
    """The retry limit is reached (raised by the framework, not by handlers)."""


class UnknownOutcome(HandlerError):
    """A request was sent and no answer came back: reconcile before retrying with the same key."""


# --- problems with a message --------------------------------------------------


class ResultNotJSON(TypeError):
    """A handler (or its reconciler's ``Done``, or its bulk form) returned a result that
    cannot be stored as ``result_json``: the handler's own error, a code defect like any
    ``TypeError`` (permanent unless mapped otherwise)."""


class MessageError(KafkaIdemError):
    """The message cannot be processed."""


class Undecodable(MessageError):
    """The message value could not be decoded."""


class PayloadTooLarge(Undecodable):
    """The message value is over the payload size limit (setting payload_max_bytes)."""


class InvalidPayload(MessageError):
    """The decoded payload does not validate against the handler's model."""


class MissingKeyField(MessageError):
    """A field of the idempotency key is missing or blank."""


class InvalidKey(MessageError):
    """The idempotency key cannot be used (too long, not valid Unicode, or without a
    model a key field that holds no string)."""


class DataRejected(MessageError):
    """The database rejected data that came from the message (e.g. a NUL character,
    an invalid byte sequence, a value over a size limit); retrying cannot help."""


# --- the framework's surroundings --------------------------------------------


class FrameworkError(KafkaIdemError):
    """kafka_idem could not do its own work."""


class ConfigError(FrameworkError):
    """Invalid configuration."""


class StoreError(FrameworkError):
    """The idempotency store failed."""


class StoreUnavailable(StoreError):
    """The database is unreachable or the connection was lost (retried, never charged)."""


class TransientStoreError(StoreError):
    """A transient database error (serialization failure, deadlock, lock timeout); retried."""


class IllegalTransition(StoreError):
    """The database refused a state transition."""


class StaleOwner(StoreError):
    """The lease was taken over by another owner; this attempt's writes were rolled back."""


class InternalError(FrameworkError):
    """kafka_idem's own code failed around the handler (a bug of kafka_idem, not of the
    handler or the message); nothing is charged."""


class DeadLetterError(FrameworkError):
    """The dead-letter record could not be produced; the source offset is not committed."""


class BrokerError(FrameworkError):
    """The Kafka client reported an error."""


class DeliveryFailed(BrokerError):
    """Records sent with :meth:`kafka_idem.App.producer` were not acknowledged by Kafka."""

    def __init__(self, message: str | None = None, *,
                 failures: list[tuple[str, bytes | None, str]] | None = None,
                 **context: Any) -> None:
        super().__init__(message, **context)
        self.failures = failures or []  # (topic, Kafka key, error) of each record


class SchemaRegistryUnavailable(FrameworkError):
    """The schema registry could not be asked; the message waits, it is not dead-lettered."""
