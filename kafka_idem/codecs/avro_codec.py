"""Avro payloads: :class:`AvroObjectCodec`, Avro single-object encoding (the ``"avro"``
format: ``C3 01`` + the writer schema's CRC-64-AVRO fingerprint + the body), writer
schemas from the ``.avsc`` files of a directory (:class:`AvroCodec`), read with the
handler's reader schema; and the checks of a reader schema against the handler's model
(:func:`reader_mismatch`, :func:`non_string_fields`), which the registry codec shares."""


from __future__ import annotations

import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import fastavro
import fastavro.schema
from pydantic import (
    TypeAdapter,
)

from kafka_idem.codecs.base import (
    CONFLUENT_MAGIC,
    SINGLE_OBJECT_MAGIC,
    Codec,
    _name_of,
    as_python,
    fields_of,
    sniff,
    validate,
)
from kafka_idem.errors import ConfigError, Undecodable


def reader_mismatch(reader: Any, adapter: TypeAdapter[Any], model: Any,
                    fields: tuple[str, ...]) -> str | None:
    """Why records read with the Avro ``reader`` schema could never become the handler's
    payload, or ``None``: a field the model requires (or, without a model, a key or hash
    field) that the schema lacks; a field the schema adds that a model forbidding extra
    fields would refuse. Checked at start-up: each would fail every message."""
    if not isinstance(reader, dict) or reader.get("type") != "record":
        return None
    avro = {f["name"] for f in reader.get("fields", [])}
    if model is None:
        lacking = [f for f in fields if f not in avro]
        return f"it has no field {lacking} (key or hash fields)" if lacking else None
    try:
        js = adapter.json_schema(mode="validation")
    except Exception:  # a model pydantic cannot describe: nothing to compare
        return None
    names = set(fields_of(model) or ())
    lacking = [f for f in js.get("required", []) if f not in avro
               and _name_of(model, f) not in avro]
    if lacking:
        return f"it has no field {lacking}, which {getattr(model, '__name__', model)} requires"
    if js.get("additionalProperties") is False:
        extra = sorted(avro - set(js.get("properties", {})) - names)
        if extra:
            return (f"its fields {extra} are not in {getattr(model, '__name__', model)}, "
                    "which forbids extra fields")
    return None


# Avro types a record field's value is never a str of (an enum is read as its
# symbol's name; a named type is looked up; an unknown name is given the benefit of
# the doubt: the message's key is checked anyway).
_NOT_STRINGS = frozenset(("null", "boolean", "int", "long", "float", "double", "bytes",
                          "record", "error", "array", "map", "fixed"))


def _may_be_string(avro_type: Any, named: Mapping[str, Any], depth: int = 0) -> bool:
    """Whether a value of ``avro_type`` (a parsed Avro type) can be read as a string:
    a ``string`` (logical types such as ``uuid`` included), an ``enum``, or a union
    with one of them."""
    if depth > 32:
        return True
    if isinstance(avro_type, list):
        return any(_may_be_string(t, named, depth + 1) for t in avro_type)
    if isinstance(avro_type, dict):
        return _may_be_string(avro_type.get("type"), named, depth + 1)
    if not isinstance(avro_type, str) or avro_type in _NOT_STRINGS:
        return False
    if avro_type in ("string", "enum"):
        return True
    ref = named.get(avro_type)
    return ref is None or _may_be_string(ref, named, depth + 1)


def _type_text(avro_type: Any) -> str:
    """A short name of a parsed Avro type for an error message."""
    if isinstance(avro_type, list):
        return "[" + ", ".join(_type_text(t) for t in avro_type) + "]"
    if isinstance(avro_type, dict):
        kind = avro_type.get("type")
        return kind if isinstance(kind, str) else _type_text(kind)
    return str(avro_type)


def non_string_fields(reader: Any, fields: tuple[str, ...]) -> dict[str, str]:
    """The ``fields`` of the Avro record schema ``reader`` that can never hold a string
    (their Avro type has no ``string`` or ``enum`` branch), each with its type: without
    a model, a key template field of them would refuse every message (a key field takes
    strings only there). Fields the schema lacks are :func:`reader_mismatch`'s."""
    if not isinstance(reader, dict) or reader.get("type") != "record":
        return {}
    named = reader.get("__named_schemas") or {}
    types = {f["name"]: f["type"] for f in reader.get("fields", [])}
    return {f: _type_text(types[f]) for f in dict.fromkeys(fields)
            if f in types and not _may_be_string(types[f], named)}




def fingerprint(parsed_schema: Any) -> bytes:
    """The 8 bytes single-object encoding puts on the wire (CRC-64-AVRO, little-endian)."""
    canonical = fastavro.schema.to_parsing_canonical_form(parsed_schema)
    # fastavro returns the fingerprint's bytes in wire (little-endian) order.
    return bytes.fromhex(fastavro.schema.fingerprint(canonical, "CRC-64-AVRO"))


def read_avro(body: bytes, writer: Any, reader: Any, *, fmt: str) -> dict[str, Any]:
    """An Avro binary body as a record, or :class:`Undecodable` with the reason."""
    try:
        record = fastavro.schemaless_reader(io.BytesIO(body), writer, reader)
    except Exception as exc:  # fastavro raises many types on corrupt bodies
        raise Undecodable(
            f"{fmt}: Avro body does not decode (truncated or not this schema): "
            f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(record, dict):
        raise Undecodable(f"{fmt}: Avro body is not a record")
    return record


class AvroCodec:
    """The app's Avro schemas (from ``schemas_dir``), by full name and by fingerprint;
    single-object encoding of plain records. Thread-safe (read-only after loading).

        >>> schemas = AvroCodec.from_dir(Path("schemas"))
        >>> data = schemas.encode("payments.ChargeRequested", {...})
        >>> schemas.decode(data)  # -> (full name, dict)
    """

    def __init__(self, schemas: Mapping[str, Any] | None = None) -> None:
        self._by_name: dict[str, Any] = {}
        self._raw: dict[str, Any] = {}  # as written, logical types and all (for a registry)
        self._fingerprint_of: dict[str, bytes] = {}  # computing one costs ~0.3 ms
        self._by_fingerprint: dict[bytes, Any] = {}
        for schema in (schemas or {}).values():
            self.add(schema)

    @classmethod
    def from_dir(cls, folder: Path) -> AvroCodec:
        """Every ``.avsc`` schema of ``folder`` (``schemas_dir``); a missing folder or
        schema that does not parse is a :class:`ConfigError` naming it."""
        codec = cls()
        if not folder.is_dir():
            what = "is not a folder" if folder.exists() else "does not exist"
            where = "" if folder.is_absolute() else f" (from {str(Path.cwd())!r})"
            raise ConfigError(
                f"schemas folder {str(folder)!r}{where} {what}: set KAFKA_IDEM_SCHEMAS_DIR to "
                "the folder of the .avsc files", setting="schemas_dir"
            )
        for path in sorted(folder.rglob("*.avsc")):
            try:
                codec.add(json.loads(path.read_text()))
            except (ValueError, fastavro.schema.SchemaParseException) as exc:
                raise ConfigError(f"bad Avro schema {path}: {exc}", setting="schemas_dir") from exc
        return codec

    def add(self, schema: Any) -> str:
        """Add a schema (its JSON as Python values); return its full name."""
        parsed = fastavro.parse_schema(schema)
        name = parsed["name"] if isinstance(parsed, dict) else str(parsed)
        self._by_name[name] = parsed
        self._raw[name] = schema
        self._fingerprint_of[name] = fingerprint(parsed)
        self._by_fingerprint[self._fingerprint_of[name]] = parsed
        return name

    def schema(self, name: str) -> Any:
        """The parsed schema ``name`` (a :class:`ConfigError` when there is none)."""
        try:
            return self._by_name[name]
        except KeyError:
            raise ConfigError(f"no Avro schema named {name!r}", setting="schemas_dir") from None

    def source(self, name: str) -> Any:
        """The schema ``name`` as it was written (JSON-able)."""
        self.schema(name)
        return self._raw[name]

    def has(self, name: str) -> bool:
        """Whether a schema is named ``name``."""
        return name in self._by_name

    @property
    def names(self) -> list[str]:
        """The full names of the schemas, sorted."""
        return sorted(self._by_name)

    def encode(self, name: str, record: Mapping[str, Any]) -> bytes:
        """``record`` single-object encoded with schema ``name`` (magic, fingerprint, body)."""
        parsed = self.schema(name)
        buf = io.BytesIO()
        buf.write(SINGLE_OBJECT_MAGIC)
        buf.write(self._fingerprint_of[name])
        fastavro.schemaless_writer(buf, parsed, dict(record))
        return buf.getvalue()

    def decode(self, data: bytes | None, reader: str | None = None) -> tuple[str, dict[str, Any]]:
        """Return ``(writer schema name, record)``; raise :class:`Undecodable` with the reason."""
        if not data:
            raise Undecodable("avro: empty message value")
        if data[:2] != SINGLE_OBJECT_MAGIC:
            raise Undecodable(f"avro: not Avro single-object encoded: the value is {sniff(data)}",
                              first_bytes=data[:4].hex())
        if len(data) < 10:
            raise Undecodable(f"avro: truncated frame: {len(data)} bytes, the header alone "
                              "is 10 (C3 01 + an 8-byte fingerprint)")
        writer = self._by_fingerprint.get(data[2:10])
        if writer is None:
            raise Undecodable("avro: unknown schema fingerprint", fingerprint=data[2:10].hex())
        reader_schema = self.schema(reader) if reader else writer
        return writer["name"], read_avro(data[10:], writer, reader_schema, fmt="avro")


class AvroObjectCodec:
    """Avro single-object encoding, read with the handler's reader schema and validated
    into its model. With a registry codec as ``framed``, Confluent-framed Avro is
    accepted too (kafka_idem's behaviour before formats, kept for handlers with
    ``schema=`` when ``schema_registry_url`` is set)."""

    name = "avro"

    def __init__(self, schemas: AvroCodec, schema: str, adapter: TypeAdapter[Any],
                 *, framed: Codec | None = None) -> None:
        self.schemas = schemas
        self.schema = schema
        self.adapter = adapter
        self.framed = framed
        schemas.schema(schema)  # a ConfigError now, not at the first message

    def decode(self, data: bytes) -> Any:
        """The handler's payload: ``data`` read with its reader schema, validated into
        its model."""
        if self.framed is not None and data[0] == CONFLUENT_MAGIC:
            return self.framed.decode(data)
        _name, record = self.schemas.decode(data, reader=self.schema)
        return validate(self.adapter, record, fmt=self.name)

    def encode(self, payload: Any) -> bytes:
        """``payload`` (a model instance or what the model accepts) single-object encoded."""
        return self.schemas.encode(self.schema, as_python(self.adapter, payload))

