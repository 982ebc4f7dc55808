"""Dead-letter records as read back from a DLQ topic, and which of them to pick.

:class:`DlqRecord` is one record with its ``idem.*`` headers parsed (the headers
:mod:`kafka_idem.deadletters.dead_letter` wrote); :class:`Selection` is the filter that ``dlq list``
and ``dlq replay`` share (key, kind, handler, failure time, partition, offsets).
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from kafka_idem.deadletters import headers as written
from kafka_idem.deadletters.dead_letter import ERROR_KINDS, PREFIX
from kafka_idem.errors import ConfigError, MessageError
from kafka_idem.settings import Settings

if TYPE_CHECKING:
    from kafka_idem.app import App

Header = tuple[str, bytes | None]


def _header_text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("utf-8", "replace")


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _when(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


REPLAY_GROUP = written.REPLAY_GROUP.name  # the replay that sent a copy (its group)


@dataclass(frozen=True, slots=True)
class DlqRecord:
    """One record read from a DLQ topic, with its ``idem.*`` headers parsed."""

    dlq_topic: str
    partition: int
    offset: int
    timestamp: dt.datetime | None
    key: bytes | None
    value: bytes | None
    headers: tuple[Header, ...]
    idempotency_key: str | None = None
    kind: str | None = None
    error_class: str | None = None
    error_message: str | None = None
    handler: str | None = None
    consumer_group: str | None = None
    attempts: int | None = None
    original_topic: str | None = None
    original_partition: int | None = None
    original_offset: int | None = None
    first_failure_at: dt.datetime | None = None
    last_failure_at: dt.datetime | None = None
    truncated: str | None = None  # what the DLQ copy lacks ("value", ...): see dlq.slim
    namespace: str | None = None  # None: written before namespaces (found by its key)
    # idem.replay.* lineage: the dead letter of a copy a replay sent
    replayed_from: str | None = None  # the DLQ topic that replay read
    replay_group: str | None = None  # that replay (copies from before it was recorded: None)

    @classmethod
    def from_message(cls, msg: Any) -> DlqRecord:
        headers = tuple((k, v) for k, v in (msg.headers() or []))
        idem = {k: _header_text(v) for k, v in headers if k.startswith(PREFIX)}
        ts_type, ts = msg.timestamp()
        return cls(
            dlq_topic=msg.topic(),
            partition=msg.partition(),
            offset=msg.offset(),
            timestamp=dt.datetime.fromtimestamp(ts / 1000, dt.UTC) if ts_type else None,
            key=msg.key(),
            value=msg.value(),
            headers=headers,
            idempotency_key=idem.get("idem.key"),
            kind=idem.get("idem.error.kind"),
            error_class=idem.get("idem.error.class"),
            error_message=idem.get("idem.error.message"),
            handler=idem.get("idem.handler"),
            consumer_group=idem.get("idem.consumer_group"),
            attempts=_int(idem.get("idem.attempts")),
            original_topic=idem.get("idem.original.topic"),
            original_partition=_int(idem.get("idem.original.partition")),
            original_offset=_int(idem.get("idem.original.offset")),
            first_failure_at=_when(idem.get("idem.first_failure_at")),
            last_failure_at=_when(idem.get("idem.last_failure_at")),
            truncated=idem.get("idem.truncated"),
            namespace=idem.get("idem.namespace"),
            replayed_from=idem.get("idem.replay.source_topic"),
            replay_group=idem.get(REPLAY_GROUP),
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-able view; header values as text (``base64:...`` when not UTF-8)."""
        return {
            "dlq_topic": self.dlq_topic,
            "partition": self.partition,
            "offset": self.offset,
            "timestamp": self.timestamp.isoformat() if self.timestamp else None,
            "namespace": self.namespace,
            "idempotency_key": self.idempotency_key,
            "kind": self.kind,
            "error_class": self.error_class,
            "error_message": self.error_message,
            "handler": self.handler,
            "consumer_group": self.consumer_group,
            "attempts": self.attempts,
            "original_topic": self.original_topic,
            "original_partition": self.original_partition,
            "original_offset": self.original_offset,
            "truncated": self.truncated,
            "first_failure_at": _iso(self.first_failure_at),
            "last_failure_at": _iso(self.last_failure_at),
            "kafka_key": display_bytes(self.key),
            "value_size": len(self.value) if self.value is not None else None,
            "headers": [[k, display_bytes(v)] for k, v in self.headers],
        }


def payload_view(rec: DlqRecord, app: App | None = None) -> dict[str, Any]:
    """The record's value for ``dlq show --payload``, JSON-able: decoded by the handler
    of its original topic in ``app`` (as the consumer decoded it: the model as JSON),
    else parsed as JSON text when it is some, else its raw bytes in base64 (and as
    text when they are UTF-8) with why."""
    if rec.value is None:
        return {"decoded_by": None, "error": "the record has no value", "text": None,
                "base64": None}
    handler = app.handlers.get(rec.original_topic or "") if app is not None else None
    error = None
    if handler is not None:
        try:
            decoded = handler.decode(rec.value)
        except MessageError as exc:
            error = str(exc)
        else:
            return {"decoded_by": f"handler {handler.name!r}, {handler.codec.name}",
                    "value": _jsonable(decoded)}
    else:
        try:
            return {"decoded_by": "JSON text, not by a handler (give --app for its codec)",
                    "value": json.loads(rec.value.decode("utf-8"))}
        except ValueError:  # UnicodeDecodeError too
            error = ("not JSON text; give --app MODULE:APP to decode it with its handler"
                     if app is None else f"app {app.name!r} has no handler of topic "
                     f"{rec.original_topic!r}")
    try:  # a broken JSON document is still text: shown as such, not only as base64
        text: str | None = rec.value.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    return {"decoded_by": None, "error": error, "text": text,
            "base64": base64.b64encode(rec.value).decode("ascii")}


def _jsonable(decoded: Any) -> Any:
    """A decoded payload as JSON values (a model as pydantic dumps it in JSON mode)."""
    if isinstance(decoded, BaseModel):
        return decoded.model_dump(mode="json")
    return json.loads(json.dumps(decoded, default=str))


def display_bytes(value: bytes | None) -> str | None:
    """Text when the bytes are UTF-8, else ``base64:<data>``."""
    if value is None:
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(value).decode("ascii")


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


@dataclass(frozen=True, slots=True)
class Selection:
    """Which DLQ records to list or replay. Every set field must match.

    ``since`` is inclusive and ``until`` exclusive, both on ``idem.last_failure_at``;
    ``from_offset`` and ``to_offset`` are inclusive DLQ offsets (of every partition
    read, or of ``partition`` when it is set); ``positions``, when set, are the only
    (partition, offset) pairs that match (records chosen one by one: the console's).
    """

    key: str | None = None
    kind: str | None = None
    error_class: str | None = None  # idem.error.class, e.g. TypeError (a code defect)
    handler: str | None = None
    namespace: str | None = None  # a record from before namespaces (none) matches any
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    partition: int | None = None
    from_offset: int | None = None
    to_offset: int | None = None
    positions: frozenset[tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        if self.positions is not None:
            object.__setattr__(self, "positions", frozenset(
                (int(p), int(o)) for p, o in self.positions))
        if self.kind is not None and self.kind not in ERROR_KINDS:
            raise ConfigError(f"kind must be one of {', '.join(ERROR_KINDS)}", setting="kind")
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and value.tzinfo is None:  # naive means UTC
                object.__setattr__(self, name, value.replace(tzinfo=dt.UTC))
        if (self.from_offset is not None and self.to_offset is not None
                and self.from_offset > self.to_offset):
            raise ConfigError("from_offset must be <= to_offset", setting="from_offset")

    def matches(self, rec: DlqRecord) -> bool:
        if self.key is not None and rec.idempotency_key != self.key:
            return False
        if self.kind is not None and rec.kind != self.kind:
            return False
        if self.error_class is not None and rec.error_class != self.error_class:
            return False
        if self.handler is not None and rec.handler != self.handler:
            return False
        if (self.namespace is not None and rec.namespace is not None
                and rec.namespace != self.namespace):
            return False
        if self.since is not None or self.until is not None:
            at = rec.last_failure_at
            if at is None:
                return False
            if self.since is not None and at < self.since:
                return False
            if self.until is not None and at >= self.until:
                return False
        if self.partition is not None and rec.partition != self.partition:
            return False
        if self.from_offset is not None and rec.offset < self.from_offset:
            return False
        if self.positions is not None and (rec.partition, rec.offset) not in self.positions:
            return False
        return self.to_offset is None or rec.offset <= self.to_offset

    @classmethod
    def at(cls, positions: Iterable[tuple[int, int]], **filters: Any) -> Selection:
        """The records at ``positions`` (that ``filters`` match too), read from the
        first of them to the last only."""
        chosen = frozenset(positions)
        if not chosen:
            raise ConfigError("no record chosen", setting="positions")
        parts = {p for p, _ in chosen}
        return cls(**filters, positions=chosen,
                   partition=parts.pop() if len(parts) == 1 else None,
                   from_offset=min(o for _, o in chosen), to_offset=max(o for _, o in chosen))

    def to_json(self) -> dict[str, Any]:
        """The set fields, JSON-able (for the audit trail and the replay group's name)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, frozenset):
                out[f.name] = [list(x) for x in sorted(value)]
            elif value is not None:
                out[f.name] = value.isoformat() if isinstance(value, dt.datetime) else value
        return out


def dlq_topic_for(settings: Settings, source_topic: str, app: App | None = None) -> str:
    """The DLQ of ``source_topic``: its handler's in ``app`` (a handler may name its own
    ``dlq_topic``), else ``source_topic`` + the ``dlq_suffix`` setting."""
    handler = app.handlers.get(source_topic) if app is not None else None
    if app is not None and handler is not None:
        return app.dlq_topic(handler)
    return f"{source_topic}{settings.dlq_suffix}"
