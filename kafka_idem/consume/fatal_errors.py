"""Client errors that end a member, and the error it ends with: a fenced static member
or a session timeout the broker refuses is the settings' fault (exit 2), any other fatal
error the broker's (:func:`fatal_error`)."""

from __future__ import annotations

from confluent_kafka import KafkaError
from confluent_kafka.admin import AdminClient

from kafka_idem.admin import topics
from kafka_idem.errors import BrokerError, ConfigError, FrameworkError
from kafka_idem.settings import Settings

_SESSION_BOUNDS = ("group.min.session.timeout.ms", "group.max.session.timeout.ms")


def ends_member(err: KafkaError) -> bool:
    """A client error no retry can heal: fatal ones, a fenced static member, and a
    session timeout the broker refuses (a join that fails the same way forever)."""
    return err.fatal() or err.code() in (
        KafkaError._FATAL, KafkaError.FENCED_INSTANCE_ID, KafkaError.INVALID_SESSION_TIMEOUT)





def fatal_error(err: KafkaError, settings: Settings, group_id: str) -> FrameworkError:
    """The exception a fatal client error ends the member with. librdkafka reports a
    static member replaced by another with the same group.instance.id as a ``_FATAL``
    error (confluent-kafka does not expose the original FENCED_INSTANCE_ID code), so
    its text is the one place that says so: then it is the setting's fault (exit 2)."""
    if err.code() == KafkaError.INVALID_SESSION_TIMEOUT:
        return session_timeout_refused(settings, group_id)
    fenced = err.code() == KafkaError.FENCED_INSTANCE_ID or "fenced" in err.str().lower()
    if fenced and settings.group_instance_id is not None:
        return ConfigError(
            f"another member of group {group_id!r} joined with this member's "
            f"group.instance.id {settings.group_instance_id!r} and replaced it: every "
            "member needs its own (KAFKA_IDEM_GROUP_INSTANCE_ID, or run --instance-id)",
            setting="group_instance_id")
    return BrokerError(f"fatal Kafka error: {err.str()}")

def session_timeout_refused(settings: Settings, group_id: str) -> ConfigError:
    """The broker refused to let the member join with its ``session.timeout.ms``
    (librdkafka would retry the join forever): say the setting and the broker's
    bounds, read from its configuration when it answers."""
    admin = AdminClient(settings.admin_config())
    bounds = topics.broker_configs(admin, _SESSION_BOUNDS, timeout=5.0)
    low, high = (bounds.get(name, "?") for name in _SESSION_BOUNDS)
    return ConfigError(
        f"the broker refused session_timeout_ms={settings.session_timeout_ms} "
        f"(KAFKA_IDEM_SESSION_TIMEOUT_MS) when this member joined group "
        f"{group_id!r} (INVALID_SESSION_TIMEOUT): it must be within the broker's "
        f"group.min.session.timeout.ms={low} and group.max.session.timeout.ms={high}",
        setting="session_timeout_ms")
