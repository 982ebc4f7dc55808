"""``Harness.check``: the scenario matrix planned for a handler, run scenario by
scenario from a clean database, and reported (an ``AssertionError`` carries the report
when a scenario failed)."""

from __future__ import annotations

import json
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from kafka_idem.consume.paths.verdicts import CODE_DEFECT
from kafka_idem.errors import ConfigError, MessageError
from kafka_idem.handler import Handler
from kafka_idem.retry import no_wait
from kafka_idem.testing.case import Case, Kit, Reference, settings_for, show, sig, told
from kafka_idem.testing.events import (
    MADE,
    Compared,
    EmittedEvent,
    Made,
    drifting_fields,
    made_fields,
    made_values,
)
from kafka_idem.testing.message import FakeMessage
from kafka_idem.testing.orm_defaults import Leak, OrmMade, carrying, leak_fault, orm_made
from kafka_idem.testing.processor import KitProcessor
from kafka_idem.testing.report import CheckReport, Fault, ScenarioResult, remember_left_out
from kafka_idem.testing.sandbox import Delivered, Path, Sandbox
from kafka_idem.testing.scenarios import LEASED_ONLY, RUN, SCENARIOS
from kafka_idem.testing.tables import (
    DRIFTING,
    State,
    Table,
    drifting,
    drifting_result,
    leave_out,
)
from kafka_idem.testing.values import conflicting, other_keys

NEEDS_SUCCESS = ("crash_before_commit", "retries_exhausted", "unknown_outcome",
                 "lease_takeover")
# leased: the next owner's claim is a second attempt (a takeover or a retry)
NEEDS_RETRY = ("crash_before_commit", "unknown_outcome", "lease_takeover")


def paths_of(handler: Handler[Any]) -> list[Path]:
    """The paths ``handler``'s messages can take; the first is the reference."""
    if handler.mode == "leased":
        return ["leased"]
    return ["per-message", "batch"] if handler.batch else ["per-message"]


def _plan(handler: Handler[Any], paths: list[Path],
          names: Iterable[str] | None) -> list[tuple[str, Path]]:
    chosen = list(SCENARIOS) if names is None else list(names)
    unknown = [n for n in chosen if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    plan: list[tuple[str, Path]] = []
    for name in SCENARIOS:
        if name not in chosen:
            continue
        if name in LEASED_ONLY and handler.mode != "leased":
            continue
        if name == "batch":
            if "batch" in paths:
                plan.append((name, "batch"))
            continue
        plan.extend((name, p) for p in paths if not (name == "once" and p == paths[0]))
    return plan


def run_one(case: Case, name: str, path: Path) -> ScenarioResult:
    out = ScenarioResult(name, SCENARIOS[name], path)
    started = time.monotonic()
    if name in NEEDS_SUCCESS and not case.succeeded:
        out.skipped = f"the reference did not succeed ({show(case.first)})"
        return out
    budget = case.harness.base.retry_policy(case.handler).max_attempts
    if path == "leased" and name in NEEDS_RETRY and budget < 2:
        out.skipped = (f"a retry budget of {budget} attempt leaves none for the next owner "
                       "(max_attempts)")
        return out
    for remote in case.harness.remotes.values():
        remote.reset()
    case.harness.hooks.forget()
    try:
        RUN[name](case, path, out)
    except Exception as exc:
        out.wrong("the scenario could not run: " + "".join(
            traceback.format_exception_only(exc)).strip())
    out.seconds = time.monotonic() - started
    return out


def _derived(harness: Kit, topic: str, data: bytes, prepare: Callable[[bytes], Any],
             conflict: Any, batch: Iterable[Any] | None) -> tuple[bytes | None, list[bytes]]:
    """The conflicting payload and the batch's payloads: the ones given (a conflict
    checked to keep the key and change the request), else made from ``data``."""
    handler = harness.handler(topic)
    try:
        first = prepare(data)
    except MessageError:  # the message itself does not decode: nothing to derive
        return None, [data] if batch is None else [harness.encode(topic, v) for v in batch]
    if conflict is None:
        other = conflicting(handler, data, prepare)
    else:
        other = harness.encode(topic, conflict)
        theirs = prepare(other)
        same = theirs.request_hash == first.request_hash
        if theirs.key != first.key or same:
            raise ValueError(f"conflict= must have the key {first.key!r} and another request "
                             f"hash; it has the key {theirs.key!r} and "
                             f"{'the same' if same else 'another'} request hash")
    if batch is not None:
        return other, [harness.encode(topic, v) for v in batch]
    others = other_keys(handler, data, prepare, 2)
    # the message, another key, a duplicate, the conflict, a third key: one unit
    return other, [data, *others[:1], data, *([other] if other is not None else []),
                   *others[1:]]


def _clean(harness: Kit) -> None:
    for remote in harness.remotes.values():
        remote.reset()
    harness.hooks.forget()


Probe = tuple[State, Any, list[EmittedEvent]]


def _probe(harness: Kit, msg: FakeMessage, path: Path) -> Probe:
    """The tables, the result and the events after a first delivery of the reference,
    from a clean database: the reference's own delivery is the second, and a column or
    an event field that differs between the two holds a value the handler makes anew
    (every scenario would differ in it)."""
    _clean(harness)
    with harness.scratch(**settings_for(path)) as sb:
        d = sb.drive(sb.processor(), msg, path)
        return sb.state(harness.tables), d.result, sb.events()


def _compared(harness: Kit, msg: FakeMessage, path: Path, tables: list[Table],
              ref: list[EmittedEvent], ref_made: Made, probed: list[EmittedEvent],
              orm: dict[str, OrmMade]) -> tuple[Compared, list[str], list[Leak]]:
    """How events are compared, the report's lines for the fields left out, and the
    ORM-made values the events carry: the user's ``ignore``, the fields that carry a
    value the database makes (found by delivering the reference once more, every
    sequence moved to a range of its own: a field that then differs and is in both
    deliveries the value of one left-out column), and the fields that differ between the ``probed``
    delivery and the reference's, as a column does (:data:`DRIFTING`; a field that is
    in both the value of a column an ORM default fills, ``orm``, leaks it)."""
    made: dict[str, dict[str, tuple[str, ...]]] = {}
    if ref:
        _clean(harness)
        with harness.scratch(**settings_for(path)) as sb:
            harness.move_sequences(sb.conn())
            sb.drive(sb.processor(), msg, path)
            made = made_fields(ref, ref_made, sb.events(), made_values(sb.conn(), tables))
    left: dict[str, set[str]] = {}
    lines = []
    for topic, fields in sorted(made.items()):
        for name, columns in sorted(fields.items()):
            left.setdefault(topic, set()).add(name)
            lines.append(f"event {topic} field {name} ({MADE}: {' or '.join(columns)})")
    for topic, names in sorted(harness.event_ignore.items()):
        for name in sorted(names):
            left.setdefault(topic, set()).add(name)
            lines.append(f"event {topic} field {name} (ignored)")
    leaks = []
    for topic, moving in sorted(drifting_fields(probed, ref).items()):
        for name in sorted(moving - left.get(topic, set())):
            left.setdefault(topic, set()).add(name)
            m = _carried(orm, probed, ref, topic, name)
            if m is not None:
                leaks.append(Leak(m, f"event {topic} field {name}"))
            lines.append(f"event {topic} field {name} ({DRIFTING if m is None else m.why})")
    return Compared({t: frozenset(f) for t, f in left.items()}), lines, leaks


def _carried(orm: dict[str, OrmMade], first: list[EmittedEvent], second: list[EmittedEvent],
             topic: str, name: str) -> OrmMade | None:
    """The ORM-made column field ``name`` of the events to ``topic`` carries in both
    deliveries (paired in order, as :func:`drifting_fields` pairs them), or ``None``."""
    for a, b in zip(first, second, strict=True):
        fa, fb = a.fields(), b.fields()
        if a.topic == topic and fa is not None and fb is not None and name in fa.keys() & fb.keys():
            m = carrying(orm, fa[name], fb[name])
            if m is not None:
                return m
    return None


def _require_comparable(harness: Kit) -> None:
    if not harness.tables and not harness.remotes:
        raise ConfigError(
            "check has nothing to compare: it compares the app's own tables and remote "
            "fakes, and the app's migrations made no table; register its set-up with "
            "@app.migration, name its tables (tables=[...]) or pass remotes={...}",
            setting="tables")


def _reference(harness: Kit, handler: Handler[Any], msg: FakeMessage, paths: list[Path],
               sb: Sandbox, proc: KitProcessor,
               probe: Probe) -> tuple[Case, Made]:
    """Deliver the reference once on the first path (in ``sb`` by ``proc``): the case
    the scenarios are compared with, and the values the database made in its tables.
    ``probe`` is the tables and result of an earlier delivery: what differs between the
    two is not compared."""
    probe_state, probe_result, _events = probe
    d = sb.drive(proc, msg, paths[0])
    # what differs between two deliveries of the reference is not compared; what an ORM
    # model's client-side default made, said so
    full = sb.state(harness.tables)
    moving = drifting(probe_state, full)
    orm = orm_made(harness.app, moving, probe_state, full)
    tables = leave_out(harness.tables, {t: [c for c in cs if f"{t}.{c}" not in orm]
                                        for t, cs in moving.items()}, DRIFTING)
    for m in orm.values():
        tables = leave_out(tables, {m.table: [m.name]}, m.why)
    case = Case(harness, handler, msg, paths,
                Reference(d, sb.state(tables), {}, sb.events()),
                tables=tables, result_drift=drifting_result(probe_result, d.result),
                orm_made=orm)
    case.ref.effects = case.effects()
    return case, made_values(sb.conn(), tables)


def _result_left_out(case: Case, probe_result: Any) -> tuple[list[str], list[Leak]]:
    """The report's lines for the stored result's keys left out, and the ORM-made
    values among them (they leave the transaction: every duplicate gets them)."""
    lines, leaks = [], []
    result = case.ref.delivered.result
    for k in sorted(case.result_drift):
        what = f"the stored result{f'[{k!r}]' if k else ''}"
        first, second = ((probe_result, result) if not k else
                         (probe_result.get(k), result.get(k)))
        m = carrying(case.orm_made, first, second)
        if m is not None:
            leaks.append(Leak(m, what))
        lines.append(f"{what} ({DRIFTING if m is None else m.why})")
    return lines, leaks


def _defect(d: Delivered) -> Fault | None:
    """A reference that failed as a code defect fails the check: nothing can be
    compared with what the handler does until it succeeds."""
    rec = d.record or {}
    message = str(rec.get("error_message") or "")
    if rec.get("status") != "failed" or not message.startswith(CODE_DEFECT):
        return None
    error = rec.get("error_class") or "an error"
    return Fault(f"the reference delivery failed with a code defect ({show(sig(d))}: "
                 f"{error})",
                 [f"the reference delivery failed: {error}: {message}",
                  "  no scenario can show what the handler does until a delivery succeeds: "
                  "fix the handler (the scenarios below are compared with this failure)"],
                 about_reference=True)


def _report(case: Case, topic: str, events_left_out: list[str], probe_result: Any,
            leaks: list[Leak]) -> CheckReport:
    """The report before any scenario ran: what is compared, what is left out, what
    the reference delivery did, and the check's own faults (:class:`Fault`)."""
    harness, handler, tables, d = case.harness, case.handler, case.tables, case.ref.delivered
    results_left_out, result_leaks = _result_left_out(case, probe_result)
    report = CheckReport(
        handler=handler.name, topic=topic, mode=handler.mode,
        tables=[t.name for t in tables],
        left_out=[f"{t.name}.{c} ({why})" for t in tables for c, why in t.left_out]
        + results_left_out + events_left_out,
        remotes=list(harness.remotes), reference_outcome=show(case.first))
    report.faults += [f for f in (_defect(d), leak_fault([*leaks, *result_leaks])) if f]
    rows = ", ".join(f"{len(r.rows)} row(s) in {name}" for name, r in case.ref.state.items())
    report.reference.append(f"delivered once on the {case.paths[0]} path: {told(d)}; {rows}")
    if d.record and d.record.get("status") == "failed" and d.record.get("error_class"):
        report.reference.append(f"error: {d.record['error_class']}: "
                                f"{d.record.get('error_message') or ''}")
    if d.result is not None:
        report.reference.append(f"stored result: {json.dumps(d.result, default=str)}")
    if harness.app.event_topics:
        emitted = Counter(e.topic for e in case.ref.events)
        report.reference.append("events: " + (", ".join(
            f"{n} to {t}" for t, n in sorted(emitted.items())) or "none"))
    report.reference += [f"remote {n!r}: {sum(c.values())} effect(s)"
                         for n, c in case.ref.effects.items()]
    return report


def check(
    harness: Kit,
    topic: str,
    value: Any,
    *,
    key: str | bytes | None = None,
    headers: Any = None,
    conflict: Any = None,
    batch: Iterable[Any] | None = None,
    scenarios: Iterable[str] | None = None,
) -> CheckReport:
    """See :meth:`Harness.check`."""
    __tracebackhide__ = True
    started = time.monotonic()
    handler = harness.handler(topic)
    _require_comparable(harness)
    paths = paths_of(handler)
    data = harness.encode(topic, value)
    stamp = int(time.time() * 1000)

    def at(offset: int, payload: bytes) -> FakeMessage:
        return FakeMessage(topic, offset=offset, key=key, value=payload, headers=headers,
                           timestamp=stamp)

    msg = at(0, data)
    plan = _plan(handler, paths, scenarios)
    with no_wait():
        probe = _probe(harness, msg, paths[0])
        _clean(harness)
        with harness.scratch(**settings_for(paths[0])) as sb:
            proc = sb.processor()
            case, ref_made = _reference(harness, handler, msg, paths, sb, proc, probe)

            def prepare(payload: bytes) -> Any:
                return proc.prepare(handler, at(0, payload))

            other, payloads = _derived(harness, topic, data, prepare, conflict, batch)
        case.compared, events_left_out, leaks = _compared(
            harness, msg, paths[0], case.tables, case.ref.events, ref_made, probe[2],
            case.orm_made)
    report = _report(case, topic, events_left_out, probe[1], leaks)
    with no_wait():
        d = case.ref.delivered
        if d.outcome == "deferred":
            raise AssertionError(f"kafka_idem check of handler {handler.name!r}: the "
                                 f"reference delivery did not finish ({told(d)})")
        if other is not None:
            case.conflict = at(1, other)
        case.batch = [at(i, p) for i, p in enumerate(payloads)]
        for name, path in plan:
            report.results.append(run_one(case, name, path))
    report.seconds = time.monotonic() - started
    remember_left_out(report)
    if not report.passed:
        raise AssertionError(str(report))
    return report
