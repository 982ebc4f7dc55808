"""What a member finished, in one INFO line at most every ``progress_seconds``.

A first run must not look idle: the first messages a member finishes are reported at
once, then at most one line per interval, and nothing while there is nothing new::

    processed 3 message(s): inventory.reserve: dead_lettered 1, succeeded 2
    no message finished: 2 retries scheduled (inventory.reserve: 2)
    processed 5210 message(s) in the last 10.0 s: inventory.reserve: replayed 210, succeeded 5000

Each outcome counted is the ``outcome`` label of ``kafka_idem_messages_total``
(``busy`` deferrals are left out: they are not progress); retries scheduled are
counted apart, not as processed (their messages come again). No I/O but the log line.
"""

from __future__ import annotations

import logging
import math
from collections import Counter

log = logging.getLogger(__name__)


COUNTED = ("succeeded", "replayed", "conflict", "dead_lettered", "retried")


class Progress:
    """Counts what finished and says so at most every ``interval`` seconds (0: never)."""

    def __init__(self, interval: float, *, logger: logging.Logger = log) -> None:
        self.interval = interval
        self.log = logger
        self._counts: Counter[tuple[str, str]] = Counter()
        self._last = -math.inf  # when the last line was written

    def add(self, counts: Counter[tuple[str, str]]) -> None:
        """Count ``(topic, outcome) -> n`` (what ``Partitions.apply`` returns)."""
        if self.interval <= 0:
            return
        for (topic, outcome), n in counts.items():
            if outcome in COUNTED and n:
                self._counts[(topic, outcome)] += n

    def tick(self, now: float, *, final: bool = False) -> None:
        """Write the line if there is something new and the interval has passed (or,
        ``final``, the member is stopping)."""
        if not self._counts or (now - self._last < self.interval and not final):
            return
        by_topic: dict[str, list[str]] = {}
        retries: dict[str, int] = {}
        for (topic, outcome), n in sorted(self._counts.items()):
            if outcome == "retried":  # not processed: the message comes again
                retries[topic] = n
            else:
                by_topic.setdefault(topic, []).append(f"{outcome} {n}")
        total = sum(n for (_, outcome), n in self._counts.items() if outcome != "retried")
        detail = "; ".join(f"{topic}: {', '.join(parts)}" for topic, parts in by_topic.items())
        if retries:
            n = sum(retries.values())
            per = ", ".join(f"{topic}: {k}" for topic, k in retries.items())
            detail = "; ".join(filter(None, [
                detail, f"{n} {'retry' if n == 1 else 'retries'} scheduled ({per})"]))
        done = "no message finished" if total == 0 else f"processed {total} message(s)"
        if self._last == -math.inf:  # the first line: at once, as the first outcome came
            self.log.info("%s: %s", done, detail, extra={"action": "progress"})
        else:
            self.log.info("%s in the last %.1f s: %s", done, now - self._last, detail,
                          extra={"action": "progress"})
        self._counts.clear()
        self._last = now
