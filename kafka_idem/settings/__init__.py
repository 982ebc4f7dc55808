"""Settings: one frozen pydantic model (:class:`~kafka_idem.settings.model.Settings`),
from arguments or ``KAFKA_IDEM_*`` variables.

    >>> s = Settings(group_id="payments", max_attempts=3)
    >>> s.consumer_config()["enable.auto.offset.store"]
    False

librdkafka options pass through untouched in ``kafka`` (for SASL/TLS and
tuning); the options the guarantees depend on are applied *over* them, so a
user cannot switch them off by accident.

Its parts: :mod:`~kafka_idem.settings.model` (the fields and what they derive),
:mod:`~kafka_idem.settings.checks` (one function per rule),
:mod:`~kafka_idem.settings.clients` (the options applied over the user's librdkafka ones)
and :mod:`~kafka_idem.settings.environment` (``KAFKA_IDEM_*`` variables,
:func:`load_settings`).
"""

from kafka_idem.settings.checks import TOPIC_CHARS, check_namespace
from kafka_idem.settings.environment import load_settings, warn_unknown_variables
from kafka_idem.settings.model import DEFAULT_BOOTSTRAP, DEFAULT_DATABASE_URL, Settings

__all__ = ["DEFAULT_BOOTSTRAP", "DEFAULT_DATABASE_URL", "TOPIC_CHARS", "Settings",
           "check_namespace", "load_settings", "warn_unknown_variables"]
