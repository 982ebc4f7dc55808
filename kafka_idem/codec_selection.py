"""Which codec a handler gets: its ``format=`` (a name, a codec, a factory) and the
app's settings (``default_format``, ``schemas_dir``, the schema registry)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from kafka_idem.codecs.avro_codec import AvroObjectCodec
from kafka_idem.codecs.base import Codec, CodecFactory, validate
from kafka_idem.codecs.json_codec import JsonCodec
from kafka_idem.errors import ConfigError
from kafka_idem.registration import check_avro_reader

if TYPE_CHECKING:
    from kafka_idem.codecs.avro_codec import AvroCodec
    from kafka_idem.handler import Handler
    from kafka_idem.settings import Settings


class CodecSource(Protocol):
    """What a codec is made from: an app's settings, Avro schemas and registry client."""

    @property
    def settings(self) -> Settings: ...

    def avro_schemas(self) -> AvroCodec: ...

    def registry_client(self, *, serialized: bool = False) -> Any: ...


def codec_for(app: CodecSource, handler: Handler[Any]) -> Codec:
    """The codec ``handler``'s format names, built from ``app``'s settings."""
    from kafka_idem.codecs.registry import RegistryCodec

    fmt = handler.format
    if fmt is not None and not isinstance(fmt, str | CodecFactory):
        return _Validated(fmt, handler)
    name = handler.format_name or app.settings.default_format
    try:
        if isinstance(fmt, CodecFactory):
            return fmt.for_handler(app, handler)
        if name == "json":
            return JsonCodec(handler.adapter)
        schemas = app.avro_schemas() if handler.schema else None
        if schemas is not None and handler.schema is not None:
            check_avro_reader(handler, schemas, app.settings.schemas_dir)
        if name == "registry":
            return RegistryCodec(app.registry_client(), handler.adapter, schemas=schemas,
                                 schema=handler.schema, subject=f"{handler.topic}-value")
        if schemas is None or handler.schema is None:
            raise ConfigError("format 'avro' needs schema= (the Avro reader schema's full "
                              "name); the app's default_format is 'avro'", setting="schema")
        framed = None
        if app.settings.schema_registry_url:  # as before formats: both framings
            framed = RegistryCodec(app.registry_client(), handler.adapter, schemas=schemas,
                                   schema=handler.schema, subject=f"{handler.topic}-value")
        return AvroObjectCodec(schemas, handler.schema, handler.adapter, framed=framed)
    except ConfigError as exc:
        raise ConfigError(f"handler {handler.name!r}: {exc.message}",
                          **exc.context) from exc


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
