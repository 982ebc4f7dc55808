"""Confluent's wire format through a Schema Registry: byte ``0`` + a 4-byte big-endian
schema id + the body (Avro binary, or JSON for JSON Schema).

Schemas are looked up with ``confluent_kafka.schema_registry.SchemaRegistryClient``
(basic auth, bearer/OAuth, TLS options and its cache come from
``KAFKA_IDEM_SCHEMA_REGISTRY``), once per id, and kept parsed here. Whose fault
a failure is decides what happens to the message:

* the registry cannot be asked (refused, timed out, HTTP 5xx, 401/403):
  :class:`~kafka_idem.errors.SchemaRegistryUnavailable`, a framework error: the
  partition waits and retries, the message is never charged;
* the id names no schema (HTTP 404), or a schema this codec cannot use (one that
  does not parse; Protobuf, which :class:`kafka_idem.codecs.protobuf.ProtobufCodec` reads):
  :class:`~kafka_idem.errors.Undecodable`, the message is dead-lettered with the id.

Producing (:meth:`RegistryCodec.encode`) registers the handler's schema under the
subject ``<topic>-value`` (TopicNameStrategy) once and frames with its id: the Avro
reader schema named by ``schema=`` if the handler has one, else the JSON Schema
of its model (``TypeAdapter.json_schema()``).
"""

from __future__ import annotations

import io
import json
import struct
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import fastavro
from pydantic import TypeAdapter

from kafka_idem.codecs.avro_codec import AvroCodec, read_avro
from kafka_idem.codecs.base import CONFLUENT_MAGIC, as_python, sniff, validate
from kafka_idem.codecs.json_codec import JsonCodec
from kafka_idem.errors import (
    ConfigError,
    KafkaIdemError,
    MessageError,
    SchemaRegistryUnavailable,
    Undecodable,
)

T = TypeVar("T")
NOT_FOUND = 404


def registry_client(url: str, options: dict[str, Any]) -> Any:
    """A ``SchemaRegistryClient`` for ``url`` with pass-through ``options``
    (``basic.auth.user.info``, ``bearer.auth.*``, ``ssl.*``, ``timeout``, ``max.retries``,
    ``cache.capacity`` ...); a bad option is a :class:`ConfigError`."""
    from confluent_kafka.schema_registry import SchemaRegistryClient

    try:
        return SchemaRegistryClient({**options, "url": url})
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"schema registry client: {exc}", setting="schema_registry") from exc


def registry_trouble(exc: BaseException) -> bool:
    """``exc`` came from asking the registry (an HTTP answer or a transport failure), not
    from the bytes of a message."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    return isinstance(exc, SchemaRegistryError | OSError) or \
        type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore")


def blame(exc: BaseException, what: str, *, schema_id: int | None = None,
          fmt: str = "registry") -> KafkaIdemError:
    """Whose fault a failed registry call is: an id the registry does not know is the
    message's (:class:`Undecodable`), anything else the framework's
    (:class:`SchemaRegistryUnavailable`: retried, never charged)."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    if isinstance(exc, SchemaRegistryError):
        if exc.http_status_code == NOT_FOUND and schema_id is not None:
            return Undecodable(f"{fmt}: schema id {schema_id} not found in the registry",
                               schema_id=schema_id)
        return SchemaRegistryUnavailable(
            f"schema registry answered HTTP {exc.http_status_code} to {what}: "
            f"{exc.error_message}", schema_id=schema_id)
    # httpx transport errors: refused, reset, timed out, TLS
    return SchemaRegistryUnavailable(
        f"schema registry unreachable ({what}): {type(exc).__name__}: {exc}",
        schema_id=schema_id)


def ask(what: str, call: Callable[[], T], *, schema_id: int | None = None,
        fmt: str = "registry") -> T:
    """Run one registry call, turning its failures into whose fault they are (``fmt``: the
    format named in the message's error)."""
    try:
        return call()
    except Exception as exc:
        raise blame(exc, what, schema_id=schema_id, fmt=fmt) from exc


class RegistryCodec:
    """Confluent-framed Avro or JSON Schema payloads, validated into the model."""

    name = "registry"

    def __init__(
        self,
        client: Any,
        adapter: TypeAdapter[Any],
        *,
        subject: str,
        schemas: AvroCodec | None = None,
        schema: str | None = None,
    ) -> None:
        self.client = client
        self.adapter = adapter
        self.subject = subject
        self.schemas = schemas
        self.schema = schema
        self.reader = schemas.schema(schema) if schemas is not None and schema else None
        self.json = JsonCodec(adapter)
        self._decoders: dict[int, tuple[str, Any]] = {}  # id -> (type, parsed Avro or None)
        self._writer_id: int | None = None
        self._lock = threading.Lock()

    # --- decode ---------------------------------------------------------------

    def decode(self, data: bytes) -> Any:
        if data[0] != CONFLUENT_MAGIC:
            raise Undecodable(f"registry: not Confluent-framed (magic byte 0 expected): "
                              f"the value is {sniff(data)}")
        if len(data) < 5:
            raise Undecodable(f"registry: truncated frame: {len(data)} bytes, the header "
                              "alone is 5 (magic byte 0 + a 4-byte schema id)")
        (schema_id,) = struct.unpack(">I", data[1:5])
        kind, parsed = self._decoder(schema_id)
        body = data[5:]
        if kind == "AVRO":
            record = read_avro(body, parsed, self.reader or parsed, fmt=f"registry avro, "
                               f"schema id {schema_id}")
            return validate(self.adapter, record, fmt=f"registry avro (schema id {schema_id})")
        # JSON Schema: the body is plain JSON; the model is the schema we enforce.
        try:
            return self.json.decode(body)
        except MessageError as exc:  # Undecodable or InvalidPayload: named for this format
            exc.message = f"registry json (schema id {schema_id}): " + \
                exc.message.removeprefix("json: ")
            exc.args = (exc.message,)
            raise

    def _decoder(self, schema_id: int) -> tuple[str, Any]:
        with self._lock:
            cached = self._decoders.get(schema_id)
        if cached is not None:
            return cached
        schema = ask(f"GET /schemas/ids/{schema_id}", lambda: self.client.get_schema(schema_id),
                     schema_id=schema_id)
        kind = (schema.schema_type or "AVRO").upper()
        if kind == "AVRO":
            try:
                decoder: tuple[str, Any] = (kind, fastavro.parse_schema(
                    json.loads(schema.schema_str)))
            except Exception as exc:
                raise Undecodable(f"registry: schema id {schema_id}: unusable Avro schema: "
                                  f"{type(exc).__name__}: {exc}", schema_id=schema_id) from exc
        elif kind == "JSON":
            decoder = (kind, None)
        else:
            raise Undecodable(f"registry: schema id {schema_id} is a {kind} schema; a 'registry' "
                              "handler reads Avro and JSON Schema (Protobuf: "
                              "format=ProtobufCodec(<message class>))", schema_id=schema_id)
        with self._lock:
            self._decoders[schema_id] = decoder
        return decoder

    # --- encode ---------------------------------------------------------------

    def writer_id(self) -> int:
        """The id of the schema this codec writes with (registered once, then cached)."""
        if self._writer_id is None:
            from confluent_kafka.schema_registry import Schema

            if self.schemas is not None and self.schema:
                text = json.dumps(self.schemas.source(self.schema))
                schema = Schema(text, "AVRO")
            else:
                schema = Schema(json.dumps(self.adapter.json_schema()), "JSON")
            self._writer_id = ask(f"POST /subjects/{self.subject}/versions",
                                  lambda: self.client.register_schema(self.subject, schema))
        return self._writer_id

    def encode(self, payload: Any) -> bytes:
        head = bytes([CONFLUENT_MAGIC]) + struct.pack(">I", self.writer_id())
        if self.reader is not None:
            buf = io.BytesIO()
            fastavro.schemaless_writer(buf, self.reader, as_python(self.adapter, payload))
            return head + buf.getvalue()
        return head + self.json.encode(payload)


__all__ = ["RegistryCodec", "ask", "blame", "registry_client", "registry_trouble"]
