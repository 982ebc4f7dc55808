"""The librdkafka options the settings put in every client: the options the guarantees
depend on, applied over the user's ``kafka`` options, and the warnings about the user's
options a client ignores."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

# Consumer options the exactly-once-effects protocol depends on: auto-commit or
# auto-stored offsets would commit a message before its effect is durable.
_PROTECTED_CONSUMER = {
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "enable.partition.eof": False,
}
# The DLQ producer must not lose or duplicate a record on its own retries.
_PROTECTED_PRODUCER = {
    "enable.idempotence": True,
    "acks": "all",
}
# librdkafka options in ``kafka`` that other settings decide: why each one is ignored.
_FROM_SETTINGS = {
    "bootstrap.servers": "set bootstrap_servers (KAFKA_IDEM_BOOTSTRAP_SERVERS)",
    "group.id": "set group_id (KAFKA_IDEM_GROUP_ID, or run --group-id)",
    "group.instance.id": "set group_instance_id (KAFKA_IDEM_GROUP_INSTANCE_ID, or run "
    "--instance-id)",
    "session.timeout.ms": "set session_timeout_ms (KAFKA_IDEM_SESSION_TIMEOUT_MS)",
    "max.poll.interval.ms": "set max_poll_interval_ms (KAFKA_IDEM_MAX_POLL_INTERVAL_MS)",
}
_WARNED: set[str] = set()  # the ignored options already said (once per process)


_CONSUMER_ONLY = (
    "auto.offset.reset",
    "auto.commit.",
    "enable.auto.",
    "enable.partition.eof",
    "partition.assignment.strategy",
    "fetch.",
    "group.",
    "heartbeat.interval.ms",
    "session.timeout.ms",
    "max.poll.interval.ms",
    "isolation.level",
    "queued.",
    "check.crcs",
)


def consumer_only(key: str) -> bool:
    return key.startswith(_CONSUMER_ONLY)


def say_ignored(options: dict[str, Any], protected: dict[str, Any], *,
                 consumer: bool) -> None:
    """Warn once per option when ``kafka`` sets one this client ignores: a protected
    option set otherwise (the guarantees depend on it) or one another setting decides."""
    for key, value in options.items():
        if key in _WARNED:
            continue
        if key in protected and str(value).lower() != str(protected[key]).lower():
            why = f"kafka_idem always uses {key}={str(protected[key]).lower()} (the " \
                  "exactly-once effects depend on it)"
        elif key in _FROM_SETTINGS and (consumer or key == "bootstrap.servers"):
            why = _FROM_SETTINGS[key]
        else:
            continue
        _WARNED.add(key)
        log.warning("librdkafka option %s in kafka (KAFKA_IDEM_KAFKA) is ignored: %s", key, why,
                    extra={"action": "config_ignored", "kind": key})
