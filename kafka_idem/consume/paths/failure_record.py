"""What the failure record of a handler's error says, decided with no I/O: shared by
the sync paths (:meth:`Steps.record_failure
<kafka_idem.consume.paths.steps.Steps.record_failure>`, ``Store.fail``) and the
``async def`` path (``Steps.record_failure_async``, ``Store.fail_async``), so both
record the same status, kind, delay, error class and message."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from kafka_idem.consume.paths.verdicts import Failing, error_of, failing
from kafka_idem.errors import RetryLimitReached
from kafka_idem.handler import Handler
from kafka_idem.retry import RetryPolicy
from kafka_idem.store import Claim


@dataclass(frozen=True, slots=True)
class Recording:
    """A failure about to be recorded: the decision, the error's class and its message
    as stored."""

    failing: Failing
    error_class: str
    message: str

    def fail_args(self, key: str, token: uuid.UUID | None) -> dict[str, Any]:
        """``Store.fail``'s arguments, fenced by ``token`` (the attempt's claim's)."""
        assert token is not None
        f = self.failing
        return {"key": key, "token": token, "status": f.status, "kind": f.kind,
                "error_class": self.error_class, "error_message": self.message,
                "delay": f.delay}


def recording(handler: Handler[Any], claim: Claim, exc: BaseException, *,
              policy: RetryPolicy, message_max: int) -> Recording:
    """What recording ``exc``, the attempt's failure under ``claim``, means
    (:func:`~kafka_idem.consume.paths.verdicts.failing` decides)."""
    error_class, message = error_of(exc, message_max)
    f = failing(handler.classify(exc), claim=claim, policy=policy,
                limit_reached=isinstance(exc, RetryLimitReached),
                reconciler=handler.reconcile is not None,
                defect=handler.code_defect(exc))
    return Recording(f, error_class, f.stored_message(message, message_max))
