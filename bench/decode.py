"""Decode cost per message, by payload format: bytes -> the handler's validated payload
(the step ``Processor.prepare`` runs first), for the payments charge request.

    .venv/bin/python -m bench.decode [--messages 20000]

Prints microseconds per message (best of 5 rounds) for the payments model as JSON
(``format="json"``), as Avro single-object encoding (``format="avro"``) and as
registry-framed Protobuf (``format=ProtobufCodec(...)``, the amount a
``confluent.type.Decimal``; its schema looked up once from an in-process registry,
``tests/registry.py``), with the bytes per message. CPU only: no Kafka, no database.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
import uuid
from decimal import Decimal

from consumers import payments
from kafka_idem import App


def charge_message() -> type:
    """payments.ChargeRequested as a Protobuf message class (what protoc would generate)."""
    from confluent_kafka.schema_registry.confluent.type import decimal_pb2  # noqa: F401
    from google.protobuf import (
        descriptor_pb2,
        descriptor_pool,
        message_factory,
        timestamp_pb2,  # noqa: F401
    )

    pool = descriptor_pool.Default()
    name = "bench/charge_requested.proto"
    try:
        pool.FindFileByName(name)
    except KeyError:
        f = descriptor_pb2.FieldDescriptorProto
        file = descriptor_pb2.FileDescriptorProto(
            name=name, package="bench", syntax="proto3",
            dependency=["google/protobuf/timestamp.proto", "confluent/type/decimal.proto"])
        message = file.message_type.add(name="ChargeRequested")
        for number, (field, kind) in enumerate([
                ("tenant_id", ""), ("order_id", ""), ("amount", ".confluent.type.Decimal"),
                ("currency", ""), ("request_id", ""),
                ("requested_at", ".google.protobuf.Timestamp")], 1):
            added = message.field.add(name=field, number=number, label=f.LABEL_OPTIONAL,
                                      type=f.TYPE_MESSAGE if kind else f.TYPE_STRING)
            if kind:
                added.type_name = kind
        pool.Add(file)
    cls: type = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("bench.ChargeRequested"))
    return cls


def handlers(registry_url: str) -> dict[str, object]:
    from kafka_idem.codecs.protobuf import ProtobufCodec

    out: dict[str, object] = {}
    formats: dict[str, object] = {"json": "json", "avro": "avro",
                                  "protobuf": ProtobufCodec(charge_message())}
    for name, fmt in formats.items():
        app = App(f"bench-{name}", schemas_dir=payments.SCHEMAS_DIR,
                  schema_registry_url=registry_url)
        out[name] = app.handler(topic=f"bench.{name}", model=payments.ChargeRequested,
                                format=fmt,  # type: ignore[arg-type]
                                schema=payments.SCHEMA if fmt == "avro" else None,
                                key="{tenant_id}:charge:{order_id}",
                                hash_fields=("amount", "currency"))(payments.charge)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode")
    parser.add_argument("--messages", type=int, default=20_000)
    args = parser.parse_args(argv)
    now = dt.datetime.now(dt.UTC)
    records = [payments.ChargeRequested(
        tenant_id=f"bench-t{i % 50:02d}", order_id=f"o{i}", amount=Decimal(i % 997 + 1) / 4,
        currency="EUR", request_id=str(uuid.uuid4()), requested_at=now)
        for i in range(args.messages)]
    from tests.registry import Registry

    print(f"{'format':<8} {'bytes/msg':>10} {'us/msg':>8}")
    with Registry() as registry:
        found = handlers(registry.url)
        values = {fmt: [h.encode(r) for r in records]  # type: ignore[attr-defined]
                  for fmt, h in found.items()}
        for h, v in zip(found.values(), values.values(), strict=True):
            h.decode(v[0])  # type: ignore[attr-defined]  # the registry asked once, here
    for fmt, h in found.items():
        decode = h.decode  # type: ignore[attr-defined]
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for v in values[fmt]:
                decode(v)
            best = min(best, time.perf_counter() - start)
        size = sum(map(len, values[fmt])) / len(values[fmt])
        print(f"{fmt:<8} {size:>10.0f} {best / len(values[fmt]) * 1e6:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
