"""The baseline: an idempotent consumer written the plainest way, as users would without kafka_idem.

One message at a time (``poll``), one database transaction per message with
the claim/complete protocol, then a synchronous Kafka commit of that
message's offset:

    BEGIN
    INSERT INTO store (...) VALUES (key, hash, 'processing', my_token, lease) ON CONFLICT DO NOTHING
    SELECT request_hash, status, owner_token, lease_until ... FROM store WHERE key = ... FOR UPDATE
      hash differs                 -> conflict: nothing written
      succeeded                    -> replay: nothing written
      processing, live, not mine   -> busy: roll back, retry the message later
      otherwise (mine, expired...) -> take it: UPDATE ... SET owner_token = my_token
    handler: INSERT ledger row, upsert balance       (consumers.payments.charge, unchanged)
    UPDATE store SET status = 'succeeded', ... WHERE key = ... AND owner_token = my_token
    COMMIT
    consumer.commit(message, asynchronous=False)

No batching, no pipelining, no savepoints; psycopg's defaults (which prepare a
statement after it ran five times). It uses a store table built by
``kafka_idem.admin.migrate`` (so the database's transition guard checks it too; its records
are in the namespace ``naive``) and
the payments example's tables, so its effects are checked like the framework's.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import psycopg
from confluent_kafka import Consumer
from psycopg import sql
from psycopg.types.json import Jsonb

from consumers import payments
from kafka_idem.settings import Settings

CLAIM = """
INSERT INTO {t} (namespace, idempotency_key, request_hash, status, owner_token, lease_until,
                 attempts, kafka_topic, kafka_partition, kafka_offset)
VALUES ('naive', %s, %s, 'processing', %s, now() + interval '30 seconds', 1, %s, %s, %s)
ON CONFLICT (namespace, idempotency_key) DO NOTHING
"""
LOCK = """
SELECT request_hash, status, owner_token, lease_until > clock_timestamp()
FROM {t} WHERE namespace = 'naive' AND idempotency_key = %s FOR UPDATE
"""
TAKE = """
UPDATE {t} SET owner_token = %s, lease_until = now() + interval '30 seconds',
               attempts = attempts + 1, status = 'processing', updated_at = now()
WHERE namespace = 'naive' AND idempotency_key = %s
"""
DONE = """
UPDATE {t} SET status = 'succeeded', result_json = %s, completed_token = owner_token,
               owner_token = NULL, lease_until = NULL, completed_at = clock_timestamp(),
               updated_at = now()
WHERE namespace = 'naive' AND idempotency_key = %s AND owner_token = %s
"""


class Busy(Exception):
    """Another consumer holds the key with a live lease: retry the message later."""


class NaiveConsumer:
    """The same start / step / close shape as the framework's Runner, for the bench driver."""

    def __init__(
        self, s: Settings, *, topic: str, group: str, schema: str, table: str,
        on_effect: Callable[[Any], None] | None = None,
    ) -> None:
        self.s = s
        self.topic = topic
        self.group = group
        self.on_effect = on_effect
        t = sql.Identifier(schema, table)
        self.q = {name: sql.SQL(text).format(t=t) for name, text in
                  (("claim", CLAIM), ("lock", LOCK), ("take", TAKE), ("done", DONE))}
        self.consumer: Any = None
        self.conn: psycopg.Connection[Any] | None = None
        self.codec = payments.codec()
        self.outcomes = {"succeeded": 0, "replayed": 0, "conflict": 0, "busy": 0}
        # Wall time by step, to show where a message's time goes.
        self.seconds = {"poll": 0.0, "decode_and_database": 0.0, "kafka_commit": 0.0}

    def start(self) -> None:
        self.consumer = Consumer(self.s.consumer_config(self.group))
        self.consumer.subscribe([self.topic])
        self.conn = psycopg.connect(self.s.dsn, autocommit=False)
        self.conn.execute("SET synchronous_commit = on")
        self.conn.commit()

    def step(self, timeout: float = 0.1) -> None:
        t0 = time.perf_counter()
        msg = self.consumer.poll(timeout)
        t1 = time.perf_counter()
        self.seconds["poll"] += t1 - t0
        if msg is None or msg.error() is not None:
            return
        while True:
            try:
                self.handle(msg)
                break
            except Busy:
                self.outcomes["busy"] += 1
                time.sleep(0.5)
        t2 = time.perf_counter()
        self.seconds["decode_and_database"] += t2 - t1
        if self.on_effect is not None:
            self.on_effect(msg)
        self.consumer.commit(message=msg, asynchronous=False)
        self.seconds["kafka_commit"] += time.perf_counter() - t2

    def handle(self, msg: Any) -> None:
        assert self.conn is not None
        conn = self.conn
        _name, record = self.codec.decode(msg.value())
        m = payments.ChargeRequested.model_validate(record)
        key = f"{m.tenant_id}:charge:{m.order_id}"
        digest = hashlib.sha256(
            json.dumps({"amount": str(m.amount), "currency": m.currency}).encode()
        ).hexdigest()
        token = uuid.uuid4()
        with conn.transaction():
            conn.execute(self.q["claim"], (key, digest, token, msg.topic(), msg.partition(),
                                           msg.offset()))
            row = conn.execute(self.q["lock"], (key,)).fetchone()
            assert row is not None
            stored_hash, status, owner, live = row
            if stored_hash != digest:
                self.outcomes["conflict"] += 1
                return
            if status == "succeeded":
                self.outcomes["replayed"] += 1
                return
            if owner != token:
                if status == "processing" and live:
                    raise Busy(key)
                conn.execute(self.q["take"], (token, key))
            ctx = SimpleNamespace(tx=conn, idempotency_key=key)
            result = payments.charge(m, ctx)  # type: ignore[arg-type]
            conn.execute(self.q["done"], (Jsonb(result), key, token))
            self.outcomes["succeeded"] += 1

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
            self.consumer = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None
