"""Payload codecs: bytes on the wire <-> the handler's payload, behind one interface.

* :mod:`~kafka_idem.codecs.base`: the interface (:class:`Codec`, :class:`CodecFactory`)
  and what every codec shares (the model's adapter and fields, validation);
* :mod:`~kafka_idem.codecs.json_codec`: :class:`JsonCodec` (``format="json"``);
* :mod:`~kafka_idem.codecs.avro_codec`: :class:`AvroObjectCodec` (``format="avro"``) and
  :class:`AvroCodec`, the ``.avsc`` schemas of a directory;
* :mod:`~kafka_idem.codecs.registry`: Confluent's wire format through a Schema Registry
  (``format="registry"``), Avro and JSON Schema;
* :mod:`~kafka_idem.codecs.protobuf`: ``ProtobufCodec(MyMessage)``, the ``protobuf``
  extra (:mod:`~kafka_idem.codecs.protobuf_values`: messages <-> plain values).

Imported from here: the interface and the built-in codecs that need no extra.
"""

from kafka_idem.codecs.avro_codec import AvroCodec, AvroObjectCodec
from kafka_idem.codecs.base import FORMATS, Codec, CodecFactory
from kafka_idem.codecs.json_codec import JsonCodec

__all__ = ["FORMATS", "AvroCodec", "AvroObjectCodec", "Codec", "CodecFactory", "JsonCodec"]
