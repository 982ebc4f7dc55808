"""Stored text on a terminal: never markup, control characters escaped."""

from __future__ import annotations

import io

from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console
from rich.table import Table

from kafka_idem.observe.text import cell, one_line, plain


def render(*cells: object) -> str:
    out = io.StringIO()
    table = Table(title=cell("t[/]itle"))
    table.add_column("value")
    for value in cells:
        table.add_row(cell(value))
    Console(file=out, width=200, color_system=None).print(table)
    return out.getvalue()


def test_markup_is_shown_as_written() -> None:
    shown = render("a[/]b", "[link=https://evil.example]click[/link]", "[bold red]x")
    assert "a[/]b" in shown and "t[/]itle" in shown
    assert "[link=https://evil.example]click[/link]" in shown
    assert "[bold red]x" in shown


def test_control_characters_are_escaped_never_emitted() -> None:
    shown = render("k1\nFORGED LINE", "k2\x1b[2J\x1b[31m", "k3\r\u202eevil\u2028x")
    assert "\x1b" not in shown and "\r" not in shown and "\u202e" not in shown
    assert not any(line.startswith("FORGED") for line in shown.splitlines())
    assert "k1\\nFORGED LINE" in shown
    assert "k2\\x1b[2J\\x1b[31m" in shown
    assert "k3\\r\\u202eevil\\u2028x" in shown


@given(st.text())
def test_plain_text_is_one_printable_line(text: str) -> None:
    shown = plain(text)
    assert "\n" not in shown and "\x1b" not in shown and "\r" not in shown
    assert all(ch.isprintable() or ch.isspace() for ch in shown)


def test_ordinary_text_is_unchanged() -> None:
    for text in ("t1:charge:o1", "amount must be positive, got 0", "héllo ✓ 東京"):
        assert plain(text) == text


def test_one_line_collapses_error_text() -> None:
    assert one_line("connection refused\n\tIs the server running?\x1b[0m") == (
        "connection refused Is the server running?\\x1b[0m")
