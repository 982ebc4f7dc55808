"""OpenTelemetry tracing with the SDK's in-memory exporter, on the real broker and
database: a span per message, a child of the producer's ``traceparent``; its claim,
handler and completion as children; its outcome, key and attempts; the dead letter
carrying the span's context; a replay's span between the dead letter and the message
it republishes, whose next processing is the replay's child."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.util._once import Once

from consumers.payments import build_app, encode_charge
from kafka_idem import replay
from kafka_idem.replay import Selection
from tests.conftest import (
    DB,
    InProcess,
    Topics,
    app_settings,
    caught_up,
    headers,
    read_topic,
    wait_for,
)

PRODUCER_SPAN = "{:016x}"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """An SDK tracer provider for this test only (the global is put back after it, so
    tracing is off again for the tests that follow)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    yield exporter
    provider.shutdown()
    trace._TRACER_PROVIDER = None  # type: ignore[attr-defined]
    trace._TRACER_PROVIDER_SET_ONCE = Once()  # type: ignore[attr-defined]


def traceparent(trace_id: int, span_id: int) -> bytes:
    return f"00-{trace_id:032x}-{span_id:016x}-01".encode()


def produce_traced(topic: str, records: list[tuple[bytes, bytes, bytes]]) -> None:
    from confluent_kafka import Producer

    from tests.conftest import BOOTSTRAP

    p = Producer({"bootstrap.servers": BOOTSTRAP, "enable.idempotence": True})
    for key, value, parent in records:
        p.produce(topic, key=key, value=value, partition=0, headers=[("traceparent", parent)])
    assert p.flush(30) == 0


def process_spans(exporter: InMemorySpanExporter, topic: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == f"process {topic}"]


def children(exporter: InMemorySpanExporter, parent: ReadableSpan) -> list[str]:
    return sorted(s.name for s in exporter.get_finished_spans()
                  if s.parent is not None and s.parent.span_id == parent.context.span_id)


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


@pytest.mark.parametrize("batch_path", [False, True], ids=["per-message", "batch-path"])
def test_a_span_per_message_continues_the_producers_trace_to_the_dlq_and_the_replay(
    db: DB, topics: Topics, group: str, spans: InMemorySpanExporter, batch_path: bool
) -> None:
    topic = topics(partitions=1)
    producer = {"o1": (0xA1, 0x11), "dup": (0xB2, 0x22), "o5": (0xC3, 0x33)}
    produce_traced(topic, [
        (b"o1", encode_charge("t1", "o1", "10.00"), traceparent(*producer["o1"])),
        (b"o1", encode_charge("t1", "o1", "10.00"), traceparent(*producer["dup"])),
        (b"o5", encode_charge("t1", "o5", "0"), traceparent(*producer["o5"])),  # permanent
    ])
    app = build_app(topic=topic, **app_settings(db, group_id=group, batch_path=batch_path))
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), what="the group to catch up")
        wait_for(lambda: len(read_topic(f"{topic}.dlq")) == 1, what="the dead letter")

    got = {attrs(s)["messaging.kafka.offset"]: s for s in process_spans(spans, topic)}
    assert sorted(got) == [0, 1, 2], [attrs(s) for s in process_spans(spans, topic)]
    for offset, name in enumerate(("o1", "dup", "o5")):
        span = got[offset]
        assert span.kind is SpanKind.CONSUMER
        assert span.context.trace_id == producer[name][0]  # the producer's trace
        assert span.parent is not None and span.parent.span_id == producer[name][1]
        assert attrs(span)["messaging.destination.name"] == topic
        assert attrs(span)["messaging.consumer.group.name"] == group
        assert attrs(span)["kafka_idem.key"] == ("t1:charge:o5" if name == "o5"
                                                 else "t1:charge:o1")
    assert attrs(got[0])["kafka_idem.outcome"] == "succeeded"
    assert attrs(got[1])["kafka_idem.outcome"] == "replayed"
    assert attrs(got[2])["kafka_idem.outcome"] == "dead_lettered"
    assert attrs(got[2])["kafka_idem.attempts"] == 1
    assert got[2].status.status_code is StatusCode.ERROR
    if not batch_path:  # the per-message path: each step its own child span
        assert children(spans, got[0]) == ["claim", "complete", "handler"]
        assert attrs(got[0])["kafka_idem.attempts"] == 1
        assert children(spans, got[1]) == ["claim"]  # replayed: no handler call

    # The dead letter carries the failed message's span, under the producer's trace.
    (letter,) = read_topic(f"{topic}.dlq")
    assert headers(letter)["traceparent"] == traceparent(
        producer["o5"][0], got[2].context.span_id).decode()

    # The replay: a span between the dead letter and the message it sends again.
    spans.clear()
    s = app.settings
    summary = replay.replay(s, None, f"{topic}.dlq", Selection(), actor="test",
                            include_permanent=True, reason="tracing test", app=app)
    assert summary.sent == 1
    (replay_span,) = [x for x in spans.get_finished_spans() if x.name == f"replay {topic}"]
    assert replay_span.kind is SpanKind.PRODUCER
    assert replay_span.context.trace_id == producer["o5"][0]
    assert replay_span.parent is not None
    assert replay_span.parent.span_id == got[2].context.span_id
    again = [m for m in read_topic(topic) if m.offset() == 3]
    assert headers(again[0])["traceparent"] == traceparent(
        producer["o5"][0], replay_span.context.span_id).decode()
    def next_run() -> list[ReadableSpan]:
        return [x for x in process_spans(spans, topic)
                if attrs(x)["messaging.kafka.offset"] == 3]

    with InProcess(app):  # (the replay's commit marker follows its message: no caught_up)
        wait_for(next_run, what="the replayed message's processing span")
    (again_span,) = next_run()
    assert again_span.parent is not None
    assert again_span.parent.span_id == replay_span.context.span_id
    assert again_span.context.trace_id == producer["o5"][0]  # one trace, end to end


def test_without_a_tracer_provider_nothing_is_traced_and_headers_stay(
    db: DB, topics: Topics, group: str
) -> None:
    from kafka_idem.observe.tracing import enabled

    assert not enabled()
    topic = topics(partitions=1)
    parent = traceparent(0xD4, 0x44)
    produce_traced(topic, [(b"o5", encode_charge("t1", "o5", "0"), parent)])
    app = build_app(topic=topic, **app_settings(db, group_id=group))
    with InProcess(app):
        wait_for(lambda: len(read_topic(f"{topic}.dlq")) == 1, what="the dead letter")
    (letter,) = read_topic(f"{topic}.dlq")
    assert headers(letter)["traceparent"] == parent.decode()  # the original, untouched


def test_keys_claimed_together_in_a_round_keep_a_claim_span_each(
    db: DB, topic: str, group: str, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Key-ordered (``concurrency=4``): the four keys started together share one claim
    statement, and each message's span still has its claim, handler and completion."""
    from consumers import payments
    from tests.integration.test_keyed import keyed_app
    from tests.integration.test_round_claims import ClaimSpy

    spy = ClaimSpy(monkeypatch)
    app = keyed_app(db, topic, group, payments.charge, concurrency=4, ordering_key=None)
    produce_traced(topic, [(o.encode(), encode_charge("t1", o, "1.00"), traceparent(0xD4, i + 1))
                           for i, o in enumerate(("o1", "o2", "o3", "o4"))])
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), what="the group to catch up")
    assert max(len(tokens) for _, tokens in spy.rounds) > 1  # (all four, fetched at once)
    got = process_spans(spans, topic)
    assert len(got) == 4
    for span in got:
        assert children(spans, span) == ["claim", "complete", "handler"]
        assert attrs(span)["kafka_idem.outcome"] == "succeeded"
        assert attrs(span)["kafka_idem.attempts"] == 1
