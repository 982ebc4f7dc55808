"""Avro codec: single-object encoding, CRC-64-AVRO fingerprints, Confluent framing."""

from __future__ import annotations

import datetime as dt
import io
import json
import struct
import threading
from collections.abc import Iterator
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import fastavro
import fastavro.schema
import pytest

from kafka_idem.codec import AvroCodec
from kafka_idem.errors import Undecodable

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


# --- Confluent framing through a (tiny, real) schema registry ---------------------


class Registry:
    """A Schema Registry stand-in on 127.0.0.1: ``GET /schemas/ids/{id}``."""

    def __init__(self, schemas: dict[int, Any]) -> None:
        self.schemas = schemas
        self.requests: list[str] = []
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                registry.requests.append(self.path)
                prefix = "/schemas/ids/"
                sid = self.path[len(prefix):]
                if self.path.startswith(prefix) and sid.isdigit() and int(sid) in registry.schemas:
                    body = json.dumps({"schema": json.dumps(registry.schemas[int(sid)])}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
                else:
                    body = json.dumps({"error_code": 40403, "message": "Schema not found"}).encode()
                    self.send_response(404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Registry:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def registry() -> Iterator[Registry]:
    with Registry({7: CHARGE_SCHEMA}) as reg:
        yield reg


def confluent(schema_id: int, record: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    buf.write(b"\x00" + struct.pack(">I", schema_id))
    fastavro.schemaless_writer(buf, fastavro.parse_schema(CHARGE_SCHEMA), record)
    return buf.getvalue()


def test_confluent_framing_is_decoded_with_the_registrys_schema(registry: Registry) -> None:
    codec = AvroCodec.from_dir(SCHEMAS, registry_url=registry.url + "/")
    record = charge(amount=Decimal("0.07"))
    name, decoded = codec.decode(confluent(7, record))
    assert name == CHARGE
    assert decoded == record
    assert registry.requests == ["/schemas/ids/7"]
    # The schema is fetched once per id, then cached.
    codec.decode(confluent(7, charge(order_id="o-43")))
    assert registry.requests == ["/schemas/ids/7"]


def test_confluent_framing_with_an_unknown_schema_id_is_undecodable(registry: Registry) -> None:
    codec = AvroCodec.from_dir(SCHEMAS, registry_url=registry.url)
    with pytest.raises(Undecodable, match="schema id 99 not found"):
        codec.decode(confluent(99, charge()))
    assert registry.requests == ["/schemas/ids/99"]


def test_confluent_framing_with_a_truncated_body_is_undecodable(registry: Registry) -> None:
    codec = AvroCodec.from_dir(SCHEMAS, registry_url=registry.url)
    with pytest.raises(Undecodable, match="does not decode"):
        codec.decode(confluent(7, charge())[:-3])


def test_confluent_framing_without_a_registry_is_undecodable(codec: AvroCodec) -> None:
    with pytest.raises(Undecodable, match="not Avro single-object encoded"):
        codec.decode(confluent(7, charge()))


def test_an_unreachable_registry_is_not_the_messages_fault() -> None:
    import socket

    from kafka_idem.errors import FrameworkError

    with socket.socket() as s:  # a port nobody listens on (127.0.0.1 only)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    codec = AvroCodec.from_dir(SCHEMAS, registry_url=f"http://127.0.0.1:{port}")
    with pytest.raises(FrameworkError):
        codec.decode(confluent(7, charge()))
