"""JSON payloads: :class:`JsonCodec`, UTF-8 JSON validated into the handler's model by
pydantic's JSON parser (the ``"json"`` format)."""


from __future__ import annotations

import re
from typing import Any

from pydantic import (
    TypeAdapter,
    ValidationError,
)

from kafka_idem.codecs.base import (
    CONFLUENT_MAGIC,
    SINGLE_OBJECT_MAGIC,
    sniff,
    validation_reasons,
)
from kafka_idem.errors import InvalidPayload, Undecodable


class JsonCodec:
    """UTF-8 JSON validated into the model by pydantic's JSON parser (no ``json.loads``).

    Numbers are parsed as IEEE doubles before they reach a ``Decimal`` field, so
    amounts with more than 15 significant digits should be sent as strings
    (``"amount": "10.00"``, which is also what :meth:`encode` writes for a Decimal).
    """

    name = "json"

    def __init__(self, adapter: TypeAdapter[Any] | None = None) -> None:
        self.adapter = adapter or TypeAdapter(dict[str, Any])

    def decode(self, data: bytes) -> Any:
        """``data``, UTF-8 JSON, validated into the model."""
        if not data:
            raise Undecodable("json: empty value")
        if data[:2] == SINGLE_OBJECT_MAGIC or (data[0] == CONFLUENT_MAGIC and len(data) >= 5):
            raise Undecodable(f"json: the value is {sniff(data)}, not JSON")
        try:
            return self.adapter.validate_json(data)
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_input=False)
            if errors and errors[0]["type"] == "json_invalid":
                # pydantic's own text starts "Invalid JSON: ": said once
                why = re.sub(r"^invalid json:?\s*", "", errors[0]["msg"], flags=re.IGNORECASE)
                raise Undecodable(f"json: invalid JSON: {why or 'not JSON'}") from exc
            raise InvalidPayload(
                f"json: payload does not validate: {validation_reasons(exc)}") from exc

    def encode(self, payload: Any) -> bytes:
        """``payload``, validated by the model first, as UTF-8 JSON."""
        # every value is validated (an instance of the model passes as it is): another
        # model's instance or a str is refused, never written as something else
        return self.adapter.dump_json(self.adapter.validate_python(payload))
