"""Structured logs: a stable ``action`` field plus topic/partition/offset/key (and, for
a dead letter, the error's kind, class and bounded message).

Never payloads or secrets. ``log_format="json"`` writes one JSON object a line.

Other libraries are quiet (:class:`Libraries`): a record below WARNING from a logger of
an installed package or of the standard library is dropped, unless the ``log_levels``
setting names that logger (or a parent); kafka_idem's, the app's and any logger that
is no installed module's show ``log_level`` and above.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import logging
import re
import sys
import sysconfig
from collections.abc import Iterable, Mapping
from pathlib import Path
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


_INSTALLED = ("site-packages", "dist-packages")


class Libraries(logging.Filter):
    """The filter of the process's log handler: drops the records below WARNING of
    other libraries' loggers. A library's logger is one whose top-level name is a
    module installed as a package (under ``site-packages`` or ``dist-packages``) or
    of the standard library, and not one of :attr:`own` (kafka_idem, ``__main__``,
    the app's modules: :meth:`own_modules`). A logger named in :attr:`levels` (or
    under one) is left to its level, set by :func:`set_levels`."""

    def __init__(self) -> None:
        super().__init__()
        self.own: set[str] = {"kafka_idem", "__main__"}
        self.levels: dict[str, str] = {}
        self._library: dict[str, bool] = {}

    def own_modules(self, names: Iterable[str]) -> None:
        """Count the packages of the modules ``names`` as the app's own (an app may be
        installed in site-packages too: its loggers still show INFO)."""
        self.own.update(n.partition(".")[0] for n in names if n)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        name = record.name
        if any(name == n or name.startswith(n + ".") for n in self.levels):
            return True  # the logger's own level (log_levels) decided
        top = name.partition(".")[0]
        return top in self.own or not self.library(top)

    def library(self, top: str) -> bool:
        """``top`` is a module of the standard library or of an installed package."""
        known = self._library.get(top)
        if known is None:
            known = self._library[top] = _installed(top)
        return known


def _installed(top: str) -> bool:
    if top in sys.stdlib_module_names:
        return True
    where = _origin(top)
    if not where:
        return False  # no module of that name: a logger of the app's naming
    path = Path(where).resolve()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    return any(part in _INSTALLED for part in path.parts) or stdlib in path.parents


def _origin(top: str) -> str | None:
    """Where the module ``top`` is (imported, or found without importing it)."""
    module = sys.modules.get(top)
    if module is not None:
        found = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", ())),
                                                          None)
        return str(found) if found else None
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    return spec.origin or next(iter(spec.submodule_search_locations or ()), None)


LIBRARIES = Libraries()


def set_levels(levels: Mapping[str, str]) -> None:
    """The ``log_levels`` setting: each named logger at its level (its records below
    WARNING let through :class:`Libraries` too)."""
    for name in set(LIBRARIES.levels) - set(levels):
        logging.getLogger(name).setLevel(logging.NOTSET)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    LIBRARIES.levels = dict(levels)


def configure(fmt: str = "text", level: str = "INFO",
              levels: Mapping[str, str] | None = None) -> None:
    """Log to stderr in ``fmt`` at ``level``, other libraries at WARNING unless
    ``levels`` (the ``log_levels`` setting) says otherwise (:class:`Libraries`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(LIBRARIES)
    set_levels(levels or {})
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
