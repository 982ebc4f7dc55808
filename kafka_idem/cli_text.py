"""Showing stored and user-controlled text on a terminal: as plain text, never markup,
with control characters escaped.

Idempotency keys, error messages, DLQ headers, actors and reasons come from
payloads, handlers and operators. Printed as rich markup, ``[/]`` crashes the
command and ``[link=...]`` changes what the operator sees; printed raw, a newline
forges a line and an escape sequence repaints the terminal. So every such value
goes through :func:`cell` (a rich :class:`~rich.text.Text`, never parsed as
markup) or :func:`plain` (for ``click.echo``), both of which escape control and
format characters the way ``repr`` does:

    >>> plain("t1:charge:o1\\nFORGED \\x1b[31m")
    't1:charge:o1\\\\nFORGED \\\\x1b[31m'
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def plain(value: object) -> str:
    """``value`` as text with what ``repr`` escapes escaped (control and format
    characters, line separators, unassigned code points: ``\\n``, ``\\x1b``,
    ``\\u202e``), quotes and backslashes left as they are; ``None`` is empty."""
    text = "" if value is None else str(value)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape_char(ch) for ch in text)


def cell(value: object, style: str = "") -> Text:
    """A table cell or title: :func:`plain` text that rich never reads as markup."""
    return Text(plain(value), style=style)


def cell_lines(lines: Iterable[object], style: str = "") -> Text:
    """A multi-line cell: each line :func:`plain`, the lines joined by real newlines."""
    return Text("\n".join(plain(line) for line in lines), style=style)


def one_line(text: str) -> str:
    """An error text on one line: whitespace runs (newlines too) become one space,
    other control characters are escaped."""
    return plain(" ".join(text.split()))


__all__ = ["cell", "cell_lines", "one_line", "plain"]
