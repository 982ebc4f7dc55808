"""Source messages decoded exactly as the payments handler decodes them.

:class:`PaymentsDecoder` builds ``consumers.payments``'s handler and uses its
codec, model, key template and hash fields, so a message decodes to the same
:class:`Intent` (idempotency key ``{tenant_id}:charge:{order_id}``, request hash
over amount and currency, whether the example's rule accepts the charge) as in
the consumer, or to the reason it does not decode; :meth:`PaymentsDecoder.event`
decodes an event of the outbox's topic (``payments.ChargeCompleted``) the same
way. :data:`ROOT` is the checkout
the example is imported from (the chaos run starts its members there too).
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kafka_idem.errors import InvalidPayload, MessageError
from kafka_idem.keys import hash_payload

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class Intent:
    key: str
    request_hash: str
    tenant: str
    order: str
    amount: Decimal
    currency: str
    valid: bool


class PaymentsDecoder:
    """Decodes a source message exactly as ``consumers.payments`` does (or says why not)."""

    def __init__(self, topic: str) -> None:
        from consumers import payments

        self.payments = payments
        self.handler = payments.build_app(topic=topic).handlers[topic]
        self.currencies = payments.CURRENCIES

    def __call__(self, value: bytes | None) -> Intent | str:
        h = self.handler
        try:
            model = h.decode(value)  # the handler's own codec
            key = h.key.build(model)
        except InvalidPayload:
            return "invalid payload"
        except MessageError as exc:
            return f"{type(exc).__name__}"
        amount = Decimal(model.amount)
        return Intent(key, hash_payload(model, h.hash_fields), model.tenant_id, model.order_id,
                      amount, model.currency, amount > 0 and model.currency in self.currencies)

    def event(self, value: bytes | None) -> Any:
        """A ``payments.ChargeCompleted`` event (the example's model), or why it is not one."""
        try:
            name, record = self.payments.codec().decode(value)
            if name != self.payments.EVENT_SCHEMA:
                return f"written with {name}, not {self.payments.EVENT_SCHEMA}"
            return self.payments.ChargeCompleted.model_validate(record)
        except (MessageError, ValidationError) as exc:
            return f"undecodable: {type(exc).__name__}"
