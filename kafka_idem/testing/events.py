"""The events a handler emitted (``ctx.emit``): the rows the transactional outbox holds
in the kit's database (no relay runs there, so every committed event stays), read as
:class:`EmittedEvent`, and how two sets of them differ.

Events are compared as a multiset of (topic, key, value, headers): the value decoded
by the event topic's codec and flattened into fields (``ledger_entry.id``), or its
bytes when it does not decode; the headers the handler gave, without the trace
context (``traceparent``, ``tracestate``: a span's, new in every run).

A field is left out when it carries a value the database makes, as the tables'
identity, sequence and volatile-default columns are: found by delivering the
reference once more with every sequence moved to a range of its own (so no two
sequences' numbers meet), a field whose value differs *and* is, in each delivery,
the value of one and the same left-out column (:func:`made_fields`:
``payments.ledger.id``, ``payments.ledger.created_at``). A value the
handler makes anew itself (a counter of the process, a random id, the time) is left
out as such a column is: a field that differs between two deliveries of the
reference, each from a clean database (:func:`drifting_fields`).
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from psycopg import sql

from kafka_idem.app import App
from kafka_idem.observe.tracing import TRACE_HEADERS
from kafka_idem.store import Conn
from kafka_idem.testing.tables import (
    REFERENCES,
    State,
    Table,
    freeze,
    made_anew,
    show_value,
    snapshot,
)

MADE = "a value the database makes"


@dataclass(frozen=True)
class EmittedEvent:
    """One event in the outbox: what the relay would publish.

    ``value`` is the bytes (``None``: a tombstone), ``decoded`` the value as the event
    topic's codec reads it back (its model's instance, or a mapping; ``None`` when it
    does not decode), ``headers`` the handler's own (trace context included).
    ``source`` is the delivery that emitted it: (topic, partition, offset)."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    decoded: Any
    idem_key: str
    source: tuple[str | None, int | None, int | None]

    def header(self, name: str) -> bytes | None:
        """The value of the event's header ``name`` (``None``: it has none)."""
        return next((v for k, v in self.headers if k == name), None)

    def fields(self) -> dict[str, Any] | None:
        """The decoded value flattened (``{"ledger_entry.id": 1, ...}``); ``None``: it
        did not decode."""
        if self.decoded is None:
            return None
        return flatten(_plain(self.decoded))


def _plain(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings and lists as ``{"a.b": ..., "items[0]": ...}``."""
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(_plain(v), f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list | tuple) and value:
        out = {}
        for i, v in enumerate(value):
            out.update(flatten(_plain(v), f"{prefix}[{i}]"))
        return out
    return {prefix: value}


def mark(conn: Conn, schema: str, namespace: str) -> int:
    """The highest outbox id now (0: none): the events after it are a delivery's."""
    row = conn.execute(sql.SQL("SELECT coalesce(max(id), 0) FROM {} WHERE namespace = %s")
                       .format(sql.Identifier(schema, "outbox")), (namespace,)).fetchone()
    return int(row[0]) if row else 0


def read_events(conn: Conn, app: App, *, after: int = 0) -> list[EmittedEvent]:
    """The app's events in the outbox (those with an id above ``after``), in id order."""
    s = app.settings
    rows = conn.execute(sql.SQL(
        "SELECT topic, key, value, headers, idem_key, source_topic, source_partition,"
        " source_offset FROM {} WHERE namespace = %s AND id > %s ORDER BY id").format(
        sql.Identifier(s.schema_name, "outbox")), (app.namespace, after)).fetchall()
    return [EmittedEvent(
        topic=r[0], key=None if r[1] is None else bytes(r[1]),
        value=None if r[2] is None else bytes(r[2]),
        headers=tuple((k, base64.b64decode(v)) for k, v in r[3] or ()),
        decoded=_decode(app, r[0], r[2]), idem_key=r[4], source=(r[5], r[6], r[7]))
        for r in rows]


def _decode(app: App, topic: str, value: bytes | None) -> Any:
    declared = app.event_topics.get(topic)
    if value is None or declared is None:
        return None
    try:
        return declared.decode(bytes(value))
    except Exception:  # compared as bytes
        return None


# --- leaving out what the database makes -------------------------------------------------

Made = dict[str, list[Any]]  # "schema.table.column" -> its values


def made_values(conn: Conn, tables: Iterable[Table]) -> Made:
    """The values of the left-out columns of ``tables`` now, but those the handler
    makes anew (:func:`~kafka_idem.testing.tables.made_anew`): an event field copying
    one of those drifts as the column does, and is said so (:func:`drifting_fields`);
    and but a column that only references one of the others (its values are that
    column's: a field is said to carry the column that makes the value)."""
    shown = [Table(t.name, made) for t in tables
             if (made := tuple(c for c, why in t.left_out
                               if not made_anew(why) and not why.startswith(REFERENCES)))]
    return _columns(snapshot(conn, shown))


def _columns(state: State) -> Made:
    out: Made = {}
    for name, rows in state.items():
        for column in rows.table.columns:
            out[f"{name}.{column}"] = [r[column] for r in rows.rows]
    return out


def _same(a: Any, b: Any) -> bool:
    """A field's value and a column's: equal, or equal as a timestamp the codec keeps
    to the millisecond, or as text (a JSON payload's string of it)."""
    if a == b:
        return True
    if isinstance(a, dt.datetime) and isinstance(b, dt.datetime):
        try:
            return abs(a - b) < dt.timedelta(milliseconds=1)
        except TypeError:  # naive and aware
            return False
    if isinstance(a, str) != isinstance(b, str):
        text = b.isoformat() if isinstance(b, dt.datetime | dt.date) else str(b)
        other = a.isoformat() if isinstance(a, dt.datetime | dt.date) else str(a)
        return text == other
    return False


def columns_of(value: Any, made: Made) -> set[str]:
    """The columns of ``made`` one of whose values is ``value``."""
    return {c for c, values in made.items() if any(_same(value, v) for v in values)}


def made_fields(first: list[EmittedEvent], first_made: Made,
                second: list[EmittedEvent], second_made: Made
                ) -> dict[str, dict[str, tuple[str, ...]]]:
    """The event fields whose values differ between two deliveries and are, in both,
    the value of one and the same left-out column: ``{topic: {field: columns}}``, the
    columns sorted (more than one: the field's value is each's in both deliveries, as
    two ``now()`` defaults in one transaction are; it is one of theirs)."""
    out: dict[str, dict[str, tuple[str, ...]]] = {}
    if len(first) != len(second):
        return out
    for a, b in zip(first, second, strict=True):
        fa, fb = a.fields(), b.fields()
        if a.topic != b.topic or fa is None or fb is None:
            continue
        for name in fa.keys() & fb.keys():
            if fa[name] == fb[name]:
                continue
            both = columns_of(fa[name], first_made) & columns_of(fb[name], second_made)
            if both:
                out.setdefault(a.topic, {})[name] = tuple(sorted(both))
    return out


def drifting_fields(first: list[EmittedEvent],
                    second: list[EmittedEvent]) -> dict[str, set[str]]:
    """The event fields whose values differ between two deliveries of the same message
    that should be equal (each from a clean database), ``{topic: {field}}``: the events
    paired in the order they were emitted; none when the two differ in number or
    topics (then nothing is left out: the scenarios show the difference)."""
    out: dict[str, set[str]] = {}
    if [e.topic for e in first] != [e.topic for e in second]:
        return out
    for a, b in zip(first, second, strict=True):
        fa, fb = a.fields(), b.fields()
        if fa is None or fb is None:
            continue
        for name in fa.keys() & fb.keys():
            if freeze(fa[name]) != freeze(fb[name]):
                out.setdefault(a.topic, set()).add(name)
    return out


# --- comparing -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Compared:
    """How events are compared: the fields left out, by topic."""

    left_out: Mapping[str, frozenset[str]] = dataclasses.field(default_factory=dict)

    def form(self, e: EmittedEvent) -> tuple[Any, ...]:
        headers = tuple((k, v) for k, v in e.headers if k.lower() not in TRACE_HEADERS)
        fields = e.fields()
        if fields is None:
            return (e.topic, e.key, e.value, headers)
        gone = self.left_out.get(e.topic, frozenset())
        kept = tuple(sorted((k, freeze(v)) for k, v in fields.items() if k not in gone))
        return (e.topic, e.key, kept, headers)

    def show(self, e: EmittedEvent) -> str:
        key = "no key" if e.key is None else f"key {show_value(_text(e.key))}"
        headers = [(k, v) for k, v in e.headers if k.lower() not in TRACE_HEADERS]
        extra = ("; headers {" + ", ".join(f"{k}: {show_value(_text(v))}" for k, v in headers)
                 + "}") if headers else ""
        fields = e.fields()
        if fields is None:
            value = "a tombstone" if e.value is None else f"bytes {e.value!r}"
        else:
            gone = self.left_out.get(e.topic, frozenset())
            value = "{" + ", ".join(f"{k}: {show_value(v)}" for k, v in fields.items()
                                    if k not in gone) + "}"
        return f"{key}: {value}{extra}"



def _text(raw: bytes) -> str | bytes:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return raw


def compare_events(expected: list[EmittedEvent], got: list[EmittedEvent], how: Compared, *,
                   what: str, limit: int = 8) -> list[str]:
    """One problem per topic whose events differ from ``expected`` (as multisets)."""
    problems = []
    for topic in sorted({e.topic for e in expected} | {e.topic for e in got}):
        want = Counter(how.form(e) for e in expected if e.topic == topic)
        have = Counter(how.form(e) for e in got if e.topic == topic)
        if want == have:
            continue
        missing = _pick([e for e in expected if e.topic == topic], want - have, how)
        extra = _pick([e for e in got if e.topic == topic], have - want, how)
        head = (f"events to {topic}: {sum(have.values())} event(s), {what} has "
                f"{sum(want.values())}")
        lines = [head]
        for label, events in (("missing", missing), ("extra  ", extra)):
            lines += [f"  {label} {how.show(e)}" for e in events[:limit]]
            if len(events) > limit:
                lines.append(f"  ... and {len(events) - limit} more {label.strip()} event(s)")
        problems.append("\n".join(lines))
    return problems


def _pick(events: list[EmittedEvent], keys: Counter[tuple[Any, ...]],
          how: Compared) -> list[EmittedEvent]:
    left = Counter(keys)
    out = []
    for e in events:
        k = how.form(e)
        if left[k] > 0:
            left[k] -= 1
            out.append(e)
    return out

