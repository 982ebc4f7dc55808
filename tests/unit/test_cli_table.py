"""A CLI table where it is printed: piped, on a wide terminal, on a narrow one."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kafka_idem.cli.table import Grid, emit

KEY = "tenant-0042:charge:order-2026-12-01-000123456789"
HASH = "v1:sha256:" + "ab12" * 16


def grid() -> Grid:
    g = Grid(["partition", "offset", "key", "request_hash", "count"], title="t.dlq: 2",
             right=frozenset({"count"}))
    g.add(0, 7, KEY, HASH, 3)
    g.add(1, 12, "k2", "", 10)
    return g


def render(*, terminal: bool, width: int) -> str:
    out = io.StringIO()
    emit(grid(), Console(file=out, width=width, force_terminal=terminal, color_system=None))
    return out.getvalue()


def test_piped_it_is_plain_full_width_columns_whatever_the_width() -> None:
    text = render(terminal=False, width=40)
    assert text.splitlines() == [
        "t.dlq: 2",
        f"partition  offset  key{' ' * (len(KEY) - 3)}  request_hash{' ' * (len(HASH) - 12)}"
        "  count",
        f"0          7       {KEY}  {HASH}      3",
        f"1          12      k2{' ' * (len(KEY) - 2)}  -{' ' * (len(HASH) - 1)}     10",
    ]


def test_on_a_wide_terminal_it_is_a_table() -> None:
    text = render(terminal=True, width=200)
    assert "┃ partition ┃" in text and KEY in text and HASH in text
    assert "…" not in text


def test_on_a_narrow_terminal_it_is_one_block_per_row_never_a_squeezed_table() -> None:
    text = render(terminal=True, width=60)
    lines = text.splitlines()
    assert "┃" not in text and "…" not in text
    assert lines[0] == "t.dlq: 2" and lines[1].startswith("-[ 1 ]")
    assert f"key           {KEY}" in lines and f"request_hash  {HASH}" in lines
    assert "request_hash  -" in lines  # the second row's empty cell


def test_a_field_value_listing_stays_one_pair_a_line() -> None:
    g = Grid(["field", "value"], header=False)
    g.add("request_hash", HASH)
    g.add("error_kind", None)
    out = io.StringIO()
    emit(g, Console(file=out, width=30, force_terminal=True, color_system=None))
    assert out.getvalue().splitlines() == [f"request_hash  {HASH}", "error_kind    -"]


@pytest.mark.parametrize("terminal", [False, True])
def test_an_empty_table_says_no_records_not_a_lone_header(terminal: bool) -> None:
    out = io.StringIO()
    emit(Grid(["at", "actor", "action"], title="audit trail"),
         Console(file=out, width=120, force_terminal=terminal, color_system=None))
    assert out.getvalue() == "audit trail\nno records\n"
