"""The JSON example (consumers/orders_json.py) and the registry format against the real
broker and database: exactly-once effects with JSON payloads, every class of bad
input of issue 12 dead-lettered with the format and the problem, the request hash
the same across formats (through the real schema registry), a registry outage never
charged to the message (the in-test registry, which can be taken down)."""

from __future__ import annotations

import datetime as dt
import io
import json
import struct
import time
from decimal import Decimal
from typing import Any

import fastavro
import pytest

from consumers.orders_json import OrderPlaced, build_app, create_tables, encode_order, place
from kafka_idem import App
from kafka_idem.codecs.avro_codec import AvroCodec
from kafka_idem.keys import hash_payload
from tests.conftest import (
    DB,
    ROOT,
    InProcess,
    Topics,
    app_settings,
    caught_up,
    committed,
    end_offsets,
    headers,
    produce,
    wait_for,
)
from tests.integration.support import assert_dead_letter, dlq_records, migrate_app
from tests.registry import Registry

HASH_FIELDS = ("amount", "currency", "items")
SCHEMAS = ROOT / "schemas"
ORDER_SCHEMA = json.loads((SCHEMAS / "orders" / "order_placed.avsc").read_text())


def rows(db: DB) -> dict[str, int]:
    found = db.rows("SELECT idempotency_key, count(*) AS n FROM orders.placed GROUP BY 1")
    return {r["idempotency_key"]: r["n"] for r in found}


def order_json(order_id: str, amount: str = "10.0", **over: Any) -> bytes:
    """JSON as a hand-written producer sends it: the amount a JSON *number*."""
    fields = {"tenant_id": "t1", "order_id": order_id, "currency": "EUR", "items": 2,
              "request_id": f"r-{time.monotonic_ns()}", "placed_at": "2025-01-31T12:00:00Z",
              **over}
    body = json.dumps(fields)[:-1] + f', "amount": {amount}}}'
    return body.encode()


def test_json_orders_take_effect_once_and_duplicates_replay(db: DB, topics: Topics,
                                                          group: str) -> None:
    topic = topics(partitions=2)
    app = build_app(topic=topic, **app_settings(db, group_id=group))
    migrate_app(db, app)
    sent = [(f"o{i}".encode(), encode_order("t1", f"o{i}", f"{i + 1}.50", items=i + 1))
            for i in range(20)]
    # Producer retries in another JSON spelling: the amount as a number, new request ids.
    again = [(f"o{i}".encode(), order_json(f"o{i}", f"{i + 1}.5", items=i + 1)) for i in range(5)]
    produce(topic, sent + again)
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), what="the group to catch up")
    assert rows(db) == {f"t1:order:o{i}": 1 for i in range(20)}
    assert db.status_counts() == {"succeeded": 20}
    assert dlq_records(topic) == []
    stored = db.record("t1:order:o3")
    assert stored is not None and stored["result_json"] == {
        "order_id": "o3", "amount": "4.50", "items": 4}


def test_bad_json_is_dead_lettered_naming_the_format_and_the_consumer_moves_on(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=1)
    app = build_app(topic=topic, **app_settings(db, group_id=group, payload_max_bytes=600))
    migrate_app(db, app)
    avro = AvroCodec.from_dir(SCHEMAS)
    bad = {
        "invalid JSON": (b'{"tenant_id": "t1", "order_id": ', "undecodable", "Undecodable",
                         "json: invalid JSON: "),
        "wrong shape": (order_json("o-x", items="\"many\""), "permanent", "InvalidPayload",
                        "json: payload does not validate: items: Input should be a valid "
                        "integer"),
        "not an object": (b"[1, 2, 3]", "permanent", "InvalidPayload",
                          "json: payload does not validate: (root): Input should be"),
        "registry-framed": (b"\x00\x00\x00\x00\x2a" + order_json("o-y"), "undecodable",
                            "Undecodable", "json: the value is Confluent-framed (magic byte 0, "
                            "schema id 42), not JSON"),
        "avro": (avro.encode("orders.OrderPlaced", {
            "tenant_id": "t1", "order_id": "o-z", "amount": Decimal("1.00"), "currency": "EUR",
            "items": 1, "request_id": "r", "placed_at": dt.datetime.now(dt.UTC)}),
            "undecodable", "Undecodable", "json: the value is Avro single-object encoded"),
        "too large": (order_json("o-big", request_id="r" * 700), "undecodable",
                      "PayloadTooLarge", "json: the value is "),
        "empty": (b"", "undecodable", "Undecodable", "json: empty message value"),
    }
    good = [(b"ok1", encode_order("t1", "ok1", "1.00")), (b"ok2", encode_order("t1", "ok2", 2))]
    offsets = produce(topic, [(name.encode(), value) for name, (value, *_r) in bad.items()]
                      + good)
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), what="the group to catch up")
        wait_for(lambda: len(dlq_records(topic)) == len(bad), what="the dead letters")
    sources = {m.key().decode(): m for m in _read(topic)}
    letters = {m.key().decode(): m for m in dlq_records(topic)}
    for name, (_value, kind, cls, text) in bad.items():
        h = assert_dead_letter(letters[name], sources[name], kind=kind, attempts=0,
                               group=group, handler="place", key=None)
        assert h["idem.error.class"] == cls, name
        assert h["idem.error.message"].startswith(text), (name, h["idem.error.message"])
    assert "over the limit of 600 (setting payload_max_bytes)" in \
        headers(letters["too large"])["idem.error.message"]
    assert rows(db) == {"t1:order:ok1": 1, "t1:order:ok2": 1}
    assert db.status_counts() == {"succeeded": 2}  # bad input leaves no record
    assert committed(group, topic) == {0: offsets[-1][1] + 1}


def _read(topic: str) -> list[Any]:
    from tests.conftest import read_topic

    return read_topic(topic)


def confluent(schema_id: int, body: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", schema_id) + body


def avro_body(record: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(ORDER_SCHEMA), record)
    return buf.getvalue()


def registry_app(db: DB, group: str, json_topic: str, registry_topic: str, url: str) -> App:
    """One app, two handlers with one key template: the same orders as JSON on one topic and
    registry-framed on the other (a producer moving formats)."""
    app = App("orders", **app_settings(db, group_id=group, schemas_dir=SCHEMAS,
                                       schema_registry_url=url,
                                       schema_registry={"max.retries": 0}))
    app.migration(create_tables)
    app.handler(topic=json_topic, model=OrderPlaced, format="json",
                key="{tenant_id}:order:{order_id}", hash_fields=HASH_FIELDS, name="json")(place)
    app.handler(topic=registry_topic, model=OrderPlaced, format="registry",
                schema="orders.OrderPlaced", key="{tenant_id}:order:{order_id}",
                hash_fields=HASH_FIELDS, name="registry")(place)
    return app


def test_the_same_intent_as_json_and_as_registry_avro_is_one_effect(
    db: DB, topics: Topics, group: str, schema_registry: str
) -> None:
    """Through the real registry (scripts/registry.sh)."""
    json_topic, registry_topic = topics(), topics()
    app = registry_app(db, group, json_topic, registry_topic, schema_registry)
    migrate_app(db, app)
    codec = app.handlers[registry_topic].codec
    record = {"tenant_id": "t1", "order_id": "o1", "amount": Decimal("10.00"),
              "currency": "EUR", "items": 2, "request_id": "r-avro",
              "placed_at": dt.datetime(2025, 1, 31, 12, tzinfo=dt.UTC)}
    as_avro = codec.encode(record)
    as_json = order_json("o1", "10.0")  # the same intent: amount 10.0, 2 items
    h_json = hash_payload(app.handlers[json_topic].decode(as_json), HASH_FIELDS)
    h_avro = hash_payload(codec.decode(as_avro), HASH_FIELDS)
    assert h_json == h_avro
    produce(json_topic, [(b"o1", as_json)])
    with InProcess(app):
        wait_for(lambda: caught_up(group, json_topic), what="the JSON topic")
        produce(registry_topic, [(b"o1", as_avro)])
        wait_for(lambda: caught_up(group, registry_topic), what="the registry topic")
    assert rows(db) == {"t1:order:o1": 1}  # replayed, not a payload conflict
    assert dlq_records(registry_topic) == []
    rec = db.record("t1:order:o1")
    assert rec is not None and rec["request_hash"] == h_json


def test_bad_registry_input_is_dead_lettered_and_an_outage_waits(
    db: DB, topics: Topics, group: str
) -> None:
    json_topic, topic = topics(), topics()
    with Registry() as registry:
        app = registry_app(db, group, json_topic, topic, registry.url)
        migrate_app(db, app)
        codec = app.handlers[topic].codec

        def order(order_id: str) -> dict[str, Any]:
            return {"tenant_id": "t1", "order_id": order_id, "amount": Decimal("3.00"),
                    "currency": "EUR", "items": 1, "request_id": "r",
                    "placed_at": dt.datetime(2025, 1, 31, tzinfo=dt.UTC)}

        good = codec.encode(order("ok1"))
        json_sid = registry.register("other-value", json.dumps({"type": "object"}), "JSON")
        bad = {
            "unknown id": (confluent(999, avro_body(order("x1"))), "undecodable",
                           "registry: schema id 999 not found in the registry"),
            "json on registry": (order_json("x2"), "undecodable",
                                 "registry: not Confluent-framed (magic byte 0 expected): "
                                 "the value is JSON"),
            "truncated header": (b"\x00\x00\x01", "undecodable",
                                 "registry: truncated frame: 3 bytes"),
            "truncated body": (good[:-4], "undecodable", "registry avro, schema id"),
            "registry json wrong shape": (confluent(json_sid, b'{"order_id": 5}'), "permanent",
                                          f"registry json (schema id {json_sid}): payload does "
                                          "not validate"),
        }
        produce(topic, [(name.encode(), value) for name, (value, *_r) in bad.items()])
        with InProcess(app):
            wait_for(lambda: caught_up(group, topic), what="the registry topic")
            # An outage: the next message waits (no dead letter, no record), then succeeds.
            new_sid = registry.register("orders-v2", json.dumps(ORDER_SCHEMA) + " ", "AVRO")
            registry.down = True  # a schema id never seen: the member must ask, and can't
            produce(topic, [(b"during outage", confluent(new_sid, avro_body(order("o2"))))])
            wait_for(lambda: any("GET /schemas/ids/" + str(new_sid) == r
                                 for r in registry.requests), what="a registry lookup")
            time.sleep(1.5)
            assert len(dlq_records(topic)) == len(bad)
            assert db.record("t1:order:o2") is None
            registry.down = False
            wait_for(lambda: caught_up(group, topic), what="the outage to end")
        letters = {m.key().decode(): m for m in dlq_records(topic)}
        assert set(letters) == set(bad)
        for name, (_value, kind, text) in bad.items():
            h = headers(letters[name])
            assert h["idem.error.kind"] == kind, name
            assert h["idem.error.message"].startswith(text), (name, h["idem.error.message"])
        assert "schema_id=999" in headers(letters["unknown id"])["idem.error.message"]
        assert rows(db) == {"t1:order:o2": 1}
        assert end_offsets(topic) == {0: len(bad) + 1}


@pytest.mark.parametrize("fmt", ["avro", "registry"])
def test_a_format_that_cannot_work_fails_at_start_naming_the_handler(
    db: DB, topics: Topics, group: str, fmt: str
) -> None:
    from kafka_idem.consume.runner import Runner
    from kafka_idem.errors import ConfigError

    app = App("orders", **app_settings(db, group_id=group, default_format=fmt,
                                       schemas_dir=SCHEMAS))
    app.handler(topic=topics(), model=OrderPlaced, key="{tenant_id}:order:{order_id}",
                hash_fields=HASH_FIELDS, name="place")(place)
    wanted = "needs schema=" if fmt == "avro" else "no schema registry"
    with pytest.raises(ConfigError, match=f"handler 'place': .*{wanted}"):
        Runner(app)
