"""The idempotency store: every statement kafka_idem runs on its own tables.

* :mod:`~kafka_idem.store.protocol` — :class:`Store`: the claim / complete / fail
  protocol with fencing tokens (sync, and async for ``async def`` handlers), the
  batch path's statements;
* :mod:`~kafka_idem.store.claim_plan` — the claim's decisions, written once as a plan
  that :mod:`~kafka_idem.store.plans` runs on a sync or an async connection;
* :mod:`~kafka_idem.store.connection` — :func:`connect`, :func:`connect_async`: the
  session every connection starts with;
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
)
from kafka_idem.store.connection import connect, connect_async
from kafka_idem.store.errors import (
    classify_db_error,
    describe,
    is_data_error,
    rejected,
    translate_errors,
)
from kafka_idem.store.outbox import CHANNEL
from kafka_idem.store.protocol import Store
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
    "describe",
    "is_data_error",
    "raise_failed_attempt",
    "rejected",
    "translate_errors",
]
