"""``/livez`` and ``/readyz`` of one member, served with ``/metrics`` on the metrics port.

A thread that answers HTTP says nothing about the loop: ``/metrics`` kept answering
while the loop was stuck. So the loop reports to :class:`Health` itself:

* **live** (``/livez``): the loop finished a round (consume, harvest, dispatch,
  commit) less than ``liveness_seconds`` ago (``KAFKA_IDEM_LIVENESS_SECONDS``,
  default 300 s, librdkafka's default ``max.poll.interval.ms``: a loop stuck longer
  has left the group anyway). A restart is the cure for a loop that is not live.
* **ready** (``/readyz``): live, not stopping, the member joined its group (it got
  its first assignment, possibly empty: a spare member is ready), its outbox relay
  (if it runs one) not in a trouble episode (the reason is said), and every assigned
  partition is caught up within ``readiness_max_lag`` messages
  (``KAFKA_IDEM_READINESS_MAX_LAG``, default 1000; measured as for the lag gauge:
  the high watermark minus the first unfinished offset, which for a partition not
  fetched from yet is its committed offset). A partition whose lag is not known
  (the broker did not answer for it) is not caught up. A paused handler
  (``kafka-idem pause``) leaves the member ready, its lag not counted: the answer
  carries a ``note`` naming it and ``paused_handlers`` with their reasons.

Both answer ``200`` or ``503`` with a small JSON body saying why::

    {"status": "not ready", "reason": "2 of 6 partitions more than 1000 messages behind",
     "assigned": 6, "max_lag": 5230, "last_round_seconds_ago": 0.04}
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

TP = tuple[str, int]


@dataclass(frozen=True)
class Probe:
    ok: bool
    body: dict[str, Any]


class Health:
    """What the loop tells about itself, and the two answers. Thread-safe: the loop
    writes, the HTTP threads read."""

    def __init__(self, *, liveness_seconds: float = 300.0, max_lag: int = 1000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.liveness_seconds = liveness_seconds
        self.max_lag = max_lag
        self.clock = clock
        self._lock = threading.Lock()
        self._last_round = clock()  # starting counts as progress
        self._assigned: set[TP] | None = None  # None: not joined yet
        self._lag: dict[TP, int | None] = {}
        self._stopping = False
        self._outbox: str | None = None  # the outbox relay's current trouble
        self._paused: dict[str, str] = {}  # paused handlers and why (kafka-idem pause)
        self._held: frozenset[str] = frozenset()  # their topics: lag not counted

    # --- what the loop reports ---------------------------------------------------------

    def round(self) -> None:
        """A loop round finished."""
        with self._lock:
            self._last_round = self.clock()

    def assigned(self, tps: Iterable[TP]) -> None:
        with self._lock:
            self._assigned = (self._assigned or set()) | set(tps)

    def revoked(self, tps: Iterable[TP]) -> None:
        with self._lock:
            gone = set(tps)
            self._assigned = (self._assigned or set()) - gone
            for tp in gone:
                self._lag.pop(tp, None)

    def observed(self, lags: dict[TP, int | None]) -> None:
        """Each assigned partition's lag (``None``: not known yet)."""
        with self._lock:
            self._lag.update(lags)

    def outbox(self, problem: str | None) -> None:
        """The outbox relay's current trouble (``None``: none): /readyz says it."""
        with self._lock:
            self._outbox = problem

    def paused(self, reasons: dict[str, str], topics: Iterable[str] = ()) -> None:
        """The handlers paused now, with their reasons, and their topics."""
        with self._lock:
            self._paused = dict(sorted(reasons.items()))
            self._held = frozenset(topics)

    def stopping(self) -> None:
        # No lock: called from a signal handler, which runs on the loop's thread and
        # could interrupt it while it holds the lock (a bool assignment is atomic).
        self._stopping = True

    def assignment(self) -> list[TP]:
        with self._lock:
            return sorted(self._assigned or ())

    # --- the answers ---------------------------------------------------------------------

    def live(self) -> Probe:
        with self._lock:
            ago = self.clock() - self._last_round
        body: dict[str, Any] = {"last_round_seconds_ago": round(ago, 3),
                                "liveness_seconds": self.liveness_seconds}
        if ago > self.liveness_seconds:
            return Probe(False, {"status": "not live", "reason": f"the loop made no progress "
                                 f"for {ago:.0f}s (bound {self.liveness_seconds:.0f}s)", **body})
        return Probe(True, {"status": "live", **body})

    def ready(self) -> Probe:
        live = self.live()
        with self._lock:
            assigned = None if self._assigned is None else sorted(self._assigned)
            lags = {tp: self._lag.get(tp) for tp in assigned or () if tp[0] not in self._held}
            stopping = self._stopping
            outbox = self._outbox
            paused = dict(self._paused)
        known = [n for n in lags.values() if n is not None]
        body: dict[str, Any] = {
            "assigned": None if assigned is None else len(assigned),
            "max_lag": max(known, default=None),
            "readiness_max_lag": self.max_lag,
            "last_round_seconds_ago": live.body["last_round_seconds_ago"],
        }
        if paused:
            body["note"] = f"paused: handler{'s' if len(paused) > 1 else ''} " + ", ".join(
                paused)
            body["paused_handlers"] = paused
        reason = None
        if not live.ok:
            reason = live.body["reason"]
        elif stopping:
            reason = "stopping"
        elif assigned is None:
            reason = "not joined to the group yet (no assignment)"
        elif outbox is not None:
            reason = f"outbox relay: {outbox}"
        else:
            unknown = [tp for tp, n in lags.items() if n is None]
            behind = [tp for tp, n in lags.items() if n is not None and n > self.max_lag]
            if behind:
                reason = (f"{len(behind)} of {len(lags)} partitions more than {self.max_lag} "
                          f"messages behind")
            elif unknown:
                reason = f"{len(unknown)} of {len(lags)} partitions not measured yet"
        if reason is not None:
            return Probe(False, {"status": "not ready", "reason": reason, **body})
        return Probe(True, {"status": "ready", **body})


def serve(registry: CollectorRegistry, health: Health | None, port: int,
          addr: str = "127.0.0.1") -> ThreadingHTTPServer:
    """``/metrics`` (Prometheus text) and, with ``health``, ``/livez`` and ``/readyz``,
    on daemon threads. Raise :class:`OSError` when the port cannot be bound."""
    probes: dict[str, Callable[[], Probe]] = (
        {"/livez": health.live, "/readyz": health.ready} if health is not None else {})

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                self._send(200, content_type, encoder(registry))
            elif path in probes:
                probe = probes[path]()
                self._send(200 if probe.ok else 503, "application/json",
                           json.dumps(probe.body).encode() + b"\n")
            else:
                self._send(404, "text/plain; charset=utf-8",
                           b"not found: /metrics, /livez and /readyz are served here\n")

        def _send(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a scrape every few seconds is not news

    server = ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="kafka-idem-http", daemon=True).start()
    return server


__all__ = ["Health", "Probe", "serve"]
