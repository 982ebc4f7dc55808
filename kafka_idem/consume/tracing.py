"""OpenTelemetry tracing, when it is installed (``pip install 'kafka-idem[otel]'``) and
configured (a ``TracerProvider`` set by the application, e.g. with the OTLP exporter).
Otherwise every call here is a no-op that costs a check.

* **A span per message** a unit of work takes, ``process <topic>`` (kind ``CONSUMER``),
  a child of the context in the message's ``traceparent`` header (W3C trace context,
  through the globally configured propagator), with the attributes
  ``messaging.system``, ``messaging.destination.name``,
  ``messaging.destination.partition.id``, ``messaging.kafka.offset``,
  ``messaging.consumer.group.name`` and kafka_idem's own ``kafka_idem.handler``,
  ``kafka_idem.key``, ``kafka_idem.attempts`` and ``kafka_idem.outcome``
  (``succeeded``, ``replayed``, ``conflict``, ``dead_lettered`` or ``deferred``, with
  ``kafka_idem.deferred_reason``). Dead-lettered messages (conflicts too) end with an
  error status.
* **Children** ``claim``, ``handler`` and ``complete`` on the per-message paths, and
  ``handler`` on the batch path's pipelined calls; the ``handler`` span is the current
  span while the handler runs, so the handler's own spans (an HTTP call) nest in it.
* **Dead letters** carry the message span's context in ``traceparent`` (replacing
  the original's, which is its parent), so whoever reads the DLQ continues the trace.
* **Replays** (``dlq replay``, ``rerun``): a ``replay <topic>`` span (kind
  ``PRODUCER``), a child of the dead letter's context, is put in the republished
  message's ``traceparent``: the message's next processing span is its child.

    >>> t = Tracing()
    >>> with t.unit([]) as unit:
    ...     unit.finish({})
    {}

Spans cost nothing when tracing is off: :meth:`Tracing.unit` checks once per unit.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kafka_idem.consume.outcome import Deferred, Finished, Message, Results
from kafka_idem.observe.tracing import (
    INSTRUMENTATION,
    SpanKind,
    Status,
    StatusCode,
    carrier,
    enabled,
    inject,
    propagate,
    trace,
)

_Pos = tuple[str, int, int]


def _pos(msg: Message) -> _Pos:
    return (msg.topic(), msg.partition(), msg.offset())


class Tracing:
    """One per processor (thread): the message spans of the unit it runs.

    A message's span is started when a step first touches it, or when its result is
    known, with the unit's start as its start time (its work ran within the unit), and
    ended once the unit's results are in (after its commit): a message the unit did not
    reach (its partition waits on an earlier one) gets no span."""

    def __init__(self, *, group: str | None = None) -> None:
        self.group = group
        self._msgs: dict[_Pos, Message] = {}
        self._spans: dict[_Pos, Any] = {}
        self._start = 0

    @contextmanager
    def unit(self, msgs: Sequence[Message]) -> Iterator[Tracing]:
        """The block runs one unit of ``msgs``; call :meth:`finish` with its results."""
        if not msgs or not enabled():
            yield self
            return
        self._msgs = {_pos(m): m for m in msgs}
        self._start = time.time_ns()
        try:
            yield self
        finally:
            for span in self._spans.values():  # the unit failed before its results
                span.set_attribute("kafka_idem.outcome", "error")
                span.set_status(Status(StatusCode.ERROR, "the unit of work failed"))
                span.end()
            self._msgs, self._spans = {}, {}

    def _span(self, pos: _Pos) -> Any:
        span = self._spans.get(pos)
        if span is None and pos in self._msgs:
            msg = self._msgs[pos]
            attrs: dict[str, Any] = {
                "messaging.system": "kafka", "messaging.operation.type": "process",
                "messaging.destination.name": msg.topic(),
                "messaging.destination.partition.id": str(msg.partition()),
                "messaging.kafka.offset": msg.offset(),
            }
            if self.group:
                attrs["messaging.consumer.group.name"] = self.group
            span = trace.get_tracer(INSTRUMENTATION).start_span(
                f"process {msg.topic()}", context=propagate.extract(carrier(msg.headers())),
                kind=SpanKind.CONSUMER, attributes=attrs, start_time=self._start)
            self._spans[pos] = span
        return span

    def finish(self, results: Results) -> Results:
        """Set each decided message's outcome and end its span; put the span's context
        on the dead letters. Returns ``results`` (with the letters so stamped)."""
        if not self._msgs:
            return results
        out: Results = {}
        for tp, rs in results.items():
            mine = sorted(p for p in self._msgs if p[:2] == tp)
            out[tp] = [self._end(pos, r) for pos, r in zip(mine, rs, strict=False)]
            out[tp] += rs[len(out[tp]):]
        self._msgs = {}
        return out

    def _end(self, pos: _Pos, r: Any) -> Any:
        span = self._span(pos)
        self._spans.pop(pos, None)
        if isinstance(r, Finished):
            span.set_attribute("kafka_idem.outcome", str(r.outcome))
            if r.key is not None:
                span.set_attribute("kafka_idem.key", r.key)
            if r.letter is not None:
                span.set_attribute("kafka_idem.attempts", r.letter.attempts)
                span.set_attribute("kafka_idem.error.kind", r.letter.kind)
                if r.letter.idempotency_key is not None:
                    span.set_attribute("kafka_idem.key", r.letter.idempotency_key)
                span.set_status(Status(StatusCode.ERROR,
                                       f"{r.letter.kind}: {r.letter.error_class}"))
                r = Finished(r.outcome, dataclasses.replace(r.letter, trace=inject(span)),
                             r.key)
        elif isinstance(r, Deferred):
            span.set_attribute("kafka_idem.outcome", "deferred")
            span.set_attribute("kafka_idem.deferred_reason", str(r.reason))
        span.end()
        return r

    def note(self, msg: Message, **attributes: Any) -> None:
        """Attributes of ``msg``'s span (``handler``, ``key``, ``attempts``)."""
        span = self._span(_pos(msg)) if self._msgs else None
        if span is not None:
            for k, v in attributes.items():
                span.set_attribute(f"kafka_idem.{k}", v)

    @contextmanager
    def step(self, msg: Message, name: str) -> Iterator[None]:
        """A child span ``name`` of ``msg``'s span, current while the block runs."""
        parent = self._span(_pos(msg)) if self._msgs else None
        if parent is None:
            yield
            return
        span = trace.get_tracer(INSTRUMENTATION).start_span(
            name, context=trace.set_span_in_context(parent))
        with trace.use_span(span, end_on_exit=True, record_exception=True,
                            set_status_on_exception=True):
            yield
