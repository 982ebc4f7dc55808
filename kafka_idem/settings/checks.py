"""The settings' checks: one function per rule, each raising ``ValueError`` with the text
the settings' error shows (pydantic names the setting and its variable around it), and
the check of librdkafka options against librdkafka itself."""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from typing import Any

from pydantic import SecretStr

from kafka_idem.deadletters.signing import MIN_KEY_BYTES
from kafka_idem.observe.redact import redact, secrets_in
from kafka_idem.settings.durations import parse_duration

TOPIC_CHARS = re.compile(r"[a-zA-Z0-9._-]+")  # what Kafka allows in a topic name
# Names are matched whole (fullmatch): "$" would also accept a trailing newline.
_IDENT = re.compile(r"[a-z_][a-z0-9_]{0,39}")

NAMESPACE_MAX = 200  # UTF-8 bytes: with a key of key_max_bytes (<= 2000) the primary
# key's index entry stays under PostgreSQL's limit (about 2700 bytes)


def check_namespace(value: str) -> str:
    """A namespace is non-empty printable text without surrounding spaces, at most
    NAMESPACE_MAX UTF-8 bytes ('' is reserved for records written before namespaces)."""
    if (not value.strip() or value != value.strip() or not value.isprintable()
            or len(value.encode("utf-8", "surrogatepass")) > NAMESPACE_MAX):
        raise ValueError(
            f"{value!r} is not a usable namespace: it must be non-empty, at most "
            f"{NAMESPACE_MAX} bytes (UTF-8), without leading or trailing spaces, newlines or "
            "other control characters"
        )
    return value


def check_identifier(value: str) -> str:
    if not _IDENT.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a plain SQL identifier: use lower-case letters, digits and "
            "underscores, starting with a letter or underscore, at most 40 characters"
        )
    return value


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def check_log_levels(value: str) -> str:
    """``logger=LEVEL`` pairs, comma-separated (``httpx=INFO,myapp.db=DEBUG``), the
    levels in capitals; a pair that is not one is refused, naming it."""
    pairs = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, eq, level = (x.strip() for x in item.partition("="))
        if not eq or not name or any(c.isspace() for c in name):
            raise ValueError(f"{item!r} is not LOGGER=LEVEL (e.g. httpx=INFO,myapp.db=DEBUG)")
        if level.upper() not in LOG_LEVELS:
            raise ValueError(f"{item!r}: the level must be one of {', '.join(LOG_LEVELS)}")
        pairs.append(f"{name}={level.upper()}")
    return ",".join(pairs)


def check_group_id(value: str | None) -> str | None:
    if value is not None and (not value.strip() or value != value.strip()
                              or not value.isprintable()):
        raise ValueError(
            f"{value!r} is not a usable consumer group id: it must be non-empty, without "
            "leading or trailing spaces, newlines or other control characters"
        )
    return value


def check_group_instance_id(value: str | None) -> str | None:
    if value is None:
        return None
    if "{hostname}" in value:
        value = value.replace("{hostname}", socket.gethostname())
    # Kafka's own rule for group.instance.id (the broker refuses anything else).
    if len(value) > 249 or not TOPIC_CHARS.fullmatch(value) or value in (".", ".."):
        raise ValueError(
            f"{value!r} is not a usable group.instance.id: 1-249 ASCII letters, digits, "
            "'.', '_' and '-' ({hostname} is replaced by the host name)"
        )
    return value


def check_conninfo(value: SecretStr) -> SecretStr:
    from psycopg.conninfo import conninfo_to_dict

    dsn = value.get_secret_value()
    try:
        conninfo_to_dict(dsn)
    except Exception as exc:  # psycopg.ProgrammingError: its text may echo the password
        # libpq quotes the string it could not parse, password and all: mask the
        # whole string and every secret (and piece of one) found in it.
        problem = redact(" ".join(str(exc).split()), [dsn, *secrets_in(dsn)])
        raise ValueError(
            f"not a PostgreSQL URL (postgresql://user@host:port/dbname) or conninfo "
            f"string: {problem}"
        ) from None
    return value


def check_signing_keys(value: Any) -> Any:
    if isinstance(value, list | tuple):  # App(dlq_signing_keys=[...]) from code
        value = ",".join(v.get_secret_value() if isinstance(v, SecretStr) else str(v)
                         for v in value)
    raw = value.get_secret_value() if isinstance(value, SecretStr) else value
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    if not isinstance(raw, str):
        raise ValueError("a comma-separated list of keys")
    for i, key in enumerate(raw.split(",")):
        size = len(key.strip().encode("utf-8"))
        if size < MIN_KEY_BYTES:  # the key itself is never echoed
            raise ValueError(
                f"key {i + 1} of the list is {size} bytes; each key needs at least "
                f"{MIN_KEY_BYTES} (e.g. `openssl rand -hex 32`)")
    return raw


def check_topic_affix(value: str) -> str:
    if value and not TOPIC_CHARS.fullmatch(value):
        raise ValueError(
            f"{value!r} would make invalid topic names: Kafka topic names use only "
            "ASCII letters, digits, '.', '_' and '-'"
        )
    return value


def check_ip_address(value: str) -> str:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(
            f"{value!r} is not an IP address: use 127.0.0.1 (this host) or 0.0.0.0 (all)"
        ) from None
    return value


def check_linger(value: float, max_wait: float | None) -> float:
    if max_wait is not None and value > max_wait:
        raise ValueError(
            f"{value} is longer than batch_max_wait_seconds ({max_wait}), which bounds "
            "every loop round (how soon a stop or a backoff's end is seen): "
            "raise KAFKA_IDEM_BATCH_MAX_WAIT_SECONDS too, or linger less"
        )
    return value


def check_backoff(value: float, base: float | None) -> float:
    # A field validator (not a model one) so the error names this setting and its variable.
    if base is not None and value < base:
        raise ValueError("backoff_cap_seconds must be >= backoff_base_seconds")
    return value


def check_librdkafka_options(options: dict[str, Any]) -> None:
    """Refuse an option librdkafka does not know or a value it does not accept, when
    the settings are made (a configuration error naming the option), not when the
    first client is created. A client made here, without brokers, only checks them."""
    if not options:
        return
    problem = _librdkafka_refuses(options)
    if problem is None:
        return
    # the option at fault (librdkafka may name its alias: linger.ms is queue.buffering.max.ms)
    culprit = next((k for k in options if _librdkafka_refuses({k: options[k]})), None)
    where = f"option {culprit!r}: " if culprit else ""
    raise ValueError(f"librdkafka refuses {where}{problem}")


def _librdkafka_refuses(options: dict[str, Any]) -> str | None:
    from confluent_kafka import KafkaException, Producer

    try:
        Producer({**options, "logger": _SILENT})  # consumer options are only warned about
    except KafkaException as exc:
        text = str(exc.args[0].str())
        # "Failed to create ...": the options are known and valid, but this client made
        # without brokers lacks what they need together (e.g. a SASL mechanism): the real
        # client says so when it is made.
        return None if text.startswith("Failed to create") else text
    except (TypeError, ValueError) as exc:  # a value of the wrong Python type
        return str(exc)
    return None


_SILENT = logging.getLogger("kafka_idem.settings.check")
_SILENT.addHandler(logging.NullHandler())
_SILENT.propagate = False


def check_duration(value: str | None) -> str | None:
    """A duration like ``30d`` (:func:`~kafka_idem.settings.durations.parse_duration`),
    kept as typed, so messages about it say what the operator wrote."""
    if value is None:
        return None
    seconds = parse_duration(value)  # its ValueError names the forms it reads
    if seconds <= 0:
        raise ValueError(f"{value!r} is not a positive duration")
    return value.strip()


def check_console_token(value: SecretStr | None) -> SecretStr | None:
    if value is not None and len(value.get_secret_value().strip()) < 16:
        raise ValueError("must be at least 16 characters (e.g. python -c 'import "
                         "secrets; print(secrets.token_urlsafe(24))')")
    return value
