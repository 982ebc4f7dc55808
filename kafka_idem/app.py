"""The handler API: :class:`App`, ``@app.handler``, :class:`Context`.

    app = App(name="payments")

    @app.handler(
        topic="payments.charge-requested",
        model=ChargeRequested,
        key="{tenant_id}:charge:{order_id}",
        hash_fields=("amount", "currency"),
    )
    def charge(msg: ChargeRequested, ctx: Context) -> dict:
        ctx.tx.execute("INSERT INTO payments.ledger ...", (...))
        return {"charged": str(msg.amount)}

A handler gets the decoded, validated payload and a :class:`Context` whose
``tx`` is an open psycopg transaction: business writes made through it commit
together with the success record, or not at all. The return value must be
JSON-able; it is stored and replayed, exactly, on every duplicate.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import psycopg
from pydantic import ValidationError

from kafka_idem.codec import (
    FORMATS,
    AvroCodec,
    AvroObjectCodec,
    Codec,
    JsonCodec,
    adapter_for,
    fields_of,
    validate,
)
from kafka_idem.errors import (
    ConfigError,
    MessageError,
    PayloadTooLarge,
    Permanent,
    Retryable,
    StaleOwner,
    Undecodable,
    UnknownOutcome,
)
from kafka_idem.keys import KeySpec, KeyTemplate
from kafka_idem.retry import RetryPolicy
from kafka_idem.settings import TOPIC_CHARS, Settings, check_namespace, load_settings
from kafka_idem.store import is_data_error

M = TypeVar("M")

Format = Literal["json", "avro", "registry"]

Mode = Literal["local", "leased"]
ErrorKind = Literal["retryable", "permanent", "unknown_outcome"]


@dataclass
class Context:
    """What a handler knows about the message it is processing.

    ``tx`` is the open transaction (a psycopg connection inside ``BEGIN``):
    write business rows through it. ``idempotency_key`` is the key to pass
    downstream (e.g. as an ``Idempotency-Key`` HTTP header) so remote side
    effects are deduplicated by the remote side too.
    """

    tx: psycopg.Connection[Any]
    idempotency_key: str
    request_hash: str
    attempt: int
    handler: str
    topic: str
    partition: int
    offset: int
    timestamp: int | None
    kafka_key: bytes | None
    headers: Mapping[str, bytes] = field(default_factory=dict)
    _lease_lost: threading.Event | None = field(default=None, repr=False)

    @property
    def lease_lost(self) -> bool:
        """True once a heartbeat found the lease taken over (leased mode): stop early."""
        return self._lease_lost is not None and self._lease_lost.is_set()


@dataclass(frozen=True, slots=True)
class Done:
    """What ``reconcile`` returns when the downstream says the operation already happened."""

    result: Any = None


Reconciler = Callable[[Any, Context], Done | None]
BulkHandler = Callable[[list[tuple[Any, Context]], psycopg.Connection[Any]], list[Any]]


# Default classification of exceptions a handler lets escape (first match wins).
DEFAULT_ERRORS: tuple[tuple[type[BaseException], ErrorKind], ...] = (
    (Permanent, "permanent"),
    (Retryable, "retryable"),
    (UnknownOutcome, "unknown_outcome"),
    (MessageError, "permanent"),
    (ValidationError, "permanent"),
    (psycopg.errors.IntegrityError, "permanent"),
    (psycopg.errors.DataError, "permanent"),
    (UnicodeError, "permanent"),  # a value that cannot be encoded: psycopg refuses it
)


def check_topic_name(name: str, *, setting: str) -> str:
    """``name`` if Kafka accepts it as a topic name, else a :class:`ConfigError`."""
    if len(name) > 249 or not TOPIC_CHARS.fullmatch(name) or name in (".", ".."):
        raise ConfigError(
            f"{name!r} is not a valid Kafka topic name (1-249 ASCII letters, digits, "
            "'.', '_', '-')", setting=setting)
    return name


class Handler(Generic[M]):
    """A registered handler; call ``@handler.reconciler`` to add a reconcile step."""

    def __init__(
        self,
        fn: Callable[[M, Context], Any],
        *,
        name: str,
        topic: str,
        model: type[M] | None,
        key: KeySpec,
        hash_fields: tuple[str, ...],
        mode: Mode,
        batch: bool,
        dlq_topic: str | None,
        schema: str | None,
        retry: RetryPolicy | None,
        errors: tuple[tuple[type[BaseException], ErrorKind], ...],
        format: Format | Codec | None = None,
        binder: Callable[[Handler[Any]], Codec] | None = None,
    ) -> None:
        self.fn = fn
        self.name = name
        self.topic = topic
        self.model = model
        self.key = KeyTemplate(key)
        self.hash_fields = hash_fields
        self.mode: Mode = mode
        self.batch = batch
        self.dlq_topic_override = dlq_topic
        self.schema = schema
        self.retry_override = retry
        self.errors = errors
        self.reconcile: Reconciler | None = None
        self.bulk: BulkHandler | None = None
        # Checked now, not at the first message: the model, the format, the fields.
        self.adapter = adapter_for(model, handler=name)
        if isinstance(format, str):
            if format not in FORMATS:
                raise ConfigError(f"handler {name!r}: format must be one of {list(FORMATS)} "
                                  f"or a codec object, not {format!r}", setting="format")
            if format == "avro" and not schema:
                raise ConfigError(f"handler {name!r}: format 'avro' needs schema= (the Avro "
                                  "reader schema's full name, from schemas_dir)", setting="schema")
        elif format is not None and not isinstance(format, Codec):
            raise ConfigError(f"handler {name!r}: format {format!r} is neither "
                              f"{list(FORMATS)} nor a codec (name, decode, encode)",
                              setting="format")
        self.format = format
        self._binder = binder
        self._codec: Codec | None = None
        self.payload_max_bytes: int | None = None
        known = fields_of(model)
        if known is not None:
            unknown = [f for f in (*self.key.fields, *hash_fields) if f not in known]
            if unknown:
                raise ConfigError(
                    f"handler {name!r}: fields {unknown} are not fields of "
                    f"{getattr(model, '__name__', model)}",
                    setting="key/hash_fields",
                )

    # --- payloads -----------------------------------------------------------

    @property
    def format_name(self) -> str | None:
        """The format asked for: ``format=``, else ``"avro"`` with ``schema=``, else
        ``None`` (the app's ``default_format``)."""
        if isinstance(self.format, str):
            return self.format
        if self.format is not None:
            return self.format.name
        return "avro" if self.schema else None

    @property
    def codec(self) -> Codec:
        """The handler's bound codec (bound by its app on first use or at start-up)."""
        if self._codec is None:
            if self._binder is None:
                raise ConfigError(f"handler {self.name!r} is not registered with an app",
                                  setting="format")
            self._codec = self._binder(self)
        return self._codec

    def bind(self, codec: Codec, *, payload_max_bytes: int) -> None:
        self._codec = codec
        self.payload_max_bytes = payload_max_bytes

    def decode(self, data: bytes | None) -> Any:
        """The message value as the handler's payload, validated into its model; raise
        :class:`Undecodable` / :class:`InvalidPayload` naming the format and the problem
        (or a framework error, e.g. the registry down: retried, never charged)."""
        codec = self.codec
        if not data:
            raise Undecodable(f"{codec.name}: empty message value")
        limit = self.payload_max_bytes
        if limit is not None and len(data) > limit:
            raise PayloadTooLarge(f"{codec.name}: the value is {len(data)} bytes, over the "
                                  f"limit of {limit} (setting payload_max_bytes)")
        try:
            return codec.decode(data)
        except MessageError as exc:
            if not exc.message.startswith(codec.name):
                exc.message = f"{codec.name}: {exc.message}"
                exc.args = (exc.message,)
            raise

    def encode(self, payload: Any) -> bytes:
        """The bytes a producer sends for ``payload`` (a model instance or a mapping)."""
        return self.codec.encode(payload)

    def __call__(self, msg: M, ctx: Context) -> Any:
        return self.fn(msg, ctx)

    def reconciler(self, fn: Reconciler) -> Reconciler:
        """Register ``fn(msg, ctx) -> Done | None``: asked first on the attempt after an
        unknown outcome (or a lease lost mid-flight); ``Done(result)`` completes the
        record without calling the handler again, ``None`` retries it with the same key."""
        self.reconcile = fn
        return fn

    def bulk_handler(self, fn: BulkHandler) -> BulkHandler:
        """Register ``fn(batch, tx) -> results``: the batch path's way to run many
        messages in a few statements (e.g. one ``INSERT ... SELECT FROM unnest``).

        ``batch`` is a list of ``(msg, ctx)`` for the claimed messages of one
        transaction; return one JSON-able result per item, in order, or for an item
        rejected *before anything of it was written*, a ``Permanent`` exception
        instance (it is recorded failed and dead-lettered). It must have
        exactly the effect of calling the handler on each item; the handler itself
        still runs whenever the batch falls back to the per-message path (an error
        raised here makes the batch fall back). Lock rows in a stable order (sort
        by key) so concurrent batches can't deadlock.
        """
        self.bulk = fn
        return fn

    def classify(self, exc: BaseException) -> ErrorKind:
        """Retryable, permanent or unknown outcome. Unmapped exceptions are retryable
        (up to the retry limit, then exhausted)."""
        for cls, kind in self.errors:
            if isinstance(exc, cls):
                return kind
        if is_data_error(exc):
            # The database refused a value the message brought (e.g. an index entry
            # over its size limit): the same message can never succeed.
            return "permanent"
        return "retryable"


class App:
    """A kafka_idem application: settings plus handlers, one per topic."""

    def __init__(
        self,
        name: str,
        *,
        group_id: str | None = None,
        settings: Settings | None = None,
        errors: Mapping[type[BaseException], ErrorKind] | None = None,
        **overrides: Any,
    ) -> None:
        self.name = name
        self._settings = settings
        self._overrides = {"group_id": group_id, **overrides}
        self.errors = tuple((errors or {}).items())
        self.handlers: dict[str, Handler[Any]] = {}
        self._codec_lock = threading.RLock()
        self._avro: AvroCodec | None = None
        self._registry: Any = None
        self.migrations: list[Callable[[psycopg.Connection[Any]], None]] = []

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = load_settings(**self._overrides)
        return self._settings

    def configure(self, **overrides: Any) -> None:
        """Replace settings fields (CLI flags, tests)."""
        clean = {k: v for k, v in overrides.items() if v is not None}
        base = self.settings.model_dump()
        base["database_url"] = self.settings.dsn
        self._settings = load_settings(**{**base, **clean})

    @property
    def group_id(self) -> str:
        return self.settings.group_id or self.name

    @property
    def namespace(self) -> str:
        """Where this app's keys live in the store: the ``namespace`` setting, else the
        app's name. Two apps on one store see each other's keys only when they share it."""
        value = self.settings.namespace or self.name
        try:
            return check_namespace(value)
        except ValueError as exc:
            raise ConfigError(
                f"app {self.name!r}: {exc}; set KAFKA_IDEM_NAMESPACE", setting="namespace"
            ) from None

    def handler(
        self,
        *,
        topic: str,
        model: type[M] | None = None,
        key: KeySpec,
        hash_fields: tuple[str, ...] | list[str],
        format: Format | Codec | None = None,
        mode: Mode = "local",
        batch: bool = True,
        dlq_topic: str | None = None,
        schema: str | None = None,
        name: str | None = None,
        retry: RetryPolicy | None = None,
        errors: Mapping[type[BaseException], ErrorKind] | None = None,
    ) -> Callable[[Callable[[M, Context], Any]], Handler[M]]:
        """Register a handler for ``topic``.

        ``mode="local"`` (default) runs claim, handler and completion in one
        transaction: for handlers whose effects are only in this database.
        ``mode="leased"`` commits the claim first and fences the completion with
        the owner token, with a heartbeat on the lease: for handlers that call
        other systems.

        ``model`` is a pydantic model, a dataclass or a TypedDict (``None``: a dict).
        ``format`` is ``"json"``, ``"avro"`` (single-object encoding, with ``schema=``
        the reader schema's name), ``"registry"`` (Confluent wire format through
        ``schema_registry_url``) or a codec object; not given, ``"avro"`` when
        ``schema=`` is, else the app's ``default_format`` (``KAFKA_IDEM_DEFAULT_FORMAT``,
        ``"json"``). A bad model, format or missing schema is a :class:`ConfigError`
        now or when the app starts, never at the first message.

        ``batch=True`` (local mode) lets the batch path run many messages in one
        transaction with pipelined statements; when a batch falls back to the
        per-message path the handler may run again after a rollback, so keep
        its effects in this database (or pass ``batch=False``).
        """
        check_topic_name(topic, setting="topic")
        if dlq_topic is not None:
            check_topic_name(dlq_topic, setting="dlq_topic")
        if topic in self.handlers:
            raise ConfigError(f"topic {topic!r} already has a handler", setting="topic")
        if mode not in ("local", "leased"):
            raise ConfigError(f"mode must be 'local' or 'leased', not {mode!r}", setting="mode")
        if not hash_fields:
            raise ConfigError("hash_fields must name at least one field", setting="hash_fields")

        def register(fn: Callable[[M, Context], Any]) -> Handler[M]:
            mapping = tuple((errors or {}).items()) + self.errors + DEFAULT_ERRORS
            h = Handler(
                fn,
                name=name or fn.__name__,
                topic=topic,
                model=model,
                key=key,
                hash_fields=tuple(hash_fields),
                mode=mode,
                batch=batch,
                dlq_topic=dlq_topic,
                schema=schema,
                retry=retry,
                errors=mapping,
                format=format,
                binder=self.bind_codec,
            )
            self.handlers[topic] = h
            return h

        return register

    # --- payload codecs -------------------------------------------------------

    def avro_schemas(self) -> AvroCodec:
        """The Avro schemas of ``schemas_dir``, loaded once."""
        with self._codec_lock:
            if self._avro is None:
                self._avro = AvroCodec.from_dir(self.settings.schemas_dir)
            return self._avro

    def registry_client(self) -> Any:
        """The app's ``SchemaRegistryClient`` (made once; it caches schemas by id)."""
        from kafka_idem.registry import registry_client

        with self._codec_lock:
            if self._registry is None:
                url = self.settings.schema_registry_url
                if not url:
                    raise ConfigError("no schema registry: set KAFKA_IDEM_SCHEMA_REGISTRY_URL",
                                      setting="schema_registry_url")
                self._registry = registry_client(url, self.settings.schema_registry)
            return self._registry

    def make_codec(self, handler: Handler[Any]) -> Codec:
        """The codec ``handler``'s format names, built from the app's settings."""
        from kafka_idem.registry import RegistryCodec

        fmt = handler.format
        if fmt is not None and not isinstance(fmt, str):
            return _Validated(fmt, handler)
        name = handler.format_name or self.settings.default_format
        try:
            if name == "json":
                return JsonCodec(handler.adapter)
            schemas = self.avro_schemas() if handler.schema else None
            if name == "registry":
                return RegistryCodec(self.registry_client(), handler.adapter, schemas=schemas,
                                     schema=handler.schema, subject=f"{handler.topic}-value")
            if schemas is None or handler.schema is None:
                raise ConfigError("format 'avro' needs schema= (the Avro reader schema's full "
                                  "name); the app's default_format is 'avro'", setting="schema")
            framed = None
            if self.settings.schema_registry_url:  # as before formats: both framings
                framed = RegistryCodec(self.registry_client(), handler.adapter, schemas=schemas,
                                       schema=handler.schema, subject=f"{handler.topic}-value")
            return AvroObjectCodec(schemas, handler.schema, handler.adapter, framed=framed)
        except ConfigError as exc:
            raise ConfigError(f"handler {handler.name!r}: {exc.message}",
                              **exc.context) from exc

    def bind_codec(self, handler: Handler[Any]) -> Codec:
        with self._codec_lock:
            codec = self.make_codec(handler)
            handler.bind(codec, payload_max_bytes=self.settings.payload_max_bytes)
            return codec

    def bind_codecs(self) -> AvroCodec:
        """Bind every handler's codec (at start-up: a missing schema, registry setting
        or schemas folder fails here, naming the handler); return the Avro schemas
        (empty when no handler uses Avro)."""
        for handler in self.handlers.values():
            self.bind_codec(handler)
        with self._codec_lock:
            return self._avro if self._avro is not None else AvroCodec()

    def migration(self, fn: Callable[[psycopg.Connection[Any]], None]) -> Callable[..., None]:
        """Register the app's own schema set-up, run by ``kafka-idem migrate`` (idempotent SQL)."""
        self.migrations.append(fn)
        return fn

    def retry_policy(self, handler: Handler[Any]) -> RetryPolicy:
        """The handler's own policy, else one from the settings (read at run time)."""
        if handler.retry_override is not None:
            return handler.retry_override
        s = self.settings
        return RetryPolicy(
            base=s.backoff_base_seconds,
            cap=s.backoff_cap_seconds,
            max_attempts=s.max_attempts,
            max_elapsed=s.max_elapsed_seconds,
        )

    def dlq_topic(self, handler: Handler[Any]) -> str:
        return handler.dlq_topic_override or f"{handler.topic}{self.settings.dlq_suffix}"

    def check_topics(self) -> None:
        """Every handler's source and dead-letter topic is a name Kafka accepts (checked
        when a member starts: a DLQ record that can never be written would hold its
        partition forever)."""
        for handler in self.handlers.values():
            check_topic_name(handler.topic, setting="topic")
            setting = "dlq_topic" if handler.dlq_topic_override else "dlq_suffix"
            check_topic_name(self.dlq_topic(handler), setting=setting)

    @property
    def topics(self) -> list[str]:
        return list(self.handlers)


class _Validated:
    """A user's codec, its output validated into the handler's model."""

    def __init__(self, codec: Codec, handler: Handler[Any]) -> None:
        self.codec = codec
        self.name = codec.name
        self.adapter = handler.adapter

    def decode(self, data: bytes) -> Any:
        return validate(self.adapter, self.codec.decode(data), fmt=self.name)

    def encode(self, payload: Any) -> bytes:
        return self.codec.encode(payload)


__all__ = ["App", "Context", "Done", "Handler", "StaleOwner"]
