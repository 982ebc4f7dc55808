"""OpenTelemetry, when it is installed (``pip install 'kafka-idem[otel]'``) and configured
(a ``TracerProvider`` set by the application, e.g. with the OTLP exporter); otherwise
every call here is a no-op that costs a check. What the member, the outbox and replays
share: a trace context as Kafka headers (:func:`inject`, :func:`with_trace`), the one an
emitted event carries (:func:`current_trace`), and a replay's span (:func:`replaying`).
A message's own spans: :mod:`kafka_idem.consume.tracing`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

try:  # the optional extra
    from opentelemetry import propagate, trace
    from opentelemetry.trace import ProxyTracerProvider, SpanKind, Status, StatusCode
except ImportError:  # pragma: no cover - exercised where opentelemetry is absent
    # Every name the package imports from here exists without the extra (used only
    # once enabled() is true): kafka_idem must import in a venv without opentelemetry.
    trace = None  # type: ignore[assignment]
    propagate = None  # type: ignore[assignment]
    ProxyTracerProvider = SpanKind = Status = StatusCode = None  # type: ignore[assignment,misc]

INSTRUMENTATION = "kafka_idem"
TRACE_HEADERS = ("traceparent", "tracestate")


def enabled() -> bool:
    """OpenTelemetry is installed and the application set a tracer provider."""
    return trace is not None and not isinstance(trace.get_tracer_provider(),
                                                ProxyTracerProvider)


def carrier(headers: Sequence[tuple[str, bytes | str | None]] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in headers or ():
        if k.lower() in TRACE_HEADERS and v is not None:
            out[k.lower()] = v.decode("utf-8", "replace") if isinstance(v, bytes) else v
    return out


def inject(span: Any) -> tuple[tuple[str, bytes], ...]:
    """``span``'s context as Kafka headers (``traceparent``, ``tracestate``)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return tuple((k, v.encode()) for k, v in carrier.items())


def with_trace(headers: list[tuple[str, Any]], trace_headers: Sequence[tuple[str, bytes]]
               ) -> list[tuple[str, Any]]:
    """``headers`` with their trace context replaced by ``trace_headers`` (when any)."""
    if not trace_headers:
        return headers
    return [(k, v) for k, v in headers if k.lower() not in TRACE_HEADERS] + list(trace_headers)


def current_trace(source: Mapping[str, bytes]) -> list[tuple[str, bytes]]:
    """The trace context an emitted event carries: the current span's (the handler's,
    when tracing is on), else the source message's own ``traceparent`` /
    ``tracestate``, so a trace continues through the outbox either way."""
    if trace is not None:  # a valid current span only when a tracer provider is set
        span = trace.get_current_span()
        if span.get_span_context().is_valid:
            return list(inject(span))
    return [(name, source[name]) for name in TRACE_HEADERS if source.get(name)]


@contextmanager
def replaying(record: Any, target: str) -> Iterator[tuple[tuple[str, bytes], ...]]:
    """A ``replay <target>`` span, child of the dead letter's context; yields the
    headers that carry it (empty when tracing is off)."""
    if not enabled():
        yield ()
        return
    tracer = trace.get_tracer(INSTRUMENTATION)
    attrs: dict[str, Any] = {
        "messaging.system": "kafka", "messaging.operation.type": "send",
        "messaging.destination.name": target,
        "kafka_idem.dlq.topic": record.dlq_topic,
        "kafka_idem.dlq.partition": record.partition,
        "kafka_idem.dlq.offset": record.offset,
    }
    if record.idempotency_key:
        attrs["kafka_idem.key"] = record.idempotency_key
    span = tracer.start_span(f"replay {target}", context=propagate.extract(
        carrier(record.headers)), kind=SpanKind.PRODUCER, attributes=attrs)
    with contextlib.ExitStack() as stack:
        stack.enter_context(trace.use_span(span, end_on_exit=True, record_exception=True))
        yield inject(span)


__all__ = ["INSTRUMENTATION", "TRACE_HEADERS", "SpanKind", "Status", "StatusCode", "carrier",
           "current_trace", "enabled", "inject", "propagate", "replaying", "trace",
           "with_trace"]
