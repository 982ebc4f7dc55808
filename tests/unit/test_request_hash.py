"""Idempotency keys and request hashes: properties of the v1 canonical form."""

from __future__ import annotations

import datetime as dt
import enum
import hashlib
import json
import re
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from kafka_idem.errors import ConfigError, MissingKeyField
from kafka_idem.keys import (
    KeyTemplate,
    _canonical,
    _flat_canonical,
    canonical_json,
    canonical_number,
    hash_payload,
    request_hash,
)

HASH_FORMAT = re.compile(r"^v1:sha256:[0-9a-f]{64}$")

# --- strategies ---------------------------------------------------------------

field_names = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12
)
finite_floats = st.floats(allow_nan=False, allow_infinity=False)
decimals = st.decimals(allow_nan=False, allow_infinity=False, places=None)
safe_ints = st.integers(min_value=-(2**53), max_value=2**53)

# JSON-able values whose JSON text round-trips (floats included: parse_float=Decimal
# reads back the same shortest text json.dumps wrote).
json_scalars = st.none() | st.booleans() | st.integers() | finite_floats | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
json_objects = st.dictionaries(st.text(max_size=10), json_values, max_size=6)


# --- the hash's format --------------------------------------------------------


@given(json_objects)
def test_hash_is_version_prefixed_sha256_hex(fields: dict[str, Any]) -> None:
    assert HASH_FORMAT.match(request_hash(fields))


def test_hash_of_a_known_document_is_stable() -> None:
    # The v1 rule must not drift: a stored digest from yesterday must match today.
    fields = {"currency": "EUR", "amount": Decimal("10.00")}
    assert canonical_json(fields) == '{"amount":10,"currency":"EUR"}'
    digest = hashlib.sha256(b'{"amount":10,"currency":"EUR"}').hexdigest()
    assert request_hash(fields) == f"v1:sha256:{digest}"


# --- what never changes the hash ----------------------------------------------


@given(json_objects, st.data())
def test_field_order_never_changes_the_hash(fields: dict[str, Any], data: Any) -> None:
    items = data.draw(st.permutations(list(fields.items())), label="order")
    reordered = dict(items)
    assert reordered == fields
    assert request_hash(reordered) == request_hash(fields)
    assert request_hash(dict(reversed(list(fields.items())))) == request_hash(fields)


@given(
    st.dictionaries(
        st.text(max_size=6),
        st.dictionaries(st.text(max_size=6), json_scalars, max_size=4),
        max_size=4,
    ),
    st.randoms(use_true_random=False),
)
def test_nested_mappings_are_canonicalised(fields: dict[str, Any], rnd: Any) -> None:
    def shuffle(value: Any) -> Any:
        if isinstance(value, dict):
            items = list(value.items())
            rnd.shuffle(items)
            return {k: shuffle(v) for k, v in items}
        return value

    assert request_hash(shuffle(fields)) == request_hash(fields)


def test_nested_structures_canonical_text() -> None:
    fields = {"b": [{"y": 1.50, "x": Decimal("2.0")}, (True, None)], "a": {"d": "é", "c": -0.0}}
    assert canonical_json(fields) == '{"a":{"c":0,"d":"é"},"b":[{"x":2,"y":1.5},[true,null]]}'


def test_list_order_is_significant() -> None:
    assert request_hash({"items": [1, 2]}) != request_hash({"items": [2, 1]})


@given(
    json_objects,
    st.sampled_from([None, 0, 1, 2, 4, "\t"]),
    st.sampled_from([(",", ":"), (", ", ": "), (" ,  ", " :\n "), (",\n", ":\t")]),
    st.booleans(),
)
def test_json_whitespace_and_key_order_never_change_the_hash(
    fields: dict[str, Any], indent: Any, separators: tuple[str, str], sort_keys: bool
) -> None:
    document = json.dumps(fields, indent=indent, separators=separators, sort_keys=sort_keys)
    compact = json.dumps(fields, separators=(",", ":"))
    # Whatever the layout, reading the document back gives the same hash, and
    # reading numbers as Decimal or as float does not matter either.
    as_decimal = json.loads(document, parse_float=Decimal)
    assert request_hash(as_decimal) == request_hash(json.loads(compact, parse_float=Decimal))
    assert request_hash(as_decimal) == request_hash(json.loads(document))
    assert request_hash(as_decimal) == request_hash(fields)


class Charge(BaseModel):
    tenant_id: str
    order_id: str
    amount: Decimal
    currency: str
    request_id: str
    requested_at: dt.datetime


charges = st.builds(
    Charge,
    tenant_id=st.text(min_size=1, max_size=10),
    order_id=st.text(min_size=1, max_size=10),
    amount=st.decimals(min_value=0, max_value=10**9, places=2),
    currency=st.sampled_from(["EUR", "USD", "JPY"]),
    request_id=st.uuids().map(str),
    requested_at=st.datetimes(timezones=st.just(dt.UTC)),
)


@given(charges, st.uuids().map(str), st.datetimes(timezones=st.just(dt.UTC)))
def test_excluded_metadata_never_changes_the_hash(
    charge: Charge, other_request: str, other_time: dt.datetime
) -> None:
    resent = charge.model_copy(update={"request_id": other_request, "requested_at": other_time})
    hashed = ("amount", "currency")
    assert hash_payload(resent, hashed) == hash_payload(charge, hashed)
    # Same on the plain mapping form, with metadata keys a model doesn't even know.
    as_dict = charge.model_dump()
    noisy = {**as_dict, "trace_id": other_request, "produced_at": other_time, "headers": {"x": 1}}
    assert hash_payload(noisy, hashed) == hash_payload(as_dict, hashed)
    assert hash_payload(as_dict, hashed) == hash_payload(charge, hashed)


def test_hash_payload_ignores_fields_it_is_not_asked_for() -> None:
    a = {"amount": 5, "currency": "EUR", "note": "first"}
    b = {"amount": 5, "currency": "EUR", "note": "second"}
    assert hash_payload(a, ["amount", "currency"]) == hash_payload(b, ["amount", "currency"])
    assert hash_payload(a, ["amount", "currency", "note"]) != hash_payload(
        b, ["amount", "currency", "note"]
    )


# --- the fast path of flat payloads: the generic canonical form, byte for byte -----

# Everything json.dumps escapes (quotes, backslash, control characters; in keys also
# DEL and non-ASCII), next to plain text, non-ASCII, a lone surrogate, U+2028.
tricky_chars = st.sampled_from(
    ['"', "\\", "\x00", "\x01", "\x08", "\t", "\n", "\x0c", "\r", "\x1f", " ", "\x7f",
     "\x80", "\u00e9", "\u20ac", "\u2028", "\ud800", "\U0001f600", "a", "Z", "0", ":", "-",
     "/", "~", "{", "}"]
)
flat_text = st.text(tricky_chars, max_size=12) | st.text(max_size=12)
flat_scalars = (
    st.none() | st.booleans() | st.integers() | st.integers(min_value=10**27, max_value=10**40)
    | st.decimals(allow_nan=False, allow_infinity=False, places=None)
    | st.decimals(min_value=-(10**9), max_value=10**9, places=2) | flat_text
)
flat_dicts = st.dictionaries(flat_text, flat_scalars, max_size=8)


class Color(enum.Enum):
    RED = "red"


class Kind(enum.StrEnum):
    A = "a"


class Text(str):
    pass


others = (
    finite_floats | st.lists(flat_scalars, max_size=3) | st.just(Color.RED) | st.just(Kind.A)
    | st.builds(Text, st.text(max_size=4)) | st.just({"nested": 1})
    | st.datetimes(timezones=st.just(dt.UTC)) | st.uuids() | st.binary(max_size=4)
)


@settings(max_examples=1000)
@given(flat_dicts)
def test_the_fast_path_writes_the_generic_canonical_form(fields: dict[str, Any]) -> None:
    assert _flat_canonical(fields) == _canonical(fields)
    assert canonical_json(fields) == _canonical(fields)


@settings(max_examples=300)
@given(flat_dicts, flat_text, others)
def test_other_values_take_the_generic_path(fields: dict[str, Any], name: str, value: Any) -> None:
    mixed = {**fields, name: value}
    assert _flat_canonical(mixed) is None
    try:
        expected = _canonical(mixed)
    except (TypeError, ValueError) as exc:
        with pytest.raises(type(exc)):
            canonical_json(mixed)
    else:
        assert canonical_json(mixed) == expected


@given(st.dictionaries(st.integers() | flat_text, flat_scalars, min_size=1, max_size=4))
def test_keys_that_are_not_all_str_take_the_generic_path(fields: dict[Any, Any]) -> None:
    assume(any(type(k) is not str for k in fields))
    assert _flat_canonical(fields) is None
    assert canonical_json(fields) == _canonical(fields)


@pytest.mark.parametrize("bad", [Decimal("NaN"), Decimal("-Infinity"), Decimal("sNaN")])
def test_the_fast_path_refuses_what_the_generic_path_refuses(bad: Decimal) -> None:
    fields = {"amount": bad, "currency": "EUR"}
    with pytest.raises(ValueError, match="NaN and infinity"):
        _canonical(fields)
    with pytest.raises(ValueError, match="NaN and infinity"):
        canonical_json(fields)


@given(charges)
def test_a_payments_payload_hashes_as_before(charge: Charge) -> None:
    fields = {"amount": charge.amount, "currency": charge.currency}
    generic = "v1:sha256:" + hashlib.sha256(_canonical(fields).encode()).hexdigest()
    assert hash_payload(charge, ("amount", "currency")) == generic
    assert hash_payload(charge.model_dump(), ("amount", "currency")) == generic
    assert hash_payload(charge, ("amount", "missing")) == "v1:sha256:" + hashlib.sha256(
        _canonical({"amount": charge.amount, "missing": None}).encode()).hexdigest()


# --- numbers ------------------------------------------------------------------


@pytest.mark.parametrize("amount", [10, 10.0, Decimal("10"), Decimal("10.0"), Decimal("10.00"),
                                    Decimal("1E+1"), Decimal("0.01E+3"), "10.00"])
def test_ten_is_ten_whatever_its_spelling(amount: Any) -> None:
    value = Decimal(amount) if isinstance(amount, str) else amount
    assert canonical_number(value) == "10"
    assert request_hash({"amount": value, "currency": "EUR"}) == request_hash(
        {"amount": 10, "currency": "EUR"}
    )


@pytest.mark.parametrize("zero", [0, 0.0, -0.0, Decimal("0"), Decimal("-0.00"), Decimal("0E+5")])
def test_all_zeros_are_zero(zero: Any) -> None:
    assert canonical_number(zero) == "0"


@pytest.mark.parametrize(
    ("value", "text"),
    [(Decimal("1.50"), "1.5"), (1e-7, "0.0000001"), (Decimal("-12.340"), "-12.34"),
     (1e20, "100000000000000000000"), (Decimal("123E-5"), "0.00123")],
)
def test_numbers_are_plain_decimal_text(value: Any, text: str) -> None:
    assert canonical_number(value) == text


@given(safe_ints, st.integers(min_value=0, max_value=4))
def test_int_float_and_decimal_of_equal_value_hash_equal(n: int, zeros: int) -> None:
    spellings = [n, float(n), Decimal(n), Decimal(f"{n}.{'0' * zeros}" if zeros else str(n))]
    hashes = {request_hash({"amount": v}) for v in spellings}
    assert len(hashes) == 1


@given(finite_floats)
def test_a_float_hashes_like_the_decimal_of_its_text(x: float) -> None:
    # What a JSON document says (e.g. 0.1) is what is hashed, whether the reader
    # produced a float or a Decimal from that text.
    assert request_hash({"v": x}) == request_hash({"v": Decimal(repr(x))})
    read_back = json.loads(json.dumps(x), parse_float=Decimal)
    assert request_hash({"v": x}) == request_hash({"v": read_back})


@given(decimals, st.integers(min_value=0, max_value=6))
def test_trailing_zeros_and_exponent_spelling_never_change_the_hash(d: Decimal, extra: int) -> None:
    sign, digits, exponent = d.as_tuple()
    assert isinstance(exponent, int)
    padded = Decimal((sign, (*digits, *([0] * extra)), exponent - extra))  # 1.5 -> 1.500
    assert padded == d
    assert request_hash({"amount": padded}) == request_hash({"amount": d})
    assert request_hash({"amount": d.normalize()}) == request_hash({"amount": d})
    assert request_hash({"amount": Decimal(str(d).lower())}) == request_hash({"amount": d})


def test_bool_is_not_a_number() -> None:
    assert request_hash({"v": True}) != request_hash({"v": 1})
    assert request_hash({"v": False}) != request_hash({"v": 0})
    assert request_hash({"v": True}) != request_hash({"v": Decimal(1)})
    assert canonical_json({"v": True}) == '{"v":true}'


def test_a_number_is_not_its_text() -> None:
    assert request_hash({"amount": 10}) != request_hash({"amount": "10"})


# --- what always changes the hash ---------------------------------------------


@given(
    st.sampled_from(["amount", "currency", "target"]),
    st.data(),
)
def test_any_change_of_a_hashed_business_field_changes_the_hash(field: str, data: Any) -> None:
    strategies = {
        "amount": st.decimals(min_value=-(10**12), max_value=10**12, places=2),
        "currency": st.text(min_size=1, max_size=5),
        "target": st.text(max_size=20) | st.integers() | st.none(),
    }
    base = {"amount": Decimal("10.00"), "currency": "EUR", "target": "acct-1"}
    a = data.draw(strategies[field], label="a")
    b = data.draw(strategies[field], label="b")
    # "Different" means a different business value: 10 and 10.00 are one amount.
    assume(type(a) is not type(b) or a != b)
    assert request_hash({**base, field: a}) != request_hash({**base, field: b})


@given(json_objects, field_names, json_values)
def test_adding_a_hashed_field_changes_the_hash(
    fields: dict[str, Any], name: str, value: Any
) -> None:
    assume(name not in fields)
    assert request_hash({**fields, name: value}) != request_hash(fields)


def test_strings_are_not_case_or_unicode_folded() -> None:
    assert request_hash({"c": "EUR"}) != request_hash({"c": "eur"})
    assert request_hash({"c": "\u00e9"}) != request_hash({"c": "e\u0301"})


# --- values without a canonical form ------------------------------------------


def test_naive_datetimes_are_rejected() -> None:
    with pytest.raises(ValueError, match="naive"):
        request_hash({"at": dt.datetime(2024, 1, 1, 12, 0)})


def test_aware_datetimes_hash_by_instant() -> None:
    utc = dt.datetime(2024, 1, 1, 12, 0, tzinfo=dt.UTC)
    paris = utc.astimezone(dt.timezone(dt.timedelta(hours=1)))
    assert request_hash({"at": paris}) == request_hash({"at": utc})


@pytest.mark.parametrize(
    "bad", [float("nan"), float("inf"), float("-inf"), Decimal("NaN"), Decimal("Infinity"),
            Decimal("-Infinity")]
)
def test_nan_and_infinity_are_rejected(bad: Any) -> None:
    with pytest.raises(ValueError, match="NaN and infinity"):
        request_hash({"amount": bad})
    with pytest.raises(ValueError):
        request_hash({"nested": [{"amount": bad}]})


def test_sets_and_unknown_types_are_rejected() -> None:
    with pytest.raises(TypeError):
        request_hash({"tags": {"a", "b"}})  # a set has no order: no canonical form


# --- KeyTemplate --------------------------------------------------------------


def test_key_template_builds_tenant_operation_business_id() -> None:
    template = KeyTemplate("{tenant_id}:charge:{order_id}")
    assert template.fields == ("tenant_id", "order_id")
    assert template.build({"tenant_id": "t1", "order_id": "o9", "amount": 5}) == "t1:charge:o9"
    model = Charge(tenant_id="t1", order_id="o9", amount=Decimal(5), currency="EUR",
                   request_id="r", requested_at=dt.datetime.now(dt.UTC))
    assert template.build(model) == "t1:charge:o9"


@settings(max_examples=50)
@given(st.uuids(), st.uuids(), st.datetimes(timezones=st.just(dt.UTC)))
def test_key_never_depends_on_per_send_metadata(req_a: Any, req_b: Any, at: dt.datetime) -> None:
    template = KeyTemplate("{tenant_id}:charge:{order_id}")
    a = {"tenant_id": "t1", "order_id": "o9", "request_id": str(req_a)}
    b = {"tenant_id": "t1", "order_id": "o9", "request_id": str(req_b), "requested_at": at}
    assert template.build(a) == template.build(b) == "t1:charge:o9"


@pytest.mark.parametrize("value", [None, "", "   ", "\t\n"])
@pytest.mark.parametrize("where", ["tenant_id", "order_id"])
def test_missing_or_blank_key_field_raises_naming_the_field(value: Any, where: str) -> None:
    payload: dict[str, Any] = {"tenant_id": "t1", "order_id": "o9", where: value}
    with pytest.raises(MissingKeyField) as info:
        KeyTemplate("{tenant_id}:charge:{order_id}").build(payload)
    assert info.value.context["field"] == where
    assert where in str(info.value)


def test_absent_key_field_raises_naming_the_field() -> None:
    with pytest.raises(MissingKeyField) as info:
        KeyTemplate("{tenant_id}:charge:{order_id}").build({"tenant_id": "t1"})
    assert info.value.context["field"] == "order_id"


@pytest.mark.parametrize("spec", ["charge", "", "static:key:{}", "{0}:x", "{a.b}:x"])
def test_template_without_named_fields_is_a_config_error(spec: str) -> None:
    with pytest.raises(ConfigError):
        KeyTemplate(spec)


def test_key_spec_must_be_a_template_or_callable() -> None:
    with pytest.raises(ConfigError):
        KeyTemplate(42)  # type: ignore[arg-type]


def test_callable_keys() -> None:
    template = KeyTemplate(lambda p: f"{p['tenant_id']}:refund:{p['refund_id']}")
    assert template.build({"tenant_id": "t2", "refund_id": "r5"}) == "t2:refund:r5"
    with pytest.raises(MissingKeyField):
        KeyTemplate(lambda p: "  ").build({})
    with pytest.raises(MissingKeyField):
        KeyTemplate(lambda p: None).build({})  # type: ignore[arg-type,return-value]
