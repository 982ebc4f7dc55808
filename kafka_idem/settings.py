"""Settings: one frozen pydantic model, from arguments or ``KAFKA_IDEM_*`` variables.

    >>> s = Settings(group_id="payments", max_attempts=3)
    >>> s.consumer_config()["enable.auto.offset.store"]
    False

librdkafka options pass through untouched in ``kafka`` (for SASL/TLS and
tuning); the options the guarantees depend on are applied *over* them, so a
user cannot switch them off by accident.
"""

from __future__ import annotations

import difflib
import ipaddress
import logging
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from kafka_idem.errors import ConfigError
from kafka_idem.kafka_logs import KAFKA_LOG
from kafka_idem.redact import option_secrets, redact, redact_options, secrets_in
from kafka_idem.signing import MIN_KEY_BYTES

log = logging.getLogger(__name__)

DEFAULT_BOOTSTRAP = "127.0.0.1:39092"
DEFAULT_DATABASE_URL = "postgresql://kafka_idem@127.0.0.1:55432/kafka_idem"

TOPIC_CHARS = re.compile(r"[a-zA-Z0-9._-]+")  # what Kafka allows in a topic name
# Names are matched whole (fullmatch): "$" would also accept a trailing newline.
_IDENT = re.compile(r"[a-z_][a-z0-9_]{0,39}")

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


class Settings(BaseSettings):
    """Configuration of one kafka_idem process. Environment prefix ``KAFKA_IDEM_``."""

    model_config = SettingsConfigDict(
        env_prefix="KAFKA_IDEM_", frozen=True, extra="forbid", populate_by_name=True,
        hide_input_in_errors=True,  # a rejected database_url would be echoed, password and all
    )

    bootstrap_servers: str = Field(DEFAULT_BOOTSTRAP, description="Kafka bootstrap servers.")
    database_url: SecretStr = Field(
        SecretStr(DEFAULT_DATABASE_URL), description="PostgreSQL connection URL (secret)."
    )
    group_id: str | None = Field(None, description="Consumer group id (defaults to the app name).")
    group_instance_id: str | None = Field(
        None,
        description="Static group membership: this member's librdkafka group.instance.id, "
        "stable across its restarts ({hostname} is replaced by the host name). A member "
        "restarted within session_timeout_ms gets its partitions back without a rebalance.",
    )
    namespace: str | None = Field(
        None,
        description="Scope of the app's idempotency keys in the store (defaults to the app "
        "name); apps given the same namespace share their records on purpose.",
    )
    schema_name: str = Field("kafka_idem", description="PostgreSQL schema of the store tables.")
    table: str = Field("task_idempotency", description="Name of the idempotency table.")
    lease_seconds: float = Field(30.0, gt=0, description="Lease of a claimed key (leased mode).")
    max_attempts: int = Field(5, ge=1, description="Attempts before a key is exhausted.")
    max_elapsed_seconds: float = Field(
        3600.0, gt=0, description="Time since the first failure after which a key is exhausted."
    )
    backoff_base_seconds: float = Field(0.5, ge=0, description="Retry backoff base.")
    backoff_cap_seconds: float = Field(60.0, ge=0, description="Retry backoff cap.")
    busy_retry_seconds: float = Field(
        0.5, gt=0, description="Wait before retrying a key another member holds."
    )
    batch_size: int = Field(500, ge=1, le=100_000, description="Messages per consume batch.")
    batch_max_wait_seconds: float = Field(
        0.1, ge=0,
        description="Longest wait of an idle loop round for the first message of a batch "
        "(a batch then takes what has arrived, up to batch_size, without waiting to fill).",
    )
    batch_linger_seconds: float = Field(
        0.0, ge=0, le=60,
        description="After a batch's first message, how long it may wait to fill up to "
        "batch_size (0: it starts at once with what has arrived).",
    )
    leased_workers: int = Field(
        4, ge=1, le=64,
        description="Partitions processed at once in leased mode (one database connection each).",
    )
    max_concurrency: int = Field(
        64, ge=1, le=1024,
        description="Handler calls at once in this member over all key-ordered handlers "
        "(concurrency > 1 or async def). A sync handler's message holds a thread and a "
        "database connection from its claim to its completion; async def handlers claim up "
        "to as many more messages ahead, waiting for a call, and open at most "
        "max_concurrency + a quarter (at least 2) connections.",
    )
    drain_seconds: float = Field(
        10.0, ge=0,
        description="On a revoke or a stop, how long key-ordered work in flight may take to "
        "finish; what is still running then is abandoned (its lease and fencing keep it "
        "exactly-once: its offset is not committed, the next owner takes the key over).",
    )
    event_loop_thread: bool = Field(
        False, description="Run async def handlers' event loop on a thread of its own instead "
        "of the consumer's loop thread (which runs it whenever it waits): their tasks then go "
        "on while the loop thread is busy elsewhere (an inline local-mode batch of another "
        "topic, a dead letter's acknowledgement), at the cost of two threads contending for "
        "the GIL (fewer messages/s).",
    )
    gc_tuning: bool = Field(
        True, description="At start, freeze the objects the member has made so far out of "
        "the garbage collector and collect the youngest generation every 10,000 allocations "
        "instead of 700: the loop thread, which runs every message's bookkeeping (and async "
        "def handlers' tasks), spends about half as long in collections. The interpreter is "
        "the process's: false leaves its settings alone (an app embedding the Runner).",
    )
    local_workers: int = Field(
        0, ge=0, le=16,
        description="Local-mode batches in flight at once on worker threads, over disjoint "
        "partitions (one database connection each); 0 runs one batch at a time in the loop.",
    )
    batch_path: bool = Field(
        True, description="Run local-mode batches on the optimistic batch path (see batch.py)."
    )
    dlq_suffix: str = Field(".dlq", min_length=1, description="Default DLQ topic suffix.")
    dlq_signing_keys: SecretStr | None = Field(
        None,
        description="Keys that sign dead letters (secret): a comma-separated list, each at "
        f"least {MIN_KEY_BYTES} bytes. The first signs every dead letter (header "
        "idem.signature, HMAC-SHA256); all of them verify, so a key is rotated by putting the "
        "new one first. With keys, dlq replay acts only on records whose signature holds "
        "(--trust-unsigned admits unsigned ones written before).",
    )
    name_prefix: str = Field(
        "", description="Put before every topic, consumer group and transactional id that "
        "kafka-idem's own tools create (verify, dlq replay, the DLQ readers), for clusters "
        "whose ACLs grant names by prefix.",
    )
    outbox_shards: int = Field(
        4, ge=1, le=256,
        description="Outbox shards: events are split by key over this many, each published "
        "by one relay at a time (a partition of the outbox control topic). Change it only "
        "with an empty outbox.",
    )
    outbox_batch: int = Field(
        1000, ge=1, le=100_000, description="Most outbox rows published in one Kafka "
        "transaction of the relay.",
    )
    outbox_relay: bool = Field(
        True, description="kafka-idem run runs the outbox relay of an app with event topics "
        "(false: run it apart, `kafka-idem relay`).",
    )
    outbox_poll_seconds: float = Field(
        0.5, gt=0, le=60, description="The relay looks for unpublished rows at least this "
        "often (it is woken at once by the emitting transactions' notifications).",
    )
    error_message_max: int = Field(
        1024, ge=64, le=65536, description="Bound on error text stored and put in DLQ headers."
    )
    key_max_bytes: int = Field(
        1024, ge=16, le=2000,
        description="Longest idempotency key (UTF-8 bytes); a longer key dead-letters its "
        "message as InvalidKey, never truncated (PostgreSQL cannot index much more).",
    )
    schemas_dir: Path = Field(Path("schemas"), description="Folder of Avro schemas (.avsc).")
    schema_registry_url: str | None = Field(
        None, description="Confluent Schema Registry URL; enables Confluent wire framing."
    )
    schema_registry: dict[str, Any] = Field(
        default_factory=dict,
        description="SchemaRegistryClient options passed through (JSON in env): "
        "basic.auth.user.info, bearer.auth.*, ssl.*, timeout, max.retries, cache.capacity...",
    )
    default_format: Literal["json", "avro", "registry"] = Field(
        "json",
        description="Payload format of a handler given neither format= nor schema= "
        "(one with schema= and no format= is Avro single-object, as before formats).",
    )
    payload_max_bytes: int = Field(
        10_485_760, ge=1,
        description="Largest message value decoded; a larger one is dead-lettered as "
        "PayloadTooLarge without being parsed.",
    )
    kafka: dict[str, Any] = Field(
        default_factory=dict, description="librdkafka options passed through (JSON in env)."
    )
    max_poll_interval_ms: int = Field(300_000, ge=1000, description="librdkafka option.")
    session_timeout_ms: int = Field(
        10_000, ge=1000,
        description="librdkafka session.timeout.ms: how long the group waits for a member "
        "that stopped heartbeating (e.g. SIGKILLed) before its partitions move.",
    )
    lock_timeout_seconds: float = Field(
        5.0, ge=0,
        description="Longest wait of a member's statement for a row lock (PostgreSQL "
        "lock_timeout) before it gives up, rolls back and tries again later (never charged "
        "to the message): a member waiting on another's rows keeps polling its partitions. "
        "At most a fifth of max_poll_interval_ms is used; 0 disables.",
    )
    idle_in_transaction_timeout_seconds: float = Field(
        300.0,
        ge=0,
        description="PostgreSQL ends a framework session idle in a transaction this long "
        "(a stalled zombie's locks are released); 0 disables.",
    )
    long_running_seconds: float = Field(
        300.0, gt=0, description="A record unfinished for this long counts as long-running."
    )
    metrics_sample_seconds: float = Field(
        15.0, gt=0, description="Interval of the database gauges' sampling."
    )
    metrics_addr: str = Field(
        "127.0.0.1", description="Address /metrics binds (0.0.0.0 in a container)."
    )
    metrics_port: int | None = Field(None, ge=0, le=65535, description="/metrics port.")
    liveness_seconds: float = Field(
        300.0, gt=0, description="/livez fails when the loop made no progress this long."
    )
    readiness_max_lag: int = Field(
        1000, ge=0, description="/readyz: most messages an assigned partition may be behind."
    )
    progress_seconds: float = Field(
        10.0, ge=0,
        description="A member logs what it finished (per topic and outcome) at INFO at most "
        "this often, and never while idle; 0 switches the line off.",
    )
    log_format: Literal["text", "json"] = Field("text", description="Log output format.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO")

    @field_validator("schema_name", "table")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not _IDENT.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a plain SQL identifier: use lower-case letters, digits and "
                "underscores, starting with a letter or underscore, at most 40 characters"
            )
        return value

    @field_validator("batch_linger_seconds")
    @classmethod
    def _linger(cls, value: float, info: ValidationInfo) -> float:
        max_wait = info.data.get("batch_max_wait_seconds")
        if max_wait is not None and value > max_wait:
            raise ValueError(
                f"{value} is longer than batch_max_wait_seconds ({max_wait}), which bounds "
                "every loop round (how soon a stop or a backoff's end is seen): "
                "raise KAFKA_IDEM_BATCH_MAX_WAIT_SECONDS too, or linger less"
            )
        return value

    @field_validator("group_id")
    @classmethod
    def _group_id(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or value != value.strip()
                                  or not value.isprintable()):
            raise ValueError(
                f"{value!r} is not a usable consumer group id: it must be non-empty, without "
                "leading or trailing spaces, newlines or other control characters"
            )
        return value

    @field_validator("group_instance_id")
    @classmethod
    def _group_instance_id(cls, value: str | None) -> str | None:
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

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str | None) -> str | None:
        if value is not None:
            check_namespace(value)
        return value

    @field_validator("database_url")
    @classmethod
    def _conninfo(cls, value: SecretStr) -> SecretStr:
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

    @field_validator("dlq_signing_keys", mode="before")
    @classmethod
    def _signing_keys(cls, value: Any) -> Any:
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

    @field_validator("dlq_suffix", "name_prefix")
    @classmethod
    def _topic_suffix(cls, value: str) -> str:
        if value and not TOPIC_CHARS.fullmatch(value):
            raise ValueError(
                f"{value!r} would make invalid topic names: Kafka topic names use only "
                "ASCII letters, digits, '.', '_' and '-'"
            )
        return value

    @field_validator("kafka")
    @classmethod
    def _librdkafka_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_librdkafka_options(value)
        return value

    @field_validator("backoff_cap_seconds")
    @classmethod
    def _backoff(cls, value: float, info: ValidationInfo) -> float:
        # A field validator (not a model one) so the error names this setting and its variable.
        base = info.data.get("backoff_base_seconds")
        if base is not None and value < base:
            raise ValueError("backoff_cap_seconds must be >= backoff_base_seconds")
        return value

    def __repr_args__(self) -> Any:
        # repr() and str() show librdkafka secrets (sasl.password...) masked, like redacted().
        for name, value in super().__repr_args__():
            if name in ("kafka", "schema_registry"):
                value = redact_options(value)
            elif name == "schema_registry_url" and value is not None:
                value = redact(value)
            yield name, value

    @field_validator("metrics_addr")
    @classmethod
    def _ip_address(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(
                f"{value!r} is not an IP address: use 127.0.0.1 (this host) or 0.0.0.0 (all)"
            ) from None
        return value

    # --- derived ---------------------------------------------------------------

    @property
    def dsn(self) -> str:
        return self.database_url.get_secret_value()

    @property
    def lock_wait_seconds(self) -> float:
        """The lock_timeout a member's sessions use: ``lock_timeout_seconds``, at most a
        fifth of ``max_poll_interval_ms`` (0: none)."""
        if self.lock_timeout_seconds == 0:
            return 0.0
        return min(self.lock_timeout_seconds, self.max_poll_interval_ms / 5000)

    @property
    def signing_keys(self) -> tuple[bytes, ...]:
        """``dlq_signing_keys`` as bytes, the signing one first (empty: none configured)."""
        if self.dlq_signing_keys is None:
            return ()
        raw = self.dlq_signing_keys.get_secret_value()
        return tuple(k.strip().encode("utf-8") for k in raw.split(","))

    def consumer_config(self, group_id: str | None = None) -> dict[str, Any]:
        group = group_id or self.group_id
        if not group:
            raise ConfigError("group_id is required", setting="group_id")
        conf: dict[str, Any] = {
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "cooperative-sticky",
            "fetch.wait.max.ms": 50,
            "logger": KAFKA_LOG,  # librdkafka's lines through logging, deduplicated
            **self.kafka,
        }
        _say_ignored(self.kafka, _PROTECTED_CONSUMER, consumer=True)
        conf.update(
            {
                "bootstrap.servers": self.bootstrap_servers,
                "group.id": group,
                "max.poll.interval.ms": self.max_poll_interval_ms,
                "session.timeout.ms": self.session_timeout_ms,
                **_PROTECTED_CONSUMER,
            }
        )
        if self.group_instance_id is not None:
            conf["group.instance.id"] = self.group_instance_id
        return conf

    def producer_config(self) -> dict[str, Any]:
        conf: dict[str, Any] = {"linger.ms": 5, "message.timeout.ms": 30_000,
                                "logger": KAFKA_LOG}
        conf.update({k: v for k, v in self.kafka.items() if not _consumer_only(k)})
        _say_ignored(self.kafka, _PROTECTED_PRODUCER, consumer=False)
        conf.update({"bootstrap.servers": self.bootstrap_servers, **_PROTECTED_PRODUCER})
        return conf

    def admin_config(self) -> dict[str, Any]:
        conf: dict[str, Any] = {"logger": KAFKA_LOG}
        conf.update({k: v for k, v in self.kafka.items() if not _consumer_only(k)})
        conf["bootstrap.servers"] = self.bootstrap_servers
        return conf

    def redacted(self) -> dict[str, Any]:
        """Settings for display: secrets masked, librdkafka secrets masked."""
        data = self.model_dump(mode="json")
        data["database_url"] = redact(self.dsn, self.secret_values())
        data["kafka"] = redact_options(self.kafka)
        data["schema_registry"] = redact_options(self.schema_registry)
        if self.schema_registry_url is not None:
            data["schema_registry_url"] = redact(self.schema_registry_url, self.secret_values())
        return data

    def secret_values(self) -> list[str]:
        """The secrets these settings hold (the database password, secret librdkafka
        options, a registry URL's password): pass them to :func:`kafka_idem.redact.redact`
        so an error text echoing one of them out of context is masked too."""
        found = secrets_in(self.dsn) + option_secrets(self.kafka) + option_secrets(
            self.schema_registry)
        if self.schema_registry_url:
            found += secrets_in(self.schema_registry_url)
        found += [k.decode("utf-8") for k in self.signing_keys]
        return found


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


def _consumer_only(key: str) -> bool:
    return key.startswith(_CONSUMER_ONLY)


def _say_ignored(options: dict[str, Any], protected: dict[str, Any], *,
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


ENV_PREFIX = "KAFKA_IDEM_"
# KAFKA_IDEM_* variables that are not settings but are read on purpose: by kafka_idem
# itself (audit.py, chaos/services.py), by the test suite, and by the project's scripts
# (scripts/*.sh, ./dev). tests/unit/test_settings.py keeps this list complete.
OWN_VARIABLES = frozenset({
    "KAFKA_IDEM_ACTOR",  # who an audited admin action names (kafka_idem.audit)
    "KAFKA_IDEM_TEST_SCHEMA_REGISTRY_URL",  # the tests' Schema Registry
    "KAFKA_IDEM_ROOT", "KAFKA_IDEM_VENV",  # exported by scripts/bootstrap.sh
    "KAFKA_IDEM_LOCAL_DIR",  # the services' state folder (scripts, ./dev)
    "KAFKA_IDEM_KAFKA_PORT", "KAFKA_IDEM_KAFKA_START_TIMEOUT",  # scripts/kafka.sh
    "KAFKA_IDEM_KAFKA_EXTRA_CONFIG",
    "KAFKA_IDEM_PG_PORT",  # scripts/postgres.sh
    "KAFKA_IDEM_REGISTRY_PORT", "KAFKA_IDEM_REGISTRY_START_TIMEOUT",  # scripts/registry.sh
})
_SAID_UNKNOWN: set[str] = set()  # the unknown variables already warned about (per process)


def setting_variables() -> list[str]:
    """The ``KAFKA_IDEM_*`` name of every setting."""
    return [f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields]


def unknown_variables(env: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``(variable, the setting it probably meant or None)`` for every ``KAFKA_IDEM_*``
    variable in ``env`` that is neither a setting nor one of :data:`OWN_VARIABLES`
    (names are matched without regard to case, as the settings are read)."""
    settings = setting_variables()
    known = {*settings, *OWN_VARIABLES}
    found = []
    for name in sorted(env):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in known:
            continue
        # Compared without the prefix they all share (it would make every name close).
        close = difflib.get_close_matches(upper.removeprefix(ENV_PREFIX),
                                          [v.removeprefix(ENV_PREFIX) for v in settings],
                                          n=1, cutoff=0.75)
        found.append((name, f"{ENV_PREFIX}{close[0]}" if close else None))
    return found


def warn_unknown_variables(env: Mapping[str, str] | None = None) -> list[str]:
    """Warn, once per process and variable, about each ``KAFKA_IDEM_*`` variable that
    is not a setting (a misspelt one would otherwise be ignored without a word):
    ``KAFKA_IDEM_BATCH_SIZ is not a setting (did you mean KAFKA_IDEM_BATCH_SIZE?); it
    is ignored``. A warning, not an error: other tools may share the prefix. Never
    the variable's value. Returns the lines said now."""
    said = []
    for name, meant in unknown_variables(os.environ if env is None else env):
        if name in _SAID_UNKNOWN:
            continue
        _SAID_UNKNOWN.add(name)
        hint = f" (did you mean {meant}?)" if meant else ""
        line = f"{name} is not a setting{hint}; it is ignored"
        log.warning("%s", line, extra={"action": "config_unknown", "kind": name})
        said.append(line)
    return said


def load_settings(*, warn_unknown: bool = True, **overrides: Any) -> Settings:
    """Build settings, turning validation errors into a :class:`ConfigError` naming the setting.

    ``warn_unknown``: first warn about ``KAFKA_IDEM_*`` variables that are not
    settings (:func:`warn_unknown_variables`; the CLI does it once its logging is set).

    >>> load_settings(max_attempts=0)
    Traceback (most recent call last):
    kafka_idem.errors.ConfigError: invalid setting max_attempts (KAFKA_IDEM_MAX_ATTEMPTS): ...
    """
    if warn_unknown:
        warn_unknown_variables()
    clean = {k: v for k, v in overrides.items() if v is not None}
    try:
        return Settings(**clean)
    except SettingsError as exc:  # a variable that cannot be parsed at all (invalid JSON)
        raise ConfigError(_unparsable(exc)) from exc
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            name = ".".join(str(p) for p in err["loc"]) or "settings"
            env = f"KAFKA_IDEM_{name.upper()}"
            problems.append(f"invalid setting {name} ({env}): {err['msg']}")
        raise ConfigError("; ".join(problems)) from exc


_SOURCE_FIELD = re.compile(r'field "(\w+)"')


def _unparsable(exc: SettingsError) -> str:
    """pydantic-settings' "error parsing value for field ..." as a message naming the
    setting, its variable and what is accepted (the value itself is never echoed)."""
    found = _SOURCE_FIELD.search(str(exc))
    name = found[1] if found else "settings"
    env = f"KAFKA_IDEM_{name.upper()}"
    cause = exc.__cause__
    detail = f" ({cause.__class__.__name__}: {cause})" if isinstance(cause, ValueError) else ""
    example = "{\"linger.ms\": 5}"
    return f"invalid setting {name} ({env}): not valid JSON{detail}; e.g. {env}='{example}'"
