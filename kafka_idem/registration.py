"""The checks of a registration (:meth:`kafka_idem.app.App.handler`, ``App(...)``),
made when it is written, not at the first message: each refusal a
:class:`~kafka_idem.errors.ConfigError` naming the setting."""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Awaitable, Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from kafka_idem.codecs.avro_codec import AvroCodec, non_string_fields, reader_mismatch
from kafka_idem.errors import ConfigError
from kafka_idem.handler import Handler, Mode, check_topic_name
from kafka_idem.keys import KeySpec, refuse_typed_key_fields
from kafka_idem.settings import Settings


def check_handler_options(
    topic: str, *, dlq_topic: str | None, mode: Mode, concurrency: int,
    ordering_key: KeySpec | None, taken: Collection[str], max_rate: float | None = None,
) -> None:
    """``@app.handler(...)``'s options, before the function is known: the topic
    names, one handler per topic (``taken``: the topics that have one), the mode, and
    ``concurrency`` for leased handlers only (``ordering_key`` orders retries in any
    mode), ``max_rate`` a positive number of messages a second."""
    check_topic_name(topic, setting="topic")
    if dlq_topic is not None:
        check_topic_name(dlq_topic, setting="dlq_topic")
    if topic in taken:
        raise ConfigError(f"topic {topic!r} already has a handler", setting="topic")
    if mode not in ("local", "leased"):
        raise ConfigError(f"mode must be 'local' or 'leased', not {mode!r}", setting="mode")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ConfigError(f"concurrency must be a whole number >= 1, not {concurrency!r}",
                          setting="concurrency")
    if max_rate is not None and (isinstance(max_rate, bool) or not isinstance(
            max_rate, int | float) or not math.isfinite(max_rate) or max_rate <= 0):
        raise ConfigError(f"handler of topic {topic!r}: max_rate must be a positive number "
                          f"of messages a second, not {max_rate!r}", setting="max_rate")
    if mode != "leased" and concurrency > 1:
        raise ConfigError(f"handler of topic {topic!r}: concurrency is for mode='leased' "
                          f"handlers, not mode={mode!r} (local mode runs batches; see "
                          "local_workers)", setting="concurrency")


def handler_name(fn: Callable[..., Any], name: str | None) -> str:
    """The name a handler registers under: ``name=``, else its function's. Refused, as a
    :class:`ConfigError` naming what to do: a handler registered already (what
    ``@app.handler`` returned, given to ``app.handler(...)`` again) and a callable
    without a name of its own."""
    if isinstance(fn, Handler):
        raise ConfigError(
            f"{fn.name!r} is a registered handler already (of topic {fn.topic!r}), not a "
            f"function: register its function, app.handler(..., name=...)({fn.name}.fn) (a "
            "name of its own keeps its metrics and pauses apart; its bulk handler or "
            "reconciler again on what that returns)", setting="handler")
    called = name or getattr(fn, "__name__", None)
    if not called:
        raise ConfigError(f"the handler {fn!r} has no __name__: give it one with name=",
                          setting="name")
    return str(called)


def check_handler_function(fn: Callable[..., Any], *, name: str, mode: Mode,
                           hash_fields: Sequence[str]) -> None:
    """The decorated function fits the options: an ``async def`` one runs in leased
    mode; ``hash_fields`` names at least one field."""
    if inspect.iscoroutinefunction(fn) and mode != "leased":
        raise ConfigError(f"handler {name!r} is async def: async "
                          "handlers run in mode='leased'", setting="mode")
    if not hash_fields:
        raise ConfigError(f"handler {name!r}: hash_fields must name at "
                          "least one payload field (what makes two requests with one "
                          "key the same)", setting="hash_fields")


def check_setting_names(app: str, overrides: Collection[str]) -> None:
    """Every keyword ``App(...)`` got names a setting: a misspelt one is refused at
    once, naming the setting it probably meant (its value is checked when the settings
    are first read, with the environment's)."""
    known = list(Settings.model_fields)
    for name in overrides:
        if name in Settings.model_fields:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}=?)" if close else ""
        raise ConfigError(f"App({app!r}) got {name}=, which is not a setting{hint}; the "
                          "settings are those of docs/reference/settings.md, lower-case",
                          setting=name)


def check_avro_reader(handler: Handler[Any], schemas: AvroCodec, schemas_dir: Path) -> None:
    """The handler's ``schema=`` exists and its records can become its payload."""
    assert handler.schema is not None
    if not schemas.has(handler.schema):
        known = ", ".join(schemas.names) or "none"
        raise ConfigError(
            f"schema {handler.schema!r} is not among the Avro schemas of "
            f"{str(schemas_dir)!r} (KAFKA_IDEM_SCHEMAS_DIR; found: {known})",
            setting="schema")
    reader = schemas.schema(handler.schema)
    problem = reader_mismatch(reader, handler.adapter,
                              handler.model, (*handler.key.fields, *handler.hash_fields))
    if problem:
        raise ConfigError(f"schema {handler.schema!r} does not fit the handler: {problem}",
                          setting="schema")
    if handler.key.strings_only:  # no model: a key field takes strings only
        refuse_typed_key_fields(non_string_fields(reader, handler.key.fields),
                                f"schema {handler.schema!r}")


def check_loop_closer(fn: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """``app.on_loop_close`` takes an ``async def`` function (awaited on the loop)."""
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"app.on_loop_close takes an async def function, not {fn!r}",
                          setting="on_loop_close")
    return fn
