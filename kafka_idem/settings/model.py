"""The settings model (:class:`Settings`): every setting with its default, bounds and
description (docs/reference/settings.md, generated from it), the checks it runs on each
(:mod:`~kafka_idem.settings.checks`),
and what it derives: the DSN, the lock wait, the signing keys, and each client's
librdkafka configuration with the protected options applied over the user's
(:mod:`~kafka_idem.settings.clients`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kafka_idem.deadletters.signing import MIN_KEY_BYTES
from kafka_idem.errors import ConfigError
from kafka_idem.observe.kafka_logs import KAFKA_LOG
from kafka_idem.observe.redact import option_secrets, redact, redact_options, secrets_in
from kafka_idem.settings.checks import (
    check_backoff,
    check_conninfo,
    check_console_token,
    check_duration,
    check_group_id,
    check_group_instance_id,
    check_identifier,
    check_ip_address,
    check_librdkafka_options,
    check_linger,
    check_log_levels,
    check_namespace,
    check_signing_keys,
    check_topic_affix,
)
from kafka_idem.settings.clients import (
    _PROTECTED_CONSUMER,
    _PROTECTED_PRODUCER,
    consumer_only,
    say_ignored,
)

DEFAULT_BOOTSTRAP = "127.0.0.1:39092"
DEFAULT_DATABASE_URL = "postgresql://kafka_idem@127.0.0.1:55432/kafka_idem"


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
    lease_seconds: float = Field(
        30.0, gt=0, description="Lease of a claimed key in leased mode (renewed every third of "
        "it): a member that stops renewing it for this long loses the key to the next one. Keep "
        "it above your slowest remote call, its client's timeout included: a call abandoned at "
        "a stop or a revoke keeps its lease until it runs out, so no other member calls for "
        "that key while its request may still be in flight.")
    max_attempts: int = Field(5, ge=1, description="Attempts before a key is exhausted (and "
                              "dead-lettered).")
    max_elapsed_seconds: float = Field(3600.0, gt=0, description="Time since the first "
                                       "failure after which a key is exhausted.")
    backoff_base_seconds: float = Field(
        0.5, ge=0, description="Retry backoff base: the wait before the attempt after the "
        "n-th failure is random, below base * 2^(n-1) (full jitter).")
    backoff_cap_seconds: float = Field(
        60.0, ge=0, description="Retry backoff cap: the longest wait before a retry.")
    busy_retry_seconds: float = Field(0.5, gt=0, description="Wait before retrying a key "
                                      "another member holds.")
    batch_size: int = Field(500, ge=1, le=100_000, description="Messages per consume batch.")
    batch_max_wait_seconds: float = Field(
        0.1, ge=0,
        description="Longest wait of an idle loop round for the first message of a batch "
        "(a batch then takes what has arrived, up to batch_size, without waiting to fill).",
    )
    batch_linger_seconds: float = Field(
        0.0, ge=0, le=60,
        description="After a batch's first message, how long it may wait to fill up to batch_size "
        "(0: start at once with what has arrived); at most batch_max_wait_seconds.",
    )
    retry_lookahead: int = Field(10_000, ge=1, le=10_000_000, description="While a message "
        "waits for its next attempt (other keys go on), how many messages past it its partition "
        "may run: what a crash redelivers done (replayed, not re-run); then it stops fetching.")
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
        True, description="Run local-mode batches on the optimistic batch path (one claim "
        "statement for a batch's keys); false: a transaction per message."
    )
    dlq_suffix: str = Field(".dlq", min_length=1, description="Suffix of a handler's "
                            "default dead-letter topic: <topic><suffix>.")
    dlq_signing_keys: SecretStr | None = Field(
        None,
        description="Keys that sign dead letters (secret): a comma-separated list, each at "
        f"least {MIN_KEY_BYTES} bytes. The first signs every dead letter (header "
        "idem.signature, HMAC-SHA256); all of them verify, so a key is rotated by putting the "
        "new one first. With keys, dlq replay acts only on records whose signature holds "
        "(--trust-unsigned admits unsigned ones written before).",
    )
    console_token: SecretStr | None = Field(
        None,
        description="The token the web console (kafka-idem console) asks for (secret, at "
        "least 16 characters): required when it listens on an address other than loopback; "
        "when set, required on loopback too.",
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
        default_factory=dict, description="librdkafka options passed through (JSON in the "
        "variable; SASL/TLS...); secrets are masked. An option librdkafka does not know, or a "
        "value it refuses, is a configuration error (exit 2) naming it. Options the guarantees "
        "depend on (enable.auto.commit, enable.auto.offset.store, enable.partition.eof, "
        "enable.idempotence, acks) and those other settings decide (bootstrap.servers, "
        "group.id, group.instance.id, session.timeout.ms, max.poll.interval.ms) are ignored "
        "here, with one WARNING each."
    )
    max_poll_interval_ms: int = Field(
        300_000, ge=1000, description="librdkafka max.poll.interval.ms: the longest time "
        "between two polls before the group considers the member gone.")
    session_timeout_ms: int = Field(
        10_000, ge=1000,
        description="librdkafka session.timeout.ms: how long the group waits for a member "
        "that stopped heartbeating (e.g. SIGKILLed) before its partitions move. It must lie "
        "within the broker's group.min.session.timeout.ms (6 s by default) and "
        "group.max.session.timeout.ms: outside them run stops with exit 2 naming the setting "
        "and the bounds.",
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
    retention: Annotated[str | None, AfterValidator(check_duration)] = Field(
        None, description="Background retention (unset: off): one member at a time purges the "
        "app's succeeded records older than this (e.g. 30d), at least the topics' retention.ms.")
    retention_force: bool = Field(False, description="Run retention although its window is "
                                  "shorter than a source topic's retention.ms.")
    retention_interval_seconds: float = Field(
        300.0, gt=0, description="How often a member tries a retention run (with jitter).")
    long_running_seconds: float = Field(
        300.0, gt=0, description="A record unfinished for this long counts as long-running."
    )
    metrics_sample_seconds: float = Field(
        15.0, gt=0, description="Interval of the database gauges' sampling."
    )
    metrics_addr: str = Field(
        "127.0.0.1", description="Address /metrics binds (0.0.0.0 in a container)."
    )
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Port of /metrics, /livez "
                                      "and /readyz (unset: not served; 0: any free port).")
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
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Lowest level of the log lines the process writes.")
    log_levels: str = Field(
        "",
        description="Levels of single loggers, LOGGER=LEVEL comma-separated (e.g. "
        "httpx=INFO,myapp.db=DEBUG; a logger's children follow it). By default the loggers "
        "of other libraries (installed packages and the standard library) show WARNING and "
        "above only, while kafka_idem's and the app's own show log_level and above; a "
        "logger named here shows its LEVEL and above instead.",
    )

    @field_validator("schema_name", "table")
    @classmethod
    def _identifier(cls, value: str) -> str:
        return check_identifier(value)

    @field_validator("batch_linger_seconds")
    @classmethod
    def _linger(cls, value: float, info: ValidationInfo) -> float:
        return check_linger(value, info.data.get("batch_max_wait_seconds"))

    @field_validator("group_id")
    @classmethod
    def _group_id(cls, value: str | None) -> str | None:
        return check_group_id(value)

    @field_validator("group_instance_id")
    @classmethod
    def _group_instance_id(cls, value: str | None) -> str | None:
        return check_group_instance_id(value)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str | None) -> str | None:
        if value is not None:
            check_namespace(value)
        return value

    @field_validator("database_url")
    @classmethod
    def _conninfo(cls, value: SecretStr) -> SecretStr:
        return check_conninfo(value)

    @field_validator("dlq_signing_keys", mode="before")
    @classmethod
    def _signing_keys(cls, value: Any) -> Any:
        return check_signing_keys(value)

    @field_validator("console_token")
    @classmethod
    def _console_token(cls, value: SecretStr | None) -> SecretStr | None:
        return check_console_token(value)

    @field_validator("log_levels")
    @classmethod
    def _log_levels(cls, value: str) -> str:
        return check_log_levels(value)

    @field_validator("dlq_suffix", "name_prefix")
    @classmethod
    def _topic_suffix(cls, value: str) -> str:
        return check_topic_affix(value)

    @field_validator("kafka")
    @classmethod
    def _librdkafka_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_librdkafka_options(value)
        return value

    @field_validator("backoff_cap_seconds")
    @classmethod
    def _backoff(cls, value: float, info: ValidationInfo) -> float:
        return check_backoff(value, info.data.get("backoff_base_seconds"))

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
        return check_ip_address(value)

    # --- derived ---------------------------------------------------------------

    @property
    def dsn(self) -> str:
        """``database_url`` in clear text, for connecting (never log it)."""
        return self.database_url.get_secret_value()

    @property
    def lock_wait_seconds(self) -> float:
        """The lock_timeout a member's sessions use: ``lock_timeout_seconds``, at most a
        fifth of ``max_poll_interval_ms`` (0: none)."""
        if self.lock_timeout_seconds == 0:
            return 0.0
        return min(self.lock_timeout_seconds, self.max_poll_interval_ms / 5000)

    @property
    def logger_levels(self) -> dict[str, str]:
        """:attr:`log_levels` as ``{logger: LEVEL}``."""
        return dict(item.split("=", 1) for item in self.log_levels.split(",") if item)

    @property
    def signing_keys(self) -> tuple[bytes, ...]:
        """``dlq_signing_keys`` as bytes, the signing one first (empty: none configured)."""
        if self.dlq_signing_keys is None:
            return ()
        raw = self.dlq_signing_keys.get_secret_value()
        return tuple(k.strip().encode("utf-8") for k in raw.split(","))

    def consumer_config(self, group_id: str | None = None) -> dict[str, Any]:
        """The librdkafka consumer configuration: ``kafka``'s options, with the ones the
        guarantees depend on applied over them; ``group_id`` overrides the setting."""
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
        say_ignored(self.kafka, _PROTECTED_CONSUMER, consumer=True)
        conf.update({"bootstrap.servers": self.bootstrap_servers, "group.id": group,
                     "max.poll.interval.ms": self.max_poll_interval_ms,
                     "session.timeout.ms": self.session_timeout_ms, **_PROTECTED_CONSUMER})
        if self.group_instance_id is not None:
            conf["group.instance.id"] = self.group_instance_id
        return conf

    def producer_config(self) -> dict[str, Any]:
        """The librdkafka producer configuration (dead letters, ``app.producer()``):
        ``kafka``'s options less the consumer-only ones, idempotence applied over them."""
        conf: dict[str, Any] = {"linger.ms": 5, "message.timeout.ms": 30_000,
                                "logger": KAFKA_LOG}
        conf.update({k: v for k, v in self.kafka.items() if not consumer_only(k)})
        say_ignored(self.kafka, _PROTECTED_PRODUCER, consumer=False)
        conf.update({"bootstrap.servers": self.bootstrap_servers, **_PROTECTED_PRODUCER})
        return conf

    def admin_config(self) -> dict[str, Any]:
        """The librdkafka admin client configuration: ``kafka``'s options less the
        consumer-only ones."""
        conf: dict[str, Any] = {"logger": KAFKA_LOG}
        conf.update({k: v for k, v in self.kafka.items() if not consumer_only(k)})
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
        options, a registry URL's password): pass them to :func:`kafka_idem.observe.redact.redact`
        so an error text echoing one of them out of context is masked too."""
        found = secrets_in(self.dsn) + option_secrets(self.kafka) + option_secrets(
            self.schema_registry)
        if self.schema_registry_url:
            found += secrets_in(self.schema_registry_url)
        found += [k.decode("utf-8") for k in self.signing_keys]
        if self.console_token is not None:
            found.append(self.console_token.get_secret_value())
        return found
