"""How the CLI prints a table, so it stays readable wherever its output goes.

* **Piped or redirected** (not a terminal): plain columns, each padded to its widest
  cell and separated by two spaces, one line per row at full width, whatever
  ``COLUMNS`` says: never wrapped, never cut, so ``grep``, ``cut`` and ``less -S``
  work and a key or a request hash can be copied whole. An empty cell is ``-``.
* **On a terminal wide enough**: a rich table.
* **Empty**: its title and ``no records``, not a header row over nothing.
* **On a narrower terminal**: one block per row, ``column  value`` per line (like
  ``psql``'s expanded display), instead of a table squeezed to one character per line.

Every cell is already plain, escaped text (:func:`kafka_idem.observe.text.plain`): no
markup, no control characters, no newline.

    >>> import io
    >>> out = io.StringIO()
    >>> emit(Grid(["partition", "key"], [["0", "t1:charge:o1"]]),
    ...      Console(file=out, width=20))
    >>> print(out.getvalue(), end="")
    partition  key
    0          t1:charge:o1
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from kafka_idem.observe.text import cell, plain

EMPTY = "-"


@dataclass
class Grid:
    """A table to print: column names, rows of plain text, an optional title.

    ``header=False`` for a two-column ``field value`` listing; ``right`` names the
    columns aligned right (counts)."""

    columns: Sequence[str]
    rows: list[list[str]] = field(default_factory=list)
    title: str | None = None
    header: bool = True
    right: frozenset[str] = frozenset()
    empty: str = "no records"  # said instead of a lone header row

    def add(self, *values: object) -> None:
        self.rows.append([plain(v) for v in values])


def emit(grid: Grid, console: Console | None = None) -> None:
    """Print ``grid`` as the module docstring says, for ``console`` (default: stdout)."""
    console = console or Console()
    if not grid.rows:  # a header over nothing reads as a display error
        _write(console, [plain(line) for line in (grid.title, grid.empty) if line])
        return
    if not console.is_terminal:
        _plain(grid, console)
        return
    table = _rich(grid)
    unbounded = console.options.update(width=1_000_000)  # the table's natural width
    if Measurement.get(console, unbounded, table).maximum <= console.width:
        console.print(table)
    else:
        _blocks(grid, console)


def _plain(grid: Grid, console: Console) -> None:
    lines = []
    if grid.title:
        lines.append(plain(grid.title))
    rows = [[c or EMPTY for c in row] for row in grid.rows]
    every = ([list(grid.columns)] if grid.header else []) + rows
    widths = [max((len(r[i]) for r in every), default=0) for i in range(len(grid.columns))]
    for row in every:
        cells = [
            c.rjust(w) if name in grid.right else c.ljust(w)
            for c, w, name in zip(row, widths, grid.columns, strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    _write(console, lines)


def _blocks(grid: Grid, console: Console) -> None:
    if not grid.header:  # already a field/value listing: one aligned pair a line
        _plain(grid, console)
        return
    lines = [plain(grid.title)] if grid.title else []
    width = max((len(c) for c in grid.columns), default=0)
    for n, row in enumerate(grid.rows, 1):
        lines.append(f"-[ {n} ]" + "-" * max(0, min(console.width, 40) - 6 - len(str(n))))
        lines += [f"{name.ljust(width)}  {value or EMPTY}"
                  for name, value in zip(grid.columns, row, strict=True)]
    _write(console, lines)


def _rich(grid: Grid) -> Table:
    table = Table(title=cell(grid.title) if grid.title else None, show_header=grid.header)
    for name in grid.columns:
        table.add_column(cell(name), justify="right" if name in grid.right else "left",
                         no_wrap=True)
    for row in grid.rows:
        table.add_row(*(cell(c) for c in row))
    return table


def _write(console: Console, lines: list[str]) -> None:
    # Straight to the file: rich would wrap a long line at the console's width.
    console.file.write("".join(f"{line}\n" for line in lines))
    console.file.flush()


__all__ = ["Grid", "emit"]
