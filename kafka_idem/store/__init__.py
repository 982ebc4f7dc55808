"""The idempotency store: every statement kafka_idem runs on its own tables.

* :mod:`~kafka_idem.store.protocol` — :class:`Store`: the claim / complete / fail
  protocol with fencing tokens, the batch path's statements, :func:`connect`;
* :mod:`~kafka_idem.store.admin` — the admin tools' queries (a base of :class:`Store`);
* :mod:`~kafka_idem.store.outbox` — the outbox's statements (a base of :class:`Store`);
* :mod:`~kafka_idem.store.errors` — the one translation of database errors;
* :mod:`~kafka_idem.store.types` — :class:`Claim`, :class:`Outcome`,
  :class:`Delivery`, :class:`Failure`.
"""

from kafka_idem.store.attempt import (
    AsyncAttemptTransaction,
    AttemptTransaction,
    HandlerBlock,
    raise_failed_attempt,
    unmasked,
)
from kafka_idem.store.errors import (
    DATA_SQLSTATE_CLASSES,
    DATA_SQLSTATES,
    ILLEGAL_TRANSITION,
    STALE_OWNER,
    TRANSIENT_SQLSTATES,
    UNAVAILABLE_SQLSTATES,
    classify_db_error,
    data_error_text,
    describe,
    is_data_error,
    raise_attempt_error,
    rejected,
    storable,
    translate_errors,
    translated,
)
from kafka_idem.store.outbox import CHANNEL
from kafka_idem.store.protocol import Store, connect, connect_async
from kafka_idem.store.types import (
    AsyncConn,
    Claim,
    Conn,
    Delivery,
    Event,
    Failure,
    OutboxRow,
    Outcome,
)

__all__ = [
    "CHANNEL",
    "DATA_SQLSTATES",
    "DATA_SQLSTATE_CLASSES",
    "ILLEGAL_TRANSITION",
    "STALE_OWNER",
    "TRANSIENT_SQLSTATES",
    "UNAVAILABLE_SQLSTATES",
    "AsyncAttemptTransaction",
    "AsyncConn",
    "AttemptTransaction",
    "Claim",
    "Conn",
    "Delivery",
    "Event",
    "Failure",
    "HandlerBlock",
    "OutboxRow",
    "Outcome",
    "Store",
    "classify_db_error",
    "connect",
    "connect_async",
    "data_error_text",
    "describe",
    "is_data_error",
    "raise_attempt_error",
    "raise_failed_attempt",
    "rejected",
    "storable",
    "translate_errors",
    "translated",
    "unmasked",
]
