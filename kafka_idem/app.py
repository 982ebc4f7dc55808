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

import copy
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import psycopg

from kafka_idem.codecs.avro_codec import AvroCodec
from kafka_idem.codecs.base import Codec, CodecFactory
from kafka_idem.errors import ConfigError, StaleOwner
from kafka_idem.handler import (
    DEFAULT_ERRORS,
    AsyncContext,
    Context,
    Done,
    ErrorKind,
    Format,
    Handler,
    M,
    Mode,
    check_topic_name,
)
from kafka_idem.keys import KeySpec
from kafka_idem.orm.sessions import Sessions
from kafka_idem.registration import (
    check_handler_function,
    check_handler_options,
    check_loop_closer,
    check_setting_names,
    handler_name,
)
from kafka_idem.retry import RetryPolicy
from kafka_idem.settings import Settings, check_namespace, load_settings
from kafka_idem.store import Store

if TYPE_CHECKING:
    from sqlalchemy import MetaData

    from kafka_idem.outbox.emit import Emitter
    from kafka_idem.producer import Producer


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
        check_setting_names(name, overrides)
        self._settings = settings
        self._overrides = {"group_id": group_id, **overrides}
        self.errors = tuple((errors or {}).items())
        self.handlers: dict[str, Handler[Any]] = {}
        self._codec_lock = threading.RLock()
        self._avro: AvroCodec | None = None
        self._registry: dict[bool, Any] = {}
        self.migrations: list[Callable[[psycopg.Connection[Any]], None]] = []
        self.loop_closers: list[Callable[[], Awaitable[None]]] = []
        self.declared_topics: dict[str, dict[str, Any]] = {}
        self.event_topics: dict[str, Handler[Any]] = {}
        self._emitter: Emitter | None = None
        self.sessions = Sessions()  # ctx.session (app.sqlalchemy)

    @property
    def settings(self) -> Settings:
        """The app's settings: ``settings=``, else ``KAFKA_IDEM_*`` plus the overrides."""
        if self._settings is None:
            self._settings = load_settings(**self._overrides)
        return self._settings

    def configure(self, **overrides: Any) -> None:
        """Replace settings fields (CLI flags, tests)."""
        clean = {k: v for k, v in overrides.items() if v is not None}
        base = self.settings.model_dump()
        base["database_url"] = self.settings.dsn
        self._settings = load_settings(**{**base, **clean})

    def derived(self, **overrides: Any) -> App:
        """A copy of this app with ``overrides`` applied to its settings and copies of its
        handlers: changing the copy's settings or handlers (the test kit points them at a
        database of its own and wraps their functions) leaves this app as it was.

        >>> app.derived(database_url="postgresql://localhost/scratch").settings.dsn
        'postgresql://localhost/scratch'
        """
        other = copy.copy(self)
        base = self.settings.model_dump()
        base["database_url"] = self.settings.dsn
        other._settings = load_settings(**{**base, **overrides})
        other.handlers = {topic: copy.copy(h) for topic, h in self.handlers.items()}
        other.migrations = list(self.migrations)
        other._emitter = None  # the copy's settings (shards, store) may differ
        return other

    @property
    def group_id(self) -> str:
        """The consumer group: the ``group_id`` setting, else the app's name."""
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
        format: Format | Codec | CodecFactory | None = None,
        mode: Mode = "local",
        batch: bool = True,
        dlq_topic: str | None = None,
        schema: str | None = None,
        name: str | None = None,
        retry: RetryPolicy | None = None,
        errors: Mapping[type[BaseException], ErrorKind] | None = None,
        concurrency: int = 1,
        ordering_key: KeySpec | None = None, max_rate: float | None = None,
        retry_blocks_partition: bool = False, shard_key: KeySpec | None = None,
    ) -> Callable[[Callable[[M, Any], Any]], Handler[M]]:
        """Register a handler for ``topic``.

        ``mode="local"`` (default) runs claim, handler and completion in one
        transaction: for handlers whose effects are only in this database.
        ``mode="leased"`` commits the claim first and fences the completion with
        the owner token, with a heartbeat on the lease: for handlers that call
        other systems.

        ``model`` is a pydantic model, a dataclass or a TypedDict (``None``: a dict).
        ``format`` is ``"json"``, ``"avro"`` (single-object encoding, with ``schema=``
        the reader schema's name), ``"registry"`` (Confluent wire format through
        ``schema_registry_url``: Avro, JSON Schema), ``ProtobufCodec(MyMessage)``
        (registry-framed Protobuf, :mod:`kafka_idem.codecs.protobuf`) or a codec object; not
        given, ``"avro"`` when ``schema=`` is, else the app's ``default_format``
        (``KAFKA_IDEM_DEFAULT_FORMAT``, ``"json"``). A bad model, format or missing
        schema is a :class:`ConfigError` now or when the app starts, never at the first
        message.

        ``batch=True`` (local mode) lets the batch path run many messages in one
        transaction with pipelined statements; when a batch falls back to the
        per-message path the handler may run again after a rollback, so keep
        its effects in this database (or pass ``batch=False``).

        A message waiting for a retry holds only its idempotency key and ``ordering_key``
        (any mode); ``retry_blocks_partition=True`` holds its whole partition instead.

        ``concurrency=N`` (leased mode) runs up to N calls of this handler at once
        in a member, over its partitions, in key order: messages with the same
        idempotency key, or the same ``ordering_key`` (a template or function like
        ``key``, e.g. ``"{tenant_id}"``), run one after another in offset order,
        others side by side; the offset is committed only over finished messages.
        The claim before a call and the completion after it are not counted: an
        ``async def`` handler with ``N > 1`` claims up to N more messages ahead, so
        a call that returns frees its slot for one already claimed. The member's
        ``max_concurrency`` setting caps all such handlers' calls together.
        ``max_rate=R``: at most R messages a second in each member (docs/how-to/handlers.md).
        An ``async def`` handler (leased mode) runs on the member's event loop with
        an :class:`AsyncContext` (``ctx.tx`` a ``psycopg.AsyncConnection``; the how-to
        on concurrency has an example).

        ``shard_key`` (default the key): where Citus places the message's rows: a
        template of ``key``'s fields or a function of the key (docs/CITUS.md).
        """
        check_handler_options(topic, dlq_topic=dlq_topic, mode=mode, concurrency=concurrency,
                              ordering_key=ordering_key, taken=self.handlers, max_rate=max_rate)

        def register(fn: Callable[[M, Any], Any]) -> Handler[M]:
            called = handler_name(fn, name)
            check_handler_function(fn, name=called, mode=mode, hash_fields=hash_fields)
            mapping = tuple((errors or {}).items()) + self.errors + DEFAULT_ERRORS
            h = Handler(
                fn, name=called, topic=topic, model=model, key=key,
                hash_fields=tuple(hash_fields), mode=mode, batch=batch, dlq_topic=dlq_topic,
                schema=schema, retry=retry, errors=mapping, format=format,
                binder=self.bind_codec, concurrency=concurrency, ordering_key=ordering_key,
                max_rate=max_rate, retry_blocks_partition=retry_blocks_partition,
                shard_key=shard_key)
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

    def registry_client(self, *, serialized: bool = False) -> Any:
        """The app's ``SchemaRegistryClient`` (made once; it caches schemas by id).
        ``serialized``: the Protobuf codecs' own client, which asks for schemas as
        serialized descriptors (``format=serialized``); the client caches a schema by id
        whatever form was asked, so the two forms must not share one cache."""
        from kafka_idem.codecs.registry import registry_client

        with self._codec_lock:
            client = self._registry.get(serialized)
            if client is None:
                url = self.settings.schema_registry_url
                if not url:
                    raise ConfigError("no schema registry: set KAFKA_IDEM_SCHEMA_REGISTRY_URL",
                                      setting="schema_registry_url")
                client = self._registry[serialized] = registry_client(
                    url, self.settings.schema_registry)
            return client

    def make_codec(self, handler: Handler[Any]) -> Codec:
        """The codec ``handler``'s format names, built from the app's settings."""
        from kafka_idem.codec_selection import codec_for

        return codec_for(self, handler)

    def bind_codec(self, handler: Handler[Any]) -> Codec:
        """Make ``handler``'s codec from its format and the settings, and bind it."""
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
        """Register the app's own schema set-up (idempotent SQL), run by ``kafka-idem migrate
        --app MODULE:APP`` (``kafka-idem migrate`` alone runs only the store's)."""
        self.migrations.append(fn)
        return fn

    def sqlalchemy(
        self, *, metadata: MetaData | None = None,
        engine_options: Mapping[str, Any] | None = None,
        session_options: Mapping[str, Any] | None = None,
    ) -> None:
        """Configure ``ctx.session``, the handlers' SQLAlchemy sessions (the
        ``sqlalchemy`` extra), once: ``metadata``'s tables are created by ``kafka-idem
        migrate --app`` (those missing; an app migration); ``engine_options`` (``echo``,
        ``hide_parameters``, ``execution_options``, ``query_cache_size``,
        ``logging_name``) and ``session_options`` (e.g. ``autoflush``, ``info``) apply to
        every handler's session. Without this call ``ctx.session`` has the defaults."""
        self.sessions.configure(metadata, engine_options, session_options)
        if metadata is not None:
            self.migrations.append(self.sessions.create_tables())

    def on_loop_close(
        self, fn: Callable[[], Awaitable[None]],
    ) -> Callable[[], Awaitable[None]]:
        """Register an ``async def`` that releases what the app's ``async def`` handlers
        made on an event loop (a shared HTTP client): it is awaited on each event loop
        that ran them, right before that loop closes (a member's at its stop, after its
        tasks ended; each process of the test kit's), within
        ``LOOP_CLOSE_SECONDS`` for all of them; one that raises or overruns is logged
        and the next one runs. ``asyncio.get_running_loop()`` tells which loop closes.

            clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}

            @app.on_loop_close
            async def close_client() -> None:
                client = clients.pop(asyncio.get_running_loop(), None)
                if client is not None:
                    await client.aclose()
        """
        self.loop_closers.append(check_loop_closer(fn))
        return fn

    def topic(self, name: str, *, partitions: int | None = None,
              config: Mapping[str, str] | None = None) -> str:
        """Declare a topic for ``kafka-idem topics create``: one the app produces to, or
        the partition count and configs a handler's source (or DLQ) topic should be
        created with. Existing topics are never changed. Returns ``name``.

            app.topic("inventory.reserve", partitions=6)
            app.topic("inventory.reserved", partitions=6, config={"retention.ms": "604800000"})
        """
        check_topic_name(name, setting="topic")
        if partitions is not None and partitions < 1:
            raise ConfigError(f"topic {name!r}: partitions must be at least 1",
                              setting="partitions")
        self.declared_topics[name] = {"partitions": partitions,
                                      "config": {str(k): str(v) for k, v in (config or {}).items()}}
        return name

    def event_topic(
        self, name: str, *, format: Format | Codec | CodecFactory | None = None,
        model: type[Any] | None = None, schema: str | None = None,
        partitions: int | None = None, config: Mapping[str, str] | None = None,
    ) -> str:
        """Declare a topic the app's handlers ``ctx.emit`` events to (the transactional
        outbox, docs/OUTBOX.md): its format, model and schema mean what they mean for
        ``app.handler`` (not given: the codec of the app's handler on ``name`` if it
        has one, else ``default_format``). ``kafka-idem topics create`` creates it
        (``partitions``, ``config`` as in :meth:`topic`); an app with an event topic
        runs the outbox relay in ``kafka-idem run``. Returns ``name``.

            app.event_topic("payments.charge-completed", model=ChargeCompleted)
        """
        self.topic(name, partitions=partitions, config=config)
        if format is None and model is None and schema is None and name in self.handlers:
            self.event_topics[name] = self.handlers[name]
            return name
        self.event_topics[name] = Handler(
            _never, name=f"event:{name}", topic=name, model=model, key=_no_key,
            hash_fields=(), mode="local", batch=False, dlq_topic=None, schema=schema,
            retry=None, errors=(), format=format, binder=self.bind_codec)
        return name

    def co_locate(self, conn: psycopg.Connection[Any], table: str, column: str) -> bool:
        """In an ``@app.migration``: distribute ``table`` by ``column`` (the handler's
        ``shard_key`` values) with the store's records when the store is distributed on
        Citus, so a message's writes there share its record's shard; nothing on one
        PostgreSQL (the same migration serves both). ``True`` when it distributed it.
        ``column`` must have the shard key's type (``text``) and every unique constraint
        of ``table`` must include it; a table that cannot be placed so, or is distributed
        otherwise already (by another column, apart from the records, a reference table),
        is a :class:`ConfigError` naming the table and the fix (docs/CITUS.md)."""
        from kafka_idem.store.citus import co_locate

        s = self.settings
        return co_locate(conn, table, column, schema=s.schema_name, records=s.table)

    @property
    def outbox(self) -> Emitter:
        """The app's outbox emitter (what ``ctx.emit`` writes through)."""
        from kafka_idem.outbox.emit import Emitter

        with self._codec_lock:
            if self._emitter is None:
                s = self.settings
                store = Store(schema=s.schema_name, table=s.table, namespace=self.namespace)
                self._emitter = Emitter(self.event_topics, store=store,
                                        shards=s.outbox_shards, app=self.name)
            return self._emitter

    def producer(self, *, config: Mapping[str, Any] | None = None,
                 timeout: float = 30.0) -> Producer:
        """A producer that encodes payloads with their topic's handler's codec and sets
        the Kafka key to their idempotency key (see :mod:`kafka_idem.producer`);
        ``config``: librdkafka options over the settings' ``producer_config()``::

            with app.producer() as producer:
                producer.send("inventory.reserve", {"shop": "s1", "order_id": "o-1", ...})
        """
        from kafka_idem.producer import Producer

        return Producer(self.handlers, self.settings, app=self.name, config=config,
                        timeout=timeout)

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
        """``handler``'s dead-letter topic: its ``dlq_topic=``, else topic + ``dlq_suffix``."""
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
        """The topics the app's handlers consume."""
        return list(self.handlers)


def _never(msg: Any, ctx: Context) -> Any:
    raise TypeError("an event topic's declaration is not a handler")


def _no_key(payload: Any) -> str:
    return ""


__all__ = ["App", "AsyncContext", "Context", "Done", "Handler", "StaleOwner"]
