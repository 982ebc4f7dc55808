"""What one :func:`~kafka_idem.testing.check.check` works on (:class:`Case`: the
message, the derived ones, the reference) and how a scenario judges what it saw:
outcomes as :data:`Sig` (an outcome and its dead letter's kind), the app's tables, the
events in the outbox and the remotes' effects against the reference's.

The kit's modules import one way: ``harness`` -> ``check`` -> ``scenarios`` -> ``case``.
What a check needs of its harness is :class:`Kit` (which
:class:`~kafka_idem.testing.harness.Harness` is), so nothing below the harness imports it.
"""

from __future__ import annotations

from collections import Counter
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from kafka_idem.app import App
from kafka_idem.consume.outcome import Finished, Result
from kafka_idem.handler import Handler
from kafka_idem.store import Conn
from kafka_idem.testing.events import Compared, EmittedEvent, compare_events
from kafka_idem.testing.hooks import Hooks
from kafka_idem.testing.message import FakeMessage
from kafka_idem.testing.remote import Remote
from kafka_idem.testing.report import ScenarioResult
from kafka_idem.testing.sandbox import Delivered, Path, Sandbox
from kafka_idem.testing.tables import State, Table, compare, freeze, show_value

Sig = tuple[str, str | None]


class Kit(Protocol):
    """What a check needs of the :class:`~kafka_idem.testing.harness.Harness` it runs
    in: the app, its instrumented copy, the tables and remotes it compares, and clean
    databases to run the scenarios in."""

    app: App
    base: App  # the app with the kit's hooks installed
    hooks: Hooks
    remotes: dict[str, Remote]
    tables: list[Table]  # the tables compared
    clean: State  # their state on a clean database
    concurrency: int
    event_ignore: dict[str, frozenset[str]]  # event topic -> the fields not compared

    def handler(self, topic: str) -> Handler[Any]: ...

    def encode(self, topic: str, value: Any) -> bytes: ...

    def scratch(self, **settings: Any) -> AbstractContextManager[Sandbox]: ...

    def move_sequences(self, conn: Conn) -> None: ...


def settings_for(path: Path) -> dict[str, Any]:
    """The batch path runs only when the settings allow it (the app's may not)."""
    return {"batch_path": True} if path == "batch" else {}


def sig(d: Delivered) -> Sig:
    """An outcome and its dead letter's kind (``("dead_lettered", "exhausted")``)."""
    letter = d.dead_letters[-1].kind if d.dead_letters and d.outcome != "replayed" else None
    return (d.outcome if d.outcome != "deferred" else f"deferred ({d.reason})", letter)


def show(s: Sig) -> str:
    """``dead_lettered (exhausted)``, ``replayed``..."""
    return s[0] if s[1] is None else f"{s[0]} ({s[1]})"


def told(d: Delivered) -> str:
    """A delivery in one line: its outcome, the tries before it, the key's record."""
    steps = ", ".join(d.steps[:-1])
    extra = f" after {steps}" if steps else ""
    rec = f"; record {d.status}, attempts {d.attempts}" if d.record else "; no record"
    return f"{show(sig(d))}{extra}{rec}"


Effects = dict[str, Counter[Any]]


@dataclass
class Reference:
    delivered: Delivered
    state: State
    effects: Effects
    events: list[EmittedEvent] = field(default_factory=list)


@dataclass
class Case:
    """What one :func:`check` works on."""

    harness: Kit
    handler: Handler[Any]
    msg: FakeMessage
    paths: list[Path]
    ref: Reference
    tables: list[Table] = field(default_factory=list)  # compared: the harness's, less drift
    result_drift: frozenset[str] = frozenset()  # stored result keys not compared
    # columns an ORM client-side default fills, new in every delivery (by schema.table.col)
    orm_made: dict[str, Any] = field(default_factory=dict)
    compared: Compared = field(default_factory=Compared)  # how events are compared
    conflict: FakeMessage | None = None
    batch: list[FakeMessage] = field(default_factory=list)

    @property
    def succeeded(self) -> bool:
        return self.ref.delivered.outcome == "succeeded"

    @property
    def first(self) -> Sig:
        return sig(self.ref.delivered)

    @property
    def again(self) -> Sig:
        """What a duplicate gets once the first delivery finished."""
        return ("replayed", None) if self.succeeded else self.first

    def effects(self) -> Effects:
        return {name: Counter(freeze(e) for e in r.effects())
                for name, r in self.harness.remotes.items()}

    def expect(self, out: ScenarioResult, what: str, got: Sig, want: Sig) -> None:
        if got != want:
            out.wrong(f"{what}: {show(got)}, expected {show(want)}")

    def same_state(self, out: ScenarioResult, sb: Sandbox, expected: State | None = None,
                   *, what: str = "the reference") -> None:
        """The app's tables equal ``expected`` (default: the reference's)."""
        want = self.ref.state if expected is None else expected
        for diff in compare(want, sb.state(self.tables)):
            out.wrong("\n".join(diff.lines(expected=what)))

    def same_events(self, out: ScenarioResult, sb: Sandbox,
                    expected: list[EmittedEvent] | None = None, *,
                    what: str = "the reference") -> None:
        """The outbox holds the events of ``expected`` (default: the reference's), each
        as often: none more (a replay, a conflict, a failure emit nothing)."""
        want = self.ref.events if expected is None else expected
        for problem in compare_events(want, sb.events(), self.compared, what=what):
            out.wrong(problem)

    def same_effects(self, out: ScenarioResult, *, at_most: bool = False,
                     expected: Effects | None = None, what: str = "the reference") -> None:
        """The remotes did what the reference made them do (or no more, ``at_most``)."""
        want_all = self.ref.effects if expected is None else expected
        for name, got in self.effects().items():
            want = want_all.get(name, Counter())
            extra, missing = got - want, want - got
            if extra or (missing and not at_most):
                lines = [f"remote {name!r}: {sum(got.values())} effect(s), {what} has "
                         f"{sum(want.values())}"]
                lines += [f"  extra   {show_value(e)}" for e in extra.elements()]
                if not at_most:
                    lines += [f"  missing {show_value(e)}" for e in missing.elements()]
                out.wrong("\n".join(lines))


def step(result: Result) -> str:
    """One try's outcome (``succeeded``...) or why it waits (``busy``...)."""
    return result.outcome.value if isinstance(result, Finished) else result.reason.value
