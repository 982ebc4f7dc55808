"""Idempotency keys can't collide: every field value is used as it is, except that '%',
the template's separators (the characters of its literal text that are not letters or
digits) and the control characters are percent-encoded (%XX per UTF-8 byte, upper-case
hex). No stripping, no truncation.

The rule, for the payments template ``"{tenant_id}:charge:{order_id}"`` (separator
``:``)::

    build({"tenant_id": "a:charge:x", "order_id": "y"})  == "a%3Acharge%3Ax:charge:y"
    build({"tenant_id": "a", "order_id": "x:charge:y"})  == "a:charge:x%3Acharge%3Ay"
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import string
import unicodedata
import uuid
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from typing_extensions import TypedDict

from kafka_idem import App, errors, keys
from kafka_idem.errors import ConfigError, MessageError
from kafka_idem.keys import KeyTemplate

TEMPLATE = "{tenant_id}:charge:{order_id}"
LINE_BREAKS = ("\u2028", "\u2029")


def literal_text(template: str) -> str:
    """The template's separators: its literal characters that are not letters or digits."""
    text = "".join(t for t, _name, _spec, _conv in string.Formatter().parse(template))
    return "".join(c for c in text if not c.isalnum())


def must_escape(ch: str, literal: str) -> bool:
    return ch == "%" or ch in literal or unicodedata.category(ch) == "Cc" or ch in LINE_BREAKS


def escape(value: str, literal: str) -> str:
    """The rule, written out: the reference the implementation is compared with."""
    return "".join(
        "".join(f"%{b:02X}" for b in ch.encode("utf-8")) if must_escape(ch, literal) else ch
        for ch in value
    )


def reference_key(tenant_id: str, order_id: str) -> str:
    lit = literal_text(TEMPLATE)
    return f"{escape(tenant_id, lit)}:charge:{escape(order_id, lit)}"


def build(tenant_id: Any, order_id: Any) -> str:
    return KeyTemplate(TEMPLATE).build({"tenant_id": tenant_id, "order_id": order_id})


def checked(key: str) -> str:
    """What a member does with a built key before storing it: ``build`` may refuse a bad
    key itself, or leave that to the module's ``check_key`` (when there is one)."""
    check = getattr(keys, "check_key", None)
    if check is None:
        return key
    return check(key, getattr(keys, "DEFAULT_KEY_MAX_BYTES", 1024))  # type: ignore[no-any-return]


def invalid_key_class() -> type[BaseException]:
    cls: type[BaseException] | None = getattr(errors, "InvalidKey", None)
    if cls is None:
        pytest.fail("kafka_idem.errors has no InvalidKey")
    return cls


# --- the rule, by example ------------------------------------------------------


def test_plain_values_are_used_as_they_are() -> None:
    assert build("t1", "o9") == "t1:charge:o9"
    assert build("T-7", "id-123/x") == "T-7:charge:id-123/x"
    assert build("T_1.x", "ü€日本") == "T_1.x:charge:ü€日本"


@pytest.mark.parametrize(
    ("tenant_id", "order_id", "key"),
    [
        # the separator of ":charge:" -- ':' (its letters are no separators)
        ("a:charge:x", "y", "a%3Acharge%3Ax:charge:y"),
        ("a", "x:charge:y", "a:charge:x%3Acharge%3Ay"),
        ("t1", "o:1", "t1:charge:o%3A1"),
        # '%' itself, so an escape in a value can't pose as an escaped character
        ("t1", "50%", "t1:charge:50%25"),
        ("t1", "%3A", "t1:charge:%253A"),
        # control characters (Cc) and the Unicode line/paragraph separators
        ("t\x00", "o1", "t%00:charge:o1"),
        ("t1", "o1\nFORGED", "t1:charge:o1%0AFORGED"),
        ("t1", "o\r1", "t1:charge:o%0D1"),
        ("t1", "o\t1", "t1:charge:o%091"),
        ("t1", "o\x1b[31m", "t1:charge:o%1B[31m"),
        ("t1", "o\x7f", "t1:charge:o%7F"),
        ("t1", "o\x85", "t1:charge:o%C2%85"),
        ("t1", "o\u2028x", "t1:charge:o%E2%80%A8x"),
        ("t1", "o\u2029x", "t1:charge:o%E2%80%A9x"),
        # not escaped: spaces, other letters, other punctuation, non-ASCII text
        ("t1", "a b", "t1:charge:a b"),
        ("t1", "{x}/\\'\"", "t1:charge:{x}/\\'\""),
        ("t1", "\u200b\ufeffé", "t1:charge:\u200b\ufeffé"),
    ],
)
def test_percent_separators_and_controls_are_percent_encoded(
    tenant_id: str, order_id: str, key: str
) -> None:
    assert build(tenant_id, order_id) == key
    assert key == reference_key(tenant_id, order_id)  # the table agrees with the rule


def test_escapes_are_per_utf8_byte_in_upper_case_hex() -> None:
    template = KeyTemplate("{a}→{b}")  # a non-ASCII literal character: three UTF-8 bytes
    assert template.build({"a": "x→y", "b": "z"}) == "x%E2%86%92y→z"
    assert template.build({"a": "\x1b", "b": "ß"}) == "%1B→ß"  # never lower-case "%1b"


def test_fields_that_would_collide_unescaped_are_different_keys() -> None:
    assert build("a:charge:x", "y") != build("a", "x:charge:y")
    assert build("t1", "o1%3Ax") != build("t1", "o1:x")


def test_values_are_not_stripped() -> None:
    assert build(" t1", "o1 ") == " t1:charge:o1 "
    assert build("t1", " spaced ") != build("t1", "spaced")
    assert build("t1", "\tx") == "t1:charge:%09x"


@pytest.mark.parametrize("value", ["\ud800", "x\udfffy", "\udc80"])
def test_lone_surrogates_are_an_invalid_key(value: str) -> None:
    invalid = invalid_key_class()
    assert issubclass(invalid, MessageError)  # a message's fault: permanent, dead-lettered
    with pytest.raises(invalid):
        checked(build("t1", value))
    with pytest.raises(invalid):
        checked(build(value, "o1"))


class _AB(BaseModel):
    a: str
    b: str
    amount: int


@pytest.mark.parametrize("template", ["{a}{b}", "x:{a}{b}", "{a}{b}:x", "{a}x{b}", "{a}2{b}"])
def test_adjacent_fields_without_literal_text_are_refused_at_registration(template: str) -> None:
    app = App("keys", group_id="keys")
    with pytest.raises(ConfigError):
        app.handler(topic="t", model=_AB, key=template, hash_fields=("amount",))(
            lambda msg, ctx: None
        )


# --- properties ------------------------------------------------------------------

# Key field values: arbitrary text without surrogates, weighted towards the characters
# the rule cares about, and never blank (a blank field is MissingKeyField: test_request_hash.py).
_SPECIAL = [":", "%", "c", "h", "a", "r", "g", "e", ":charge:", "%3A", "%25", "\x00", "\n",
            "\r", "\x1f", "\x7f", "\x85", "\u2028", "\u2029", " ", "é", "→", "\U0001f600"]
_piece = st.one_of(
    st.sampled_from(_SPECIAL),
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=4),
)
values = st.lists(_piece, min_size=1, max_size=8).map("".join).filter(lambda v: bool(v.strip()))


@settings(max_examples=400, deadline=None)
@given(values, values)
def test_keys_follow_the_escaping_rule(tenant_id: str, order_id: str) -> None:
    assert build(tenant_id, order_id) == reference_key(tenant_id, order_id)


@settings(max_examples=400, deadline=None)
@given(st.tuples(values, values), st.tuples(values, values))
def test_distinct_field_values_give_distinct_keys(
    first: tuple[str, str], second: tuple[str, str]
) -> None:
    if first != second:
        assert build(*first) != build(*second)
    else:
        assert build(*first) == build(*second)


@settings(max_examples=400, deadline=None)
@given(values, values)
def test_keys_contain_no_control_characters(tenant_id: str, order_id: str) -> None:
    key = build(tenant_id, order_id)
    assert not [ch for ch in key if unicodedata.category(ch) == "Cc" or ch in LINE_BREAKS]
    assert key.count(":charge:") == 1  # the literal text appears once: the separator


# --- without a model: key fields take strings only ---------------------------------------
#
# A handler registered with model=None gets the codec's raw value (a dict from JSON): the
# sender chooses each field's type. str() would give {"tenant": 7} and {"tenant": "7"} one
# key (true and "True", [1, 2] and "[1, 2]" too), so a key decoded back into more than one
# tuple of values. A template field must hold a string there: anything else is InvalidKey
# (permanent: dead-lettered, replayable once the app declares a model).

RAW = "{tenant}:raw:{order}"


def raw_key(tenant: Any, order: Any = "a") -> str:
    return KeyTemplate(RAW, strings_only=True).build({"tenant": tenant, "order": order})


@pytest.mark.parametrize(("value", "kind", "shares"), [
    (7, "number", '(7 and "7" would share a key)'),
    (-1, "number", '(7 and "7" would share a key)'),
    (7.5, "number", '(7 and "7" would share a key)'),
    (Decimal("7.00"), "number", '(7 and "7" would share a key)'),
    (True, "boolean", '(true and "True" would share a key)'),
    (False, "boolean", '(true and "True" would share a key)'),
    ([1, 2], "array", '([1, 2] and "[1, 2]" would share a key)'),
    ([], "array", '([1, 2] and "[1, 2]" would share a key)'),
    ({"a": 1}, "object", '({"a": 1} and "{\'a\': 1}" would share a key)'),
    ({}, "object", '({"a": 1} and "{\'a\': 1}" would share a key)'),
])
@pytest.mark.parametrize("where", ["tenant", "order"])
def test_without_a_model_a_key_field_that_is_not_a_string_is_an_invalid_key(
    value: Any, kind: str, shares: str, where: str,
) -> None:
    payload = {"tenant": "7", "order": "a", where: value}
    with pytest.raises(errors.InvalidKey) as info:
        KeyTemplate(RAW, strings_only=True).build(payload)
    assert info.value.context == {"field": where}
    assert info.value.message == (
        f"key field {where!r} holds a JSON {kind}, not a string: without a model a key "
        f"takes strings only {shares}; declare model= with the field's type, or build the "
        "key with a function")
    assert issubclass(errors.InvalidKey, MessageError)  # permanent: dead-lettered


def test_without_a_model_a_number_and_its_text_no_longer_share_a_key() -> None:
    assert raw_key("7") == "7:raw:a"
    for other in (7, 7.0, Decimal(7)):
        with pytest.raises(errors.InvalidKey):
            raw_key(other)
    assert raw_key("True") == "True:raw:a"
    with pytest.raises(errors.InvalidKey):
        raw_key(True)
    # what the same template built before (and still builds with a model): one key
    assert KeyTemplate(RAW).build({"tenant": 7, "order": "a"}) == raw_key("7")


def test_without_a_model_a_null_is_invalid_and_an_absent_or_blank_field_is_missing() -> None:
    template = KeyTemplate(RAW, strings_only=True)
    with pytest.raises(errors.InvalidKey) as null:
        template.build({"tenant": None, "order": "a"})
    assert null.value.context == {"field": "tenant"}
    assert null.value.message == (
        "key field 'tenant' holds a JSON null, not a string: without a model a key takes "
        "strings only; declare model= with the field's type, or build the key with a "
        "function")
    for payload in ({"order": "a"}, {"tenant": "", "order": "a"}, {"tenant": " \t", "order": "a"}):
        with pytest.raises(errors.MissingKeyField) as missing:
            template.build(payload)
        assert missing.value.context == {"field": "tenant"}
    # an object payload (not a mapping): an attribute that is None is a null, a missing one absent
    class Payload:
        order = "a"

    with pytest.raises(errors.MissingKeyField):
        template.build(Payload())
    Payload.tenant = None  # type: ignore[attr-defined]
    with pytest.raises(errors.InvalidKey):
        template.build(Payload())


def test_without_a_model_strings_are_escaped_as_before_and_a_uuid_is_its_text() -> None:
    template = KeyTemplate(RAW, strings_only=True)
    for tenant, order in [("t1", "o9"), ("a:raw:x", "y"), ("50%", "o\n1"), (" 7", "7 ")]:
        assert template.build({"tenant": tenant, "order": order}) == \
            KeyTemplate(RAW).build({"tenant": tenant, "order": order})
    # Avro's uuid logical type: a string on the wire, a UUID once read
    value = uuid.UUID("8c7f6e52-0d4e-4d6b-9a51-1f0f2a3b4c5d")
    assert template.build({"tenant": value, "order": "a"}) == f"{value}:raw:a"


def test_without_a_model_another_python_type_is_refused_naming_its_type() -> None:
    with pytest.raises(errors.InvalidKey) as info:
        raw_key(dt.date(2025, 1, 31))
    assert info.value.message.startswith(
        "key field 'tenant' holds a date value, not a string: without a model a key takes "
        "strings only; declare model=")
    assert "2025" not in str(info.value)  # never the value


def test_a_key_function_is_not_held_to_strings() -> None:
    template = KeyTemplate(lambda p: f"{p['tenant']}:raw:{p['order']}", strings_only=True)
    assert template.build({"tenant": 7, "order": "a"}) == "7:raw:a"


class _Typed(BaseModel):
    tenant: int
    order: str


@dataclasses.dataclass
class _TypedDC:
    tenant: int
    order: str


class _TypedTD(TypedDict):
    tenant: int
    order: str


def _raw_handler(app: App, **options: Any) -> Any:
    return app.handler(**{"topic": "raw", "key": RAW, "hash_fields": ("order",),
                          "format": "json", **options})(lambda msg, ctx: None)


def test_a_handler_without_a_model_refuses_json_numbers_in_its_key() -> None:
    h = _raw_handler(App("raw"))
    assert h.key.strings_only
    assert h.key.build(h.decode(b'{"tenant": "7", "order": "a"}')) == "7:raw:a"
    for body in (b'{"tenant": 7, "order": "a"}', b'{"tenant": true, "order": "a"}',
                 b'{"tenant": null, "order": "a"}', b'{"tenant": [1, 2], "order": "a"}',
                 b'{"tenant": {"a": 1}, "order": "a"}', b'{"tenant": 7.5, "order": "a"}'):
        with pytest.raises(errors.InvalidKey, match="key field 'tenant' holds a JSON "):
            h.key.build(h.decode(body))
    with pytest.raises(errors.MissingKeyField):
        h.key.build(h.decode(b'{"order": "a"}'))


@pytest.mark.parametrize("model", [_Typed, _TypedDC, _TypedTD])
def test_a_handler_with_a_model_builds_its_keys_as_before(model: Any) -> None:
    """The upgrade path: ``tenant: int`` gives str(7) = "7", the key the same message had
    without a model before the rule, so earlier records stay reachable."""
    h = _raw_handler(App("raw"), model=model)
    assert not h.key.strings_only
    assert h.key.build(h.decode(b'{"tenant": 7, "order": "a"}')) == "7:raw:a"
    assert h.key.build(h.decode(b'{"tenant": "7", "order": "a"}')) == "7:raw:a"


def test_an_ordering_key_without_a_model_still_takes_any_value() -> None:
    """An ordering key only orders work, it never deduplicates: unchanged."""
    h = _raw_handler(App("raw"), ordering_key="{tenant}", mode="leased", concurrency=4)
    assert h.ordering is not None and not h.ordering.strings_only
    payload = h.decode(b'{"tenant": 7, "order": "a"}')
    assert h.ordering.build(payload) == "7"
