"""Structured logs: a stable ``action`` field plus topic/partition/offset/key.

Never payloads or secrets. ``log_format="json"`` writes one JSON object a line.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

FIELDS = ("action", "topic", "partition", "offset", "key", "handler", "attempts", "kind", "delay")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
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


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extra = " ".join(f"{n}={getattr(record, n)}" for n in FIELDS if hasattr(record, n))
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
