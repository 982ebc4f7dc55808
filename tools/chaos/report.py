"""What the checker returns, and the one measurement the run hands to it.

:class:`Check` is one of the checks (its count of anomalies, up to
:data:`EXAMPLES` examples, what it examined); :class:`Report` holds them and
the durable figures, with :meth:`Report.table`, :meth:`Report.figures_table`
(rich tables) and :meth:`Report.to_json`. :class:`Liveness` is what the chaos
run measured after healing (time to lag 0 and its bound), judged by check 9.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

EXAMPLES = 5  # offending keys/offsets kept per check

TITLES = {
    1: "lost",
    2: "duplicate or wrong effects",
    3: "contradictory outcomes",
    4: "DLQ record integrity",
    5: "stale-owner commits",
    6: "illegal or stuck records",
    7: "committed offsets ahead of outcomes",
    8: "retry limit exceeded",
    9: "liveness (lag back to 0)",
    10: "effects out of offset order per ordering key",
    11: "outbox events (one per succeeded intent, none else, per-key order)",
}


def place(pos: tuple[int, int]) -> str:
    """A message's position as the examples name it."""
    return f"p{pos[0]}@{pos[1]}"


def secs(value: float | None) -> str:
    """Seconds as the examples say them (None: never)."""
    return "never" if value is None else f"{value:.1f}s"


@dataclass
class Check:
    number: int
    title: str
    examined: str = ""
    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, example: str, n: int = 1) -> None:
        self.count += n
        if len(self.examples) < EXAMPLES:
            self.examples.append(example)


@dataclass(frozen=True)
class Liveness:
    """What the run measured: seconds from the heal to lag 0 (None: never), and the bound."""

    healed_in: float | None
    bound: float


@dataclass
class Report:
    checks: list[Check]
    figures: dict[str, Any]

    @property
    def anomalies(self) -> int:
        return sum(c.count for c in self.checks)

    @property
    def ok(self) -> bool:
        return self.anomalies == 0

    def count(self, number: int) -> int:
        return self.by_number(number).count

    def by_number(self, number: int) -> Check:
        return next(c for c in self.checks if c.number == number)

    def failing(self) -> set[int]:
        return {c.number for c in self.checks if c.count}

    def to_json(self) -> dict[str, Any]:
        return {
            "anomalies": self.anomalies,
            "ok": self.ok,
            "checks": [
                {"number": c.number, "title": c.title, "count": c.count,
                 "examined": c.examined, "examples": c.examples}
                for c in self.checks
            ],
            "figures": self.figures,
        }

    def table(self) -> Table:
        t = Table(title="Checker (durable state only)", title_justify="left")
        for col in ("#", "check", "", "anomalies", "examined", "examples"):
            t.add_column(col, justify="right" if col in ("#", "anomalies") else "left")
        for c in self.checks:
            verdict = "[green]PASS[/]" if not c.count else "[bold red]FAIL[/]"
            t.add_row(str(c.number), c.title, verdict, str(c.count), c.examined,
                      "\n".join(c.examples))
        return t

    def figures_table(self) -> Table:
        t = Table(title="Durable figures", title_justify="left")
        t.add_column("figure")
        t.add_column("value", justify="right")
        for name, value in self.figures.items():
            if isinstance(value, dict):
                value = ", ".join(f"{k} {v}" for k, v in value.items()) or "-"
            t.add_row(name, str(value))
        return t
