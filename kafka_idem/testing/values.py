"""Payloads the scenario matrix derives from the one a test gives: the same key with
another request (the conflict), and other keys (a batch of several intents).

A field is changed to a nearby value of its type and the result is kept only when it
still decodes and validates (the handler's own codec and model), and its key and
request hash, built by the framework's own code, are what the scenario needs.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

from kafka_idem.consume.outcome import Prepared
from kafka_idem.errors import KafkaIdemError
from kafka_idem.handler import Handler

Prepare = Callable[[bytes], Prepared]


def candidates(value: Any) -> Iterator[Any]:
    """Values near ``value``, of its type, different from it."""
    if isinstance(value, bool):
        yield not value
    elif isinstance(value, int | float | Decimal):
        yield from (value + 1, value + 7, value * 2 + 1)
    elif isinstance(value, str):
        if value:
            yield value + "2"
            yield value[:-1] + chr(ord(value[-1]) + 1)
            yield value[::-1]
        yield "x" + value
    elif isinstance(value, dt.datetime | dt.date):
        yield value + dt.timedelta(days=1)
    elif isinstance(value, uuid.UUID):
        yield uuid.uuid4()
    elif isinstance(value, enum.Enum):
        yield from (m for m in type(value) if m is not value)


def _fields(handler: Handler[Any], model: Any) -> dict[str, Any]:
    dumped = handler.adapter.dump_python(model)
    if isinstance(dumped, dict):
        return dumped
    if dataclasses.is_dataclass(dumped) and not isinstance(dumped, type):
        return {f.name: getattr(dumped, f.name) for f in dataclasses.fields(dumped)}
    raise TypeError(f"cannot read the fields of a {type(dumped).__name__} payload")


def _variants(handler: Handler[Any], model: Any, names: list[str],
              prepare: Prepare) -> Iterator[tuple[str, bytes, Prepared]]:
    fields = _fields(handler, model)
    for name in names:
        for value in candidates(fields.get(name)):
            if value == fields.get(name):
                continue
            try:
                data = handler.encode({**fields, name: value})
                yield name, data, prepare(data)
            except (KafkaIdemError, ValueError, TypeError, ArithmeticError):
                continue  # the model or the codec refuses it: try the next one


def conflicting(handler: Handler[Any], data: bytes, prepare: Prepare) -> bytes | None:
    """Bytes of a payload with ``data``'s key and another request hash, or ``None``."""
    first = prepare(data)
    model = first.model
    fields = list(_fields(handler, model))
    key_fields = set(handler.key.fields)
    order = ([f for f in handler.hash_fields if f not in key_fields]
             + [f for f in handler.hash_fields if f in key_fields]
             + [f for f in fields if f not in handler.hash_fields])
    for _name, other, prep in _variants(handler, model, order, prepare):
        if prep.key == first.key and prep.request_hash != first.request_hash:
            return other
    return None


def other_keys(handler: Handler[Any], data: bytes, prepare: Prepare, n: int) -> list[bytes]:
    """Up to ``n`` payloads like ``data`` with keys of their own (the same request
    otherwise, when a key field is not hashed)."""
    first = prepare(data)
    model = first.model
    fields = list(_fields(handler, model))
    key_fields = list(reversed(handler.key.fields)) or [f for f in fields
                                               if f not in handler.hash_fields]
    found: dict[str, bytes] = {}
    for _name, other, prep in _variants(handler, model, key_fields, prepare):
        if prep.key != first.key and prep.key not in found:
            found[prep.key] = other
            if len(found) == n:
                break
    return list(found.values())
