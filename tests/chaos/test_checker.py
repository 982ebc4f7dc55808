"""The chaos checker must be able to fail.

A small real run (an in-process runner on the payments example: valid charges,
a re-send, a payload conflict, invalid charges, undecodable bytes) is checked
clean; then durable data is deliberately damaged, one way per test, and the
checker must report exactly the anomalies that damage means.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from consumers.payments import build_app, encode_charge, events_topic
from kafka_idem import App
from kafka_idem.admin import topics as topic_rules
from tests.conftest import (
    BOOTSTRAP,
    DB,
    InProcess,
    Topics,
    app_settings,
    caught_up,
    end_offsets,
    produce,
    read_topic,
    wait_for,
)
from tests.integration.outbox_support import read_committed, wait_published
from tools.chaos.checker import Liveness, PaymentsDecoder, Report, check

VALID = [("t1", "o1", "5.00", "EUR"), ("t1", "o2", "7.25", "USD"), ("t2", "o3", "1.00", "EUR"),
         ("t2", "o4", "2.50", "EUR"), ("t1", "o5", "3.10", "EUR"), ("t3", "o6", "9.99", "GBP")]
INVALID = [("t1", "o7", "0", "EUR"), ("t2", "o8", "4.00", "XXX")]


@dataclass
class Run:
    topic: str
    group: str
    db: DB
    events: str | None = None  # the outbox's event topic (check 11), when the run has one

    @property
    def dlq(self) -> str:
        return f"{self.topic}.dlq"

    def check(self, **kwargs: Any) -> Report:
        kwargs.setdefault("events_topic", self.events)
        return check(bootstrap=BOOTSTRAP, dsn=self.db.dsn, topic=self.topic, group=self.group,
                     **kwargs)

    def sql(self, statement: str, params: Any = None) -> None:
        with psycopg.connect(self.db.dsn) as conn:
            conn.execute(statement, params)

    def sql_unguarded(self, statement: str, params: Any = None) -> None:
        """Run ``statement`` with the transition guard off, in one transaction (never seen off)."""
        with psycopg.connect(self.db.dsn) as conn:
            conn.execute("ALTER TABLE kafka_idem.task_idempotency "
                         "DISABLE TRIGGER guard_transitions")
            conn.execute(statement, params)
            conn.execute("ALTER TABLE kafka_idem.task_idempotency ENABLE TRIGGER guard_transitions")

    def commit_offset(self, partition: int, offset: int) -> None:
        """Commit for the (now empty) group, as a member that skipped messages would."""
        c = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": self.group,
                      "enable.auto.commit": False})
        try:
            c.commit(offsets=[TopicPartition(self.topic, partition, offset)], asynchronous=False)
        finally:
            c.close()


def charge(tenant: str, order: str, amount: str, currency: str = "EUR") -> tuple[bytes, bytes]:
    return order.encode(), encode_charge(tenant, order, amount, currency)


def _messages() -> list[tuple[bytes | None, bytes]]:
    return [*(charge(*c) for c in VALID + INVALID),
            charge(*VALID[0]),  # a producer's re-send: same intent, new request id
            charge("t1", "o2", "8.00", "USD"),  # same key, another amount: a conflict
            charge(*INVALID[0]),  # a re-send of an invalid charge
            (b"g1", b"\x00garbage"), (None, b"")]  # undecodable bytes, an empty value


@pytest.fixture
def run(db: DB, topics: Topics, group: str) -> Run:
    topic = topics(partitions=2)
    produce(topic, _messages())
    app = build_app(topic=topic, **app_settings(db, group_id=group))
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), what="the group to catch up")
    return Run(topic, group, db)


def evented_app(db: DB, topics: Topics, group: str, admin: AdminClient, topic: str,
                **settings: Any) -> App:
    """The payments app on ``topic`` with its outbox: event topic and the relays'
    control topic made (``kafka-idem topics create``), under a prefix of its own."""
    app = build_app(topic=topic, **app_settings(
        db, group_id=group, name_prefix=f"ck{topic}-", outbox_shards=2,
        outbox_poll_seconds=0.2, **settings))
    topics.created.extend(d.name for d in topic_rules.create(app, admin, partitions=2)
                          if d.created)
    return app


@pytest.fixture
def evented(db: DB, topics: Topics, group: str, admin: AdminClient) -> Run:
    """A clean run whose charges' events were published (check 11 is asked for)."""
    topic = topics(partitions=2)
    produce(topic, _messages())
    with InProcess(evented_app(db, topics, group, admin, topic)):
        wait_for(lambda: caught_up(group, topic), what="the group to catch up")
        wait_published(db, events_topic(topic), len(VALID))
    return Run(topic, group, db, events_topic(topic))


def test_a_clean_run_has_no_anomaly(run: Run) -> None:
    report = run.check()
    assert report.ok, report.to_json()
    f = report.figures
    assert f["source messages"] == 13
    assert f["ledger rows"] == len(VALID)
    assert f["records by status"] == {"failed": 2, "succeeded": len(VALID)}
    assert f["DLQ records by kind"] == {"payload_conflict": 1, "permanent": 3, "undecodable": 2}
    assert f["messages repeating the accepted payload"] == 2
    assert f["messages with another payload (conflicts)"] == 1


# --- damage ------------------------------------------------------------------------------


def dlq_records(run: Run) -> list[Any]:
    return read_topic(run.dlq)


def reproduce(run: Run, msg: Any, *, value: bytes | None = None,
              drop: str | None = None, set_headers: dict[str, str] | None = None) -> None:
    """Produce a copy of DLQ record ``msg`` to the DLQ, altered."""
    hdrs = [(k, v) for k, v in (msg.headers() or []) if k != drop
            and k not in (set_headers or {})]
    hdrs += [(k, v.encode()) for k, v in (set_headers or {}).items()]
    p = Producer({"bootstrap.servers": BOOTSTRAP, "enable.idempotence": True})
    p.produce(run.dlq, key=msg.key(), value=msg.value() if value is None else value,
              headers=hdrs)
    assert p.flush(30) == 0


def duplicated_ledger_row(run: Run) -> str:
    run.sql("INSERT INTO payments.ledger (tenant_id, order_id, amount, currency, idempotency_key)"
            " SELECT tenant_id, order_id, amount, currency, idempotency_key FROM payments.ledger"
            " WHERE idempotency_key = 't1:charge:o1'")
    return "t1:charge:o1: 2 ledger rows"


def balance_mismatch(run: Run) -> str:
    run.sql("UPDATE payments.balances SET balance = balance + 0.01 "
            "WHERE tenant_id = 't2' AND currency = 'EUR'")
    return "balance t2/EUR: 3.51 != 3.50"


def missing_dlq_header(run: Run) -> str:
    reproduce(run, dlq_records(run)[0], drop="idem.attempts")
    return "missing idem.attempts"


def altered_dlq_value(run: Run) -> str:
    first = dlq_records(run)[0]
    reproduce(run, first, value=(first.value() or b"") + b"!")
    return "value bytes differ"


def slim_letter_of_another_value(run: Run) -> str:
    """A letter sent without its value (dlq.DeadLetter.slim) naming other bytes."""
    first = next(m for m in dlq_records(run) if m.value())  # an empty one would match
    reproduce(run, first, value=b"", set_headers={
        "idem.truncated": "value", "idem.original.value_bytes": str(len(first.value() or b"")),
        "idem.original.value_sha256": hashlib.sha256(b"something else").hexdigest()})
    return "value bytes differ"


def contradictory_dead_letter(run: Run) -> str:
    """A dead-letter record, complete and faithful, for a key that succeeded."""
    letter = next(m for m in dlq_records(run)
                  if dict(m.headers())["idem.error.kind"] == b"permanent")
    hdrs = {k: v.decode() for k, v in letter.headers()}
    source = next(m for m in read_topic(run.topic) if m.key() == b"o3")
    p = Producer({"bootstrap.servers": BOOTSTRAP, "enable.idempotence": True})
    hdrs.update({"idem.original.partition": str(source.partition()),
                 "idem.original.offset": str(source.offset()), "idem.key": "t2:charge:o3"})
    p.produce(run.dlq, key=source.key(), value=source.value(),
              headers=[(k, v.encode()) for k, v in hdrs.items()])
    assert p.flush(30) == 0
    return "t2:charge:o3: succeeded and dead-lettered as permanent"


def dropped_intent(run: Run) -> str:
    """A message the group never processed, its offset committed anyway."""
    [(part, off)] = produce(run.topic, [charge("t4", "o99", "3.00")])
    run.commit_offset(part, off + 1)
    return f"p{part}@{off} t4:charge:o99: no effect"


def unprocessed_intent(run: Run) -> str:
    [(part, _off)] = produce(run.topic, [charge("t4", "o98", "3.00")])
    return f"p{part}: lag 1"


def stuck_processing(run: Run) -> str:
    """A claim left ``processing`` (its owner died) and its offset committed past it."""
    key, value = charge("t4", "o97", "6.00")
    [(part, off)] = produce(run.topic, [(key, value)])
    intent = PaymentsDecoder(run.topic)(value)
    assert not isinstance(intent, str)
    run.sql("INSERT INTO kafka_idem.task_idempotency (namespace, idempotency_key, request_hash,"
            " status, owner_token, lease_until, attempts) VALUES ('payments', %s, %s,"
            " 'processing', %s, now() + interval '1 hour', 1)",
            (intent.key, intent.request_hash, uuid.uuid4()))
    run.commit_offset(part, off + 1)
    return "t4:charge:o97: still processing"


def attempts_over_limit(run: Run) -> str:
    run.sql_unguarded("UPDATE kafka_idem.task_idempotency SET attempts = 9 "
                      "WHERE idempotency_key = 't2:charge:o8'")
    return "t2:charge:o8: 9 attempts > 5"


def stale_owner_commit(run: Run) -> str:
    run.sql_unguarded("UPDATE kafka_idem.task_idempotency SET owner_token = gen_random_uuid() "
                      "WHERE idempotency_key = 't1:charge:o5'")
    return "t1:charge:o5: succeeded with completed_token="


def guard_disabled(run: Run) -> str:
    run.sql("ALTER TABLE kafka_idem.task_idempotency DISABLE TRIGGER guard_transitions")
    return "transition guard trigger disabled"


Damage = Callable[[Run], str]


@pytest.mark.parametrize(("damage", "expected"), [
    (duplicated_ledger_row, {2}),
    (balance_mismatch, {2}),
    (missing_dlq_header, {4}),
    (altered_dlq_value, {4}),
    (slim_letter_of_another_value, {4}),
    (contradictory_dead_letter, {3}),
    (dropped_intent, {1, 7}),
    (unprocessed_intent, {1, 9}),
    (stuck_processing, {1, 6, 7}),
    (attempts_over_limit, {8}),
    (stale_owner_commit, {5}),
    (guard_disabled, {5}),
], ids=lambda v: v.__name__ if callable(v) else None)
def test_damage_is_reported(run: Run, damage: Damage, expected: set[int]) -> None:
    assert run.check().ok
    example = damage(run)
    report = run.check()
    assert report.failing() == expected, report.to_json()
    examples = [e for n in expected for e in report.by_number(n).examples]
    assert any(example in e for e in examples), (example, examples)


def test_a_letter_sent_without_its_value_that_names_it_is_faithful(run: Run) -> None:
    """A DLQ topic that refuses large records for a while (the dlq_outage fault) can make
    a letter go out slim: without the value, which its length and SHA-256 identify."""
    first = next(m for m in dlq_records(run) if m.value())
    value = first.value() or b""
    reproduce(run, first, value=b"", set_headers={
        "idem.truncated": "value", "idem.original.value_bytes": str(len(value)),
        "idem.original.value_sha256": hashlib.sha256(value).hexdigest()})
    report = run.check()
    assert report.ok, report.to_json()


def test_liveness_bound_is_reported(run: Run) -> None:
    assert run.check(liveness=Liveness(healed_in=12.0, bound=60.0)).ok
    report = run.check(liveness=Liveness(healed_in=None, bound=60.0))
    assert report.failing() == {9}
    assert "lag not back to 0 within 60s" in report.by_number(9).examples[0]
    late = run.check(liveness=Liveness(healed_in=75.0, bound=60.0))
    assert late.failing() == {9}


def test_acknowledged_send_missing_from_the_topic_is_lost(run: Run) -> None:
    ends = end_offsets(run.topic)
    values = {(m.partition(), m.offset()): m.value() for m in read_topic(run.topic)}
    assert run.check(acknowledged=values).ok
    ghost = {**values, (0, ends[0] + 5): b"acknowledged, then gone"}
    report = run.check(acknowledged=ghost)
    assert report.failing() == {1}
    assert "acknowledged send not on the topic" in report.by_number(1).examples[0]


def test_effects_applied_out_of_offset_order_within_a_tenant_are_reported(
    db: DB, topics: Topics, group: str
) -> None:
    """Check 10, asked for when the handler keeps each tenant's order (leased mode,
    key-ordered by tenant): two rows of one tenant and partition swapped is caught."""
    topic = topics(partitions=2)
    produce(topic, [charge(*c) for c in VALID])
    app = build_app(topic=topic, mode="leased", **app_settings(db, group_id=group))
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), what="the group to catch up")
    leased = Run(topic, group, db)
    assert leased.check(ordered_by="tenant").ok
    assert 10 not in {c.number for c in leased.check().checks}  # only when asked for
    pairs = db.rows(
        "SELECT a.id AS first, b.id AS second, a.idempotency_key AS key FROM payments.ledger a"
        " JOIN payments.ledger b ON a.tenant_id = b.tenant_id AND a.id < b.id"
        " JOIN kafka_idem.task_idempotency ra ON ra.idempotency_key = a.idempotency_key"
        " JOIN kafka_idem.task_idempotency rb ON rb.idempotency_key = b.idempotency_key"
        " WHERE ra.kafka_partition = rb.kafka_partition ORDER BY a.id LIMIT 1")
    assert pairs, "two charges of one tenant on one partition"
    first, second, key = pairs[0]["first"], pairs[0]["second"], pairs[0]["key"]
    with psycopg.connect(db.dsn) as conn:  # the later message's row now looks inserted first
        conn.execute("UPDATE payments.ledger SET id = -1 WHERE id = %s", (first,))
        conn.execute("UPDATE payments.ledger SET id = %s WHERE id = %s", (first, second))
        conn.execute("UPDATE payments.ledger SET id = %s WHERE id = -1", (second,))
    report = leased.check(ordered_by="tenant")
    assert report.failing() == {10}, report.to_json()
    assert any(f"before {key}" in e for e in report.by_number(10).examples)


# --- check 11: the outbox's events -------------------------------------------------------


def test_a_clean_run_with_events_has_no_anomaly(evented: Run) -> None:
    report = evented.check()
    assert report.ok, report.to_json()
    assert report.figures["outbox events"] == len(VALID)
    assert "6 events" in report.by_number(11).examined
    assert 11 not in {c.number for c in evented.check(events_topic=None).checks}


def republish(run: Run, event: Any, **changed: str) -> None:
    """Produce a copy of ``event`` to the event topic (in no transaction), headers changed."""
    assert run.events is not None
    hdrs = [(k, v) for k, v in event.headers() if k not in changed]
    hdrs += [(k, v.encode()) for k, v in changed.items()]
    p = Producer({"bootstrap.servers": BOOTSTRAP, "enable.idempotence": True})
    p.produce(run.events, key=event.key(), value=event.value(), headers=hdrs)
    assert p.flush(30) == 0


def event_of(run: Run, order: bytes) -> Any:
    assert run.events is not None
    return next(m for m in read_committed(run.events) if m.key() == order)


def event_published_twice(run: Run) -> str:
    republish(run, event_of(run, b"o3"))
    return "t2:charge:o3: succeeded, 2 events"


def event_for_a_failed_intent(run: Run) -> str:
    republish(run, event_of(run, b"o1"), **{"idem.key": "t1:charge:o7",
                                           "idem.outbox.id": "999999"})
    return "t1:charge:o7: 1 event(s) for a failed intent"


def events_out_of_order(run: Run) -> str:
    republish(run, event_of(run, b"o4"), **{"idem.outbox.id": "0"})
    return "published before row 0"


def event_of_another_ledger_row(run: Run) -> str:
    """The event's ledger entry is no longer the charge's row (renumbered here)."""
    run.sql("UPDATE payments.ledger SET id = id + 100000 WHERE idempotency_key = 't1:charge:o5'")
    return "is not the charge and its ledger row"


@pytest.mark.parametrize("damage", [event_published_twice, event_for_a_failed_intent,
                                    events_out_of_order, event_of_another_ledger_row],
                         ids=lambda v: v.__name__)
def test_event_damage_is_reported(evented: Run, damage: Damage) -> None:
    assert evented.check().ok
    example = damage(evented)
    report = evented.check()
    assert report.failing() == {11}, report.to_json()
    assert any(example in e for e in report.by_number(11).examples), (
        example, report.by_number(11).examples)


def test_a_charge_whose_event_was_never_published_is_reported(
    evented: Run, topics: Topics, admin: AdminClient
) -> None:
    """A member without a relay charges one more: its event waits in the outbox."""
    produce(evented.topic, [charge("t4", "o96", "4.00")])
    app = evented_app(evented.db, topics, evented.group, admin, evented.topic,
                      outbox_relay=False)
    with InProcess(app):
        wait_for(lambda: caught_up(evented.group, evented.topic), what="the extra charge")
    report = evented.check()
    assert report.failing() == {11}, report.to_json()
    examples = report.by_number(11).examples
    assert "t4:charge:o96: succeeded, 0 events" in examples
    assert any("1 outbox rows never published" in e for e in examples), examples
