"""librdkafka's log lines and error callbacks through Python logging, deduplicated and
rate-limited.

Without a ``logger`` in its configuration librdkafka writes straight to stderr
(``%3|1796152217.290|FAIL|rdkafka#consumer-1| ...``), beside our structured logs and
outside their format and level. With the broker down it repeats the same connection
failure every few tens of milliseconds, from each client, and the error callback says
it once more: hundreds of lines in seconds. Every client kafka_idem builds gets
:data:`KAFKA_LOG` as its ``logger`` (see :mod:`kafka_idem.settings`), and the member's
error callback goes through :func:`error`:

* one logger, ``kafka_idem.observe.kafka_logs``, with ``action=kafka_log`` (librdkafka's lines) or
  ``action=kafka_error`` (error callbacks), in the text or JSON format of the rest;
* a line (INFO and up) is written the first time it is seen; the same line (numbers such as
  ``after 2ms`` ignored) is then counted, not written, for :data:`WINDOW_SECONDS`, and
  once the window is over its next occurrence is written with the count
  (``(and 183 more like it in the 60s before)``);
* librdkafka's transient, self-retried notices (a transaction coordinator still
  loading: ``GETPID ... retrying``) are INFO, so the CLI's tools, which log at WARNING,
  do not print them; connection failures are WARNING: kafka_idem waits and retries,
  nothing is lost.

    >>> KafkaLog(window=60).log(3, "%s [%s] %s", "FAIL", "rdkafka#consumer-1", "oops")
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

WINDOW_SECONDS = 60.0

# librdkafka's syslog levels: 0-3 emergency..error, 4 warning, 5 notice, 6 info, 7 debug.
_LEVELS = {0: logging.ERROR, 1: logging.ERROR, 2: logging.ERROR, 3: logging.WARNING,
           4: logging.WARNING, 5: logging.INFO, 6: logging.INFO, 7: logging.DEBUG}
# Notices about something librdkafka retries by itself and that ends on its own.
_TRANSIENT = re.compile(r"retrying|load in progress|not available|Coordinator", re.IGNORECASE)
_TRANSIENT_FACILITIES = {"GETPID", "TXNAPI", "COORD", "FINDCOORD", "CGRPCOORD", "ADDPARTS"}
_NUMBERS = re.compile(r"\d+(?:\.\d+)?")
_THREAD = re.compile(r"^\[thrd:[^\]]*\]:\s*")


class KafkaLog:
    """What confluent-kafka calls as a ``logger`` (its ``log(level, fmt, *args)``),
    and :meth:`error` for error callbacks. Thread-safe: librdkafka's lines arrive on
    whichever thread polls the client."""

    def __init__(self, *, window: float = WINDOW_SECONDS,
                 clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger = log) -> None:
        self.window = window
        self.clock = clock
        self.logger = logger
        self._seen: dict[str, tuple[float, int]] = {}  # line -> (first written, suppressed)
        self._lock = threading.Lock()

    # --- confluent-kafka's logger interface ---------------------------------------

    def log(self, level: int, msg: str, *args: Any) -> None:
        """Called by confluent-kafka as ``logger.log(syslog_level, "%s [%s] %s",
        facility, client_name, text)``."""
        if len(args) == 3:
            facility, client, text = (str(a) for a in args)
        else:  # not the shape confluent-kafka uses: the whole line as the text
            facility, client, text = "", "", (msg % args if args else msg)
        text = _THREAD.sub("", text)
        py_level = _LEVELS.get(level, logging.WARNING)
        if py_level > logging.INFO and (facility in _TRANSIENT_FACILITIES
                                        or (level >= 4 and _TRANSIENT.search(text))):
            py_level = logging.INFO
        self.write(py_level, f"Kafka: {text}", action="kafka_log",
                   detail=f"{client} {facility}".strip())

    def error(self, err: Any) -> None:
        """An error callback's :class:`confluent_kafka.KafkaError` (fatal ones are ERROR)."""
        fatal = bool(getattr(err, "fatal", lambda: False)())
        text = err.str() if hasattr(err, "str") else str(err)
        name = err.name() if hasattr(err, "name") else ""
        if name == "_ALL_BROKERS_DOWN":
            text += ("; waiting for the broker and retrying (nothing is lost; repeated "
                     f"Kafka lines are counted and written once every {self.window:.0f}s)")
        self.write(logging.ERROR if fatal else logging.WARNING, f"Kafka: {text}",
                   action="kafka_error", detail=name)

    # --- the dedup ---------------------------------------------------------------------

    def write(self, level: int, text: str, *, action: str, detail: str = "") -> None:
        """Write ``text`` unless the same line was written less than ``window`` ago."""
        if not self.logger.isEnabledFor(level):
            return
        extra = {"action": action, **({"kind": detail} if detail else {})}
        if level <= logging.DEBUG:  # asked for (librdkafka's `debug`): every line
            self.logger.log(level, "%s", text, extra=extra)
            return
        same = _NUMBERS.sub("N", text)
        now = self.clock()
        with self._lock:
            first, suppressed = self._seen.get(same, (None, 0))
            if first is not None and now - first < self.window:
                self._seen[same] = (first, suppressed + 1)
                return
            self._seen[same] = (now, 0)
            if len(self._seen) > 1000:  # bounded: forget the oldest lines
                for old in sorted(self._seen, key=lambda k: self._seen[k][0])[:500]:
                    del self._seen[old]
        note = (f" (and {suppressed} more like it in the {now - first:.0f}s before)"
                if suppressed and first is not None else "")
        self.logger.log(level, "%s%s", text, note, extra=extra)


KAFKA_LOG = KafkaLog()
"""The one instance every client of this process logs through (see the module doc)."""


def error(err: Any) -> None:
    """Log an error callback's error through :data:`KAFKA_LOG`."""
    KAFKA_LOG.error(err)


__all__ = ["KAFKA_LOG", "WINDOW_SECONDS", "KafkaLog", "error"]
