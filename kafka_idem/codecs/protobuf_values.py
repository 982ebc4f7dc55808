"""Protobuf messages <-> plain Python values (what a handler's model validates, what the
request hash is computed from), field by field from the message's descriptor.

Read (:func:`to_python`): scalars as Python values (every integer type an ``int``, never
the JSON mapping's string for 64-bit ones), enums by name, ``bytes`` as bytes, repeated
fields as lists, maps as dicts, messages as dicts; the well-known types as the values
they stand for (``Timestamp`` an aware UTC ``datetime``, ``Duration`` a ``timedelta``,
the wrappers their value, ``Struct``/``Value``/``ListValue`` dicts and lists,
``confluent.type.Decimal`` and ``google.type.Decimal`` a ``Decimal``). A field with
presence (a message field, ``optional``, a oneof member) that is not set is left out,
so the model's default applies (or it is reported missing); a proto3 scalar without
presence is always there (its zero value when not sent: that is the wire format).

Write (:func:`from_python`): the reverse, for producers; a name the message does not
have is a ``ValueError`` (a field would be dropped silently otherwise).

    >>> to_python(OrderPlacedPb(order_id="o1", items=2))
    {'order_id': 'o1', 'items': 2, ...}
"""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal
from typing import Any

from google.protobuf import descriptor_pb2, json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

WRAPPERS = frozenset(f"google.protobuf.{kind}Value" for kind in (
    "Double", "Float", "Int64", "UInt64", "Int32", "UInt32", "Bool", "String", "Bytes"))
DECIMALS = frozenset(("confluent.type.Decimal", "google.type.Decimal"))
STRUCTS = frozenset(("google.protobuf.Struct", "google.protobuf.Value",
                     "google.protobuf.ListValue"))


# --- message -> Python --------------------------------------------------------------


def _is_map(field: FieldDescriptor) -> bool:
    return bool(field.message_type is not None and field.message_type.GetOptions().map_entry)


def _decimal(msg: Any) -> Decimal:
    from confluent_kafka.schema_registry.confluent.type.decimal_utils import from_proto_decimal

    return from_proto_decimal(msg)


WELL_KNOWN: dict[str, Callable[[Any], Any]] = {
    "google.protobuf.Timestamp": lambda m: m.ToDatetime(tzinfo=dt.UTC),
    "google.protobuf.Duration": lambda m: m.ToTimedelta(),
    **{name: (lambda m: m.value) for name in WRAPPERS},
    **{name: json_format.MessageToDict for name in STRUCTS},
    "confluent.type.Decimal": _decimal,
    "google.type.Decimal": lambda m: Decimal(m.value),
}

# Per message type, how to read each field: (name, presence, shape, convert), worked
# out once (a descriptor's options and types looked up per message would cost more
# than the parse).
Step = tuple[str, bool, str, Callable[[Any], Any] | None]
_PLANS: dict[Any, tuple[Step, ...]] = {}


def _converter(field: FieldDescriptor) -> Callable[[Any], Any] | None:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        known: Callable[[Any], Any] = WELL_KNOWN.get(field.message_type.full_name, to_python)
        return known
    if field.type == FieldDescriptor.TYPE_ENUM:
        names = {v.number: v.name for v in field.enum_type.values}
        return lambda v: names.get(v, v)  # an open enum's unknown number stays a number
    return None


def _plan(descriptor: Descriptor) -> tuple[Step, ...]:
    plan = _PLANS.get(descriptor)
    if plan is None:
        steps: list[Step] = []
        for field in descriptor.fields:
            if _is_map(field):
                steps.append((field.name, False, "map",
                              _converter(field.message_type.fields_by_name["value"])))
            elif field.is_repeated:
                steps.append((field.name, False, "list", _converter(field)))
            else:
                steps.append((field.name, field.has_presence, "one", _converter(field)))
        plan = _PLANS[descriptor] = tuple(steps)
    return plan


def to_python(msg: Message) -> dict[str, Any]:
    """The fields of ``msg`` as plain Python values (module docstring)."""
    out: dict[str, Any] = {}
    for name, presence, shape, convert in _plan(msg.DESCRIPTOR):
        if presence and not msg.HasField(name):
            continue
        value = getattr(msg, name)
        if shape == "one":
            out[name] = value if convert is None else convert(value)
        elif shape == "list":
            out[name] = list(value) if convert is None else [convert(v) for v in value]
        else:
            out[name] = dict(value) if convert is None else \
                {k: convert(v) for k, v in value.items()}
    return out


# --- Python -> message --------------------------------------------------------------


def _scalar(field: FieldDescriptor, value: Any) -> Any:
    """``value`` as the Python type protobuf accepts for ``field``."""
    if isinstance(value, enum.Enum):
        value = value.value
    kind = field.type
    if kind == FieldDescriptor.TYPE_ENUM and isinstance(value, str):
        symbol = field.enum_type.values_by_name.get(value)
        if symbol is None:
            raise ValueError(f"{field.full_name}: {value!r} is not a value of "
                             f"{field.enum_type.full_name}")
        return symbol.number
    if kind == FieldDescriptor.TYPE_STRING and isinstance(value, Decimal | uuid.UUID):
        return str(value)
    if kind == FieldDescriptor.TYPE_STRING and isinstance(value, dt.date | dt.time):
        return value.isoformat()
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT) and \
            isinstance(value, Decimal):
        return float(value)
    return value


def _set_well_known(target: Message, value: Any) -> bool:
    """Set a well-known message from the value it stands for; ``False``: not one of them."""
    name = target.DESCRIPTOR.full_name
    setters: dict[str, Callable[[], None]] = {
        "google.protobuf.Timestamp": lambda: target.FromDatetime(value),
        "google.protobuf.Duration": lambda: target.FromTimedelta(value),
        "google.type.Decimal": lambda: setattr(target, "value", str(value)),
    }
    if name in setters:
        setters[name]()
    elif name in WRAPPERS:
        target.value = _scalar(target.DESCRIPTOR.fields_by_name["value"], value)
    elif name in STRUCTS:
        json_format.ParseDict(value, target)
    elif name == "confluent.type.Decimal":
        from confluent_kafka.schema_registry.confluent.type.decimal_utils import to_proto_decimal

        target.CopyFrom(to_proto_decimal(Decimal(value)))
    else:
        return False
    return True


def _set_message(target: Message, value: Any) -> None:
    if isinstance(value, Message):
        target.CopyFrom(value)
    elif not _set_well_known(target, value):
        if not isinstance(value, Mapping):
            raise ValueError(f"{target.DESCRIPTOR.full_name}: a mapping is needed, "
                             f"not {type(value).__name__}")
        fill(target, value)
    target.SetInParent()  # an empty sub-message is still a set field


def fill(msg: Message, values: Mapping[str, Any]) -> Message:
    """Set ``msg``'s fields from ``values`` (a ``None`` value leaves the field unset)."""
    fields = msg.DESCRIPTOR.fields_by_name
    for name, value in values.items():
        field = fields.get(name)
        if field is None:
            raise ValueError(f"Protobuf message {msg.DESCRIPTOR.full_name} has no field "
                             f"{name!r}")
        if value is None:
            continue
        container = getattr(msg, name)
        if _is_map(field):
            entry = field.message_type.fields_by_name["value"]
            for k, v in value.items():
                if entry.type == FieldDescriptor.TYPE_MESSAGE:
                    _set_message(container[k], v)
                else:
                    container[k] = _scalar(entry, v)
        elif field.is_repeated:
            for item in value:
                if field.type == FieldDescriptor.TYPE_MESSAGE:
                    _set_message(container.add(), item)
                else:
                    container.append(_scalar(field, item))
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            _set_message(container, value)
        else:
            setattr(msg, name, _scalar(field, value))
    return msg


def from_python(message: type[Message], values: Mapping[str, Any]) -> Message:
    """A new ``message`` with its fields set from ``values``."""
    return fill(message(), values)


def field_names(descriptor: Descriptor) -> tuple[str, ...]:
    return tuple(f.name for f in descriptor.fields)


def non_string_fields(descriptor: Descriptor, names: Iterable[str]) -> dict[str, str]:
    """The fields named ``names`` that :func:`to_python` never reads as a string, each
    with its type: not a ``string``, an enum (read as its value's name) or a
    ``google.protobuf.StringValue``; repeated fields and maps never are. Names the
    message lacks are left out."""
    found: dict[str, str] = {}
    for name in dict.fromkeys(names):
        field = descriptor.fields_by_name.get(name)
        if field is None:
            continue
        if _is_map(field) or field.is_repeated:
            found[name] = "map" if _is_map(field) else "repeated"
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.full_name != "google.protobuf.StringValue":
                found[name] = field.message_type.full_name
        elif field.type not in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_ENUM):
            found[name] = descriptor_pb2.FieldDescriptorProto.Type.Name(
                field.type).removeprefix("TYPE_").lower()
    return found


__all__ = ["fill", "from_python", "non_string_fields", "to_python"]
