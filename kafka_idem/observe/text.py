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

import datetime as dt
import json
from collections.abc import Iterable
from typing import Any

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


def to_json(data: Any, *, sort_keys: bool = False) -> str:
    """The ``--json`` text of a command: times in ISO 8601 (``2026-12-01T03:05:39+00:00``,
    not ``str()``'s space), anything else JSON does not know as its text.

    >>> to_json({"at": dt.datetime(2026, 12, 1, 3, 5, tzinfo=dt.UTC)})
    '{\n  "at": "2026-12-01T03:05:00+00:00"\n}'
    """
    return json.dumps(data, indent=2, sort_keys=sort_keys, default=_json_value)


def _json_value(value: Any) -> str:
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    return str(value)


__all__ = ["cell", "cell_lines", "one_line", "plain", "to_json"]
