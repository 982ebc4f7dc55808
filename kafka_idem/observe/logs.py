"""Structured logs: a stable ``action`` field plus topic/partition/offset/key (and, for
a dead letter, the error's kind, class and bounded message).

Never payloads or secrets. ``log_format="json"`` writes one JSON object a line.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import sys
from typing import Any

FIELDS = ("action", "topic", "partition", "offset", "key", "handler", "attempts", "kind", "delay",
          "error_class", "error_message")
# Fields the text format leaves out: the line's own text already says them (a dead
# letter's "dead-lettering (KIND): CLASS: MESSAGE"), and the message is the longest.
IN_TEXT = ("error_message",)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            # ISO 8601 in UTC with milliseconds: ordered and comparable across hosts
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            if hasattr(record, name):
                data[name] = getattr(record, name)
        if record.exc_info and record.exc_info[0] is not None:
            data["error"] = f"{record.exc_info[0].__name__}: {record.exc_info[1]}"
        return json.dumps(data, default=str)


# Control characters (and Unicode line separators) in a message or a field would
# let data (an error text, a key from a key function) forge log lines.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(text: str) -> str:
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


class TextFormatter(logging.Formatter):
    """One line per record (a traceback, with ``exc_info``, follows on its own lines)."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if _CONTROL.search(message):
            record = logging.makeLogRecord({**record.__dict__, "msg": _escape(message),
                                            "args": None})
        base = super().format(record)
        extra = " ".join(
            f"{n}={_escape(str(getattr(record, n)))}" for n in FIELDS
            if getattr(record, n, None) is not None and n not in IN_TEXT  # no key=None
        )
        return f"{base} {extra}" if extra else base


def configure(fmt: str = "text", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
