"""Idempotency keys and request hashes.

The **key** names one business operation and is built from payload fields only,
from a template such as ``"{tenant_id}:charge:{order_id}"``. Never offsets,
timestamps or random values, so redelivery, producer retries and replays all
map to the same key.

The **request hash** is a digest of the canonical form of the business fields
that make two requests "the same". Canonical form v1:

* objects: keys sorted, no insignificant whitespace (compact JSON);
* numbers (int, Decimal, float): the shortest plain decimal text, so ``10``,
  ``10.0`` and ``Decimal("10.00")`` are all ``10``; ``-0`` is ``0``;
* booleans stay ``true``/``false`` (never the numbers 1/0); ``None`` is ``null``;
* datetimes: ISO 8601 in UTC; dates ISO; UUIDs lower-case text; enums by value;
* strings as they are (no case or Unicode folding).

    >>> request_hash({"amount": Decimal("10.00"), "currency": "EUR"})
    'v1:sha256:...'

The digest is prefixed with its rule version (``v1:sha256:``) so a future rule
can coexist with stored v1 digests instead of silently changing them.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import hashlib
import json
import re
import string
import uuid
from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal
from typing import Any

from pydantic import BaseModel

from kafka_idem.errors import ConfigError, InvalidKey, MissingKeyField

HASH_VERSION = "v1"
MAX_EXPONENT = 4096  # decimal exponents of hashed numbers (far beyond any amount)

KeySpec = str | Callable[[Any], str]


def canonical_number(value: int | float | Decimal) -> str:
    """``10``, ``10.0`` and ``Decimal('10.00')`` all give ``'10'``."""
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("NaN and infinity have no canonical form")
        value = Decimal(repr(value))
    return _decimal_text(Decimal(value))


def _decimal_text(d: Decimal) -> str:
    """:func:`canonical_number` of a :class:`~decimal.Decimal`."""
    if not d.is_finite():
        raise ValueError("NaN and infinity have no canonical form")
    if d.is_zero():
        return "0"
    if abs(d.adjusted()) > MAX_EXPONENT:
        # Plain decimal text of 1E+999999999 is a billion characters: refuse, don't hang.
        raise ValueError(f"a number beyond 1E+/-{MAX_EXPONENT} has no canonical form")
    text = format(d.normalize(), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def _canonical(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | Decimal):
        return canonical_number(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, enum.Enum):
        return _canonical(value.value)
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            raise ValueError("naive datetimes have no canonical form; attach a timezone")
        return json.dumps(value.astimezone(dt.UTC).isoformat())
    if isinstance(value, dt.date):
        return json.dumps(value.isoformat())
    if isinstance(value, uuid.UUID):
        return json.dumps(str(value))
    if isinstance(value, bytes):
        return json.dumps(value.hex())
    if isinstance(value, BaseModel):
        return _canonical(value.model_dump())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _canonical({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    if isinstance(value, Mapping):
        items = sorted((str(k), v) for k, v in value.items())
        return "{" + ",".join(f"{json.dumps(k)}:{_canonical(v)}" for k, v in items) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_canonical(v) for v in value) + "]"
    raise TypeError(f"no canonical form for {type(value).__name__}")


# The fast path of the common case (below) writes a string's JSON text itself only
# when ``json.dumps`` would add nothing but the quotes. Values are dumped with
# ensure_ascii=False, which escapes only '"', '\\' and the control characters
# U+0000-U+001F; keys with the default ensure_ascii=True, which also escapes
# everything outside printable ASCII (U+0020-U+007E, DEL and non-ASCII included).
_PLAIN_VALUE = re.compile(r'[^\x00-\x1f"\\]*')
_PLAIN_KEY = re.compile(r'[ !#-\[\]-~]*')


def _flat_canonical(fields: dict[Any, Any]) -> str | None:
    """:func:`_canonical` of a flat dict of ``str`` keys and ``str`` / ``int`` /
    ``Decimal`` / ``bool`` / ``None`` values (exact types: no subclasses, enums or
    nesting), without the generic dispatch and with ``json.dumps`` only for the
    strings that need escaping; ``None`` for any other dict (the caller then
    takes the generic path). Same text, byte for byte: a property test compares both.
    """
    try:
        names = sorted(fields)  # the generic path sorts (str(k), v): the same for str keys
    except TypeError:
        return None
    parts = []
    for name in names:
        if type(name) is not str:
            return None
        value = fields[name]
        kind = type(value)
        if kind is str:
            text = f'"{value}"' if _PLAIN_VALUE.fullmatch(value) else json.dumps(
                value, ensure_ascii=False)
        elif kind is Decimal:
            text = _decimal_text(value)
        elif value is None:
            text = "null"
        elif kind is bool:
            text = "true" if value else "false"
        elif kind is int:
            text = canonical_number(value)
        else:
            return None
        key = f'"{name}"' if _PLAIN_KEY.fullmatch(name) else json.dumps(name)
        parts.append(f"{key}:{text}")
    return "{" + ",".join(parts) + "}"


def canonical_json(fields: Mapping[str, Any]) -> str:
    """The v1 canonical text of a mapping of business fields."""
    if type(fields) is dict:
        text = _flat_canonical(fields)
        if text is not None:
            return text
    return _canonical(fields)


def request_hash(fields: Mapping[str, Any]) -> str:
    """``v1:sha256:<hex>`` of the canonical form of ``fields``."""
    digest = hashlib.sha256(canonical_json(fields).encode("utf-8")).hexdigest()
    return f"{HASH_VERSION}:sha256:{digest}"


def _field(payload: Any, name: str) -> Any:
    if isinstance(payload, Mapping):
        return payload.get(name)
    return getattr(payload, name, None)


def hash_payload(payload: Any, fields: Iterable[str]) -> str:
    """Request hash of the named fields of a model or mapping (missing fields hash as null)."""
    if isinstance(payload, Mapping):
        return request_hash({name: payload.get(name) for name in fields})
    return request_hash({name: getattr(payload, name, None) for name in fields})


# Characters never written raw into a key: control characters (C0, DEL, C1) and the
# Unicode line/paragraph separators, so a key can't forge a log line or a terminal row.
_CONTROL = "\x00-\x1f\x7f-\x9f\u2028\u2029"
_HAS_CONTROL = re.compile(f"[{_CONTROL}]")
DEFAULT_KEY_MAX_BYTES = 1024


def _percent(match: re.Match[str]) -> str:
    return "".join(f"%{b:02X}" for b in match.group().encode("utf-8"))


def _separator(c: str) -> bool:
    return not c.isalnum()


def check_key(key: str, max_bytes: int, *, escaped: bool = False) -> str:
    """``key`` if it can be stored as it is; else :class:`InvalidKey`.

    A key is refused, never cut or cleaned: two intents must not meet in one key.
    ``escaped``: built by a template, so it has no control character to look for.
    """
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidKey("the key is not valid Unicode (a lone surrogate)") from None
    if size > max_bytes:
        raise InvalidKey(
            f"the key is {size} bytes, over the limit of {max_bytes} (setting key_max_bytes)"
        )
    if not escaped and _HAS_CONTROL.search(key):
        raise InvalidKey("the key contains a control character")
    return key


# Without a model, what each JSON type of a non-string key field would collide with if
# it were turned into text (a null has no entry: it never built a key, it was refused
# as a missing field before the rule).
_SHARED_WITH = {
    "number": '7 and "7"',
    "boolean": 'true and "True"',
    "array": '[1, 2] and "[1, 2]"',
    "object": '{"a": 1} and "{\'a\': 1}"',
}


def _json_type(value: Any) -> str | None:
    """The JSON type of a decoded value that is not a string (``None``: none of them)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float | Decimal):
        return "number"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, list | tuple):
        return "array"
    return None


def _string_field(payload: Any, name: str, value: Any) -> str:
    """The text of key field ``name`` of a payload without a model, whose ``value`` is
    not exactly a ``str``: a ``str`` subclass or a UUID (Avro's ``uuid`` logical type,
    a string on the wire) as ``str()`` gives it; ``""`` when the field is absent (the
    caller's :class:`MissingKeyField`); anything else an :class:`InvalidKey` naming
    the field and its type, never its value."""
    if isinstance(value, str | uuid.UUID):
        return str(value)
    if value is None and not (name in payload if isinstance(payload, Mapping)
                              else hasattr(payload, name)):
        return ""
    kind = _json_type(value)
    what = f"a JSON {kind}" if kind is not None else f"a {type(value).__name__} value"
    shared = f" ({_SHARED_WITH[kind]} would share a key)" if kind in _SHARED_WITH else ""
    raise InvalidKey(
        f"key field {name!r} holds {what}, not a string: without a model a key takes "
        f"strings only{shared}; declare model= with the field's type, or build the key "
        "with a function", field=name)


def refuse_typed_key_fields(typed: Mapping[str, str], where: str) -> None:
    """At start, for a handler without a model: :class:`ConfigError` naming the key
    template fields whose schema type (``typed``: field -> type, from ``where``) never
    holds a string, as every message would then be dead-lettered (see
    :class:`KeyTemplate`, ``strings_only``)."""
    if typed:
        fields = ", ".join(f"{f!r} ({t})" for f, t in typed.items())
        raise ConfigError(
            f"key field(s) {fields} of {where} never hold a string: without a model a key "
            "takes strings only, so every message would be dead-lettered; declare model= "
            "with the field's type, or build the key with a function", setting="key")


class KeyTemplate:
    """Builds ``tenant:operation:business-id`` keys from payload fields.

    >>> KeyTemplate("{tenant_id}:charge:{order_id}").build({"tenant_id": "t1", "order_id": "o9"})
    't1:charge:o9'

    Field values are used as they are (never stripped), except that ``%``, the
    template's separators (the characters of its own text that are not letters or
    digits: here ``:``) and control characters are percent-encoded (``%3A`` for
    ``:``), so no value can imitate a separator: two different sets of values
    always give two different keys. Two fields must have a separator between them.

    >>> KeyTemplate("{tenant_id}:charge:{order_id}").build({"tenant_id": "a:b", "order_id": "7"})
    'a%3Ab:charge:7'

    A field that is missing, empty or only whitespace is a :class:`MissingKeyField`.

    ``strings_only`` (a handler without a model, whose payload is the codec's raw
    value): a field must hold a string. A number, a boolean, a null, a list or an
    object is an :class:`InvalidKey`, since ``str()`` would give ``7`` and ``"7"``
    (or ``true`` and ``"True"``) one key, and the key would no longer decode back
    into one tuple of values. With a model, the model types the values and they are
    used as ``str()`` gives them.

    >>> KeyTemplate("{tenant}:raw:{order}", strings_only=True).build({"tenant": 7, "order": "a"})
    Traceback (most recent call last):
    kafka_idem.errors.InvalidKey: key field 'tenant' holds a JSON number, not a string: ...
    """

    def __init__(self, spec: KeySpec, *, setting: str = "key",
                 strings_only: bool = False) -> None:
        """``setting``: the argument ``spec`` was given as, named by its errors.
        ``strings_only``: refuse template field values that are not strings (see the
        class docs); no effect on a key function."""
        self.spec = spec
        self.fields: tuple[str, ...] = ()
        self.strings_only = strings_only
        self._escape: re.Pattern[str] | None = None
        if isinstance(spec, str):
            parsed = list(string.Formatter().parse(spec))
            names = [name for _, name, _, _ in parsed if name is not None]
            if not names:
                raise ConfigError(
                    f"{setting} template {spec!r} names no payload field; use e.g. "
                    + ("'{tenant_id}'" if setting in ("ordering_key", "shard_key")
                       else "'{tenant_id}:charge:{order_id}'"),
                    setting=setting,
                )
            for i, (literal, name, fmt, conv) in enumerate(parsed):
                if name is None:
                    continue
                if not name.isidentifier():
                    raise ConfigError(f"{setting} template field {name!r} is not a field name",
                                      setting=setting)
                if fmt or conv:
                    raise ConfigError(
                        f"{setting} template field {name!r} has a format or conversion; "
                        "use a key function for that", setting=setting)
                if i > 0 and not any(_separator(c) for c in literal):
                    raise ConfigError(
                        f"{setting} template {spec!r} has two fields with no separator between "
                        "them, so their values could run into each other; put e.g. ':' "
                        "between them", setting=setting)
            seps = sorted({c for lit, _, _, _ in parsed for c in lit if _separator(c)})
            specials = "".join(re.escape(c) for c in ["%", *seps])
            self._escape = re.compile(f"[{specials}{_CONTROL}]")
            self.fields = tuple(names)
        elif not callable(spec):
            raise ConfigError(f"{setting} must be a template string or a callable", setting=setting)

    @property
    def escapes(self) -> bool:
        """Whether :meth:`build` escapes (a template) or not (a key function)."""
        return self._escape is not None

    def build(self, payload: Any) -> str:
        """The key of ``payload``. Template keys are escaped (see the class docs); a key
        function's result is used as it is."""
        if self._escape is not None:
            assert isinstance(self.spec, str)
            escape = self._escape
            strings_only = self.strings_only
            values: dict[str, str] = {}
            for name in self.fields:
                value = _field(payload, name)
                if type(value) is str:
                    text = value
                elif strings_only:
                    text = _string_field(payload, name, value)
                else:
                    text = "" if value is None else str(value)
                if not text or text.isspace():
                    raise MissingKeyField(f"key field {name!r} is missing or blank", field=name)
                values[name] = escape.sub(_percent, text) if escape.search(text) else text
            return self.spec.format(**values)
        assert callable(self.spec)
        key = self.spec(payload)
        if not isinstance(key, str) or not key or key.isspace():
            raise MissingKeyField("the key function returned an empty key")
        return key
