"""What :meth:`Harness.check` found: one :class:`ScenarioResult` per scenario and path,
and the readable report an ``AssertionError`` carries when one failed.

One defect of a handler usually shows in many scenarios, as the same difference (the
same rows or events missing and extra). The report says each distinct difference
once, first, with the scenarios it appeared in (:func:`differences`); each scenario's
own lines then name it by number. A difference whose rows or events differ between
scenarios only in field values that are new in every scenario (a random id, a
counter of the process: :func:`_merge`) is one difference too, those values shown as
differing."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

Status = Literal["passed", "FAILED", "not applicable"]
PASSED: Status = "passed"
FAILED: Status = "FAILED"
NOT_APPLICABLE: Status = "not applicable"


@dataclass
class ScenarioResult:
    """One scenario on one path: what happened (``story``), what was wrong
    (``problems``; empty when it passed), and how long it took."""

    name: str
    title: str
    path: str
    story: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    skipped: str | None = None  # why the scenario does not apply
    seconds: float = 0.0

    @property
    def status(self) -> Status:
        """``passed``, ``FAILED`` or ``not applicable`` (:attr:`skipped` says why)."""
        if self.problems:
            return FAILED
        return NOT_APPLICABLE if self.skipped else PASSED

    @property
    def passed(self) -> bool:
        """No problem was found (a scenario that does not apply passes)."""
        return not self.problems

    def said(self, line: str) -> None:
        """Add ``line`` to what happened (:attr:`story`)."""
        self.story.append(line)

    def wrong(self, line: str) -> None:
        """Add ``line`` to what was wrong (:attr:`problems`): the scenario fails."""
        self.problems.append(line)

    @property
    def label(self) -> str:
        """``crash_before_commit [per-message]``: the scenario and its path."""
        return f"{self.name} [{self.path}]"

    def lines(self, numbers: dict[str, int] | None = None) -> list[str]:
        """The scenario's report: its problems in full, or with ``numbers`` (a problem's
        number among the report's differences) their first lines and numbers."""
        head = f"{self.status:<8} {self.label}: {self.title}"
        if self.skipped and not self.problems:
            return [f"{head} ({self.skipped})"]
        out = [head]
        out += [f"    {line}" for line in self.story]
        for problem in self.problems:
            first, *rest = problem.splitlines() or [""]
            if numbers is not None and problem in numbers:
                out.append(f"  ! {first}  (difference {numbers[problem]} above)")
                continue
            out.append(f"  ! {first}")
            out += [f"      {line}" for line in rest]
        return out


@dataclass
class Difference:
    """One distinct problem and the scenarios it appeared in (``problems``: its text
    in each of them, so a scenario's lines can name it)."""

    text: str  # as reported: the values that differ between the scenarios marked
    scenarios: list[str]
    problems: list[str]

    def lines(self, number: int) -> list[str]:
        first, *rest = self.text.splitlines() or [""]
        out = [f"  ! {number}. {first}"]
        out += [f"      {line}" for line in rest]
        n = len(self.scenarios)
        out.append(f"    in {n} scenario{'s' if n > 1 else ''}: {', '.join(self.scenarios)}")
        return out


def differences(results: Sequence[ScenarioResult]) -> list[Difference]:
    """The distinct problems of ``results``, each once with the scenarios it appeared in,
    the most widespread first (then in the order they were first met)."""
    groups: dict[tuple[str, ...], list[tuple[str, str]]] = {}
    for r in results:
        for problem in r.problems:
            groups.setdefault(_skeleton(problem), []).append((r.label, problem))
    found: list[Difference] = []
    for members in groups.values():
        found += _merge(members)
    order = {id(d): i for i, d in enumerate(found)}
    return sorted(found, key=lambda d: (-len(d.scenarios), order[id(d)]))


def _merge(members: list[tuple[str, str]]) -> list[Difference]:
    """Problems of one skeleton: one :class:`Difference` when they are the same text, or
    differ only in field values each scenario has its own of (all distinct: made anew
    in every run); else one per distinct text."""
    split = [_parts(problem) for _, problem in members]
    varying = [i for i in range(1, len(split[0]), 2)
               if len({parts[i] for parts in split}) > 1]
    if all(len({parts[i] for parts in split}) == len(members) for i in varying):
        text = "".join(
            _differing([parts[i] for parts in split]) if i in varying else piece
            for i, piece in enumerate(split[0]))
        return [Difference(text, list(dict.fromkeys(s for s, _ in members)),
                           [p for _, p in members])]
    exact: dict[str, list[str]] = {}
    for label, problem in members:
        exact.setdefault(problem, []).append(label)
    return [Difference(problem, list(dict.fromkeys(labels)), [problem])
            for problem, labels in exact.items()]


def _differing(values: list[str], shown: int = 2) -> str:
    examples = ", ".join(values[:shown]) + (", ..." if len(values) > shown else "")
    return f"<a different value in each scenario: {examples}>"


def _skeleton(problem: str) -> tuple[str, ...]:
    """``problem`` without its field values: the text between them."""
    return tuple(_parts(problem)[::2])


def _parts(problem: str) -> list[str]:
    """``problem`` cut into text, field value, text, field value, ..., text: the field
    values are those of the rows and events shown (``{name: value, ...}``, within a
    line's outermost braces), quotes, brackets and nested braces respected."""
    parts: list[str] = []
    text_start = 0
    depth = 0
    quote: str | None = None
    value_start: int | None = None
    i = 0
    while i < len(problem):
        c = problem[i]
        if c == "\n":  # a line's braces and quotes end with it
            if value_start is not None:
                parts += [problem[text_start:value_start], problem[value_start:i]]
                text_start = i
            depth, quote, value_start = 0, None, None
        elif depth and quote is not None:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
        elif depth and c in "'\"":
            quote = c
        elif c in "{[(" and (depth or c == "{"):
            depth += 1
        elif c in "}])" and depth:
            if depth == 1 and value_start is not None:
                parts += [problem[text_start:value_start], problem[value_start:i]]
                text_start, value_start = i, None
            depth -= 1
        elif depth == 1 and value_start is None and problem.startswith(": ", i):
            value_start = i + 2
            i += 2
            continue
        elif depth == 1 and value_start is not None and problem.startswith(", ", i):
            parts += [problem[text_start:value_start], problem[value_start:i]]
            text_start, value_start = i, None
        i += 1
    parts.append(problem[text_start:])
    return parts


@dataclass(frozen=True)
class Fault:
    """A problem of the whole check, found before any scenario ran (a reference that
    failed with a code defect, a value an ORM default makes that leaves the
    transaction): it fails the check whatever the scenarios say. ``head`` is said in
    the headline, ``lines`` first of all below it."""

    head: str
    lines: list[str]
    about_reference: bool = False  # says why the reference delivery did not succeed


@dataclass
class CheckReport:
    """Every scenario :meth:`Harness.check` ran, in order; ``str()`` is the report."""

    handler: str
    topic: str
    mode: str
    tables: list[str]
    left_out: list[str]
    remotes: list[str]
    reference: list[str] = field(default_factory=list)
    results: list[ScenarioResult] = field(default_factory=list)
    seconds: float = 0.0
    reference_outcome: str = "succeeded"  # the reference delivery's (``dead_lettered (...)``)
    faults: list[Fault] = field(default_factory=list)  # the check's own problems

    @property
    def passed(self) -> bool:
        """No :attr:`faults`, and every scenario agrees with the reference (which may
        itself have failed, not as a code defect: see :attr:`reference_succeeded`)."""
        return not self.faults and all(r.passed for r in self.results)

    @property
    def reference_succeeded(self) -> bool:
        """The reference delivery succeeded: else the scenarios were compared with a
        failure (a handler that raises, or returns what is not JSON, agrees with itself),
        and the headline says so."""
        return self.reference_outcome == "succeeded"

    @property
    def failed(self) -> list[ScenarioResult]:
        """The results that did not pass."""
        return [r for r in self.results if not r.passed]

    def result(self, name: str, path: str | None = None) -> ScenarioResult:
        """The result of scenario ``name`` (on ``path``, when it ran on several)."""
        for r in self.results:
            if r.name == name and (path is None or r.path == path):
                return r
        raise KeyError(f"no scenario {name!r}" + (f" on path {path!r}" if path else ""))

    def left_out_lines(self) -> list[str]:
        """The report's block of what no scenario compares: a heading, then each
        column, stored result key or event field with why (none: nothing left out)."""
        if not self.left_out:
            return []
        return [f"  LEFT OUT: {len(self.left_out)} value(s) no scenario compares "
                "(a mistake in them would not fail this check):",
                *(f"    - {line}" for line in self.left_out)]

    def __str__(self) -> str:
        ran = [r for r in self.results if not r.skipped or r.problems]
        verdict = (f"{len(self.failed)} of {len(ran)} scenarios FAILED" if self.failed
                   else f"all {len(ran)} scenarios passed")
        if not self.reference_succeeded:  # not "all passed", as if all were well
            said = any(f.about_reference for f in self.faults)
            verdict = ("" if said else f"the reference delivery did not succeed "
                       f"({self.reference_outcome}); ") + (
                verdict if self.failed else f"{len(ran)} scenarios agree with it")
        if self.faults:
            verdict = "FAILED: " + "; ".join([f.head for f in self.faults] + [verdict])
        left = (f"; {len(self.left_out)} value(s) LEFT OUT of the comparison (listed "
                "below)") if self.left_out else ""
        out = [f"kafka_idem check of handler {self.handler!r} (topic {self.topic}, "
               f"{self.mode} mode): {verdict} in {self.seconds:.1f}s{left}"]
        for fault in self.faults:  # the check's own problems first
            out += [("  ! " if not line.startswith(" ") else "      ") + line.strip()
                    for line in fault.lines]
        # What differs, then where: each distinct difference once, with its scenarios.
        failed = self.failed
        numbers: dict[str, int] = {}
        for n, d in enumerate(differences(failed), 1):
            out += d.lines(n)
            numbers.update(dict.fromkeys(d.problems, n))
        out += self.left_out_lines()
        out.append(f"  compared: {', '.join(self.tables) or '(no tables)'}"
                   + (f"; remotes: {', '.join(self.remotes)}" if self.remotes else ""))
        out += [f"  reference: {line}" for line in self.reference]
        out.append("")
        for r in failed + [r for r in self.results if r.passed]:
            out += r.lines(numbers) if not r.passed else r.lines()[:1]
        return "\n".join(out)


# What every check of the session left out, for the pytest plugin's terminal summary:
# (what was checked, the left-out lines) -> the tests that checked it.
LEFT_OUT: dict[tuple[str, tuple[str, ...]], list[str]] = {}


def remember_left_out(report: CheckReport) -> None:
    """Keep ``report``'s left-out values for the end of the pytest session (with the
    test that ran the check, when pytest runs one)."""
    if not report.left_out:
        return
    what = f"handler {report.handler!r} (topic {report.topic}, {report.mode} mode)"
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0] or "(no test)"
    tests = LEFT_OUT.setdefault((what, tuple(report.left_out)), [])
    if test not in tests:
        tests.append(test)
