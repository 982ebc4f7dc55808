"""A registered handler and what it is given: :class:`Handler`, :class:`Context`,
:class:`Done` (see :mod:`kafka_idem.app` for registering one with ``@app.handler``).

A handler gets the decoded, validated payload (:meth:`Handler.decode`, through its
codec) and a :class:`Context` whose ``tx`` is an open psycopg transaction.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import psycopg
from pydantic import ValidationError

from kafka_idem.codecs.base import FORMATS, Codec, CodecFactory, adapter_for, fields_of
from kafka_idem.context import EMITTED as EMITTED
from kafka_idem.context import AsyncContext as AsyncContext
from kafka_idem.context import Context as Context
from kafka_idem.context import Emitted as Emitted
from kafka_idem.context import EventSink as EventSink
from kafka_idem.errors import (
    ConfigError,
    MessageError,
    MissingKeyField,
    PayloadTooLarge,
    Permanent,
    Retryable,
    Undecodable,
    UnknownOutcome,
)
from kafka_idem.keys import KeySpec, KeyTemplate
from kafka_idem.retry import RetryPolicy
from kafka_idem.settings import TOPIC_CHARS
from kafka_idem.store import is_data_error

M = TypeVar("M")

Format = Literal["json", "avro", "registry"]

Mode = Literal["local", "leased"]
ErrorKind = Literal["retryable", "permanent", "unknown_outcome"]


@dataclass(frozen=True, slots=True)
class Done:
    """What ``reconcile`` returns when the downstream says the operation already happened."""

    result: Any = None


Reconciler = Callable[[Any, Any], Done | Awaitable[Done | None] | None]
BulkHandler = Callable[[list[tuple[Any, Context]], psycopg.Connection[Any]], list[Any]]


# Exceptions that say the code is wrong, not the message or the surroundings: running
# the same code again cannot fix them, so they are permanent by default (dead-lettered
# at the first attempt; after the fix, ``kafka-idem dlq replay --include-permanent``).
# Not KeyError, ValueError, LookupError or AssertionError: those can depend on the
# data or on timing. ``NameError`` covers ``UnboundLocalError``. Opt back per app or
# handler with ``errors={TypeError: "retryable"}`` (mappings are checked first).
CODE_DEFECTS: tuple[type[Exception], ...] = (
    TypeError, AttributeError, NameError, NotImplementedError,
)


def refused_by_client(exc: BaseException) -> bool:
    """psycopg refused a call before any server saw it (a ``ProgrammingError`` with no
    SQLSTATE): a wrong number of query parameters, a fetch with no results, a
    ``commit()`` inside the attempt's transaction. A code defect too; a server's
    ``ProgrammingError`` (an undefined table: perhaps a migration not run yet) has a
    SQLSTATE and stays retryable."""
    return ((isinstance(exc, psycopg.ProgrammingError) and not exc.sqlstate)
            or _orm_misuse(exc))


# SQLAlchemy's errors that say the code is wrong (an ORM call with wrong arguments, a
# statement that cannot compile, an object of no mapped class): code defects too.
_ORM_DEFECTS = frozenset({"ArgumentError", "CompileError", "UnmappedError"})


def _orm_misuse(exc: BaseException) -> bool:
    return (type(exc).__module__.startswith("sqlalchemy")
            and any(c.__name__ in _ORM_DEFECTS for c in type(exc).__mro__))


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
    *((cls, "permanent") for cls in CODE_DEFECTS),
)


def check_topic_name(name: str, *, setting: str) -> str:
    """``name`` if Kafka accepts it as a topic name, else a :class:`ConfigError`."""
    if len(name) > 249 or not TOPIC_CHARS.fullmatch(name) or name in (".", ".."):
        raise ConfigError(
            f"{name!r} is not a valid Kafka topic name (1-249 ASCII letters, digits, "
            "'.', '_', '-')", setting=setting)
    return name


def check_takes_two(fn: Callable[..., Any], *, what: str, params: str, setting: str) -> None:
    """A :class:`ConfigError` now when ``fn`` cannot be called with the two positional
    arguments the framework passes, instead of a ``TypeError`` retried at every message."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(None, None)
    except TypeError as exc:
        shown = f"{getattr(fn, '__name__', type(fn).__name__)}({', '.join(sig.parameters)})"
        raise ConfigError(f"{what} must take two arguments {params}; {shown} cannot: {exc}",
                          setting=setting) from None


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
        format: Format | Codec | CodecFactory | None = None,
        binder: Callable[[Handler[Any]], Codec] | None = None,
        concurrency: int = 1,
        ordering_key: KeySpec | None = None,
        max_rate: float | None = None,
        retry_blocks_partition: bool = False,
        shard_key: KeySpec | None = None,
    ) -> None:
        check_takes_two(fn, what=f"handler {name!r}", params="(msg, ctx)", setting="handler")
        self.fn = fn
        # a retry holds the whole partition (strict partition order) instead of its lanes
        self.retry_blocks_partition = retry_blocks_partition
        self.is_async = inspect.iscoroutinefunction(fn)
        self.concurrency = concurrency
        self.max_rate = max_rate  # messages a second in this member (consume/rate_limit.py)
        self.ordering = (KeyTemplate(ordering_key, setting="ordering_key")
                         if ordering_key is not None else None)
        self.name = name
        self.topic = topic
        self.model = model
        # Without a model the payload's types are the sender's: a key field must hold a
        # string, or 7 and "7" would share a key (docs/BAD_INPUT.md).
        self.key = KeyTemplate(key, strings_only=model is None)
        # the shard a distributed store keeps this message's rows on (None: the key's own)
        self.shard = ShardKey(name, shard_key, self.key) if shard_key is not None else None
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
        elif format is not None and not isinstance(format, (Codec, CodecFactory)):
            raise ConfigError(f"handler {name!r}: format {format!r} is neither "
                              f"{list(FORMATS)} nor a codec (name, decode, encode)",
                              setting="format")
        self.format = format
        self._binder = binder
        self._codec: Codec | None = None
        self.payload_max_bytes: int | None = None
        known = fields_of(model)
        if known is not None:
            _check_fields(name, topic, model, known, self.key.fields, hash_fields,
                          self.ordering.fields if self.ordering is not None else ())
        check = getattr(format, "check_handler", None)
        if callable(check):  # a codec's own checks of the model and fields, now
            try:
                check(self)
            except ConfigError as exc:
                raise ConfigError(f"handler {name!r}: {exc.message}", **exc.context) from exc

    # --- payloads -----------------------------------------------------------

    @property
    def format_name(self) -> str | None:
        """The format asked for: ``format=``, else ``"avro"`` with ``schema=``, else
        ``None`` (the app's ``default_format``)."""
        if isinstance(self.format, str):
            return self.format
        if self.format is not None:
            return str(getattr(self.format, "name", type(self.format).__name__))
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
        """Give the handler its codec and the largest value it decodes (the app does)."""
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

    @property
    def keyed(self) -> bool:
        """Run key-ordered (:mod:`kafka_idem.consume.concurrency.keyed_state`): many keys
        of a partition at once, or an ``async def`` handler; else a partition's messages
        run as prefixes, one after another."""
        return self.concurrency > 1 or self.is_async

    def __call__(self, msg: M, ctx: Context) -> Any:
        return self.fn(msg, ctx)

    def reconciler(self, fn: Reconciler) -> Reconciler:
        """Register ``fn(msg, ctx) -> Done | None``: asked first on the attempt after an
        unknown outcome (or a lease lost mid-flight); ``Done(result)`` completes the
        record without calling the handler again, ``None`` retries it with the same key.
        An ``async def`` handler's reconciler is ``async def`` too (same ``ctx``)."""
        if inspect.iscoroutinefunction(fn) != self.is_async:
            kind = "async def" if self.is_async else "def"
            raise ConfigError(f"handler {self.name!r} is {kind}: its reconciler must be "
                              f"{kind} too (it shares the handler's ctx.tx)",
                              setting="reconciler")
        check_takes_two(fn, what=f"handler {self.name!r}'s reconciler", params="(msg, ctx)",
                        setting="reconciler")
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
        check_takes_two(fn, what=f"handler {self.name!r}'s bulk handler", params="(batch, tx)",
                        setting="bulk_handler")
        self.bulk = fn
        return fn

    def classify(self, exc: BaseException) -> ErrorKind:
        """Retryable, permanent or unknown outcome: the handler's ``errors=``, then the
        app's, then :data:`DEFAULT_ERRORS` (a code defect, :data:`CODE_DEFECTS`, is
        permanent), first match wins. Unmapped exceptions are retryable (up to the
        retry limit, then exhausted)."""
        rule = self._rule(exc)
        if rule is not None:
            return rule[1]
        if refused_by_client(exc):
            return "permanent"
        if is_data_error(exc):
            # The database refused a value the message brought (e.g. an index entry
            # over its size limit): the same message can never succeed.
            return "permanent"
        return "retryable"

    def code_defect(self, exc: BaseException) -> bool:
        """``exc`` is permanent because it is a code defect (:data:`CODE_DEFECTS`), not
        because a mapping or its class says so otherwise: its failure says so."""
        rule = self._rule(exc)
        if rule is None:
            return refused_by_client(exc)
        return rule[1] == "permanent" and issubclass(rule[0], CODE_DEFECTS)

    def _rule(self, exc: BaseException) -> tuple[type[BaseException], ErrorKind] | None:
        """The first mapping ``exc`` matches (or, for the psycopg cause of an ORM error,
        :func:`kafka_idem.orm.causes.as_cause`, the SQLAlchemy error around it)."""
        wrapper = exc.__cause__
        if wrapper is not None and not type(wrapper).__module__.startswith("sqlalchemy"):
            wrapper = None
        for rule in self.errors:
            if isinstance(exc, rule[0]) or (wrapper is not None and isinstance(wrapper, rule[0])):
                return rule
        return None


class ShardKey:
    """A handler's ``shard_key=``: a template of payload fields that ``key=`` names too,
    or a function of the idempotency key (``lambda key: key.split(":")[0]``). Either
    way one idempotency key always has one shard: two messages with one key placed on
    two shards would each find no record of the other, and both take effect."""

    def __init__(self, name: str, spec: KeySpec, key: KeyTemplate) -> None:
        self.template: KeyTemplate | None = None
        self.of_key: Callable[[str], Any] | None = None
        if callable(spec):
            _takes_one(name, spec)
            self.of_key = spec
            return
        template = KeyTemplate(spec, setting="shard_key", strings_only=key.strings_only)
        if not isinstance(key.spec, str):
            raise ConfigError(
                f"handler {name!r}: with key= a function, shard_key= cannot be a template "
                "(its fields could differ between two messages of one key); give a "
                "function of the idempotency key, e.g. shard_key=lambda key: "
                "key.split(':')[0]", setting="shard_key")
        extra = [f for f in template.fields if f not in key.fields]
        if extra:
            raise ConfigError(
                f"handler {name!r}: shard_key= names {', '.join(map(repr, extra))}, which "
                f"key= ({key.spec!r}) does not: one idempotency key must always have one "
                "shard; add the field to key= or leave it out of shard_key=",
                setting="shard_key")
        self.template = template

    @property
    def escapes(self) -> bool:
        """Whether :meth:`build` escapes (a template) or not (a function)."""
        return self.template is not None and self.template.escapes

    def build(self, payload: Any, key: str) -> str:
        """The shard key of a message with ``payload`` and idempotency key ``key``."""
        if self.template is not None:
            return self.template.build(payload)
        assert self.of_key is not None
        shard = self.of_key(key)
        if not isinstance(shard, str) or not shard or shard.isspace():
            raise MissingKeyField(f"the shard_key function returned {shard!r} for key "
                                  f"{key!r}, not a non-empty string")
        return shard


def _takes_one(name: str, fn: Callable[..., Any]) -> None:
    try:
        inspect.signature(fn).bind("key")
    except TypeError:
        raise ConfigError(
            f"handler {name!r}: a shard_key= function takes one argument, the idempotency "
            "key (a function of the payload could place two messages of one key apart)",
            setting="shard_key") from None
    except ValueError:  # no signature to read (a builtin): called as documented
        pass


def _check_fields(name: str, topic: str, model: Any, known: tuple[str, ...],
                  key_fields: Sequence[str], hash_fields: Sequence[str],
                  ordering_fields: Sequence[str] = ()) -> None:
    """Every field ``key=``, ``hash_fields=`` and ``ordering_key=`` name is one of the
    model's: else one error naming the handler, each unknown field and the setting
    that names it."""
    problems, settings = [], []
    for setting, fields in (("key", key_fields), ("hash_fields", hash_fields),
                            ("ordering_key", ordering_fields)):
        unknown = [f for f in dict.fromkeys(fields) if f not in known]
        if unknown:
            settings.append(setting)
            problems.append(f"{setting}= names {', '.join(map(repr, unknown))}")
    if problems:
        model_name = getattr(model, "__name__", model)
        raise ConfigError(
            f"handler {name!r} (topic {topic!r}): {' and '.join(problems)}, but {model_name} "
            f"has no such field (its fields: {', '.join(known) or 'none'})",
            setting="/".join(settings))
