"""The chaos run's producer: charge intents for ``consumers.payments`` at a steady rate.

:class:`Feed` is a thread that sends originals, re-sends of earlier intents (a new
request id, like a producer's retry), payload conflicts, invalid charges and
undecodable bytes, seeded; it records every acknowledged message, which the
checker compares with what the source topic holds. Some originals reuse a recent
order id for another tenant: two intents on one Kafka key (the order id), so the
outbox's per-key order (check 11) has something to judge.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from confluent_kafka import Producer

from tools.chaos.services import QUIET

TENANTS = 20
SHARED_ORDERS = 0.1  # share of originals that reuse a recent order id for another tenant
CURRENCIES = ("EUR", "USD", "GBP", "CHF", "JPY")


@dataclass(frozen=True, slots=True)
class Intent:
    tenant: str
    order: str
    amount: Decimal
    currency: str


class Feed(threading.Thread):
    """Sends charge intents at a steady rate; records every acknowledged message."""

    def __init__(self, bootstrap: str, topic: str, rate: float, seed: int,
                 kafka: dict[str, Any]) -> None:
        super().__init__(name="chaos-feed", daemon=True)
        from consumers.payments import encode_charge

        self.encode = encode_charge
        self.topic, self.rate = topic, rate
        self.rng = random.Random(seed)
        conf = {k: v for k, v in kafka.items() if not k.startswith(("group.", "fetch."))}
        conf.update({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
                     "linger.ms": 5, "message.timeout.ms": 300_000, **QUIET,
                     "error_cb": self._client_error})  # transient ones: the client retries
        self.producer = Producer(conf)
        self.client_errors: Counter[str] = Counter()  # what error_cb said, for the report
        self.stopping = threading.Event()
        self.intents: list[Intent] = []
        self.sent: Counter[str] = Counter()
        self.acked: dict[tuple[int, int], bytes | None] = {}
        self.acked_kinds: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self._lock = threading.Lock()

    def next_message(self, n: int) -> tuple[str, bytes | None, bytes]:
        rng, intents = self.rng, self.intents
        r = rng.random()
        if r < 0.03:
            return "garbage", *self._garbage(n)
        if intents and r < 0.07:
            base = rng.choice(intents[-500:])
            other = Intent(base.tenant, base.order,
                           base.amount + Decimal(rng.randint(1, 999)) / 100, base.currency)
            return "conflict", base.order.encode(), self._value(other)
        if intents and r < 0.22:
            base = rng.choice(intents[-200:] if rng.random() < 0.6 else intents)
            return "duplicate", base.order.encode(), self._value(base)
        amount = Decimal(rng.randint(1, 100_000)) / 100
        currency = rng.choice(CURRENCIES)
        kind = "original"
        if rng.random() < 0.05:
            kind = "invalid"
            if rng.random() < 0.5:
                amount = Decimal(0) if rng.random() < 0.3 else -amount
            else:
                currency = "XXX"
        tenant, order = f"t{rng.randrange(TENANTS):02d}", f"o-{len(intents):07d}"
        if intents and rng.random() < SHARED_ORDERS:
            base = rng.choice(intents[-100:])  # same order id, another tenant: another intent
            tenant = f"t{(int(base.tenant[1:]) + rng.randrange(1, TENANTS)) % TENANTS:02d}"
            order = base.order
        intent = Intent(tenant, order, amount, currency)
        intents.append(intent)
        return kind, intent.order.encode(), self._value(intent)

    def _value(self, i: Intent) -> bytes:
        # A fresh request_id and requested_at per send, like a producer's retry.
        return self.encode(i.tenant, i.order, i.amount, i.currency,
                           request_id=str(uuid.UUID(int=self.rng.getrandbits(128))))

    def _garbage(self, n: int) -> tuple[bytes | None, bytes]:
        rng = self.rng
        good = self.encode("t", "o", "1.00")
        junk = [b"", b"not avro", b'{"tenant_id": "t1", "amount": 10}', good[:12],
                b"\xc3\x01" + rng.randbytes(8) + good[10:], b"\x00\x00\x00\x00\x01" + good[10:],
                rng.randbytes(rng.randint(1, 64))]
        key = None if rng.random() < 0.3 else b"garbage-%d" % n
        return key, rng.choice(junk)

    def run(self) -> None:
        start, n = time.monotonic(), 0
        while not self.stopping.is_set():
            due = start + n / self.rate
            wait = due - time.monotonic()
            if wait > 0:
                self.stopping.wait(min(wait, 0.5))
                continue
            if wait < -1.0:  # fell behind (broker away): no catch-up burst
                start, n = time.monotonic(), 0
            kind, key, value = self.next_message(sum(self.sent.values()))
            while not self.stopping.is_set():
                try:
                    self.producer.produce(self.topic, key=key, value=value,
                                          on_delivery=self._acked(kind, value))
                    break
                except BufferError:
                    self.producer.poll(0.1)
            self.sent[kind] += 1
            n += 1
            self.producer.poll(0)
        left = self.producer.flush(120)
        if left:
            self.errors["not acknowledged within 120 s of the end"] += left

    def _client_error(self, err: Any) -> None:
        """The producer's own errors: retried by the client, but kept, so that a run
        whose traffic stopped (its sends not acknowledged) says what the client saw."""
        with self._lock:
            self.client_errors[f"{'fatal: ' if err.fatal() else ''}{err.str()}"] += 1

    def _acked(self, kind: str, value: bytes) -> Callable[[Any, Any], None]:
        def on_delivery(err: Any, msg: Any) -> None:
            with self._lock:
                if err is not None:
                    self.errors[str(err)] += 1
                else:
                    self.acked[(msg.partition(), msg.offset())] = value
                    self.acked_kinds[kind] += 1
        return on_delivery
