"""The reference pages made from tables in the code: the settings (:class:`Settings`'
fields), the metrics (:data:`kafka_idem.observe.metrics.METRICS`) and the ``idem.*``
headers (:mod:`kafka_idem.deadletters.headers`)."""

from __future__ import annotations

import enum
import types
import typing
from pathlib import PurePath
from typing import Any

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from kafka_idem.deadletters import headers
from kafka_idem.observe.metrics import METRICS
from kafka_idem.settings import Settings
from tools.docs.markdown import cell, code, page, table

ENV_PREFIX = str(Settings.model_config.get("env_prefix", ""))
# bool before int: a bool is an int to issubclass
_SIMPLE = {str: "string", bool: "boolean", int: "integer", float: "number",
           SecretStr: "string, secret", PurePath: "path"}


def env_name(field: str) -> str:
    """The environment variable a setting is read from (``KAFKA_IDEM_BATCH_SIZE``)."""
    return f"{ENV_PREFIX}{field.upper()}"


def type_name(annotation: Any) -> str:
    """A setting's type in user terms: ``integer``, ``one of json, avro``, ``JSON object``..."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        kept = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(kept) + (", optional" if len(kept) < len(args) else "")
    if origin is dict:
        return "JSON object"
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            raise TypeError(f"nested settings model {annotation.__name__}: "
                            "the settings page does not list its fields yet")
        if issubclass(annotation, enum.Enum):
            return "one of " + ", ".join(str(m.value) for m in annotation)
        for kind, name in _SIMPLE.items():
            if issubclass(annotation, kind):
                return name
    raise TypeError(f"no user-facing name for the setting type {annotation!r}")


# A constraint of pydantic's metadata: its type, the attribute with its value, the words.
_BOUNDS = (
    (annotated_types.Gt, "gt", "> {}"), (annotated_types.Ge, "ge", ">= {}"),
    (annotated_types.Lt, "lt", "< {}"), (annotated_types.Le, "le", "<= {}"),
    (annotated_types.MinLen, "min_length", "at least {} characters"),
    (annotated_types.MaxLen, "max_length", "at most {} characters"),
)


def bounds(info: FieldInfo) -> str:
    """A field's constraints, e.g. ``>= 1, <= 64``."""
    return ", ".join(said.format(getattr(rule, attr)) for rule in info.metadata
                     for kind, attr, said in _BOUNDS if isinstance(rule, kind))


def default_of(info: FieldInfo) -> str:
    """A field's default as its variable would be written (a dash when unset)."""
    if info.default_factory is not None:
        value: Any = info.default_factory()  # type: ignore[call-arg]
    else:
        value = info.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return code("true" if value else "false")
    if isinstance(value, dict):
        return code("{}") if not value else code(repr(value))
    if value == "":
        return "empty"
    return code(str(value))


def settings_page() -> str:
    """Every setting of :class:`Settings`, in the model's order."""
    rows = []
    for name, info in Settings.model_fields.items():
        if info.alias or info.validation_alias:
            raise TypeError(f"setting {name} has an alias: its variable is not "
                            f"{env_name(name)}")
        if not info.description:
            raise ValueError(f"setting {name} has no description (Field(description=...))")
        kind = type_name(info.annotation)
        limits = bounds(info)
        rows.append([code(env_name(name)), code(name),
                     cell(f"{kind}; {limits}" if limits else kind),
                     default_of(info), cell(info.description)])
    body = [
        "Every setting of `kafka_idem.Settings`, in the model's order. A setting is given "
        "as an argument (`Settings(batch_size=100)`, `App(\"payments\", batch_size=100)`) "
        "or as its "
        "environment variable; arguments win. `JSON object` settings take JSON in their "
        "variable (`KAFKA_IDEM_KAFKA='{\"linger.ms\": 5}'`); a `KAFKA_IDEM_*` variable "
        "that is no setting is warned about once.",
        "",
        *table(["Variable", "Setting", "Type", "Default", "Description"], rows),
    ]
    return page("Settings", "the fields of kafka_idem.settings.Settings", body)


def metrics_page() -> str:
    """Every metric of :data:`METRICS`, sorted by name."""
    rows = []
    for _attr, kind, name, help_text, labels in sorted(METRICS, key=lambda m: m[2]):
        kind_name = kind.__name__.lower()
        if kind_name == "histogram":
            kind_name = f"histogram ({name}_bucket, _sum, _count)"
        rows.append([code(name), cell(kind_name),
                     ", ".join(code(label) for label in labels) or "-", cell(help_text)])
    body = [
        "Every metric a kafka_idem process exports on `/metrics` (the `metrics_port` "
        "setting, `kafka-idem run --metrics-port`), sorted by name. Counters are counted "
        "on the message path; the gauges marked *sampled* are read from the database at "
        "an interval (`metrics_sample_seconds`), never on a scrape.",
        "",
        *table(["Metric", "Type", "Labels", "Help"], rows),
    ]
    return page("Metrics", "kafka_idem.observe.metrics.METRICS", body)


def _header_rows(written: tuple[headers.Header, ...]) -> list[list[str]]:
    return [[code(h.name), cell(h.meaning), cell(h.present)] for h in written]


def headers_page() -> str:
    """The ``idem.*`` headers of :mod:`kafka_idem.deadletters.headers`, in writing order."""
    head = ["Header", "Meaning", "Present"]
    body = [
        "Every `idem.*` header kafka_idem writes, in the order it writes them. Values are "
        "UTF-8 text. Names starting with `idem.` are kafka_idem's: `ctx.emit` refuses "
        "them in an event's own headers.",
        "",
        "## On dead letters",
        "",
        "A dead letter keeps the original Kafka key and value bytes unchanged, and the "
        "original headers (less `idem.*` ones from an earlier trip, except the "
        "`idem.replay.*` lineage), followed by these:",
        "",
        *table(head, _header_rows(headers.DEAD_LETTER)),
        "",
        "## On outbox events",
        "",
        "An event published by the relay carries the headers given to `ctx.emit` (and "
        "the trace context), followed by these:",
        "",
        *table(head, _header_rows(headers.OUTBOX_EVENT)),
        "",
        "## On replayed messages",
        "",
        "A dead letter's key and value sent again to a topic (`kafka-idem dlq replay`, "
        "`kafka-idem rerun`) carry the original headers and, instead of the dead "
        "letter's `idem.*` headers, this lineage (kept if the copy is dead-lettered "
        "again):",
        "",
        *table(head, _header_rows(headers.REPLAYED)),
    ]
    return page("Headers", "kafka_idem.deadletters.headers", body)
