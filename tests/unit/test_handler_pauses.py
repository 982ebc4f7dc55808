"""What a member decides about paused handlers, on stubs (no Kafka, no PostgreSQL):
which partitions it pauses and resumes at the consumer, that queued messages of a
paused handler start nothing, when it acknowledges a pause, what /readyz says.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from confluent_kafka import TopicPartition

from kafka_idem import App
from kafka_idem.admin.pauses import Pause, check_handler
from kafka_idem.consume.partitions import Partitions
from kafka_idem.consume.pause_watch import HandlerHold, PauseWatch
from kafka_idem.errors import ConfigError
from kafka_idem.observe.health import Health
from kafka_idem.observe.metrics import Metrics
from kafka_idem.store import Store
from kafka_idem.testing import FakeMessage

A, B = "topic-a", "topic-b"


def app() -> App:
    a = App("shop")
    for topic, name in ((A, "alpha"), (B, "beta")):
        a.handler(topic=topic, key="{id}", hash_fields=("id",), format="json",
                  name=name)(lambda msg, ctx: None)
    return a


def paused(*names: str) -> dict[str, Pause]:
    at = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    return {n: Pause("shop", n, "incident", "ops", at) for n in names}


class Watch:
    def __init__(self) -> None:
        self.pauses: dict[str, Pause] = {}

    def current(self) -> dict[str, Pause]:
        return self.pauses


class Units:
    def __init__(self) -> None:
        self.running: set[str] = set()
        self.cancelled: list[set[Any]] = []

    def cancel(self, leaving: set[Any]) -> None:
        self.cancelled.append(leaving)

    def running_topics(self) -> set[str]:
        return self.running


class Consumer:
    def __init__(self) -> None:
        self.paused: list[list[TopicPartition]] = []

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused.append(partitions)


class Setup:
    def __init__(self) -> None:
        self.app = app()
        self.metrics = Metrics()
        self.health = Health()
        self.parts = Partitions()
        self.hold = HandlerHold(self.app, Store(schema="s", table="t", namespace="shop"),
                                self.parts, metrics=self.metrics, health=self.health)
        self.watch = Watch()
        self.hold.watch = self.watch  # type: ignore[assignment]
        self.units = Units()
        self.assigned = {(A, 0), (A, 1), (B, 0)}

    def round(self, flow: tuple[list[Any], list[Any]] = ([], [])) -> tuple[list[Any], list[Any]]:
        return self.hold.pause_resume(flow, self.assigned, self.units)  # type: ignore[arg-type]

    def gauge(self, name: str) -> float | None:
        return self.metrics.registry.get_sample_value("kafka_idem_handler_paused",
                                                      {"handler": name})


def test_a_pause_pauses_the_handlers_assigned_partitions_once_and_a_resume_resumes_them() -> None:
    s = Setup()
    assert s.round() == ([], []) and s.gauge("alpha") == 0.0
    s.watch.pauses = paused("alpha")
    assert s.round() == ([(A, 0), (A, 1)], [])
    assert s.units.cancelled == [{(A, 0), (A, 1)}]  # what runs stops between messages
    assert s.round() == ([], [])  # paused already: no call again
    assert s.parts.held == {A}
    s.watch.pauses = {}
    assert s.round() == ([], [(A, 0), (A, 1)])
    assert s.parts.held == frozenset()


def test_flow_controls_decisions_pass_through_and_its_own_pause_outlasts_a_resume() -> None:
    s = Setup()
    s.watch.pauses = paused("alpha")
    assert s.round(([(B, 0)], [])) == ([(B, 0), (A, 0), (A, 1)], [])
    s.parts.add(FakeMessage(A, partition=1, offset=0), 0.0)
    st = s.parts.get((A, 1))
    assert st is not None
    st.paused = True  # flow control holds it (a full queue): it resumes it, not the pause
    s.watch.pauses = {}
    assert s.round() == ([], [(A, 0)])


def test_queued_messages_of_a_paused_handler_are_not_due_and_flow_control_leaves_them() -> None:
    parts = Partitions()
    for offset in range(3):
        parts.add(FakeMessage(A, partition=0, offset=offset), 0.0)
        parts.add(FakeMessage(B, partition=0, offset=offset), 0.0)
    parts.held = frozenset({A})
    assert [tp for tp, _ in parts.due(1.0)] == [(B, 0)]
    assert parts.pause_resume(1.0, batch_size=1) == ([(B, 0)], [])  # A's full queue: left
    parts.held = frozenset()
    assert [tp for tp, _ in parts.due(1.0)] == [(A, 0), (B, 0)]


def test_a_held_partitions_backoff_does_not_wake_the_loop() -> None:
    parts = Partitions()
    parts.add(FakeMessage(A, partition=0, offset=0), 0.0)
    st = parts.get((A, 0))
    assert st is not None
    st.not_before, st.since = 5.0, 0.0  # a deferred message, due at 5 s
    assert parts.wait_time(10.0, max_wait=1.0) == 0.001  # overdue: run it at once
    parts.held = frozenset({A})
    assert parts.wait_time(10.0, max_wait=1.0) == 1.0  # held: nothing to wake for


def test_a_pause_is_acknowledged_once_the_handlers_work_in_flight_ended() -> None:
    s = Setup()
    s.units.running = {A}
    s.watch.pauses = paused("alpha")
    s.round()
    assert s.gauge("alpha") == 0.0 and s.hold.acknowledged == set()
    s.units.running = {B}
    s.round()
    assert s.gauge("alpha") == 1.0 and s.hold.acknowledged == {"alpha"}
    s.watch.pauses = {}
    s.round()
    assert s.gauge("alpha") == 0.0


def test_newly_assigned_partitions_of_a_paused_handler_are_not_resumed_but_paused() -> None:
    s = Setup()
    s.watch.pauses = paused("alpha")
    s.round()
    new = [TopicPartition(A, 1), TopicPartition(A, 2), TopicPartition(B, 1)]
    s.assigned |= {(A, 2), (B, 1)}
    consumer = Consumer()
    # (A, 1) revoked and assigned again: paused again, whatever state it came back in
    assert s.hold.unheld(new, consumer) == [TopicPartition(B, 1)]
    assert consumer.paused == [[TopicPartition(A, 1), TopicPartition(A, 2)]]
    assert s.round() == ([], [])  # paused already


def test_readyz_stays_ready_with_a_note_and_without_the_paused_handlers_lag() -> None:
    h = Health(max_lag=5)
    h.assigned([(A, 0), (B, 0)])
    h.observed({(A, 0): 500, (B, 0): 0})
    assert not h.ready().ok
    h.paused({"alpha": "incident"}, {A})
    probe = h.ready()
    assert probe.ok
    assert probe.body["note"] == "paused: handler alpha"
    assert probe.body["paused_handlers"] == {"alpha": "incident"}
    h.paused({})
    assert "note" not in h.ready().body


def test_an_unknown_handler_is_refused_naming_the_apps_handlers() -> None:
    try:
        check_handler(app(), "gamma")
    except ConfigError as exc:
        assert "no handler 'gamma'" in str(exc) and "alpha, beta" in str(exc)
    else:
        raise AssertionError("gamma was accepted")


def test_the_watch_keeps_going_when_the_database_is_unreachable() -> None:
    watch = PauseWatch("postgresql://nobody@127.0.0.1:1/none?connect_timeout=1",
                       Store(schema="s", table="t", namespace="shop"), poll_seconds=0.1)
    watch.start()  # no exception: the member starts, nothing known is paused
    try:
        assert watch.current() == {}
    finally:
        watch.stop()
