"""The workload: payments charge requests, produced as a backlog or at a fixed rate.

Intents are deterministic from ``(tag, n, dup_ratio, seed)``, so a worker
process can rebuild the exact set of keys and sums a topic holds and check
the effects without being sent them.

The paced producer runs in its own process (``python -m bench.workload
paced ...``) so its CPU is not the consumer's: it produces ``rate`` messages a
second for ``seconds``, each stamped by librdkafka with its CreateTime at the
``produce()`` call, which is the start of every end-to-end latency.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from consumers import payments
from kafka_idem.settings import Settings, load_settings

PARTITIONS = 4
TENANTS = 50
CURRENCIES = sorted(payments.CURRENCIES)


@dataclass(frozen=True)
class Intent:
    tenant_id: str
    order_id: str
    amount: Decimal
    currency: str

    @property
    def key(self) -> str:
        return f"{self.tenant_id}:charge:{self.order_id}"


@dataclass(frozen=True)
class Plan:
    """What a topic holds: ``n`` messages, ``dup_ratio`` of them duplicates."""

    tag: str  # unique per topic: tenants and order ids carry it
    n: int
    dup_ratio: float
    seed: int
    tenants: int = TENANTS

    def build(self) -> tuple[list[Intent], list[Intent]]:
        """Distinct intents, and the ``n`` messages (intents plus duplicates, shuffled)."""
        rng = random.Random(f"{self.seed}:{self.tag}")
        distinct = max(1, self.n - round(self.n * self.dup_ratio))
        intents = [
            Intent(
                tenant_id=f"bench-{self.tag}-t{i % self.tenants:02d}",
                order_id=f"bench-{self.tag}-o{i:07d}",
                amount=Decimal(rng.randint(1, 100_000)) / 100,
                currency=rng.choice(CURRENCIES),
            )
            for i in range(distinct)
        ]
        messages = intents + rng.choices(intents, k=self.n - distinct)
        rng.shuffle(messages)
        return intents, messages

    def to_json(self) -> dict[str, Any]:
        return {"tag": self.tag, "n": self.n, "dup_ratio": self.dup_ratio, "seed": self.seed,
                "tenants": self.tenants}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Plan:
        return Plan(d["tag"], int(d["n"]), float(d["dup_ratio"]), int(d["seed"]),
                    int(d.get("tenants", TENANTS)))


def tenants_of(tag: str, n: int = TENANTS) -> list[str]:
    return [f"bench-{tag}-t{i:02d}" for i in range(n)]


def encode(m: Intent, fmt: str | None = None) -> bytes:
    """The payments app's bytes for ``m``: its format (PAYMENTS_FORMAT), or ``fmt``."""
    if fmt is None or fmt == payments.FORMAT:
        return payments.encode_charge(m.tenant_id, m.order_id, m.amount, m.currency)
    data: bytes = _handler(fmt).encode(
        payments.charge_payload(m.tenant_id, m.order_id, m.amount, m.currency))
    return data


@functools.cache
def _handler(fmt: str) -> Any:
    return payments.build_app(topic="bench.encode", fmt=fmt).handlers["bench.encode"]


def _producer(s: Settings, linger_ms: int) -> tuple[Producer, list[str]]:
    failures: list[str] = []
    producer = Producer({**s.producer_config(), "linger.ms": linger_ms})
    return producer, failures


def produce_backlog(s: Settings, topic: str, messages: list[Intent],
                    fmt: str | None = None) -> None:
    """All messages as fast as possible (the backlog the throughput runs drain)."""
    producer, failures = _producer(s, 20)

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is not None:
            failures.append(str(err))

    for i, m in enumerate(messages):
        value = encode(m, fmt)
        while True:
            try:
                producer.produce(
                    topic, key=m.order_id.encode(), value=value, on_delivery=on_delivery
                )
                break
            except BufferError:
                producer.poll(0.1)
        if i % 1000 == 0:
            producer.poll(0)
    left = producer.flush(120)
    if left or failures:
        raise SystemExit(f"bench: produce failed ({left} unacknowledged, errors: {failures[:3]})")


def produce_paced(
    s: Settings, topic: str, values: list[tuple[bytes, bytes]], rate: float, linger_ms: int = 5
) -> dict[str, Any]:
    """``values`` at ``rate`` messages/s, on a fixed schedule (message i is due at i/rate)."""
    producer, failures = _producer(s, linger_ms)

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is not None:
            failures.append(str(err))

    # Connected and the topic's leaders known before the clock starts: otherwise the
    # first messages carry the connection set-up in their latency.
    producer.list_topics(topic, timeout=10)
    started = time.perf_counter()
    behind = 0.0
    i = 0
    n = len(values)
    while i < n:
        now = time.perf_counter()
        due = min(n, int((now - started) * rate) + 1)
        behind = max(behind, (due - i) / rate)
        while i < due:
            key, value = values[i]
            try:
                producer.produce(topic, key=key, value=value, on_delivery=on_delivery)
            except BufferError:
                producer.poll(0.01)
                continue
            i += 1
        producer.poll(0)
        nxt = started + i / rate
        pause = nxt - time.perf_counter()
        if pause > 0:
            time.sleep(min(pause, 0.002))
    elapsed = time.perf_counter() - started
    left = producer.flush(60)
    return {
        "produced": n,
        "seconds": elapsed,
        "rate": n / elapsed if elapsed > 0 else 0.0,
        "max_behind_seconds": behind,
        "unacknowledged": left,
        "errors": failures[:3],
    }


def end_offsets(s: Settings, topic: str, partitions: int = PARTITIONS) -> dict[int, int]:
    probe = Consumer({**s.consumer_config("bench-probe")})
    try:
        return {
            p: probe.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(partitions)
        }
    finally:
        probe.close()


def create_topic(admin: AdminClient, topic: str, partitions: int = PARTITIONS) -> None:
    for fut in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        fut.result(30)


# --- the paced producer process ---------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.workload")
    parser.add_argument("command", choices=["paced"])
    parser.add_argument("--topic", required=True)
    parser.add_argument("--plan", required=True, help="Plan as JSON")
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--raw", action="store_true", help="one fixed payload (raw path)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    s = load_settings()
    plan = Plan.from_json(json.loads(args.plan))
    if args.raw:
        value = encode(Intent("bench-raw", "bench-raw-o", Decimal("1.00"), "EUR"))
        values = [(str(i).encode(), value) for i in range(plan.n)]
    else:
        _intents, messages = plan.build()
        values = [(m.order_id.encode(), encode(m)) for m in messages]
    stats = produce_paced(s, args.topic, values, args.rate)
    with open(args.out, "w") as f:
        json.dump(stats, f)
    return 0 if not stats["unacknowledged"] and not stats["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
