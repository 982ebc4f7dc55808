"""What ``kafka-idem verify`` found: per scenario the checks, the durable figures they
were decided on, and the verdict; printed as a table and written as JSON."""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kafka_idem.observe.redact import redact
from kafka_idem.observe.text import cell, cell_lines, plain

PASS, FAIL, SKIPPED = "PASS", "FAIL", "SKIPPED"


@dataclass
class Check:
    what: str
    ok: bool
    detail: str = ""


@dataclass
class Outcome:
    """One scenario's result; its verdict follows from its checks."""

    id: str
    title: str
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None
    error: str | None = None
    seconds: float = 0.0
    artefacts: dict[str, Any] = field(default_factory=dict)
    cleanup_errors: list[str] = field(default_factory=list)

    def check(self, what: str, ok: bool, detail: Any = "") -> bool:
        """Record a check (``detail`` says why when it failed); return ``ok``."""
        self.checks.append(Check(what, bool(ok), str(detail)))
        return bool(ok)

    def figure(self, **figures: Any) -> None:
        """Record figures the scenario measured (shown with its verdict, kept in the JSON)."""
        self.figures.update(figures)

    @property
    def status(self) -> str:
        """``PASS`` (every check held), ``FAIL`` (one failed, none ran, or an error) or
        ``SKIPPED`` (it does not apply here)."""
        if self.skipped is not None and not self.checks and self.error is None:
            return SKIPPED
        if self.error is not None or not self.checks or not all(c.ok for c in self.checks):
            return FAIL
        return PASS

    def to_json(self) -> dict[str, Any]:
        """The outcome as JSON-able values (the report's ``scenarios`` entries)."""
        return {
            "id": self.id,
            "title": self.title,
            "status": self.status,
            "checks": [{"what": c.what, "ok": c.ok, "detail": c.detail} for c in self.checks],
            "figures": self.figures,
            "skipped": self.skipped,
            "error": self.error,
            "seconds": round(self.seconds, 2),
            "artefacts": self.artefacts,
            "cleanup_errors": self.cleanup_errors,
        }


@dataclass
class Report:
    """A verify run: its outcomes, where it ran (secrets masked) and how long it took."""

    run_id: str
    bootstrap_servers: str
    database: str
    kept: bool
    started_at: dt.datetime
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    logs: str | None = None
    # Masked wherever they occur in the report (an error text may echo the database URL).
    secrets: tuple[str, ...] = field(default=(), repr=False)

    @property
    def passed(self) -> bool:
        """No scenario failed (skipped ones do not count)."""
        return all(o.status != FAIL for o in self.outcomes)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-able values, secrets masked (``kafka-idem verify --json``)."""
        counts: dict[str, int] = {}
        for o in self.outcomes:
            counts[o.status] = counts.get(o.status, 0) + 1
        data: dict[str, Any] = _redacted({
            "run_id": self.run_id,
            "passed": self.passed,
            "counts": counts,
            "bootstrap_servers": self.bootstrap_servers,
            "database": self.database,
            "started_at": self.started_at.isoformat(),
            "seconds": round(self.seconds, 2),
            "kept": self.kept,
            "logs": self.logs,
            "scenarios": [o.to_json() for o in self.outcomes],
        }, self.secrets)
        return data

    def write_json(self, path: Path) -> None:
        """Write :meth:`to_json` to ``path``."""
        path.write_text(json.dumps(self.to_json(), indent=2, default=str) + "\n")

    def print(self, console: Console) -> None:
        """The table on a terminal of 100 columns or more, else (piped, or narrower) one
        block of plain lines per scenario; every text plain (never markup), control
        characters escaped, secrets masked."""
        def text(value: str) -> str:
            return redact(value, self.secrets)

        if not console.is_terminal or console.width < 100:
            lines = [plain(f"kafka-idem verify  run {self.run_id}")]
            for o in self.outcomes:
                lines.append(plain(f"{o.id}. {o.title} ({o.seconds:.1f}s): {o.status}"))
                lines += [plain(f"  {text(c)}") for c in _checks(o)]
                lines += [plain(f"  {text(f)}") for f in format_figures(o.figures).split("\n")
                          if f]
            console.file.write("".join(f"{line}\n" for line in lines))
            return
        table = Table(title=cell(f"kafka-idem verify  run {self.run_id}"), show_lines=True)
        table.add_column("scenario", no_wrap=False, max_width=24)
        table.add_column("what was checked")
        table.add_column("durable figures read")
        table.add_column("result", justify="center")
        for o in self.outcomes:
            checks = _checks(o)
            style = {PASS: "bold green", FAIL: "bold red"}.get(o.status, "bold yellow")
            table.add_row(cell_lines([f"{o.id}. {o.title}", f"({o.seconds:.1f}s)"]),
                          cell_lines(text(c) for c in checks),
                          cell_lines(text(format_figures(o.figures)).split("\n")),
                          cell(o.status, style=style))
        console.print(table)


def _checks(o: Outcome) -> list[str]:
    checks = [f"{'✓' if c.ok else '✗'} {c.what}" + ("" if c.ok or not c.detail
                                                    else f": {c.detail}")
              for c in o.checks]
    if o.error:
        checks.append(f"✗ error: {o.error}")
    if o.skipped:
        checks.append(f"skipped: {o.skipped}")
    return checks


_UUID = re.compile(r"\b([0-9a-f]{8})-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")


_TIME = re.compile(r"\b\d{4}-\d\d-\d\dT(\d\d:\d\d:\d\d(?:\.\d{3})?)\d*\+00:00\b")


def format_figures(figures: dict[str, Any]) -> str:
    """One ``name: value`` line per figure; tokens shortened to their first 8 digits and
    UTC times to the time of day (the JSON report keeps them whole)."""
    lines = []
    for name, value in figures.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
        elif isinstance(value, list | tuple):
            value = ", ".join(str(v) for v in value) or "-"
        lines.append(_TIME.sub(r"\1", _UUID.sub(r"\1", f"{name}: {value}")))
    return "\n".join(lines)


def _redacted(value: Any, secrets: tuple[str, ...]) -> Any:
    """``value`` (JSON-able) with every string redacted."""
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, dict):
        return {k: _redacted(v, secrets) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redacted(v, secrets) for v in value]
    return value
