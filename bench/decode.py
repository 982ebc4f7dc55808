"""Decode cost per message, by payload format: bytes -> the handler's validated payload
(the step ``Processor.prepare`` runs first), for the payments charge request.

    .venv/bin/python -m bench.decode [--messages 20000]

Prints microseconds per message (best of 5 rounds) for the payments model as JSON
(``format="json"``) and as Avro single-object encoding (``format="avro"``), with
the bytes per message. CPU only: no Kafka, no database.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
import uuid
from decimal import Decimal

from consumers import payments
from kafka_idem import App


def handlers() -> dict[str, object]:
    out = {}
    for fmt in ("json", "avro"):
        app = App(f"bench-{fmt}", schemas_dir=payments.SCHEMAS_DIR)
        out[fmt] = app.handler(topic=f"bench.{fmt}", model=payments.ChargeRequested, format=fmt,
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
    print(f"{'format':<8} {'bytes/msg':>10} {'us/msg':>8}")
    for fmt, h in handlers().items():
        values = [h.encode(r) for r in records]  # type: ignore[attr-defined]
        decode = h.decode  # type: ignore[attr-defined]
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for v in values:
                decode(v)
            best = min(best, time.perf_counter() - start)
        size = sum(map(len, values)) / len(values)
        print(f"{fmt:<8} {size:>10.0f} {best / len(values) * 1e6:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
