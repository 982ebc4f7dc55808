"""The registry formats against a real Confluent-compatible Schema Registry (Apicurio
Registry's Confluent API, scripts/registry.sh): Avro, JSON Schema and Protobuf framed by
the codecs, registered under <topic>-value with their types, read back by id; an id
the registry does not know, a schema of another type, another message of a Protobuf
schema are the message's fault; one intent has one hash in every registry format.
(Outages and 5xx need fault injection: tests/unit with tests/registry.py.)"""

from __future__ import annotations

import datetime as dt
import json
import struct
import uuid
from decimal import Decimal
from typing import Any

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient

from consumers.orders_json import OrderPlaced
from kafka_idem.codecs.avro_codec import AvroCodec
from kafka_idem.codecs.base import Codec, adapter_for
from kafka_idem.codecs.protobuf import ProtobufCodec
from kafka_idem.codecs.registry import RegistryCodec, registry_client
from kafka_idem.errors import InvalidPayload, Undecodable
from kafka_idem.keys import hash_payload
from tests import protos
from tests.conftest import ROOT

SCHEMAS = AvroCodec.from_dir(ROOT / "schemas")
ADAPTER = adapter_for(OrderPlaced, handler="h")
HASH_FIELDS = ("amount", "currency", "items")


def order(**over: Any) -> dict[str, Any]:
    return {"tenant_id": "t1", "order_id": "o1", "amount": Decimal("10.00"), "currency": "EUR",
            "items": 2, "request_id": "r", "placed_at": dt.datetime(2025, 1, 31, tzinfo=dt.UTC),
            **over}


def fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def client(schema_registry: str) -> SchemaRegistryClient:
    return registry_client(schema_registry, {"max.retries": 0})


def codecs(url: str) -> dict[str, tuple[str, Codec]]:
    """One codec of each registry format, each on a topic of its own: name -> (topic, codec)."""
    shared = registry_client(url, {"max.retries": 0})
    topics = {name: fresh(name) for name in ("avro", "json", "protobuf")}
    return {
        "avro": (topics["avro"], RegistryCodec(shared, ADAPTER, subject=f"{topics['avro']}-value",
                                               schemas=SCHEMAS, schema="orders.OrderPlaced")),
        "json": (topics["json"], RegistryCodec(shared, ADAPTER,
                                               subject=f"{topics['json']}-value")),
        "protobuf": (topics["protobuf"], ProtobufCodec(
            protos.OrderPlaced, client=registry_client(url, {"max.retries": 0}),
            topic=topics["protobuf"], adapter=ADAPTER)),
    }


def test_each_format_registers_its_schema_and_reads_it_back_by_id(
    schema_registry: str, client: SchemaRegistryClient
) -> None:
    kinds = {"avro": "AVRO", "json": "JSON", "protobuf": "PROTOBUF"}
    for name, (topic, codec) in codecs(schema_registry).items():
        data = codec.encode(order())
        assert data[0] == 0, name
        (sid,) = struct.unpack(">I", data[1:5])
        latest = client.get_latest_version(f"{topic}-value")
        assert latest.schema_id == sid, name
        assert (latest.schema.schema_type or "AVRO") == kinds[name], name
        assert codec.decode(data) == OrderPlaced(**order()), name
    # Reading goes by the id alone: a codec with a cold cache, of another topic, finds the
    # writer schema.
    writers = codecs(schema_registry)
    for name, (_topic, codec) in codecs(schema_registry).items():
        data = writers[name][1].encode(order(order_id="o2"))
        assert codec.decode(data).order_id == "o2", name


def test_one_intent_has_one_hash_in_every_registry_format(schema_registry: str) -> None:
    for amount in ("10", "10.5", "0.01", "123456789.99"):
        hashes = {name: hash_payload(codec.decode(codec.encode(order(
            amount=Decimal(amount), request_id=f"r-{name}"))), HASH_FIELDS)
            for name, (_t, codec) in codecs(schema_registry).items()}
        assert len(set(hashes.values())) == 1, (amount, hashes)


def test_an_id_the_registry_does_not_know_is_undecodable(schema_registry: str,
                                                         client: SchemaRegistryClient) -> None:
    unknown = 1_000_000 + uuid.uuid4().int % 1_000_000
    for name, (_topic, codec) in codecs(schema_registry).items():
        data = codec.encode(order())
        forged = b"\x00" + struct.pack(">I", unknown) + data[5:]
        with pytest.raises(Undecodable, match=f"schema id {unknown} not found") as info:
            codec.decode(forged)
        assert info.value.context["schema_id"] == unknown, name


def test_a_schema_of_another_type_is_the_messages_fault(schema_registry: str) -> None:
    found = codecs(schema_registry)
    avro = found["avro"][1].encode(order())
    as_json = found["json"][1].encode(order())
    protobuf = found["protobuf"][1].encode(order())
    (pb_id,) = struct.unpack(">I", protobuf[1:5])
    with pytest.raises(Undecodable, match=rf"registry: schema id {pb_id} is a PROTOBUF schema; "
                       "a 'registry' handler reads Avro and JSON Schema"):
        found["json"][1].decode(protobuf)
    for data, kind in ((avro, "AVRO"), (as_json, "JSON")):
        (sid,) = struct.unpack(">I", data[1:5])
        with pytest.raises(Undecodable, match=rf"^protobuf: schema id {sid} is a {kind} schema, "
                           "not Protobuf"):
            found["protobuf"][1].decode(data)


def test_another_message_of_a_protobuf_schema_is_undecodable(schema_registry: str) -> None:
    url = schema_registry
    reads = ProtobufCodec(protos.OrderPlaced, client=registry_client(url, {}), topic=fresh("p"),
                          adapter=ADAPTER)
    ships = ProtobufCodec(protos.Shipment, client=registry_client(url, {}), topic=fresh("s"))
    data = ships.encode({"order_id": "o1", "parcels": [{"tracking": "z"}]})
    (sid,) = struct.unpack(">I", data[1:5])
    with pytest.raises(Undecodable, match=rf"protobuf \(schema id {sid}\): message indexes \[1\] "
                       r"name orders\.pb\.Shipment, this handler reads orders\.pb\.OrderPlaced"):
        reads.decode(data)
    assert ships.decode(data) == {"order_id": "o1", "parcels": [{"tracking": "z"}]}


def test_a_payload_of_the_wrong_shape_is_invalid_in_every_format(schema_registry: str) -> None:
    """A producer that sends what the model refuses (items 0): the same format, no model."""
    plain = adapter_for(None, handler="loose")
    wrong = {**order(), "items": 0}
    for name, (topic, codec) in codecs(schema_registry).items():
        if isinstance(codec, ProtobufCodec):
            data = ProtobufCodec(protos.OrderPlaced, client=codec.client, topic=topic,
                                 adapter=plain).encode(wrong)
        elif name == "avro":
            data = RegistryCodec(codec.client, plain, subject=codec.subject,
                                 schemas=codec.schemas, schema=codec.schema).encode(wrong)
        else:  # the model's schema id, JSON the model refuses
            data = codec.encode(order())[:5] + plain.dump_json(wrong)
        with pytest.raises(InvalidPayload, match="payload does not validate: items: Input "
                           "should be greater than or equal to 1"):
            codec.decode(data)


def test_the_json_schema_registered_is_the_models(schema_registry: str,
                                                 client: SchemaRegistryClient) -> None:
    topic, codec = codecs(schema_registry)["json"]
    codec.encode(order())
    latest = client.get_latest_version(f"{topic}-value")
    assert json.loads(latest.schema.schema_str)["properties"]["items"]["minimum"] == 1
