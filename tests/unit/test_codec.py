"""Codecs: JSON, Avro single-object encoding (CRC-64-AVRO fingerprints), Confluent framing
through a schema registry; models (pydantic, dataclass, TypedDict)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import io
import json
import struct
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import fastavro
import fastavro.schema
import pytest
from pydantic import BaseModel
from typing_extensions import TypedDict

from kafka_idem.codecs.avro_codec import AvroCodec
from kafka_idem.codecs.base import adapter_for, fields_of
from kafka_idem.codecs.json_codec import JsonCodec
from kafka_idem.codecs.registry import RegistryCodec, registry_client
from kafka_idem.errors import ConfigError, InvalidPayload, SchemaRegistryUnavailable, Undecodable
from tests.registry import Registry

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "schemas"
CHARGE = "payments.ChargeRequested"
CHARGE_SCHEMA = json.loads((SCHEMAS / "payments" / "charge_requested.avsc").read_text())

# The parsing canonical form of charge_requested.avsc, written out by hand from
# the spec's rules (full names; only name/type/fields kept, in that order;
# logical types and docs dropped).
CHARGE_CANONICAL = (
    '{"name":"payments.ChargeRequested","type":"record","fields":['
    '{"name":"tenant_id","type":"string"},'
    '{"name":"order_id","type":"string"},'
    '{"name":"amount","type":"bytes"},'
    '{"name":"currency","type":"string"},'
    '{"name":"request_id","type":"string"},'
    '{"name":"requested_at","type":"long"}]}'
)


# --- an independent CRC-64-AVRO (the Avro specification's "Schema Fingerprints") ---

EMPTY = 0xC15D213AA4D7A795


def _table() -> list[int]:
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (EMPTY & -(fp & 1))
        table.append(fp)
    return table


FP_TABLE = _table()


def crc64_avro(data: bytes) -> int:
    fp = EMPTY
    for byte in data:
        fp = (fp >> 8) ^ FP_TABLE[(fp ^ byte) & 0xFF]
    return fp


@pytest.mark.parametrize(
    ("canonical", "published"),
    [  # apache/avro share/test/data/schema-tests.txt, as Java (signed) longs
        ('"null"', 7195948357588979594),
        ('"boolean"', -6970731678124411036),
        ('"int"', 8247732601305521295),
        ('"long"', -3434872931120570953),
        ('{"name":"foo","type":"fixed","size":15}', 1756455273707447556),
        ('{"name":"foo","type":"record","fields":[{"name":"f1","type":"boolean"}]}',
         7843277075252814651),
    ],
)
def test_the_reference_crc64_matches_avros_published_vectors(
    canonical: str, published: int
) -> None:
    assert crc64_avro(canonical.encode()) == published & 0xFFFF_FFFF_FFFF_FFFF


# --- fixtures -------------------------------------------------------------------


@pytest.fixture(scope="module")
def codec() -> AvroCodec:
    return AvroCodec.from_dir(SCHEMAS)


def charge(**overrides: Any) -> dict[str, Any]:
    record = {
        "tenant_id": "t1",
        "order_id": "o-42",
        "amount": Decimal("1234567890123456.78"),
        "currency": "EUR",
        "request_id": "3f1c1a52-5d5e-4c1e-9a1c-0e0b6d3c2f11",
        "requested_at": dt.datetime(2024, 5, 1, 12, 30, 15, 123000, tzinfo=dt.UTC),
    }
    return {**record, **overrides}


# --- single-object encoding -----------------------------------------------------


@pytest.mark.parametrize("amount", ["0.01", "10.00", "10", "999999999999999.99", "-3.50"])
def test_round_trip_keeps_the_decimal_amount_exactly(codec: AvroCodec, amount: str) -> None:
    record = charge(amount=Decimal(amount))
    name, decoded = codec.decode(codec.encode(CHARGE, record))
    assert name == CHARGE
    assert decoded == record
    assert isinstance(decoded["amount"], Decimal)
    assert decoded["amount"] == Decimal(amount)
    assert decoded["amount"].as_tuple().exponent == -2  # scale 2 from the schema


def test_header_is_c3_01_then_the_crc64_fingerprint_of_the_canonical_form(
    codec: AvroCodec,
) -> None:
    data = codec.encode(CHARGE, charge())
    assert data[:2] == b"\xc3\x01"
    assert fastavro.schema.to_parsing_canonical_form(codec.schema(CHARGE)) == CHARGE_CANONICAL
    expected = crc64_avro(CHARGE_CANONICAL.encode("utf-8")).to_bytes(8, "little")
    assert data[2:10] == expected
    # The body after the header is plain Avro binary of the record.
    body = fastavro.schemaless_reader(io.BytesIO(data[10:]), fastavro.parse_schema(CHARGE_SCHEMA))
    assert body == charge()


def test_decoding_with_a_reader_schema(codec: AvroCodec) -> None:
    name, decoded = codec.decode(codec.encode(CHARGE, charge()), reader=CHARGE)
    assert name == CHARGE
    assert decoded["order_id"] == "o-42"


# --- what can't be decoded -----------------------------------------------------


@pytest.mark.parametrize("value", [b"", None])
def test_empty_value_is_undecodable(codec: AvroCodec, value: bytes | None) -> None:
    with pytest.raises(Undecodable, match="empty message value"):
        codec.decode(value)


@pytest.mark.parametrize("value", [b"hello world", b"{\"amount\": 10}", b"\x00\x00\x00\x00\x01x",
                                   b"\xc3", b"\x01\xc3\x01"])
def test_garbage_is_undecodable_with_a_reason(codec: AvroCodec, value: bytes) -> None:
    with pytest.raises(Undecodable) as info:
        codec.decode(value)
    assert "not Avro single-object encoded" in str(info.value)
    assert info.value.context["first_bytes"] == value[:4].hex()


def test_unknown_fingerprint_is_undecodable(codec: AvroCodec) -> None:
    data = codec.encode(CHARGE, charge())
    forged = data[:2] + bytes(b ^ 0xFF for b in data[2:10]) + data[10:]
    with pytest.raises(Undecodable, match="unknown schema fingerprint") as info:
        codec.decode(forged)
    assert info.value.context["fingerprint"] == forged[2:10].hex()


def test_header_alone_is_undecodable(codec: AvroCodec) -> None:
    with pytest.raises(Undecodable, match="does not decode"):
        codec.decode(codec.encode(CHARGE, charge())[:10])


def test_every_truncation_of_the_body_is_undecodable(codec: AvroCodec) -> None:
    data = codec.encode(CHARGE, charge())
    for cut in range(10, len(data)):
        with pytest.raises(Undecodable, match="does not decode"):
            codec.decode(data[:cut])


def test_a_record_the_writer_schema_cannot_hold_is_refused_on_encode(codec: AvroCodec) -> None:
    with pytest.raises((ValueError, TypeError)):
        codec.encode(CHARGE, charge(amount="ten"))


def test_loading_a_folder_without_it_existing_is_a_config_error(tmp_path: Path) -> None:
    from kafka_idem.errors import ConfigError

    with pytest.raises(ConfigError):
        AvroCodec.from_dir(tmp_path / "missing")
    (tmp_path / "bad.avsc").write_text("{not json")
    with pytest.raises(ConfigError, match=r"bad\.avsc"):
        AvroCodec.from_dir(tmp_path)


# --- Confluent framing through a schema registry (tests/registry.py) ---------------


@pytest.fixture
def registry() -> Iterator[Registry]:
    with Registry() as reg:
        reg.schemas[7] = (json.dumps(CHARGE_SCHEMA), "AVRO")
        yield reg


def confluent(schema_id: int, record: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    buf.write(b"\x00" + struct.pack(">I", schema_id))
    fastavro.schemaless_writer(buf, fastavro.parse_schema(CHARGE_SCHEMA), record)
    return buf.getvalue()


def registry_codec(url: str, schema: str | None = CHARGE, model: Any = None) -> RegistryCodec:
    return RegistryCodec(registry_client(url, {"max.retries": 0}), adapter_for(model, handler="h"),
                         subject="charges-value", schemas=AvroCodec.from_dir(SCHEMAS),
                         schema=schema)


def test_confluent_framing_is_decoded_with_the_registrys_schema(registry: Registry) -> None:
    codec = registry_codec(registry.url + "/")
    record = charge(amount=Decimal("0.07"))
    assert codec.decode(confluent(7, record)) == record
    assert registry.requests == ["GET /schemas/ids/7"]
    # The schema is fetched once per id, then cached.
    codec.decode(confluent(7, charge(order_id="o-43")))
    assert registry.requests == ["GET /schemas/ids/7"]


def test_confluent_framing_with_an_unknown_schema_id_is_undecodable(registry: Registry) -> None:
    codec = registry_codec(registry.url)
    with pytest.raises(Undecodable, match="schema id 99 not found") as info:
        codec.decode(confluent(99, charge()))
    assert info.value.context["schema_id"] == 99
    assert registry.requests == ["GET /schemas/ids/99"]


def test_confluent_framing_with_a_truncated_body_is_undecodable(registry: Registry) -> None:
    codec = registry_codec(registry.url)
    with pytest.raises(Undecodable, match="does not decode"):
        codec.decode(confluent(7, charge())[:-3])
    with pytest.raises(Undecodable, match="truncated frame: 3 bytes"):
        codec.decode(b"\x00\x00\x00")


def test_confluent_framing_without_a_registry_is_undecodable(codec: AvroCodec) -> None:
    with pytest.raises(Undecodable, match=r"not Avro single-object encoded.*Confluent-framed"):
        codec.decode(confluent(7, charge()))


def test_an_unreachable_registry_is_not_the_messages_fault() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on (127.0.0.1 only)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    codec = registry_codec(f"http://127.0.0.1:{port}")
    with pytest.raises(SchemaRegistryUnavailable, match="unreachable"):
        codec.decode(confluent(7, charge()))


def test_a_registry_answering_5xx_is_not_the_messages_fault(registry: Registry) -> None:
    registry.down = True
    with pytest.raises(SchemaRegistryUnavailable, match="HTTP 503"):
        registry_codec(registry.url).decode(confluent(7, charge()))
    registry.down = False  # back: the same message decodes
    assert registry_codec(registry.url).decode(confluent(7, charge())) == charge()


def test_registry_avro_round_trip_registers_the_schema_once(registry: Registry) -> None:
    codec = registry_codec(registry.url)
    data = codec.encode(charge())
    assert data[0] == 0
    (sid,) = struct.unpack(">I", data[1:5])
    assert registry.schemas[sid][1] == "AVRO"
    assert json.loads(registry.schemas[sid][0]) == CHARGE_SCHEMA  # logical types kept
    assert codec.decode(codec.encode(charge(order_id="o-2")))["order_id"] == "o-2"
    assert registry.requests.count("POST /subjects/charges-value/versions") == 1


class Order(BaseModel):
    order_id: str
    amount: Decimal


def test_registry_json_schema_round_trip(registry: Registry) -> None:
    codec = registry_codec(registry.url, schema=None, model=Order)
    data = codec.encode(Order(order_id="o1", amount=Decimal("10.50")))
    (sid,) = struct.unpack(">I", data[1:5])
    text, kind = registry.schemas[sid]
    assert kind == "JSON"
    assert json.loads(text)["properties"]["order_id"] == {"title": "Order Id", "type": "string"}
    assert codec.decode(data) == Order(order_id="o1", amount=Decimal("10.5"))
    with pytest.raises(InvalidPayload, match=r"registry json .*order_id: Field required"):
        codec.decode(data[:5] + b'{"amount": 1}')
    with pytest.raises(Undecodable, match=r"registry json \(schema id \d+\): invalid JSON"):
        codec.decode(data[:5] + b'{"amount": ')


def test_a_protobuf_schema_id_is_undecodable_not_retried(registry: Registry) -> None:
    registry.schemas[9] = ('syntax = "proto3"; message M { string a = 1; }', "PROTOBUF")
    with pytest.raises(Undecodable, match="schema id 9 is a PROTOBUF schema"):
        registry_codec(registry.url).decode(b"\x00\x00\x00\x00\x09\x00\x0a\x01a")


def test_a_value_that_is_not_confluent_framed_names_what_it_looks_like(registry: Registry) -> None:
    with pytest.raises(Undecodable, match=r"registry: not Confluent-framed.*JSON"):
        registry_codec(registry.url).decode(b'{"order_id": "o1"}')
    assert registry.requests == []


# --- JSON ------------------------------------------------------------------------


def test_json_decodes_straight_into_the_model_and_round_trips() -> None:
    codec = JsonCodec(adapter_for(Order, handler="h"))
    assert codec.decode(b'{"order_id": "o1", "amount": 10.0}') == Order(
        order_id="o1", amount=Decimal("10"))
    assert codec.decode(codec.encode({"order_id": "o2", "amount": "3.10"})).amount == \
        Decimal("3.10")


def test_json_without_a_model_is_a_dict() -> None:
    assert JsonCodec().decode(b'{"a": [1, 2.5, null]}') == {"a": [1, 2.5, None]}


@pytest.mark.parametrize(("value", "error", "text"), [
    (b"{not json", Undecodable, "json: invalid JSON: key must be a string at line 1 column 2"),
    (b"\xff\xfe\x00", Undecodable, "json: invalid JSON"),
    (b"[1, 2]", InvalidPayload, "json: payload does not validate: (root): Input should be"),
    (b'{"order_id": "o1"}', InvalidPayload, "amount: Field required"),
    (b'{"order_id": "o1", "amount": "ten"}', InvalidPayload, "amount: Input should be a valid"),
    (b"\x00\x00\x00\x00\x07abc", Undecodable, "Confluent-framed (magic byte 0, schema id 7)"),
    (b"\xc3\x01" + bytes(8), Undecodable, "Avro single-object encoded"),
])
def test_bad_json_names_the_format_and_the_problem(
    value: bytes, error: type[Exception], text: str
) -> None:
    with pytest.raises(error) as info:
        JsonCodec(adapter_for(Order, handler="h")).decode(value)
    assert text in str(info.value)
    assert "ten" not in str(info.value)  # reasons, never values
    assert "invalid JSON: Invalid JSON" not in str(info.value)  # said once


# --- models --------------------------------------------------------------------------


@dataclasses.dataclass
class OrderDC:
    order_id: str
    amount: Decimal


class OrderTD(TypedDict):
    order_id: str
    amount: Decimal


@pytest.mark.parametrize("model", [Order, OrderDC, OrderTD])
def test_pydantic_models_dataclasses_and_typeddicts_validate(model: Any) -> None:
    codec = JsonCodec(adapter_for(model, handler="h"))
    payload = codec.decode(b'{"order_id": "o1", "amount": 1.5}')
    assert fields_of(model) == ("order_id", "amount")
    amount = payload["amount"] if isinstance(payload, dict) else payload.amount
    assert amount == Decimal("1.5")
    assert codec.decode(codec.encode(payload)) == payload


@pytest.mark.parametrize("model", [int, "Order", object, dict])
def test_a_model_pydantic_cannot_use_fails_naming_the_handler(model: Any) -> None:
    with pytest.raises(ConfigError, match="handler 'h': model must be"):
        adapter_for(model, handler="h")
