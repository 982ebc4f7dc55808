"""The request hash is a function of the logical payload, not of its wire format: one
intent sent as JSON (a number or a string amount), as Avro single-object (a scale-2
decimal), registry-framed Avro, registry-framed JSON or registry-framed Protobuf (the
amount a string, a ``confluent.type.Decimal`` or a double) gets one hash (property tests)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers.orders_json import OrderPlaced
from kafka_idem.codecs.avro_codec import AvroCodec, AvroObjectCodec
from kafka_idem.codecs.base import Codec, adapter_for
from kafka_idem.codecs.json_codec import JsonCodec
from kafka_idem.codecs.protobuf import ProtobufCodec
from kafka_idem.codecs.registry import RegistryCodec, registry_client
from kafka_idem.keys import hash_payload
from tests import protos
from tests.conftest import ROOT
from tests.registry import Registry

FIELDS = ("amount", "currency", "items")
FIXTURE = [HealthCheck.function_scoped_fixture]
ADAPTER = adapter_for(OrderPlaced, handler="h")
SCHEMAS = AvroCodec.from_dir(ROOT / "schemas")

# Amounts of at most 15 significant digits, 2 decimal places (what an IEEE double
# carries exactly through a JSON number; docs/how-to/payload-formats.md).
amounts = st.integers(min_value=1, max_value=10**13 - 1).map(lambda c: Decimal(c).scaleb(-2))
intents = st.fixed_dictionaries({
    "amount": amounts,
    "currency": st.sampled_from(["EUR", "USD", "JPY"]),
    "items": st.integers(min_value=1, max_value=10_000),
    "tenant_id": st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
                         max_size=8),
    "order_id": st.from_regex(r"[a-z0-9-]{1,12}", fullmatch=True),
})


def full(intent: dict[str, Any], request_id: str) -> dict[str, Any]:
    return {**intent, "request_id": request_id,
            "placed_at": dt.datetime(2025, 1, 31, 12, tzinfo=dt.UTC)}


def hand_written_json(intent: dict[str, Any], amount_text: str) -> bytes:
    """JSON as a hand-written producer sends it: the amount a JSON number."""
    rest = {k: v for k, v in full(intent, "r-json").items() if k != "amount"}
    rest["placed_at"] = "2025-01-31T12:00:00+00:00"
    return (json.dumps(rest)[:-1] + f', "amount": {amount_text}}}').encode()


@pytest.fixture(scope="module")
def codecs() -> Iterator[dict[str, Codec]]:
    with Registry() as registry:
        client = registry_client(registry.url, {"max.retries": 0})
        yield {
            "json": JsonCodec(ADAPTER),
            "avro": AvroObjectCodec(SCHEMAS, "orders.OrderPlaced", ADAPTER),
            "registry avro": RegistryCodec(client, ADAPTER, subject="a-value", schemas=SCHEMAS,
                                           schema="orders.OrderPlaced"),
            "registry json": RegistryCodec(client, ADAPTER, subject="j-value"),
            **{f"protobuf {kind} amount": ProtobufCodec(message, client=client, topic=f"p-{kind}",
                                                        adapter=ADAPTER)
               for kind, message in PROTOBUF.items()},
        }


PROTOBUF = {"string": protos.OrderPlaced, "decimal": protos.DecimalOrderPlaced,
            "double": protos.DoubleOrderPlaced}


@pytest.fixture(scope="module")
def plain_protobuf() -> Iterator[dict[str, Codec]]:
    """Without a model: the payload is the dict of the message's values."""
    with Registry() as registry:
        client = registry_client(registry.url, {"max.retries": 0})
        yield {kind: ProtobufCodec(message, client=client, topic=f"plain-{kind}")
               for kind, message in PROTOBUF.items() if kind != "string"}


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURE)
@given(intent=intents)
def test_one_intent_has_one_hash_in_every_format(codecs: dict[str, Codec],
                                                 plain_protobuf: dict[str, Codec],
                                                 intent: dict[str, Any]) -> None:
    hashes = {name: hash_payload(codec.decode(codec.encode(full(intent, f"r-{name}"))), FIELDS)
              for name, codec in codecs.items()}
    amount = intent["amount"]
    for text in (str(amount), repr(float(amount)), f"{amount:.2f}",
                 str(amount.normalize()) if amount == amount.to_integral() else str(amount)):
        payload = codecs["json"].decode(hand_written_json(intent, text))
        hashes[f"json number {text}"] = hash_payload(payload, FIELDS)
        # No model: a dict of what the JSON parser made (a float amount) hashes the same.
        plain = JsonCodec().decode(hand_written_json(intent, text))
        hashes[f"dict {text}"] = hash_payload(plain, FIELDS)
    for kind, codec in plain_protobuf.items():  # a Decimal or a float amount, no model
        payload = codec.decode(codec.encode(full(intent, f"r-plain-{kind}")))
        assert isinstance(payload, dict)
        hashes[f"protobuf dict, {kind} amount"] = hash_payload(payload, FIELDS)
    assert len(set(hashes.values())) == 1, hashes


@given(intent=intents, other=amounts)
@settings(max_examples=100, deadline=None, suppress_health_check=FIXTURE)
def test_a_different_amount_is_a_different_hash_in_every_format(
    codecs: dict[str, Codec], intent: dict[str, Any], other: Decimal
) -> None:
    if other == intent["amount"]:
        return
    for codec in codecs.values():
        a = hash_payload(codec.decode(codec.encode(full(intent, "r1"))), FIELDS)
        b = hash_payload(codec.decode(codec.encode(full({**intent, "amount": other}, "r2"))),
                         FIELDS)
        assert a != b
