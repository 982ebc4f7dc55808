"""Registering a handler checks its model, format and fields at once, naming the handler;
the format a handler gets when it names none; a codec object of one's own."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import fastavro
import pytest
from pydantic import BaseModel
from typing_extensions import TypedDict

from kafka_idem import App
from kafka_idem.errors import ConfigError, InvalidKey, InvalidPayload, Undecodable
from tests.conftest import ROOT


class Order(BaseModel):
    tenant_id: str
    order_id: str
    amount: Decimal


@dataclasses.dataclass
class OrderDC:
    tenant_id: str
    order_id: str
    amount: Decimal


class OrderTD(TypedDict):
    tenant_id: str
    order_id: str
    amount: Decimal


def register(app: App, **options: Any) -> Any:
    options = {"topic": "orders", "key": "{tenant_id}:o:{order_id}",
               "hash_fields": ("amount",), **options}
    return app.handler(**options)(lambda msg, ctx: None)


@pytest.mark.parametrize("model", [Order, OrderDC, OrderTD])
def test_models_of_three_kinds_decode_and_their_fields_are_checked(model: Any) -> None:
    h = register(App("a"), model=model, name="place")
    payload = h.decode(b'{"tenant_id": "t", "order_id": "o", "amount": 1.5}')
    assert h.key.build(payload) == "t:o:o"
    assert h.codec.name == "json"
    with pytest.raises(ConfigError) as caught:
        register(App("b"), model=model, name="place", hash_fields=("amont",))
    assert str(caught.value) == (
        "handler 'place' (topic 'orders'): hash_fields= names 'amont', but "
        f"{model.__name__} has no such field (its fields: tenant_id, order_id, amount) "
        "(setting=hash_fields)")


def test_unknown_key_and_hash_fields_are_each_named_with_their_setting() -> None:
    with pytest.raises(ConfigError) as caught:
        register(App("a"), model=Order, name="place", key="{tenant_id}:{shop}:{sku}",
                 hash_fields=("qty", "amount"))
    assert str(caught.value) == (
        "handler 'place' (topic 'orders'): key= names 'shop', 'sku' and hash_fields= names "
        "'qty', but Order has no such field (its fields: tenant_id, order_id, amount) "
        "(setting=key/hash_fields)")


@pytest.mark.parametrize("model", [Order, OrderDC, OrderTD])
def test_an_ordering_key_naming_an_unknown_field_fails_at_registration(model: Any) -> None:
    """Not at each message, as the ordering key's MissingKeyField dead letter."""
    with pytest.raises(ConfigError) as caught:
        register(App("a"), model=model, name="place", mode="leased", concurrency=4,
                 ordering_key="{tenant_id}:{shop}")
    assert str(caught.value) == (
        "handler 'place' (topic 'orders'): ordering_key= names 'shop', but "
        f"{model.__name__} has no such field (its fields: tenant_id, order_id, amount) "
        "(setting=ordering_key)")
    h = register(App("b"), model=model, name="place", mode="leased", concurrency=4,
                 ordering_key="{tenant_id}")
    assert h.ordering is not None and h.ordering.fields == ("tenant_id",)


def test_a_model_that_is_not_a_model_fails_at_registration_naming_the_handler() -> None:
    with pytest.raises(ConfigError, match="handler 'place': model must be"):
        register(App("a"), model=Decimal, name="place")


@pytest.mark.parametrize(("options", "text"), [
    ({"format": "avro"}, "handler 'place': format 'avro' needs schema="),
    ({"format": "xml"}, "handler 'place': format must be one of"),
    ({"format": object()}, "is neither"),
])
def test_a_format_that_cannot_work_fails_at_registration(options: dict[str, Any],
                                                         text: str) -> None:
    with pytest.raises(ConfigError, match=text):
        register(App("a"), model=Order, name="place", **options)


def test_no_model_is_a_dict_and_fields_are_not_checked() -> None:
    h = register(App("a"), name="place")
    assert h.decode(b'{"tenant_id": "t", "order_id": "o", "amount": 2}') == {
        "tenant_id": "t", "order_id": "o", "amount": 2}


def test_the_format_a_handler_gets_when_it_names_none() -> None:
    assert register(App("a", schemas_dir=ROOT / "schemas"), model=Order,
                    schema="payments.ChargeRequested").codec.name == "avro"  # as before
    assert register(App("b"), model=Order).codec.name == "json"  # default_format
    with pytest.raises(ConfigError, match="needs schema="):
        _ = register(App("c", default_format="avro"), model=Order).codec
    with pytest.raises(ConfigError, match="no schema registry"):
        _ = register(App("d", default_format="registry"), model=Order).codec


def test_a_missing_schema_name_fails_when_the_codec_is_bound_naming_the_schema_setting() -> None:
    app = App("a", schemas_dir=ROOT / "schemas")
    register(app, model=Order, schema="nope.Missing", name="place")
    with pytest.raises(ConfigError, match=r"handler 'place': schema 'nope\.Missing' is not among "
                       r"the Avro schemas of .*found: orders\.OrderPlaced, payments\."
                       r"ChargeCompleted, payments\.ChargeRequested\) \(setting=schema\)"):
        app.bind_codecs()


class Csv:
    """A codec of one's own: ``tenant,order,amount``."""

    name = "csv"

    def decode(self, data: bytes) -> Any:
        parts = data.decode().split(",")
        if len(parts) != 3:
            raise Undecodable(f"{len(parts)} columns, not 3")
        return dict(zip(("tenant_id", "order_id", "amount"), parts, strict=True))

    def encode(self, payload: Any) -> bytes:
        p = payload if isinstance(payload, dict) else payload.__dict__
        return f"{p['tenant_id']},{p['order_id']},{p['amount']}".encode()


def test_a_codec_object_is_used_and_its_output_validated_into_the_model() -> None:
    h = register(App("a"), model=Order, format=Csv())
    assert h.decode(b"t,o,1.50") == Order(tenant_id="t", order_id="o", amount=Decimal("1.50"))
    assert h.decode(h.encode(Order(tenant_id="t", order_id="o", amount=Decimal(2)))).amount == 2
    with pytest.raises(Undecodable, match=r"^csv: 2 columns, not 3$"):
        h.decode(b"t,o")
    with pytest.raises(InvalidPayload, match="csv: payload does not validate: amount"):
        h.decode(b"t,o,ten")


class Reserve(BaseModel):
    shop: str
    order_id: str
    qty: int


class StrictCharge(BaseModel):
    model_config = {"extra": "forbid"}
    tenant_id: str
    order_id: str
    amount: Decimal


@pytest.mark.parametrize(("options", "text"), [
    # a model whose required fields the schema lacks: every message would be invalid
    ({"model": Reserve, "key": "{shop}:reserve:{order_id}", "hash_fields": ("qty",)},
     r"schema 'payments\.ChargeRequested' does not fit the handler: it has no field "
     r"\['shop', 'qty'\], which Reserve requires"),
    # no model: a key field the schema lacks would leave every message without a key
    ({"model": None, "key": "{shop}:reserve:{order_id}", "hash_fields": ("amount",)},
     r"schema 'payments\.ChargeRequested' does not fit the handler: it has no field "
     r"\['shop'\] \(key or hash fields\)"),
    # a model refusing extra fields, and a schema with more
    ({"model": StrictCharge},
     r"schema 'payments\.ChargeRequested' does not fit the handler: its fields \['currency', "
     r"'request_id', 'requested_at'\] are not in StrictCharge, which forbids extra fields"),
])
def test_an_avro_reader_schema_that_cannot_fill_the_payload_fails_when_the_codec_is_bound(
    options: dict[str, Any], text: str,
) -> None:
    app = App("a", schemas_dir=ROOT / "schemas")
    register(app, schema="payments.ChargeRequested", name="place", **options)
    with pytest.raises(ConfigError, match=rf"handler 'place': {text}.*\(setting=schema\)"):
        app.bind_codecs()


def test_a_reader_schema_that_fits_the_model_binds() -> None:
    app = App("a", schemas_dir=ROOT / "schemas")
    h = register(app, model=Order, schema="payments.ChargeRequested", name="place")
    app.bind_codecs()
    assert h.codec.name == "avro"


# --- without a model, a key field the reader schema types as no string ------------------

RAW_SCHEMA = {
    "type": "record", "name": "raw.Keyed", "fields": [
        {"name": "text", "type": "string"},
        {"name": "id", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "color", "type": {"type": "enum", "name": "Color", "symbols": ["RED"]}},
        {"name": "shade", "type": "raw.Color"},  # a named type, referred to
        {"name": "maybe", "type": ["null", "string"]},
        {"name": "count", "type": "long"},
        {"name": "small", "type": "int"},
        {"name": "ratio", "type": "double"},
        {"name": "flag", "type": "boolean"},
        {"name": "raw", "type": "bytes"},
        {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "either", "type": ["null", "long"]},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
        {"name": "attrs", "type": {"type": "map", "values": "string"}},
        {"name": "inner", "type": {"type": "record", "name": "Inner",
                                   "fields": [{"name": "label", "type": "string"}]}},
        {"name": "again", "type": "raw.Inner"},
        {"name": "hash", "type": {"type": "fixed", "name": "Hash", "size": 2}},
    ]}
STRINGS = ("text", "id", "color", "shade", "maybe")


def test_the_avro_fields_that_can_never_hold_a_string() -> None:
    from kafka_idem.codecs.avro_codec import non_string_fields

    reader = fastavro.parse_schema(RAW_SCHEMA)
    names = tuple(f["name"] for f in RAW_SCHEMA["fields"])  # type: ignore[index]
    assert non_string_fields(reader, names) == {
        "count": "long", "small": "int", "ratio": "double", "flag": "boolean", "raw": "bytes",
        "at": "long", "either": "[null, long]", "tags": "array", "attrs": "map",
        "inner": "record", "again": "raw.Inner", "hash": "fixed"}
    assert non_string_fields(reader, STRINGS) == {}
    assert non_string_fields(reader, ("absent",)) == {}  # reader_mismatch's to report


def raw_app(tmp_path: Path) -> App:
    (tmp_path / "keyed.avsc").write_text(json.dumps(RAW_SCHEMA))
    return App("a", schemas_dir=tmp_path)


@pytest.mark.parametrize(("key", "named"), [
    ("{text}:k:{count}", r"'count' \(long\)"),
    ("{either}:k:{flag}", r"'either' \(\[null, long\]\), 'flag' \(boolean\)"),
    ("{at}", r"'at' \(long\)"),
])
def test_without_a_model_a_key_field_the_schema_types_as_no_string_fails_at_start(
    tmp_path: Path, key: str, named: str,
) -> None:
    app = raw_app(tmp_path)
    register(app, model=None, schema="raw.Keyed", name="raw", key=key, hash_fields=("text",))
    with pytest.raises(ConfigError, match=(
            rf"^handler 'raw': key field\(s\) {named} of schema 'raw\.Keyed' never hold a "
            r"string: without a model a key takes strings only, so every message would be "
            r"dead-lettered; declare model= with the field's type, or build the key with a "
            r"function \(setting=key\)$")):
        app.bind_codecs()


def test_without_a_model_string_key_fields_of_a_schema_bind_and_build_keys(
    tmp_path: Path,
) -> None:
    app = raw_app(tmp_path)
    h = register(app, model=None, schema="raw.Keyed", name="raw",
                 key="{text}:{id}:{color}:{shade}:{maybe}", hash_fields=("count",))
    app.bind_codecs()
    record = {"text": "t", "id": "8c7f6e52-0d4e-4d6b-9a51-1f0f2a3b4c5d", "color": "RED",
              "shade": "RED", "maybe": "m", "count": 7, "small": 1, "ratio": 0.5,
              "flag": True, "raw": b"x", "at": dt.datetime(2025, 1, 31, tzinfo=dt.UTC),
              "either": None, "tags": [], "attrs": {}, "inner": {"label": "l"},
              "again": {"label": "l"}, "hash": b"ab"}
    assert h.key.build(h.decode(h.encode(record))) == \
        "t:8c7f6e52-0d4e-4d6b-9a51-1f0f2a3b4c5d:RED:RED:m"
    with pytest.raises(InvalidKey, match="key field 'maybe' holds a JSON null"):
        h.key.build(h.decode(h.encode({**record, "maybe": None})))
    # a key function, and an ordering key (it only orders work), take any field
    for options in ({"key": lambda p: f"{p['text']}:{p['count']}"},
                    {"key": "{text}", "ordering_key": "{count}:{flag}"}):
        other = raw_app(tmp_path)
        h = register(other, model=None, schema="raw.Keyed", name="raw", hash_fields=("text",),
                     mode="leased", **options)
        other.bind_codecs()
        payload = h.decode(h.encode(record))
        assert h.key.build(payload) == ("t:7" if callable(options["key"]) else "t")
        if h.ordering is not None:
            assert h.ordering.build(payload) == "7:True"
