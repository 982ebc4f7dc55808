"""The payments example's events: every charge that takes effect emits one
``payments.charge-completed`` event (key: the order id; value: the charge and its ledger
entry), published by the relay; a replay, a payload conflict or a failed charge emits
nothing. Per-message and bulk handlers, local and leased (sync and async) modes."""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient

from consumers import payments
from kafka_idem.admin import topics as topic_rules
from tests.conftest import (
    DB,
    InProcess,
    Topics,
    app_settings,
    caught_up,
    headers,
    produce,
    wait_for,
)
from tests.integration.outbox_support import read_committed, wait_published

VALID = [("t1", "o1", "5.00", "EUR"), ("t2", "o2", "7.25", "USD"), ("t1", "o3", "1.10", "EUR")]


def charge(tenant: str, order: str, amount: str, currency: str = "EUR") -> tuple[bytes, bytes]:
    return order.encode(), payments.encode_charge(tenant, order, amount, currency)


def build(db: DB, topics: Topics, group: str, admin: AdminClient, **kw: Any) -> Any:
    """The payments app on a new topic, its topics made as ``kafka-idem topics create``
    makes them (the event topic and the relays' control topic included)."""
    source = topics(partitions=2)
    app = payments.build_app(topic=source, **app_settings(
        db, group_id=group, name_prefix=f"pe{uuid.uuid4().hex[:8]}-", outbox_shards=2,
        outbox_poll_seconds=0.2), **kw)
    done = topic_rules.create(app, admin, partitions=2)
    made = [d.name for d in done if d.created]
    topics.created.extend(made)
    assert payments.events_topic(source) in made, [(d.name, d.role) for d in done]
    return app


@pytest.mark.parametrize("variant", ["bulk", "per-message", "leased", "leased-async"])
def test_each_charge_that_takes_effect_emits_one_event(
    db: DB, topics: Topics, group: str, admin: AdminClient, variant: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mode = "leased" if variant.startswith("leased") else "local"
    monkeypatch.setattr(payments, "ASYNC", variant == "leased-async")
    app = build(db, topics, group, admin, mode=mode)
    source = app.topics[0]
    if variant == "per-message":
        app.handlers[source].bulk = None
    events = payments.events_topic(source)
    produce(source, [charge(*c) for c in VALID] + [
        charge(*VALID[0]),  # a re-send: replayed, no event
        charge("t2", "o2", "8.00", "USD"),  # another amount for o2: a conflict, no event
        charge("t1", "o4", "0"),  # invalid: Permanent before any write, no event
        (b"o5", b"\x00garbage"),  # undecodable
    ])
    with InProcess(app):  # the runner publishes the outbox too (an app with event topics)
        wait_for(lambda: caught_up(group, source), what="the charges")
        got = wait_published(db, events, len(VALID))
    assert len(read_committed(events)) == len(VALID)  # and no more (replay, conflict, failure)
    ledger = {r["idempotency_key"]: r for r in db.ledger()}
    records = {r["idempotency_key"]: r for r in db.records()}
    by_order = {m.key(): m for m in got}
    assert sorted(by_order) == [b"o1", b"o2", b"o3"]
    for tenant, order, amount, currency in VALID:
        key = f"{tenant}:charge:{order}"
        m = by_order[order.encode()]
        name, value = payments.codec().decode(m.value())
        event = payments.ChargeCompleted.model_validate(value)
        row, rec = ledger[key], records[key]
        assert name == payments.EVENT_SCHEMA
        assert (event.tenant_id, event.order_id, event.amount, event.currency,
                event.idempotency_key) == (tenant, order, Decimal(amount), currency, key)
        assert (event.ledger_entry.id, event.ledger_entry.created_at) == (row["id"],
                                                                           row["created_at"])
        h = headers(m)
        assert h["idem.key"] == key and h["idem.namespace"] == app.namespace
        assert (h["idem.source.topic"], int(h["idem.source.partition"]),
                int(h["idem.source.offset"])) == (source, rec["kafka_partition"],
                                                  rec["kafka_offset"])
        assert int(h["idem.outbox.id"]) > 0
    assert records["t2:charge:o2"]["status"] == "succeeded"  # the conflict changed nothing
    assert records["t1:charge:o4"]["status"] == "failed"


def test_without_events_nothing_is_emitted(db: DB, topics: Topics, group: str) -> None:
    """``build_app(events=False)`` (``PAYMENTS_EVENTS=off``): the charge alone."""
    source = topics(partitions=1)
    app = payments.build_app(topic=source, events=False,
                             **app_settings(db, group_id=group))
    assert app.event_topics == {}
    produce(source, [charge(*c) for c in VALID])
    with InProcess(app):
        wait_for(lambda: caught_up(group, source), what="the charges")
    assert len(db.ledger()) == len(VALID)
    assert db.rows("SELECT * FROM kafka_idem.outbox") == []


def test_the_event_topic_follows_the_charge_topic() -> None:
    assert payments.events_topic("payments.charge-requested") == "payments.charge-completed"
    assert payments.events_topic("chaos.ab12.charge-requested") == "chaos.ab12.charge-completed"
    assert payments.events_topic("t-1234") == "t-1234.charge-completed"
    assert payments.app.event_topics.keys() == {"payments.charge-completed"}
