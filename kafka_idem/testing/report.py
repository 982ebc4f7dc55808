"""What :meth:`Harness.check` found: one :class:`ScenarioResult` per scenario and path,
and the readable report an ``AssertionError`` carries when one failed."""

from __future__ import annotations

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
        if self.problems:
            return FAILED
        return NOT_APPLICABLE if self.skipped else PASSED

    @property
    def passed(self) -> bool:
        return not self.problems

    def said(self, line: str) -> None:
        self.story.append(line)

    def wrong(self, line: str) -> None:
        self.problems.append(line)

    def lines(self) -> list[str]:
        head = f"{self.status:<8} {self.name} [{self.path}]: {self.title}"
        if self.skipped and not self.problems:
            return [f"{head} ({self.skipped})"]
        out = [head]
        out += [f"    {line}" for line in self.story]
        for problem in self.problems:
            first, *rest = problem.splitlines() or [""]
            out.append(f"  ! {first}")
            out += [f"      {line}" for line in rest]
        return out


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

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failed(self) -> list[ScenarioResult]:
        return [r for r in self.results if not r.passed]

    def result(self, name: str, path: str | None = None) -> ScenarioResult:
        """The result of scenario ``name`` (on ``path``, when it ran on several)."""
        for r in self.results:
            if r.name == name and (path is None or r.path == path):
                return r
        raise KeyError(f"no scenario {name!r}" + (f" on path {path!r}" if path else ""))

    def __str__(self) -> str:
        ran = [r for r in self.results if not r.skipped or r.problems]
        verdict = (f"{len(self.failed)} of {len(ran)} scenarios FAILED" if self.failed
                   else f"all {len(ran)} scenarios passed")
        out = [f"kafka_idem check of handler {self.handler!r} (topic {self.topic}, "
               f"{self.mode} mode): {verdict} in {self.seconds:.1f}s",
               f"  compared: {', '.join(self.tables) or '(no tables)'}"
               + (f"; remotes: {', '.join(self.remotes)}" if self.remotes else "")]
        if self.left_out:
            out.append(f"  left out: {'; '.join(self.left_out)}")
        out += [f"  reference: {line}" for line in self.reference]
        out.append("")
        failed = [r for r in self.results if not r.passed]
        for r in failed + [r for r in self.results if r.passed]:
            out += r.lines() if not r.passed else r.lines()[:1]
        return "\n".join(out)
