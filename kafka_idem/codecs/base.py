"""Payload codecs: bytes on the wire <-> the handler's payload, behind one interface.

A :class:`Codec` decodes a message value into the handler's payload (validated
into its model) and encodes a payload into the bytes producers send; its
``name`` is put in logs and in dead letters' ``idem.error.message``. Built in:

* ``"json"`` (:class:`~kafka_idem.codecs.json_codec.JsonCodec`): UTF-8 JSON, validated
  straight from the bytes
  by pydantic's JSON parser (``TypeAdapter.validate_json``); no model, a dict.
* ``"avro"`` (:class:`~kafka_idem.codecs.avro_codec.AvroObjectCodec`): Avro *single-object encoding*
  (``C3 01`` + the 8-byte CRC-64-AVRO fingerprint of the writer schema + the
  body), writer schemas from the ``.avsc`` files of ``schemas_dir``
  (:class:`~kafka_idem.codecs.avro_codec.AvroCodec`), read with the handler's reader schema.
* ``"registry"`` (:class:`kafka_idem.codecs.registry.RegistryCodec`): Confluent's wire
  format (byte ``0`` + a 4-byte big-endian schema id + the body) for Avro and
  JSON Schema, schemas resolved through a Schema Registry.
* ``ProtobufCodec(MyMessage)`` (:class:`kafka_idem.codecs.protobuf.ProtobufCodec`, a
  :class:`CodecFactory`): Confluent's wire format for Protobuf (the message indexes
  after the schema id), the ``protobuf`` extra.

A handler picks one with ``format=`` (or any object with ``name``, ``decode`` and
``encode``); the app binds it (:meth:`kafka_idem.app.App.codec`)::

    >>> codec = app.handlers["payments.charge-requested"].codec
    >>> codec.decode(codec.encode(ChargeRequested(...)))  # -> ChargeRequested(...)
"""

from __future__ import annotations

import dataclasses
import struct
import typing
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from pydantic import (
    BaseModel,
    PydanticSchemaGenerationError,
    PydanticUserError,
    TypeAdapter,
    ValidationError,
)
from typing_extensions import is_typeddict

from kafka_idem.errors import ConfigError, InvalidPayload

SINGLE_OBJECT_MAGIC = b"\xc3\x01"
CONFLUENT_MAGIC = 0
FORMATS = ("json", "avro", "registry")
"""The payload formats a handler's ``format=`` names (``default_format`` picks one for
handlers that name none); a :class:`Codec` or :class:`CodecFactory` may be given instead."""


@runtime_checkable
class Codec(Protocol):
    """Bytes <-> payload for one handler.

    ``decode`` raises :class:`~kafka_idem.errors.Undecodable` (the bytes are not
    this format), :class:`~kafka_idem.errors.InvalidPayload` (they are, but do not
    fit the model) or a :class:`~kafka_idem.errors.FrameworkError` (it cannot tell
    now, e.g. the schema registry is down: retried, never charged to the message).
    """

    name: str

    def decode(self, data: bytes) -> Any:
        """The message value as the handler's payload (raises as said above)."""
        ...

    def encode(self, payload: Any) -> bytes:
        """``payload`` as the bytes a handler of this format reads."""
        ...


@runtime_checkable
class CodecFactory(Protocol):
    """A codec that needs its app to work (the registry client, the handler's topic and
    model), e.g. :class:`kafka_idem.codecs.protobuf.ProtobufCodec`. Given as ``format=``, the app
    calls ``for_handler`` when it binds the handler and uses the codec returned as it is
    (it validates into the model itself)."""

    def for_handler(self, app: Any, handler: Any) -> Codec:
        """The codec of ``handler`` in ``app``, made when the app binds it."""
        ...


# --- models -------------------------------------------------------------------


def adapter_for(model: Any, *, handler: str) -> TypeAdapter[Any]:
    """The pydantic ``TypeAdapter`` of a handler's model: a pydantic model, a dataclass,
    a TypedDict (or ``None``: a plain dict). Anything else is a :class:`ConfigError`
    naming the handler, raised when the handler is registered."""
    if model is None:
        return TypeAdapter(dict[str, Any])
    if not (isinstance(model, type) and issubclass(model, BaseModel)) and not (
        dataclasses.is_dataclass(model) and isinstance(model, type)) and not is_typeddict(model):
        raise ConfigError(
            f"handler {handler!r}: model must be a pydantic model, a dataclass or a TypedDict "
            f"(or None for a dict), not {model!r}", setting="model")
    try:
        return TypeAdapter(model)
    except (PydanticSchemaGenerationError, PydanticUserError, TypeError, NameError) as exc:
        raise ConfigError(f"handler {handler!r}: pydantic cannot validate model "
                          f"{getattr(model, '__name__', model)}: {exc}", setting="model") from exc


def fields_of(model: Any) -> tuple[str, ...] | None:
    """The field names of a model (``None``: any field, a plain dict)."""
    if model is None:
        return None
    if isinstance(model, type) and issubclass(model, BaseModel):
        return tuple(model.model_fields)
    if dataclasses.is_dataclass(model):
        return tuple(f.name for f in dataclasses.fields(model))
    if is_typeddict(model):
        return tuple(typing.get_type_hints(model))
    return None


def required_fields(model: Any) -> list[str]:
    """The fields a payload must carry to validate into ``model`` (by the name validation
    reads: a pydantic alias if the field has one)."""
    if isinstance(model, type) and issubclass(model, BaseModel):
        return [info.alias if isinstance(info.alias, str) else name
                for name, info in model.model_fields.items() if info.is_required()]
    if dataclasses.is_dataclass(model):
        return [f.name for f in dataclasses.fields(model)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if is_typeddict(model):
        return sorted(model.__required_keys__)
    return []


def _name_of(model: Any, alias: str) -> str | None:
    """The field name behind a pydantic model's alias (a model that also validates by
    name accepts either)."""
    if isinstance(model, type) and issubclass(model, BaseModel):
        for name, info in model.model_fields.items():
            if info.alias == alias or info.validation_alias == alias:
                return name
    return None


def validation_reasons(exc: ValidationError) -> str:
    """Field paths and reasons only: never the payload's values."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors(
            include_url=False, include_input=False)
    )


def validate(adapter: TypeAdapter[Any], record: Any, *, fmt: str) -> Any:
    """``record`` (already decoded) validated into the model, or :class:`InvalidPayload`."""
    try:
        return adapter.validate_python(record)
    except ValidationError as exc:
        raise InvalidPayload(f"{fmt}: payload does not validate: {validation_reasons(exc)}") \
            from exc


def as_python(adapter: TypeAdapter[Any], payload: Any) -> Any:
    """A payload (a model instance, or a mapping that validates into one) as plain Python
    values (dicts, Decimals, datetimes) for a binary encoder."""
    if isinstance(payload, Mapping):
        return dict(payload)
    # another model's instance (or a str) would dump with pydantic's warnings, which
    # quote the value: validated first, it is refused with field paths instead
    return adapter.dump_python(adapter.validate_python(payload))


def sniff(data: bytes) -> str:
    """What the first bytes look like, for an error message (never the payload)."""
    if data[:2] == SINGLE_OBJECT_MAGIC:
        return "Avro single-object encoded (C3 01)"
    if data[0] == CONFLUENT_MAGIC and len(data) >= 5:
        (schema_id,) = struct.unpack(">I", data[1:5])
        return f"Confluent-framed (magic byte 0, schema id {schema_id})"
    if data[:1] in (b"{", b"[", b'"'):
        return "JSON"
    return f"first bytes {data[:4].hex()}"
