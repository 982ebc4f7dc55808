"""Signed dead letters (kafka_idem.deadletters.signing) and the replay's boundary decisions
that need no service (kafka_idem.replay.trust, targets): what a signature covers, key rotation,
the settings' checks, and which record is outside which boundary."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError
from hypothesis import given
from hypothesis import strategies as st

from kafka_idem.deadletters.dead_letter import DeadLetter, DeadLetterer
from kafka_idem.deadletters.signing import SIGNATURE, Signer, sign, verify
from kafka_idem.errors import ConfigError
from kafka_idem.replay import Boundary, DlqRecord
from kafka_idem.replay.targets import fault_of
from kafka_idem.settings import Settings, load_settings
from kafka_idem.testing.letters import MemoryProducer
from kafka_idem.testing.message import FakeMessage

K1, K2 = b"a" * 20, b"b" * 20
HEADERS = [("trace", b"t"), ("idem.key", b"t1:charge:o1"), ("idem.namespace", b"pay"),
           ("idem.original.topic", b"src")]


def signed(headers: list[tuple[str, Any]], key: bytes | None = b"o1",
           value: bytes | None = b"v", secret: bytes = K1) -> list[tuple[str, Any]]:
    return [*headers, (SIGNATURE, sign(secret, headers, key, value).encode())]


def test_a_signature_holds_for_the_record_as_written_and_any_configured_key() -> None:
    rec = signed(HEADERS)
    assert verify([K1], rec, b"o1", b"v") == "valid"
    assert verify([K2, K1], rec, b"o1", b"v") == "valid"  # rotated: the old key still verifies
    assert verify([K2], rec, b"o1", b"v") == "invalid"
    assert verify([], rec, b"o1", b"v") == "unverifiable"
    assert verify([K1], HEADERS, b"o1", b"v") == "unsigned"


@pytest.mark.parametrize("change", [
    lambda h, k, v: ([(n, b"other" if n == "idem.namespace" else x) for n, x in h], k, v),
    lambda h, k, v: ([*h, ("idem.namespace", b"other")], k, v),  # a second header
    lambda h, k, v: ([x for x in h if x[0] != "idem.key"], k, v),  # one left out
    lambda h, k, v: (list(reversed(h)), k, v),  # order
    lambda h, k, v: (h, b"o2", v),
    lambda h, k, v: (h, None, v),
    lambda h, k, v: (h, k, b"v2"),
    lambda h, k, v: (h, k, None),
    lambda h, k, v: (h, k, b""),
])
def test_any_change_to_an_idem_header_the_key_or_the_value_breaks_it(change: Any) -> None:
    headers, key, value = change(signed(HEADERS), b"o1", b"v")
    assert verify([K1], headers, key, value) == "invalid"


def test_other_headers_are_not_covered_and_two_signatures_are_refused() -> None:
    rec = signed(HEADERS)
    assert verify([K1], [("mirror", b"x"), *rec], b"o1", b"v") == "valid"
    assert verify([K1], [*rec, rec[-1]], b"o1", b"v") == "invalid"


@given(st.lists(st.tuples(st.sampled_from(["idem.a", "idem.b", "x"]), st.binary(max_size=8)),
                max_size=5), st.binary(max_size=8), st.binary(max_size=8))
def test_no_two_header_sets_share_a_canonical_form(headers: list[tuple[str, bytes]],
                                                   a: bytes, b: bytes) -> None:
    """Length prefixes: moving bytes between a name and a value, or between two values,
    gives another signature."""
    moved = [*headers, ("idem.c", a + b)]
    split = [*headers, ("idem.c", a), ("idem.d", b)]
    assert sign(K1, moved, None, None) != sign(K1, split, None, None)


def test_the_dead_letterer_signs_each_record_last_and_its_slim_copy_too() -> None:
    producer = MemoryProducer()
    letterer = DeadLetterer(producer, header_limit=256, signing_keys=[K1, K2])  # type: ignore[arg-type]
    msg = FakeMessage(topic="src", partition=0, offset=7, key=b"o1", value=b"{}",
                      headers=[("idem.signature", b"forged upstream")])
    letter = DeadLetter(dlq_topic="src.dlq", source=msg, kind="permanent", error_class="E",
                        error_message="m", attempts=1, consumer_group="g", handler="h",
                        idempotency_key="k", namespace="ns")
    assert letterer.send([letter]) == [None]
    [rec] = producer.records
    headers = list(rec.headers() or [])
    names = [n for n, _ in headers]
    assert names.count(SIGNATURE) == 1 and names[-1] == SIGNATURE
    assert verify([K1], headers, rec.key(), rec.value()) == "valid"
    slim = letter.slim(256)
    sig = Signer([K1]).header(slim.headers, slim.key, slim.value)
    assert verify([K1], [*slim.headers, sig], slim.key, slim.value) == "valid"


def test_signing_keys_are_secret_and_each_needs_16_bytes() -> None:
    s = Settings(dlq_signing_keys="0123456789abcdef, fedcba9876543210xyz")
    assert s.signing_keys == (b"0123456789abcdef", b"fedcba9876543210xyz")
    assert "0123456789abcdef" not in repr(s) and "0123456789abcdef" not in str(s.redacted())
    assert b"0123456789abcdef".decode() in s.secret_values()
    assert Settings(dlq_signing_keys="").signing_keys == ()
    with pytest.raises(ConfigError) as err:
        load_settings(dlq_signing_keys="0123456789abcdef,short")
    assert "dlq_signing_keys" in str(err.value) and "key 2" in str(err.value)
    assert "short" not in str(err.value)


# --- the boundary ---------------------------------------------------------------------


def record(**headers: str | None) -> DlqRecord:
    base = {"idem.original.topic": "orders", "idem.original.partition": "0",
            "idem.error.kind": "permanent", "idem.namespace": "shop", "idem.key": "k1"}
    base.update(headers)
    pairs = [(k, v.encode()) for k, v in base.items() if v is not None]
    return DlqRecord.from_message(FakeMessage(topic="orders.dlq", partition=0, offset=3,
                                              key=b"k", value=b"v", headers=pairs))


def test_without_an_app_the_boundary_is_the_dlqs_own_source_and_the_namespace_given() -> None:
    b = Boundary.of(Settings(), "orders.dlq", namespace="shop")
    assert b.sources == {"orders"} and b.namespace == "shop"
    assert b.outside(record()) is None
    assert b.outside(record(**{"idem.original.topic": "payments"})) == "other_topic"
    assert b.outside(record(**{"idem.original.topic": None})) == "other_topic"
    assert b.outside(record(**{"idem.namespace": "payments"})) == "other_namespace"
    assert b.outside(record(**{"idem.namespace": None})) is None  # before namespaces: ours
    to = Boundary.of(Settings(), "orders.dlq", to_topic="elsewhere")
    assert to.outside(record(**{"idem.original.topic": "payments"})) is None


def test_a_dlq_whose_source_cannot_be_told_needs_an_app_or_a_target() -> None:
    with pytest.raises(ConfigError) as err:
        Boundary.of(Settings(), "dead-letters", namespace="shop")
    assert err.value.context["setting"] == "app" and "--app" in str(err.value)
    assert Boundary.of(Settings(), "dead-letters", to_topic="orders").sources == frozenset()


def test_with_signing_keys_only_a_holding_signature_is_inside() -> None:
    s = Settings(dlq_signing_keys=K1.decode())
    b = Boundary.of(s, "orders.dlq", namespace="shop")
    assert b.verifies and b.outside(record()) == "unsigned"
    loose = Boundary.of(s, "orders.dlq", namespace="shop", trust_unsigned=True)
    assert loose.outside(record()) is None
    forged = record(**{"idem.signature": "v1:00"})
    assert loose.outside(forged) == "bad_signature" == b.outside(forged)


@pytest.mark.parametrize(("err", "fault"), [
    (KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), "record"),
    (KafkaError(KafkaError._UNKNOWN_PARTITION), "target"),
    (KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), "target"),
    (KafkaError(KafkaError._MSG_TIMED_OUT), None),
    (KafkaError(KafkaError._TRANSPORT), None),
    (KafkaError(KafkaError.NOT_ENOUGH_REPLICAS), None),
])
def test_only_a_records_or_its_targets_own_refusal_sets_it_aside(err: KafkaError,
                                                                  fault: str | None) -> None:
    assert fault_of(err) == fault
