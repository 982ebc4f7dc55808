"""A configuration error met while processing: the partition is held, loudly.

A :class:`~kafka_idem.errors.ConfigError` raised for a message after start-up (by a
handler, a codec of the app's own, or the framework) is nobody's message's fault and
will not go away by waiting: retrying it quietly would hold the partition forever
with nothing to show for it. So, for each one:

* the message is not charged and not dead-lettered (its attempt, if it was claimed,
  rolls back; a leased claim is kept and re-entered), and its partition waits, retried
  after a pause that grows to a minute (``Reason.CONFIG``); other partitions go on;
* ``kafka_idem_config_errors_total{topic, handler}`` counts it (alert on any increase);
* an ERROR line with the error's whole text, naming the handler, the message's
  position and the setting, at once and then at most once a minute per handler
  (saying how many more there were), so a held partition never floods the log.

Holding rather than stopping the member: the other handlers and partitions of the
member keep working, and a group of members that all hit the same error does not
crash-loop through rebalances. Fix the configuration and restart the member; the
message then runs as if nothing had happened.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from kafka_idem.consume.outcome import Deferred, Message, Reason
from kafka_idem.errors import ConfigError
from kafka_idem.observe.metrics import Metrics

log = logging.getLogger(__name__)


class ConfigHold:
    """Holds partitions on configuration errors; shared by a member's processors."""

    def __init__(self, metrics: Metrics, *, every: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.every = every
        self.clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # handler -> when its last line was written
        self._quiet: dict[str, int] = {}  # handler -> errors not logged since

    def hold(self, handler: Any, msg: Message, exc: ConfigError,
             token: uuid.UUID | None = None) -> Deferred:
        """Count and (rate-limited) log ``exc``; the message's partition waits."""
        self.metrics.config_errors.labels(msg.topic(), handler.name).inc()
        now = self.clock()
        with self._lock:
            last = self._last.get(handler.name)
            if last is not None and now - last < self.every:
                self._quiet[handler.name] = self._quiet.get(handler.name, 0) + 1
                return Deferred(0.0, Reason.CONFIG, token=token)
            self._last[handler.name] = now
            quiet = self._quiet.pop(handler.name, 0)
        more = f" ({quiet} more since the last line)" if quiet else ""
        log.error(
            "handler %r: configuration error at %s[%d]@%d: %s; the partition waits (the "
            "message is not charged) until the configuration is fixed and the member "
            "restarted%s", handler.name, msg.topic(), msg.partition(), msg.offset(),
            str(exc), more,
            extra={"action": "config_error", "handler": handler.name, "topic": msg.topic(),
                   "partition": msg.partition(), "offset": msg.offset()},
        )
        return Deferred(0.0, Reason.CONFIG, token=token)
