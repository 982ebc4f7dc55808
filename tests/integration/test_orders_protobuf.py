"""Registry-framed Protobuf through a real member (broker and database): orders sent as
Protobuf messages (format=ProtobufCodec) take effect once, the same intent sent as JSON
is the same request (one effect, one hash), every class of bad Protobuf input is
dead-lettered with the format and the problem, a registry outage waits and is never
charged to the message."""

from __future__ import annotations

import base64
import datetime as dt
import json
import struct
import uuid
from decimal import Decimal
from typing import Any

from confluent_kafka.schema_registry import Schema
from confluent_kafka.schema_registry.serde import SchemaId
from google.protobuf import descriptor_pb2

from consumers.orders_json import OrderPlaced, create_tables, place
from kafka_idem import App
from kafka_idem.codecs.protobuf import ProtobufCodec
from kafka_idem.keys import hash_payload
from tests import protos
from tests.conftest import (
    DB,
    InProcess,
    Topics,
    app_settings,
    caught_up,
    committed,
    headers,
    produce,
    read_topic,
    wait_for,
)
from tests.integration.support import assert_dead_letter, dlq_records, migrate_app
from tests.registry import Registry

HASH_FIELDS = ("amount", "currency", "items")
KEY = "{tenant_id}:order:{order_id}"
PLACED_AT = dt.datetime(2025, 1, 31, 12, tzinfo=dt.UTC)


def rows(db: DB) -> dict[str, int]:
    found = db.rows("SELECT idempotency_key, count(*) AS n FROM orders.placed GROUP BY 1")
    return {r["idempotency_key"]: r["n"] for r in found}


def order(order_id: str, amount: str = "3.00", **over: Any) -> dict[str, Any]:
    return {"tenant_id": "t1", "order_id": order_id, "amount": Decimal(amount),
            "currency": "EUR", "items": 1, "request_id": f"r-{order_id}",
            "placed_at": PLACED_AT, **over}


def orders_app(db: DB, group: str, url: str, *, protobuf: str, json_topic: str | None = None,
               registry_topic: str | None = None) -> App:
    """The orders example's model and handler on a Protobuf topic (plus, to compare, a JSON
    topic and a 'registry' topic with the same key template)."""
    app = App("orders", **app_settings(db, group_id=group, schema_registry_url=url,
                                       schema_registry={"max.retries": 0}))
    app.migration(create_tables)
    app.handler(topic=protobuf, model=OrderPlaced, format=ProtobufCodec(protos.OrderPlaced),
                key=KEY, hash_fields=HASH_FIELDS, name="protobuf")(place)
    if json_topic:
        app.handler(topic=json_topic, model=OrderPlaced, format="json", key=KEY,
                    hash_fields=HASH_FIELDS, name="json")(place)
    if registry_topic:
        app.handler(topic=registry_topic, model=OrderPlaced, format="registry", key=KEY,
                    hash_fields=HASH_FIELDS, name="registry")(place)
    return app


def test_protobuf_orders_take_effect_once_and_the_json_intent_is_the_same_request(
    db: DB, topics: Topics, group: str, schema_registry: str
) -> None:
    """Through the real registry (scripts/registry.sh)."""
    pb_topic, json_topic = topics(partitions=2), topics()
    app = orders_app(db, group, schema_registry, protobuf=pb_topic, json_topic=json_topic)
    migrate_app(db, app)
    codec = app.handlers[pb_topic].codec
    sent = [(f"o{i}".encode(), codec.encode(OrderPlaced(**order(f"o{i}", f"{i + 1}.50"))))
            for i in range(20)]
    # Producer retries: the same intents as Protobuf messages built by hand (the amount
    # spelled differently, new request ids).
    again = []
    for i in range(5):
        message = protos.OrderPlaced(tenant_id="t1", order_id=f"o{i}", amount=f"{i + 1}.5",
                                     currency="EUR", items=1, request_id=f"retry-{i}")
        message.placed_at.FromDatetime(PLACED_AT)
        again.append((f"o{i}".encode(), codec.encode(message)))
    as_json = app.handlers[json_topic].encode(order("o-both", "10.00"))
    both = protos.OrderPlaced(tenant_id="t1", order_id="o-both", amount="10",
                              currency="EUR", items=1, request_id="r-pb")
    both.placed_at.FromDatetime(PLACED_AT)
    as_protobuf = codec.encode(both)
    h_json = hash_payload(app.handlers[json_topic].decode(as_json), HASH_FIELDS)
    assert hash_payload(codec.decode(as_protobuf), HASH_FIELDS) == h_json
    produce(json_topic, [(b"o-both", as_json)])
    with InProcess(app):
        wait_for(lambda: caught_up(group, json_topic), what="the JSON topic")
        produce(pb_topic, [*sent, *again, (b"o-both", as_protobuf)])
        wait_for(lambda: caught_up(group, pb_topic), what="the Protobuf topic")
    assert rows(db) == {**{f"t1:order:o{i}": 1 for i in range(20)}, "t1:order:o-both": 1}
    assert db.status_counts() == {"succeeded": 21}  # the retries replayed, no conflict
    assert dlq_records(pb_topic) == [] and dlq_records(json_topic) == []
    stored = db.record("t1:order:o3")
    assert stored is not None and stored["result_json"] == {
        "order_id": "o3", "amount": "4.50", "items": 1}
    record = db.record("t1:order:o-both")
    assert record is not None and record["request_hash"] == h_json


def _frame(schema_id: int, indexes: list[int], body: bytes) -> bytes:
    return SchemaId("PROTOBUF", schema_id=schema_id, message_indexes=indexes).id_to_bytes() + body


def test_bad_protobuf_input_is_dead_lettered_naming_the_format_and_the_problem(
    db: DB, topics: Topics, group: str, schema_registry: str
) -> None:
    """Through the real registry (scripts/registry.sh)."""
    topic, reg_topic = topics(), topics()
    app = orders_app(db, group, schema_registry, protobuf=topic, registry_topic=reg_topic)
    migrate_app(db, app)
    codec = app.handlers[topic].codec
    good = codec.encode(order("ok1"))
    (sid,) = struct.unpack(">I", good[1:5])
    body = good[6:]
    shipment = ProtobufCodec(protos.Shipment, client=codec.client, topic=f"{topic}-ships").encode(
        {"order_id": "x1"})
    # (Apicurio 2.4 cannot tell a JSON Schema without properties from other content.)
    json_id = codec.client.register_schema(f"{topic}-j-value", Schema(json.dumps(
        {"type": "object", "title": topic, "properties": {"a": {"type": "string"}}}), "JSON"))
    avro_id = codec.client.register_schema(f"{topic}-a-value", Schema(json.dumps(
        {"type": "record", "name": "R", "doc": topic, "fields": []}), "AVRO"))
    unknown = 1_000_000 + uuid.uuid4().int % 1_000_000
    handler_reads = "this handler reads orders.pb.OrderPlaced"
    bad = {  # name: (value, kind, class, the start of idem.error.message)
        "other message": (shipment, "undecodable", "Undecodable",
                          "protobuf (schema id "),  # (Shipment's id: below)
        "no such index": (_frame(sid, [5], body), "undecodable", "Undecodable",
                          f"protobuf (schema id {sid}): message indexes [5] name no "
                          "message: the schema has 2 at index 5"),
        "truncated header": (good[:4], "undecodable", "Undecodable",
                             "protobuf: truncated frame: 4 bytes"),
        "no indexes": (good[:5], "undecodable", "Undecodable",
                       f"protobuf (schema id {sid}): the message indexes do not decode "
                       "(a truncated or corrupt frame"),
        "truncated body": (good[:8], "undecodable", "Undecodable",
                           f"protobuf (schema id {sid}): the body does not parse as "
                           "orders.pb.OrderPlaced"),
        "json id": (b"\x00" + struct.pack(">I", json_id) + b'{"a": "x"}', "undecodable",
                    "Undecodable", f"protobuf: schema id {json_id} is a JSON schema, not "
                    f"Protobuf ({handler_reads})"),
        "avro id": (b"\x00" + struct.pack(">I", avro_id) + good[5:], "undecodable",
                    "Undecodable", f"protobuf: schema id {avro_id} is a AVRO schema, not "
                    "Protobuf"),
        "unknown id": (_frame(unknown, [0], body), "undecodable", "Undecodable",
                       f"protobuf: schema id {unknown} not found in the registry"),
        "not framed": (b'{"order_id": "x"}', "undecodable", "Undecodable",
                       "protobuf: not Confluent-framed (magic byte 0 expected): the value "
                       "is JSON"),
        "wrong shape": (codec.encode(protos.OrderPlaced(tenant_id="t1", order_id="x2",
                                                         amount="1", currency="EUR")),
                        "permanent", "InvalidPayload", f"protobuf (schema id {sid}): payload "
                        "does not validate: items: Input should be greater than or equal "
                        "to 1"),
        "empty": (b"", "undecodable", "Undecodable", "protobuf: empty message value"),
    }
    offsets = produce(topic, [(name.encode(), value) for name, (value, *_r) in bad.items()]
                      + [(b"ok1", good)])
    produce(reg_topic, [(b"protobuf on registry", good)])  # the reverse
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic) and caught_up(group, reg_topic),
                 what="both topics")
    sources = {m.key().decode(): m for m in read_topic(topic)}
    letters = {m.key().decode(): m for m in dlq_records(topic)}
    assert set(letters) == set(bad)
    for name, (_value, kind, cls, text) in bad.items():
        h = assert_dead_letter(letters[name], sources[name], kind=kind, attempts=0, group=group,
                               handler="protobuf", key=None)
        assert h["idem.error.class"] == cls, name
        assert h["idem.error.message"].startswith(text), (name, h["idem.error.message"])
    (ship_id,) = struct.unpack(">I", shipment[1:5])
    assert headers(letters["other message"])["idem.error.message"].startswith(
        f"protobuf (schema id {ship_id}): message indexes [1] name orders.pb.Shipment, "
        f"{handler_reads}")
    assert f"schema_id={unknown}" in headers(letters["unknown id"])["idem.error.message"]
    [reverse] = dlq_records(reg_topic)
    h = headers(reverse)
    assert h["idem.error.kind"] == "undecodable"
    assert h["idem.error.message"].startswith(
        f"registry: schema id {sid} is a PROTOBUF schema; a 'registry' handler reads Avro "
        "and JSON Schema (Protobuf: format=ProtobufCodec(<message class>))")
    assert rows(db) == {"t1:order:ok1": 1}
    assert db.status_counts() == {"succeeded": 1}  # bad input leaves no record
    assert committed(group, topic) == {0: offsets[-1][1] + 1}


def test_a_registry_outage_waits_and_is_never_charged_to_the_message(
    db: DB, topics: Topics, group: str
) -> None:
    """The in-test registry: it can be taken down."""
    topic = topics()
    with Registry() as registry:
        app = orders_app(db, group, registry.url, protobuf=topic)
        migrate_app(db, app)
        codec = app.handlers[topic].codec
        good = codec.encode(order("ok1"))
        produce(topic, [(b"ok1", good)])
        with InProcess(app):
            wait_for(lambda: caught_up(group, topic), what="the first message")
            # A schema id never seen, so the member must ask, and can't: it waits and
            # asks again (no dead letter, no record), then succeeds.
            file = descriptor_pb2.FileDescriptorProto()
            protos.OrderPlaced.DESCRIPTOR.file.CopyToProto(file)
            file.name = "orders/order_placed_v2.proto"  # another schema text: another id
            new_sid = registry.register("orders-v2", base64.b64encode(
                file.SerializeToString()).decode(), "PROTOBUF")
            registry.down = True
            body = good[6:].replace(b"ok1", b"o-2")
            produce(topic, [(b"during outage", _frame(new_sid, [0], body))])
            lookup = f"GET /schemas/ids/{new_sid}"
            wait_for(lambda: registry.requests.count(lookup) >= 2, what="a second lookup")
            assert dlq_records(topic) == []
            assert db.record("t1:order:o-2") is None
            registry.down = False
            wait_for(lambda: caught_up(group, topic), what="the outage to end")
    assert dlq_records(topic) == []
    assert rows(db) == {"t1:order:ok1": 1, "t1:order:o-2": 1}
    assert committed(group, topic) == {0: 2}
