"""Protobuf message classes for the tests, built without protoc: a FileDescriptorProto
written field by field, added to the default descriptor pool (where protoc's generated
``_pb2`` modules put theirs), classes from ``message_factory.GetMessageClass``.

The orders file is what this ``.proto`` compiles to::

    syntax = "proto3";
    package orders.pb;
    import "google/protobuf/timestamp.proto";
    message OrderPlaced {                       // index [0]
      string tenant_id = 1; string order_id = 2; string amount = 3; string currency = 4;
      int32 items = 5; string request_id = 6; google.protobuf.Timestamp placed_at = 7;
    }
    message Shipment {                          // index [1]
      string order_id = 1;
      message Parcel { string tracking = 1; }   // index [1, 0]
      repeated Parcel parcels = 2;
    }

``DecimalOrderPlaced`` / ``DoubleOrderPlaced`` are the same order with the amount a
``confluent.type.Decimal`` or a ``double``; ``Everything`` has one field of each kind
the value conversion handles.
"""

from __future__ import annotations

from typing import Any

from confluent_kafka.schema_registry.confluent.type import decimal_pb2  # noqa: F401 (in the pool)
from google.protobuf import (
    descriptor_pb2,
    descriptor_pool,
    duration_pb2,  # noqa: F401
    message_factory,
    struct_pb2,  # noqa: F401
    timestamp_pb2,  # noqa: F401
    wrappers_pb2,  # noqa: F401
)

F = descriptor_pb2.FieldDescriptorProto
SCALARS = {"string": F.TYPE_STRING, "int32": F.TYPE_INT32, "int64": F.TYPE_INT64,
           "uint64": F.TYPE_UINT64, "double": F.TYPE_DOUBLE, "float": F.TYPE_FLOAT,
           "bool": F.TYPE_BOOL, "bytes": F.TYPE_BYTES, "sint32": F.TYPE_SINT32}


def _fields(message: Any, fields: list[tuple[str, str]], *, repeated: tuple[str, ...] = (),
            optional: tuple[str, ...] = ()) -> None:
    for number, (name, kind) in enumerate(fields, 1):
        field = message.field.add(name=name, number=number, label=F.LABEL_REPEATED
                                  if name in repeated else F.LABEL_OPTIONAL)
        if kind in SCALARS:
            field.type = SCALARS[kind]
        elif kind.startswith("enum:"):
            field.type, field.type_name = F.TYPE_ENUM, kind[5:]
        else:
            field.type, field.type_name = F.TYPE_MESSAGE, kind
        if name in optional:  # proto3 `optional`: a synthetic oneof gives it presence
            field.proto3_optional = True
            field.oneof_index = len(message.oneof_decl)
            message.oneof_decl.add(name=f"_{name}")


def _order_file(name: str, package: str, amount: str, deps: list[str]) -> Any:
    file = descriptor_pb2.FileDescriptorProto(name=name, package=package, syntax="proto3",
                                              dependency=deps)
    _fields(file.message_type.add(name="OrderPlaced"), [
        ("tenant_id", "string"), ("order_id", "string"), ("amount", amount),
        ("currency", "string"), ("items", "int32"), ("request_id", "string"),
        ("placed_at", ".google.protobuf.Timestamp")])
    return file


def _everything_file() -> Any:
    file = descriptor_pb2.FileDescriptorProto(
        name="tests/everything.proto", package="tests.pb", syntax="proto3",
        dependency=["google/protobuf/timestamp.proto", "google/protobuf/duration.proto",
                    "google/protobuf/wrappers.proto", "google/protobuf/struct.proto",
                    "confluent/type/decimal.proto"])
    file.enum_type.add(name="Color").value.extend([
        descriptor_pb2.EnumValueDescriptorProto(name="COLOR_UNSET", number=0),
        descriptor_pb2.EnumValueDescriptorProto(name="RED", number=1)])
    message = file.message_type.add(name="Everything")
    entry = message.nested_type.add(name="CountsEntry")
    entry.options.map_entry = True
    _fields(entry, [("key", "string"), ("value", "int64")])
    _fields(message.nested_type.add(name="Inner"), [("label", "string")])
    _fields(message, [
        ("text", "string"), ("big", "int64"), ("huge", "uint64"), ("ratio", "double"),
        ("flag", "bool"), ("raw", "bytes"), ("color", "enum:.tests.pb.Color"),
        ("tags", "string"), ("counts", ".tests.pb.Everything.CountsEntry"),
        ("inner", ".tests.pb.Everything.Inner"), ("at", ".google.protobuf.Timestamp"),
        ("took", ".google.protobuf.Duration"), ("maybe", ".google.protobuf.Int64Value"),
        ("extra", ".google.protobuf.Struct"), ("price", ".confluent.type.Decimal"),
        ("note", "string"), ("negative", "sint32"),
    ], repeated=("tags", "counts"), optional=("note",))
    return file


def _build() -> dict[str, Any]:
    pool = descriptor_pool.Default()
    orders = _order_file("orders/order_placed.proto", "orders.pb", "string",
                         ["google/protobuf/timestamp.proto"])
    shipment = orders.message_type.add(name="Shipment")
    _fields(shipment.nested_type.add(name="Parcel"), [("tracking", "string")])
    _fields(shipment, [("order_id", "string"), ("parcels", ".orders.pb.Shipment.Parcel")],
            repeated=("parcels",))
    files = [
        orders,
        _order_file("orders/decimal_amount.proto", "orders.decimal", ".confluent.type.Decimal",
                    ["google/protobuf/timestamp.proto", "confluent/type/decimal.proto"]),
        _order_file("orders/double_amount.proto", "orders.double", "double",
                    ["google/protobuf/timestamp.proto"]),
        _everything_file(),
    ]
    for file in files:
        try:
            pool.FindFileByName(file.name)
        except KeyError:
            pool.Add(file)
    names = {"OrderPlaced": "orders.pb.OrderPlaced", "Shipment": "orders.pb.Shipment",
             "DecimalOrderPlaced": "orders.decimal.OrderPlaced",
             "DoubleOrderPlaced": "orders.double.OrderPlaced",
             "Everything": "tests.pb.Everything"}
    return {k: message_factory.GetMessageClass(pool.FindMessageTypeByName(v))
            for k, v in names.items()}


_CLASSES = _build()
OrderPlaced = _CLASSES["OrderPlaced"]
Shipment = _CLASSES["Shipment"]
DecimalOrderPlaced = _CLASSES["DecimalOrderPlaced"]
DoubleOrderPlaced = _CLASSES["DoubleOrderPlaced"]
Everything = _CLASSES["Everything"]
