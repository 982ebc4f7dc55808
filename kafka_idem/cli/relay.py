"""``kafka-idem relay MODULE:APP``: the outbox relay alone, in the foreground."""

from __future__ import annotations

import threading

from kafka_idem.admin.migrate import require_current
from kafka_idem.app import App
from kafka_idem.cli.errors import ServiceError
from kafka_idem.consume.shutdown import GRACE, Shutdown
from kafka_idem.consume.startup import MIGRATE_COMMAND
from kafka_idem.errors import ConfigError
from kafka_idem.observe.health import Health
from kafka_idem.observe.metrics import Metrics
from kafka_idem.outbox import Relay
from kafka_idem.settings import Settings
from kafka_idem.store import connect


def run_relay(app: App, settings: Settings, *, max_seconds: float | None = None,
              migrate_command: str = MIGRATE_COMMAND) -> int:
    """Run ``app``'s relay until SIGTERM/SIGINT (or ``max_seconds``); the exit code.
    A store not migrated is refused, naming ``migrate_command``."""
    if not app.event_topics:
        raise ConfigError(f"app {app.name!r} declares no event topics (app.event_topic): it "
                          "has no outbox to relay", setting="event_topic")
    conn = connect(settings.dsn, application_name="kafka_idem-relay")
    try:
        require_current(conn, settings.schema_name, command=migrate_command)
    finally:
        conn.close()
    metrics = Metrics()
    health = Health(liveness_seconds=settings.liveness_seconds)
    health.assigned([])  # a relay has no source partitions: ready unless the outbox says
    metrics.health = health
    if settings.metrics_port is not None:
        try:
            metrics.serve(settings.metrics_port, addr=settings.metrics_addr)
        except OSError as exc:
            raise ServiceError(f"cannot serve /metrics on {settings.metrics_addr}:"
                               f"{settings.metrics_port}: {exc.strerror or exc}") from exc
    stop = threading.Event()

    def on_stop() -> None:
        health.stopping()
        stop.set()

    # The relay finishes its rounds and leaves; a stop still running drain_seconds + 2 s
    # later, or a second signal, ends the process at once (its rounds are fenced).
    Shutdown(on_stop=on_stop, bound=settings.drain_seconds + GRACE).install()
    if max_seconds:
        timer = threading.Timer(max_seconds, stop.set)
        timer.daemon = True
        timer.start()
    Relay(app, settings, metrics=metrics, health=health, live=True).run(stop)
    return 0
