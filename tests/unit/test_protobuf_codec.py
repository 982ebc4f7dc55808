"""Registry-framed Protobuf (kafka_idem.codecs.protobuf): the Confluent frame (magic 0, schema
id, message indexes), messages into models and back, every bad frame undecodable with
the format and the problem, a registry outage never the message's fault; the values a
message becomes (kafka_idem.codecs.protobuf_values)."""

from __future__ import annotations

import base64
import datetime as dt
import io
import json
import socket
import struct
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.serde import SchemaId

from consumers.orders_json import OrderPlaced
from kafka_idem import App
from kafka_idem.codecs.base import adapter_for
from kafka_idem.codecs.protobuf import ProtobufCodec
from kafka_idem.codecs.protobuf_values import from_python, to_python
from kafka_idem.codecs.registry import RegistryCodec, registry_client
from kafka_idem.errors import ConfigError, InvalidPayload, SchemaRegistryUnavailable, Undecodable
from tests import protos
from tests.registry import Registry

TOPIC = "orders.pb"
PLACED_AT = dt.datetime(2025, 1, 31, 12, tzinfo=dt.UTC)


def order(**over: Any) -> dict[str, Any]:
    return {"tenant_id": "t1", "order_id": "o1", "amount": Decimal("10.00"), "currency": "EUR",
            "items": 2, "request_id": "r-1", "placed_at": PLACED_AT, **over}


@pytest.fixture
def registry() -> Iterator[Registry]:
    with Registry() as reg:
        yield reg


def client(url: str) -> SchemaRegistryClient:
    return registry_client(url, {"max.retries": 0})


def codec(url: str, message: Any = protos.OrderPlaced, model: Any = OrderPlaced,
          topic: str = TOPIC) -> ProtobufCodec:
    return ProtobufCodec(message, client=client(url), topic=topic,
                         adapter=adapter_for(model, handler="h"))


def frame(schema_id: int, indexes: list[int], body: bytes) -> bytes:
    head = SchemaId("PROTOBUF", schema_id=schema_id, message_indexes=indexes).id_to_bytes()
    return head + body


# --- round trips ------------------------------------------------------------------------


def test_a_message_round_trips_into_the_model_and_the_schema_is_registered_once(
    registry: Registry,
) -> None:
    c = codec(registry.url)
    data = c.encode(OrderPlaced(**order()))
    assert data[0] == 0
    (sid,) = struct.unpack(">I", data[1:5])
    assert data[5] == 0  # message indexes [0]: the first message, written as one 0 byte
    text, kind = registry.schemas[sid]
    assert kind == "PROTOBUF"
    assert registry.subjects == {f"{TOPIC}-value": [sid]}
    described = protos.OrderPlaced.DESCRIPTOR.file.serialized_pb
    assert base64.b64decode(text) == described  # the serialized FileDescriptorProto
    assert c.decode(data) == OrderPlaced(**order())
    assert c.decode(c.encode(order(order_id="o2"))).order_id == "o2"  # a dict the model takes
    message = protos.OrderPlaced(tenant_id="t1", order_id="o3", amount="1.50", currency="EUR",
                                 items=1, request_id="r")
    message.placed_at.FromDatetime(PLACED_AT)
    assert c.decode(c.encode(message)).amount == Decimal("1.50")  # a message as it is
    assert registry.requests.count(f"POST /subjects/{TOPIC}-value/versions") == 1
    assert registry.requests.count(f"GET /schemas/ids/{sid}") == 1  # looked up once


def test_without_a_model_the_payload_is_a_dict_of_python_values(registry: Registry) -> None:
    c = codec(registry.url, model=None)
    payload = c.decode(c.encode(order()))
    assert payload == {**order(), "amount": "10.00"}  # a string field stays a string
    assert isinstance(payload["items"], int)
    assert payload["placed_at"].tzinfo is dt.UTC


def test_a_nested_message_is_found_by_its_index_path(registry: Registry) -> None:
    parcel = protos.Shipment.DESCRIPTOR.nested_types_by_name["Parcel"]
    from google.protobuf.message_factory import GetMessageClass

    c = codec(registry.url, message=GetMessageClass(parcel), model=None)
    data = c.encode({"tracking": "z-9"})
    head = SchemaId("PROTOBUF")
    head.from_bytes(io.BytesIO(data))
    assert head.message_indexes == [1, 0]
    assert c.decode(data) == {"tracking": "z-9"}


# --- bad input: the message's fault ---------------------------------------------------------


@pytest.fixture
def framed(registry: Registry) -> tuple[ProtobufCodec, bytes, int]:
    c = codec(registry.url)
    data = c.encode(order())
    (sid,) = struct.unpack(">I", data[1:5])
    return c, data, sid


def test_another_message_of_the_same_schema_is_undecodable(
    registry: Registry, framed: tuple[ProtobufCodec, bytes, int]
) -> None:
    c, _data, _sid = framed
    shipment = codec(registry.url, message=protos.Shipment, model=None, topic="ships")
    data = shipment.encode({"order_id": "o1", "parcels": [{"tracking": "z"}]})
    (sid,) = struct.unpack(">I", data[1:5])
    # Without the check, the body would parse as an OrderPlaced (tenant_id "o1").
    with pytest.raises(Undecodable, match=rf"^protobuf \(schema id {sid}\): message indexes "
                       r"\[1\] name orders\.pb\.Shipment, this handler reads "
                       r"orders\.pb\.OrderPlaced") as info:
        c.decode(data)
    assert info.value.context["schema_id"] == sid


@pytest.mark.parametrize(("indexes", "text"), [
    ([2], r"message indexes \[2\] name no message: the schema has 2 at index 2"),
    ([1, 3], r"message indexes \[1, 3\] name no message: Shipment has 1 at index 3"),
    ([-1], r"message indexes \[-1\] name no message"),
])
def test_message_indexes_naming_no_message_are_undecodable(
    framed: tuple[ProtobufCodec, bytes, int], indexes: list[int], text: str
) -> None:
    c, data, sid = framed
    body = data[6:]
    with pytest.raises(Undecodable, match=text):
        c.decode(frame(sid, indexes, body))


def test_truncated_frames_are_undecodable(framed: tuple[ProtobufCodec, bytes, int]) -> None:
    c, data, sid = framed
    with pytest.raises(Undecodable, match=r"^protobuf: truncated frame: 3 bytes"):
        c.decode(data[:3])
    with pytest.raises(Undecodable, match=rf"protobuf \(schema id {sid}\): the message "
                       r"indexes do not decode \(a truncated or corrupt frame"):
        c.decode(data[:5])
    cut = frame(sid, [0], b"\x0a\x10t1")  # field 1 says 16 bytes follow, 2 do
    with pytest.raises(Undecodable, match=rf"protobuf \(schema id {sid}\): the body does not "
                       "parse as orders.pb.OrderPlaced"):
        c.decode(cut)


def test_every_cut_of_a_message_is_refused_or_validated(
    framed: tuple[ProtobufCodec, bytes, int],
) -> None:
    """Protobuf has no end marker: a cut at a field boundary is a shorter, valid message.
    The frame check or the model refuses every cut of this one; none gets through."""
    c, data, _sid = framed
    for cut in range(1, len(data)):
        with pytest.raises((Undecodable, InvalidPayload)):
            c.decode(data[:cut])


def test_a_json_or_avro_id_on_a_protobuf_handler_is_undecodable(
    registry: Registry, framed: tuple[ProtobufCodec, bytes, int]
) -> None:
    c, data, _sid = framed
    json_id = registry.register("j-value", json.dumps({"type": "object"}), "JSON")
    avro_id = registry.register("a-value", json.dumps({"type": "record", "name": "R",
                                                       "fields": [{"name": "n", "type": "int"}]}),
                                "AVRO")
    # What those formats put after the id: JSON text, an Avro body (here the int 64,
    # whose zigzag byte would read as a message-index count of 64).
    for sid, kind, body in ((json_id, "JSON", b'{"order_id": "o1"}'),
                            (avro_id, "AVRO", b"\x80\x01"), (json_id, "JSON", data[5:])):
        with pytest.raises(Undecodable, match=rf"^protobuf: schema id {sid} is a {kind} "
                           r"schema, not Protobuf \(this handler reads orders.pb.OrderPlaced"):
            c.decode(b"\x00" + struct.pack(">I", sid) + body)


def test_a_protobuf_id_on_a_registry_handler_is_undecodable(
    registry: Registry, framed: tuple[ProtobufCodec, bytes, int]
) -> None:
    _c, data, sid = framed
    other = RegistryCodec(client(registry.url), adapter_for(OrderPlaced, handler="h"),
                          subject="x-value")
    with pytest.raises(Undecodable, match=rf"registry: schema id {sid} is a PROTOBUF schema; "
                       r"a 'registry' handler reads Avro and JSON Schema \(Protobuf: "
                       r"format=ProtobufCodec"):
        other.decode(data)


@pytest.mark.parametrize(("value", "looks"), [
    (b'{"order_id": "o1"}', "JSON"),
    (b"\x0a\x02t1", "first bytes 0a027431"),  # a Protobuf body without the frame
    (b"\xc3\x01" + bytes(8), "Avro single-object encoded"),
])
def test_a_value_that_is_not_framed_names_what_it_looks_like(
    registry: Registry, value: bytes, looks: str
) -> None:
    with pytest.raises(Undecodable, match=r"^protobuf: not Confluent-framed \(magic byte 0 "
                       rf"expected\): the value is {looks}"):
        codec(registry.url).decode(value)
    assert registry.requests == []


def test_an_unknown_schema_id_is_undecodable_with_the_id(
    registry: Registry, framed: tuple[ProtobufCodec, bytes, int]
) -> None:
    c, data, _sid = framed
    with pytest.raises(Undecodable, match="schema id 999 not found") as info:
        c.decode(frame(999, [0], data[6:]))
    assert info.value.context["schema_id"] == 999


def test_a_schema_that_is_no_descriptor_is_undecodable(
    registry: Registry, framed: tuple[ProtobufCodec, bytes, int]
) -> None:
    c, data, _sid = framed
    sid = registry.register("p-value", 'syntax = "proto3"; message M {}', "PROTOBUF")
    with pytest.raises(Undecodable, match=f"schema id {sid}: unusable Protobuf schema"):
        c.decode(frame(sid, [0], data[6:]))


def test_a_message_of_the_wrong_shape_is_an_invalid_payload(registry: Registry) -> None:
    c = codec(registry.url, model=None)
    data = c.encode(order(items=0, currency="euro"))
    with pytest.raises(InvalidPayload, match=r"^protobuf \(schema id \d+\): payload does not "
                       r"validate: currency: String should match pattern .*items: Input should "
                       "be greater than or equal to 1"):
        codec(registry.url).decode(data)


# --- the registry's fault: retried, never charged -----------------------------------------


def test_a_registry_outage_is_not_the_messages_fault(
    registry: Registry, framed: tuple[ProtobufCodec, bytes, int]
) -> None:
    _c, data, _sid = framed
    registry.down = True
    fresh = codec(registry.url)  # nothing cached: it must ask
    with pytest.raises(SchemaRegistryUnavailable, match="HTTP 503"):
        fresh.decode(data)
    with pytest.raises(SchemaRegistryUnavailable, match="HTTP 503"):
        codec(registry.url, topic="other").encode(order())
    registry.down = False
    assert fresh.decode(data) == OrderPlaced(**order())


def test_an_unreachable_registry_is_not_the_messages_fault(
    framed: tuple[ProtobufCodec, bytes, int],
) -> None:
    _c, data, _sid = framed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SchemaRegistryUnavailable, match="unreachable"):
        codec(f"http://127.0.0.1:{port}").decode(data)


# --- configuration: checked when the handler is registered ------------------------------------


def handler(app: App, **options: Any) -> Any:
    options = {"topic": TOPIC, "model": OrderPlaced, "key": "{tenant_id}:order:{order_id}",
               "hash_fields": ("amount",), "format": ProtobufCodec(protos.OrderPlaced),
               "name": "place", **options}
    return app.handler(**options)(lambda msg, ctx: None)


def test_a_handler_binds_its_codec_to_the_apps_registry_and_topic(registry: Registry) -> None:
    h = handler(App("a", schema_registry_url=registry.url))
    assert isinstance(h.codec, ProtobufCodec) and h.codec.topic == TOPIC
    assert h.codec.name == "protobuf"
    assert h.decode(h.encode(order())) == OrderPlaced(**order())
    assert f"{TOPIC}-value" in registry.subjects


def test_a_model_the_message_cannot_fill_fails_at_registration() -> None:
    from pydantic import BaseModel

    class Wider(BaseModel):
        tenant_id: str
        order_id: str
        amount: Decimal
        coupon: str

    with pytest.raises(ConfigError, match=r"handler 'place': required fields of the model "
                       r"\['coupon'\] are not fields of Protobuf message orders.pb.OrderPlaced"):
        handler(App("a"), model=Wider)
    with pytest.raises(ConfigError, match=r"handler 'place': key/hash fields \['coupon'\] are "
                       "not fields"):
        handler(App("a"), model=None, hash_fields=("coupon",))


def test_without_a_model_a_key_field_that_is_never_read_as_a_string_fails_at_registration(
) -> None:
    with pytest.raises(ConfigError, match=(
            r"^handler 'place': key field\(s\) 'items' \(int32\) of Protobuf message "
            r"orders\.pb\.OrderPlaced never hold a string: without a model a key takes strings "
            r"only, so every message would be dead-lettered; declare model= with the field's "
            r"type, or build the key with a function \(setting=key\)$")):
        handler(App("a"), model=None, key="{tenant_id}:order:{items}")
    # the same field, typed by a model, an ordering key or a key function: as before
    handler(App("a"), key="{tenant_id}:order:{items}")
    handler(App("a"), model=None, mode="leased", ordering_key="{items}")
    handler(App("a"), model=None, key=lambda p: f"{p['tenant_id']}:{p['items']}")


def test_the_protobuf_fields_that_are_never_read_as_a_string() -> None:
    from kafka_idem.codecs.protobuf_values import non_string_fields

    descriptor = protos.Everything.DESCRIPTOR
    assert non_string_fields(descriptor, [f.name for f in descriptor.fields]) == {
        "big": "int64", "huge": "uint64", "ratio": "double", "flag": "bool", "raw": "bytes",
        "tags": "repeated", "counts": "map", "inner": "tests.pb.Everything.Inner",
        "at": "google.protobuf.Timestamp", "took": "google.protobuf.Duration",
        "maybe": "google.protobuf.Int64Value", "extra": "google.protobuf.Struct",
        "price": "confluent.type.Decimal", "negative": "sint32"}
    assert non_string_fields(descriptor, ["text", "color", "note", "absent"]) == {}


@pytest.mark.parametrize("message", [OrderPlaced, dict, "orders.pb.OrderPlaced"])
def test_a_codec_needs_a_protobuf_message_class(message: Any) -> None:
    with pytest.raises(ConfigError, match="ProtobufCodec needs a Protobuf message class"):
        ProtobufCodec(message)


def test_without_a_registry_url_the_start_fails_naming_the_handler() -> None:
    h = handler(App("a"))
    with pytest.raises(ConfigError, match="handler 'place': no schema registry"):
        h.codec  # noqa: B018 (what a member does at start-up)


def test_an_unbound_codec_says_so() -> None:
    with pytest.raises(ConfigError, match="not bound to a schema registry"):
        ProtobufCodec(protos.OrderPlaced).decode(b"\x00\x00\x00\x00\x01\x00")


def test_encoding_refuses_what_the_message_cannot_carry(registry: Registry) -> None:
    c = codec(registry.url, model=None)
    with pytest.raises(ValueError, match=r"orders\.pb\.OrderPlaced has no field 'coupon'"):
        c.encode({**order(), "coupon": "x"})
    with pytest.raises(TypeError,
                       match=r"encodes orders\.pb\.OrderPlaced, not orders\.pb\.Shipment"):
        c.encode(protos.Shipment(order_id="o1"))


# --- values --------------------------------------------------------------------------


def test_every_kind_of_field_becomes_a_python_value_and_back() -> None:
    values = {
        "text": "a", "big": 2**40, "huge": 2**63, "ratio": 0.5, "flag": True, "raw": b"\x00\x01",
        "color": "RED", "tags": ["x", "y"], "counts": {"a": 2**33}, "inner": {"label": "l"},
        "at": PLACED_AT, "took": dt.timedelta(seconds=3, microseconds=5), "maybe": 7,
        "extra": {"k": [1.0, "v"], "n": None}, "price": Decimal("-10.50"), "note": "",
        "negative": -3,
    }
    message = from_python(protos.Everything, values)
    assert to_python(message) == values
    assert to_python(protos.Everything.FromString(message.SerializeToString())) == values
    # Unset: proto3 scalars are their zero value (the wire cannot tell), fields with
    # presence (messages, wrappers, `optional`) are left out for the model to default.
    assert to_python(protos.Everything()) == {
        "text": "", "big": 0, "huge": 0, "ratio": 0.0, "flag": False, "raw": b"",
        "color": "COLOR_UNSET", "tags": [], "counts": {}, "negative": 0}


def test_an_enum_number_the_schema_does_not_know_stays_a_number() -> None:
    message = protos.Everything.FromString(b"\x38\x07")  # field 7 (color) = 7
    assert to_python(message)["color"] == 7
    with pytest.raises(ValueError, match=r"'BLUE' is not a value of tests\.pb\.Color"):
        from_python(protos.Everything, {"color": "BLUE"})
