"""The first hour against the real broker and database: the topics an app needs created
(matching partitions, DLQ retention, idempotent, refusals naming the option), the
producer helper (the handler's codec, the idempotency key as the Kafka key, bad payloads
refused before sending, unacknowledged records reported), and a configuration error met
while processing: the partition held, the message never charged, the others flowing."""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from decimal import Decimal
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource
from pydantic import BaseModel

from consumers.payments import build_app
from kafka_idem import App, ConfigError, Context, DeliveryFailed, InvalidPayload, MissingKeyField
from kafka_idem.admin import topics as topic_rules
from tests.acceptance.conftest import set_topic_config
from tests.conftest import (
    BOOTSTRAP,
    DB,
    InProcess,
    Topics,
    app_settings,
    committed,
    read_topic,
    wait_for,
)


class Reserve(BaseModel):
    shop: str
    order_id: str
    sku: str
    qty: int


def inventory(name: str, *topics: str, **settings: Any) -> App:
    app = App(name, bootstrap_servers=BOOTSTRAP, **settings)
    for topic in topics:
        app.handler(topic=topic, model=Reserve, key="{shop}:reserve:{order_id}",
                    hash_fields=("sku", "qty"), name=f"reserve-{topic[-4:]}")(
            lambda msg, ctx: {"reserved": msg.qty})
    return app


def unique(prefix: str = "inv") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def configs(admin: AdminClient, topic: str) -> dict[str, str]:
    res = ConfigResource(ConfigResource.Type.TOPIC, topic)
    got = next(iter(admin.describe_configs([res]).values())).result(timeout=30)
    return {k: v.value for k, v in got.items()}


def partitions_of(admin: AdminClient, topic: str) -> int:
    """The topic's partition count once its metadata has settled (it lags a creation)."""
    return int(wait_for(lambda: len(admin.list_topics(topic, timeout=10).topics[topic].partitions),
                        what=f"{topic}'s partitions", timeout=30))


# --- topics -----------------------------------------------------------------------------


def test_topics_create_gives_each_new_dlq_its_sources_partitions_and_is_idempotent(
    admin: AdminClient, topics: Topics,
) -> None:
    old = topics(partitions=3, dlq=False, prefix="inv-old")  # exists, without its DLQ
    new, events = unique(), unique("inv-events")
    app = inventory("inv", old, new)
    app.topic(new, partitions=2)
    app.topic(events, partitions=1, config={"retention.ms": "3600000"})
    topics.created += [f"{old}.dlq", new, f"{new}.dlq", events]  # deleted after the test

    done = {d.name: d for d in topic_rules.create(app, admin)}

    assert {n: (d.role, d.created, d.partitions) for n, d in done.items()} == {
        old: ("source", False, 3), f"{old}.dlq": ("dlq", True, 3),
        new: ("source", True, 2), f"{new}.dlq": ("dlq", True, 2),
        events: ("declared", True, 1)}
    assert partitions_of(admin, f"{old}.dlq") == 3 and partitions_of(admin, f"{new}.dlq") == 2
    dlq = configs(admin, f"{old}.dlq")
    assert dlq["retention.ms"] == str(30 * 86_400_000) and dlq["cleanup.policy"] == "delete"
    assert configs(admin, events)["retention.ms"] == "3600000"

    again = topic_rules.create(app, admin, partitions=6)
    assert [d.created for d in again] == [False] * 5  # nothing changes, nothing is added
    assert partitions_of(admin, new) == 2


def test_an_existing_dlq_is_left_alone_and_a_refused_request_names_the_option(
    admin: AdminClient, topics: Topics,
) -> None:
    source = topics(partitions=2, dlq=False, prefix="inv-src")
    topics.create([f"{source}.dlq"], partitions=1)
    fresh = unique()
    app = inventory("inv", source, fresh)
    with pytest.raises(ConfigError, match=r"Kafka refused to create topic .*replication.* "
                       r"\(setting=replication_factor\)"):
        topic_rules.create(app, admin, replication_factor=3)
    assert fresh not in admin.list_topics(timeout=10).topics  # nothing half-made

    topics.created += [fresh, f"{fresh}.dlq"]
    done = {d.name: d for d in topic_rules.create(app, admin)}
    assert done[f"{source}.dlq"].note == (
        "its source has 2 partitions; left as it is (dead letters still work)")
    assert partitions_of(admin, f"{source}.dlq") == 1


# --- the producer -----------------------------------------------------------------------


def test_the_producer_encodes_with_the_handlers_codec_and_keys_by_the_idempotency_key(
    db: DB, topics: Topics, group: str,
) -> None:
    topic = topics(partitions=2)
    app = build_app(topic=topic, fmt="avro", **app_settings(db, group_id=group))
    payload = {"tenant_id": "t1", "order_id": "o-1", "amount": Decimal("12.50"),
               "currency": "EUR", "request_id": "r-1",
               "requested_at": dt.datetime(2025, 1, 31, tzinfo=dt.UTC)}
    with app.producer() as producer:
        assert producer.send(topic, payload) == "t1:charge:o-1"
        producer.send(topic, {**payload, "order_id": "o-2"}, key=b"by-order",
                      headers={"trace-id": "abc"})
    assert producer.sent == 2
    sent = {m.key(): m for m in read_topic(topic)}
    assert set(sent) == {b"t1:charge:o-1", b"by-order"}
    first = app.handlers[topic].decode(sent[b"t1:charge:o-1"].value())
    assert (first.order_id, first.amount) == ("o-1", Decimal("12.50"))
    assert sent[b"t1:charge:o-1"].value()[:2] == b"\xc3\x01"  # Avro single-object, as read
    assert dict(sent[b"by-order"].headers()) == {"trace-id": b"abc"}

    with InProcess(app):
        wait_for(lambda: db.status_counts() == {"succeeded": 2}, what="both charged")
    assert db.ledger_counts() == {"t1:charge:o-1": 1, "t1:charge:o-2": 1}


def test_a_payload_the_handler_could_not_read_is_refused_before_it_is_sent(
    topics: Topics,
) -> None:
    topic = topics(partitions=1)
    app = inventory("inv", topic)
    with app.producer() as producer:
        with pytest.raises(InvalidPayload, match="qty"):
            producer.send(topic, {"shop": "s1", "order_id": "o-1", "sku": "k"})
        with pytest.raises(MissingKeyField, match="shop"):
            producer.send(topic, {"shop": " ", "order_id": "o-1", "sku": "k", "qty": 1})
        with pytest.raises(ConfigError, match="no handler of app 'inv' reads topic 'elsewhere'"):
            producer.send("elsewhere", {"shop": "s1", "order_id": "o-1", "sku": "k", "qty": 1})
    assert read_topic(topic) == []


def test_records_kafka_does_not_acknowledge_fail_the_flush_naming_them(
    topics: Topics, admin: AdminClient,
) -> None:
    topic = topics(partitions=1)
    set_topic_config(admin, topic, "max.message.bytes", "200")  # the broker refuses it
    app = inventory("inv", topic)
    producer = app.producer(config={"message.timeout.ms": 1500})
    producer.send(topic, {"shop": "s1", "order_id": "o-1", "sku": "k" * 500, "qty": 1})
    with pytest.raises(DeliveryFailed, match=f"1 record\\(s\\) not delivered .*{topic}") as info:
        producer.flush(10)
    assert [(t, k) for t, k, _ in info.value.failures] == [(topic, b"s1:reserve:o-1")]
    assert producer.flush(1) == 0  # reported once


def test_a_topic_that_does_not_exist_is_refused_at_once_saying_how_to_create_it() -> None:
    missing = unique("inv-missing")  # never created; the broker does not auto-create
    app = inventory("inv", missing)
    producer = app.producer()  # message.timeout.ms 30 s: the refusal does not wait for it
    with pytest.raises(DeliveryFailed) as info:
        producer.send(missing, {"shop": "s1", "order_id": "o-1", "sku": "k", "qty": 1})
    assert str(info.value) == (
        f"topic {missing!r} does not exist: create it first (`kafka-idem topics create "
        "MODULE:APP` creates an app's topics)")
    assert [(t, k) for t, k, _ in info.value.failures] == [(missing, b"s1:reserve:o-1")]
    assert producer.flush(1) == 0  # nothing was queued


# --- a configuration error while processing --------------------------------------------------


@pytest.mark.parametrize("mode", ["local", "leased"])
def test_a_configuration_error_while_processing_holds_its_partition_and_charges_nothing(
    db: DB, topics: Topics, group: str, caplog: pytest.LogCaptureFixture, mode: str,
) -> None:
    caplog.set_level(logging.INFO)
    broken, fine = topics(partitions=1), topics(partitions=1)
    app = App("inv", **app_settings(db, group_id=group))

    @app.handler(topic=broken, model=Reserve, key="{shop}:reserve:{order_id}",
                 hash_fields=("qty",), name="reserve", mode=mode)  # type: ignore[arg-type]
    def reserve(msg: Reserve, ctx: Context) -> None:
        raise ConfigError("INVENTORY_API_URL is not set", setting="inventory_api_url")

    @app.handler(topic=fine, model=Reserve, key="{shop}:cancel:{order_id}",
                 hash_fields=("qty",), name="cancel", mode=mode)  # type: ignore[arg-type]
    def cancel(msg: Reserve, ctx: Context) -> dict[str, bool]:
        return {"cancelled": True}

    with app.producer() as producer:
        for topic in (broken, fine):
            for n in range(3):
                producer.send(topic, {"shop": "s1", "order_id": f"o-{n}", "sku": "k", "qty": 1})
    with InProcess(app) as member:
        held = member.runner.metrics.config_errors.labels(broken, "reserve")
        wait_for(lambda: held._value.get() >= 3, what="three holds (1 s, then 2 s apart)",
                 timeout=30)
        wait_for(lambda: db.value("SELECT count(*) FROM kafka_idem.task_idempotency WHERE "
                                  "status = 'succeeded'") == 3, what="the other topic")
        time.sleep(0.2)
        records = {r["idempotency_key"]: r for r in db.records()}
    assert {k for k, r in records.items() if r["status"] == "succeeded"} == {
        f"s1:cancel:o-{n}" for n in range(3)}
    if mode == "local":  # rolled back with its savepoint: no trace of an attempt
        assert "s1:reserve:o-0" not in records
    else:  # the claim is kept and re-entered with its token: still the first attempt
        assert (records["s1:reserve:o-0"]["status"], records["s1:reserve:o-0"]["attempts"]) == (
            "processing", 1)
    assert not any(k.startswith("s1:reserve:o-") and k != "s1:reserve:o-0" for k in records)
    assert read_topic(f"{broken}.dlq") == []
    assert committed(group, broken) == {0: -1001}  # nothing of it committed
    # kafka_idem's own errors (asyncio's report of another test's task, freed now, is not
    # this member's)
    errors = [r.getMessage() for r in caplog.records
              if r.levelno >= logging.ERROR and r.name.startswith("kafka_idem")]
    assert errors == [f"handler 'reserve': configuration error at {broken}[0]@0: "
                      "INVENTORY_API_URL is not set (setting=inventory_api_url); the partition "
                      "waits (the message is not charged) until the configuration is fixed "
                      "and the member restarted"]
    assert not any("batch transaction failed" in r.getMessage() for r in caplog.records)


# --- the assignment log line ------------------------------------------------------------------


def test_a_member_given_no_partition_says_so_not_an_empty_assigned_line(
    db: DB, topics: Topics, group: str, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kafka_idem")
    topic = topics(partitions=1)
    first, second = (inventory("inv", topic, database_url=db.dsn, group_id=group)
                     for _ in range(2))
    with InProcess(first):
        wait_for(lambda: any(r.getMessage() == f"assigned {topic}[0]" for r in caplog.records),
                 what="the first member's partition")
        with InProcess(second):
            wait_for(lambda: any(r.getMessage().startswith("no partitions assigned")
                                 for r in caplog.records), what="the spare member's line")
    said = [r.getMessage() for r in caplog.records if getattr(r, "action", "") == "assigned"]
    assert "assigned " not in said, said  # never an empty list
    assert "no partitions assigned (the group has more members than partitions, or none of " \
           "its topics exists yet)" in said
