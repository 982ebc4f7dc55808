"""Durations as operators type them (``30d``, ``12h``, ``90s``): read by the ``retention``
setting and by the admin commands' options (``purge --older-than``, ``status
--long-running``), and written back in messages, in one place."""

from __future__ import annotations

import math
import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """Seconds in ``'90s'``, ``'15m'``, ``'12h'``, ``'30d'``, ``'2w'`` (plain numbers are seconds).

    >>> parse_duration("30d")
    2592000.0
    """
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration like 90s, 15m, 12h, 30d or 2w")
    return float(match[1]) * _UNIT[match[2] or "s"]


def format_duration(seconds: float) -> str:
    """``seconds`` as :func:`parse_duration` reads it, in the largest whole unit of
    d, h, m, s (rounded up to a whole second).

    >>> format_duration(604800), format_duration(5400), format_duration(0.5)
    ('7d', '90m', '1s')
    """
    whole = math.ceil(seconds)
    for unit in ("d", "h", "m"):
        if whole and whole % _UNIT[unit] == 0:
            return f"{whole // _UNIT[unit]}{unit}"
    return f"{whole}s"
