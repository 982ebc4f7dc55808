"""A rich progress bar on stderr, when asked for and stderr is a terminal (never in
pipes, logs or tests): ``replay`` counts records scanned and sent, bulk ``rerun``
counts keys re-run. ``report(done, total, sent)`` is told too, whatever the terminal
(the console's progress)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class Progress:
    """``with Progress(on, total, "replaying", sent=True) as advance: advance(n, sent)``."""

    def __init__(self, enabled: bool, total: int, label: str, *, sent: bool = False,
                 report: Callable[[int, int, int], None] | None = None) -> None:
        self.bar: Any = None
        self.total = total
        self.done = 0
        self.report = report
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                ProgressColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.progress import Progress as Bar

            columns: list[ProgressColumn | str] = [
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
            if sent:
                columns.append(TextColumn("scanned, {task.fields[sent]} sent"))
            columns.append(TimeElapsedColumn())
            self.bar = Bar(*columns, console=Console(stderr=True))
            self.task = self.bar.add_task(label, total=total, sent=0)

    def __enter__(self) -> Callable[..., None]:
        if self.report is not None:
            self.report(0, self.total, 0)
        if self.bar is not None:
            self.bar.start()

        def advance(n: int, sent: int = 0) -> None:
            self.done += n
            if self.bar is not None:
                self.bar.update(self.task, advance=n, sent=sent)
            if self.report is not None:
                self.report(self.done, self.total, sent)

        return advance

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()
