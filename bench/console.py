"""How fast the web console's pages are on a big store and a big DLQ: ``python -m bench.console``.

The requirement: every page renders in under 300 ms (server time, p95) with 1,000,000
records in the store and 100,000 dead letters in the DLQ. One run:

1. **The store.** A fresh schema (``bench_console_<run>``), made by
   :func:`kafka_idem.admin.migrate.migrate` as ``kafka-idem migrate`` makes it (same table,
   indexes and guard triggers), filled with ``--records`` records by one
   ``INSERT ... SELECT`` over ``generate_series``. The guard trigger lets a new record in
   only as ``processing``; the load writes every status directly, so it disables that
   one trigger (``ALTER TABLE ... DISABLE TRIGGER guard_transitions_insert``, which needs
   only the table's ownership, not a superuser) and enables it again in the same
   transaction: the store the console reads has all its guards. The mix: namespaces
   ``shop`` (three quarters; handlers ``place_order`` and ``ship_order``) and ``billing``
   (``charge_invoice``); about 96% ``succeeded``, 2% ``failed`` (exhausted or permanent,
   with error class, message and failure times), 1.5% ``retryable_failed`` (due soon or
   now) and 0.5% ``processing`` (live or expired leases); keys ``order-00012345`` /
   ``invoice-00012347``; created over the last 30 days. Then a few thousand audit rows
   (re-runs of failed keys, replays, purges) and ``ANALYZE``.
2. **The DLQ.** The app's topics made by :func:`kafka_idem.admin.topics.create` (the
   source ``bench-console-<run>.orders`` and its ``.dlq``, 4 partitions, the product's
   DLQ configuration), then ``--letters`` dead letters, each built as the framework
   builds one (:class:`kafka_idem.deadletters.dead_letter.DeadLetter` over a
   :class:`kafka_idem.testing.FakeMessage` of the source, ``.record()`` for its key, value
   and ``idem.*`` headers) and produced by a plain batching producer, oldest failure
   first (the record's timestamp is its last failure). The mix: the failed
   ``place_order`` records' own letters (some dead-lettered twice), payload conflicts
   on succeeded keys, undecodable values (non-UTF-8, broken JSON, no key) and letters of
   keys the store no longer has (purged); a few carry ``<script>`` in their value or
   error text and non-UTF-8 bytes in their key or headers. A sample is read back and
   parsed with :meth:`kafka_idem.replay.DlqRecord.from_message`.
3. **The console**, a real process: ``python -m kafka_idem.cli console
   bench.console_app:app --port P`` (``bench/console_app.py``: the shop's order handler
   on the source topic, so the console knows the DLQ). The run waits for ``/healthz``,
   then for ``/healthz?ready=1`` (the console's in-memory DLQ index has caught up),
   sampling the overview meanwhile; it reports the time from the start to ready and the
   process's RSS (``VmRSS``) once ready and at the end.
4. **The pages**, over HTTP (httpx, one kept-alive connection): each URL ``--warmup``
   times, then ``--requests`` timed requests. The server time of a request is the
   console's ``Server-Timing: app;dur=<ms>`` header; the client time is the wall time
   of the request, body read. ``/letter`` gets a different letter at every request;
   the second pages of ``/records`` and ``/dlq`` are the ``<a id="next-page">`` links
   of their first pages.
5. **Prints** one table (page, requests, server p50 / p95 / max, client p95, whether
   the server p95 is under 300 ms) and the set-up line; ``--json PATH`` writes it all.
   Drops the schema and the topics (``--keep`` leaves them).

Nothing asserts on timing: the exit status is 1 only when the data could not be made
or checked, the console did not start or get ready, or a page answered an error.

    python -m bench.console                      # 1,000,000 records, 100,000 letters
    python -m bench.console --quick              # 100,000 / 10,000
    python -m bench.console --records 200000 --letters 20000 --requests 100 --json /tmp/c.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import html.parser
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urljoin

import httpx
import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from psycopg import sql
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bench.console_app import HANDLER, NAMESPACE, TOPIC_VAR, build_app
from kafka_idem.admin import topics as app_topics
from kafka_idem.admin.migrate import migrate
from kafka_idem.deadletters.dead_letter import ERROR_KINDS, REQUIRED_HEADERS, DeadLetter
from kafka_idem.replay import DlqRecord
from kafka_idem.settings import Settings, load_settings
from kafka_idem.store.queries import identifiers
from kafka_idem.testing import FakeMessage

ROOT = Path(__file__).resolve().parent.parent
TABLE = "task_idempotency"
PARTITIONS = 4
TARGET_MS = 300.0
HEADER_LIMIT = 1024  # error_message_max's default: the error text a letter carries
GROUP = NAMESPACE  # the consumer group that dead-lettered them: the app's (its name)
SCRIPT = "<script>alert('console')</script>"
PERMANENT = ("ValueError", "KeyError", "Permanent")  # the error classes of permanent failures
console = Console(stderr=True)


# --- 1. the store -----------------------------------------------------------------------

# One row per i in [0, n): namespace and handler from i, status and times from random().
# Non-final records (retryable_failed, processing) are recent, as they are in a live store.
FILL = """
INSERT INTO {table} (
    namespace, idempotency_key, request_hash, status, result_json, error_kind, error_class,
    error_message, owner_token, completed_token, lease_until, attempts, next_attempt_at,
    first_failure_at, last_failure_at, handler, kafka_topic, kafka_partition, kafka_offset,
    created_at, updated_at, completed_at)
SELECT ns, key, 'v1:sha256:' || encode(sha256(int8send(i)), 'hex'), status,
       CASE WHEN status = 'succeeded' THEN jsonb_build_object(
           'done', key, 'amount_cents', i %% 50000) END,
       kind, cls,
       CASE WHEN status = 'failed' AND i %% 499 = 0
                THEN 'bad customer name: ' || %(script)s::text
            WHEN kind = 'exhausted'
                THEN '5 attempts reached the limit of 5; last error: upstream did not answer'
                     || ' in 10s (' || key || ')'
            WHEN cls = 'ValueError' THEN 'amount must be positive, got -' || (i %% 9000 + 1)
            WHEN cls = 'KeyError' THEN '''customer'''
            WHEN cls = 'Permanent' THEN key || ' was cancelled before it was paid'
            WHEN status = 'retryable_failed' THEN 'connection reset by peer' END,
       CASE WHEN status = 'processing' THEN gen_random_uuid() END,
       CASE WHEN status = 'succeeded' THEN gen_random_uuid() END,
       CASE WHEN status = 'processing' AND r2 < 0.6 THEN now() + interval '30 seconds'
            WHEN status = 'processing' THEN now() - r2 * interval '10 minutes' END,
       CASE WHEN kind = 'exhausted' THEN 5
            WHEN status = 'retryable_failed' THEN 1 + i %% 4
            WHEN status = 'succeeded' AND r2 < 0.03 THEN 2 ELSE 1 END,
       CASE WHEN status = 'retryable_failed' THEN now() + (r2 - 0.2) * interval '1 minute' END,
       CASE WHEN status IN ('failed', 'retryable_failed') THEN created + interval '1 second'
            END,
       CASE WHEN status = 'failed' THEN failed_at
            WHEN status = 'retryable_failed' THEN created + interval '2 seconds' END,
       handler,
       CASE handler WHEN 'place_order' THEN %(orders)s::text
            WHEN 'ship_order' THEN %(shipments)s::text ELSE %(invoices)s::text END,
       i %% 4, i / 4,
       created,
       CASE WHEN status = 'failed' THEN failed_at
            WHEN status = 'retryable_failed' THEN created + interval '2 seconds'
            WHEN status = 'processing' AND r2 < 0.6 THEN now()
            ELSE created + r2 * interval '2 seconds' END,
       CASE WHEN status = 'succeeded' THEN created + r2 * interval '2 seconds' END
FROM (
    SELECT *,
           CASE WHEN kind = 'exhausted'
                    THEN (ARRAY['TimeoutError', 'ConnectionError'])[1 + i %% 2]
                WHEN kind = 'permanent'
                    THEN (ARRAY['ValueError', 'KeyError', 'Permanent'])[1 + i %% 3]
                WHEN status = 'retryable_failed' THEN 'ConnectionError' END AS cls,
           least(created + r2 * interval '2 days', now()) AS failed_at
    FROM (
        SELECT *,
               CASE WHEN ns = 'shop' THEN 'order-' ELSE 'invoice-' END
                   || lpad(i::text, 8, '0') AS key,
               CASE WHEN status = 'failed' AND r2 < 0.5 THEN 'exhausted'
                    WHEN status = 'failed' THEN 'permanent'
                    WHEN status = 'retryable_failed' AND r2 < 0.7 THEN 'retryable'
                    WHEN status = 'retryable_failed' THEN 'unknown_outcome' END AS kind,
               CASE WHEN status IN ('processing', 'retryable_failed')
                    THEN now() - r3 * interval '1 hour'
                    ELSE now() - r3 * interval '30 days' END AS created
        FROM (
            SELECT i, r2, r3,
                   CASE WHEN i %% 4 = 3 THEN 'billing' ELSE 'shop' END AS ns,
                   CASE i %% 4 WHEN 3 THEN 'charge_invoice' WHEN 2 THEN 'ship_order'
                       ELSE 'place_order' END AS handler,
                   CASE WHEN r < 0.96 THEN 'succeeded' WHEN r < 0.98 THEN 'failed'
                        WHEN r < 0.995 THEN 'retryable_failed' ELSE 'processing' END AS status
            FROM (SELECT i, random() AS r, random() AS r2, random() AS r3
                  FROM generate_series(0, %(n)s::int - 1) AS i) AS rnd
        ) AS mixed
    ) AS keyed
) AS rows
"""

# Re-runs of failed keys (one of every 6 failed records, between its two failures: it
# failed again after the re-run), a re-run of a few twice, and a replay per 1,000
# records; the same order of size as a store that has been operated for a month.
AUDIT = """
INSERT INTO {audit} (at, actor, action, namespace, idempotency_key, selection, reason,
                     previous_status, previous_error)
SELECT first_failure_at + (last_failure_at - first_failure_at) * (0.3 + 0.2 * copy),
       (ARRAY['alice', 'bob', 'ops-bot'])[1 + copy + (kafka_offset %% 2)::int],
       'rerun', namespace, idempotency_key,
       CASE WHEN copy = 0 THEN jsonb_build_object('via', 'rerun')
            ELSE jsonb_build_object('via', 'dlq replay', 'dlq_topic', %(dlq)s::text,
                                    'group', 'replay-' || kafka_offset, 'run', md5(idempotency_key))
            END,
       CASE WHEN copy = 0 THEN 'upstream fixed (INC-' || (kafka_offset %% 900 + 100) || ')'
            ELSE 'retry after the deploy' END,
       'failed', error_kind || ': ' || error_class || ': ' || error_message
FROM {table}, generate_series(0, 1) AS copy
WHERE status = 'failed' AND kafka_offset %% 6 = 0 AND (copy = 0 OR kafka_offset %% 30 = 0);

INSERT INTO {audit} (at, actor, action, namespace, selection, reason, counts)
SELECT now() - (g * interval '1 hour'), 'ops-bot', CASE WHEN g %% 5 = 0 THEN 'purge'
       ELSE 'replay' END, %(ns)s::text,
       jsonb_build_object('dlq_topic', %(dlq)s::text, 'kind', 'exhausted', 'group', 'replay-' || g),
       'nightly', jsonb_build_object('sent', g %% 40, 'skipped', g %% 7)
FROM generate_series(1, greatest(%(n)s::int / 1000, 1)) AS g;
"""


@dataclass
class Store:
    schema: str
    records: int
    seconds: float = 0.0
    by_status: dict[str, int] = field(default_factory=dict)
    audit_rows: int = 0


def fill_store(dsn: str, schema: str, records: int, topics: dict[str, str]) -> Store:
    """Make the store in ``schema`` (the product's migration) and fill it (module doc)."""
    t0 = time.perf_counter()
    migrate(dsn, schema, TABLE)
    names = identifiers(schema, TABLE)
    params = {"n": records, "script": SCRIPT, "orders": topics["orders"],
              "shipments": topics["shipments"], "invoices": topics["invoices"],
              "dlq": topics["dlq"], "ns": NAMESPACE}
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.transaction():
            conn.execute("SELECT setseed(0.42)")
            # the guard lets new records in only as 'processing': off for this load only
            conn.execute(sql.SQL("ALTER TABLE {} DISABLE TRIGGER guard_transitions_insert")
                         .format(names["table"]))
            conn.execute(sql.SQL(FILL).format(**names), params)
            conn.execute(sql.SQL("ALTER TABLE {} ENABLE TRIGGER guard_transitions_insert")
                         .format(names["table"]))
            for statement in AUDIT.split(";\n"):
                if statement.strip():
                    conn.execute(sql.SQL(statement).format(**names), params)
        conn.execute(sql.SQL("ANALYZE {}").format(names["table"]))
        conn.execute(sql.SQL("ANALYZE {}").format(names["audit"]))
        rows = conn.execute(sql.SQL("SELECT status, count(*) FROM {} GROUP BY 1").format(
            names["table"])).fetchall()
        audit = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(
            names["audit"])).fetchone()
    return Store(schema, records, time.perf_counter() - t0, {s: int(n) for s, n in rows},
                 int(audit[0]) if audit else 0)


# --- 2. the dead letters ----------------------------------------------------------------


@dataclass(frozen=True)
class Failed:
    """A failed ``place_order`` record whose dead letter the DLQ holds."""

    key: str
    kind: str
    error_class: str
    error_message: str
    attempts: int
    first_failure_at: dt.datetime
    last_failure_at: dt.datetime
    partition: int
    offset: int


def failed_records(dsn: str, schema: str) -> list[Failed]:
    query = sql.SQL(
        "SELECT idempotency_key, error_kind, error_class, error_message, attempts, "
        "first_failure_at, last_failure_at, kafka_partition, kafka_offset FROM {} "
        "WHERE namespace = %s AND handler = %s AND status = 'failed' "
        "ORDER BY idempotency_key").format(identifiers(schema, TABLE)["table"])
    with psycopg.connect(dsn) as conn:
        return [Failed(*row) for row in conn.execute(query, (NAMESPACE, HANDLER))]


def succeeded_keys(dsn: str, schema: str, limit: int) -> list[tuple[str, int]]:
    """Some succeeded ``place_order`` keys and their attempts (the payload conflicts')."""
    query = sql.SQL(
        "SELECT idempotency_key, attempts FROM {} WHERE namespace = %s AND handler = %s "
        "AND status = 'succeeded' AND kafka_offset %% 7 = 3 LIMIT %s").format(
        identifiers(schema, TABLE)["table"])
    with psycopg.connect(dsn) as conn:
        return [(k, int(a)) for k, a in conn.execute(query, (NAMESPACE, HANDLER, limit))]


def _order_value(order_id: str, rng: random.Random, customer: str | None = None) -> bytes:
    doc = {"order_id": order_id, "customer": customer or f"c-{rng.randrange(5000):04d}",
           "amount_cents": rng.randrange(-500, 90_000), "currency": rng.choice(["EUR", "USD"]),
           "items": [{"sku": f"sku-{rng.randrange(900):03d}", "qty": rng.randrange(1, 4)}
                     for _ in range(rng.randrange(1, 4))]}
    return json.dumps(doc).encode()


def _original_headers(rng: random.Random, i: int) -> list[tuple[str, bytes]]:
    out = [("content-type", b"application/json")]
    if rng.random() < 0.5:
        out.append(("traceparent", f"00-{rng.getrandbits(128):032x}-"
                                   f"{rng.getrandbits(64):016x}-01".encode()))
    if i % 1000 == 7:
        out.append(("x-legacy-origin", b"\xff\xfe\x00legacy"))  # not UTF-8
    return out


def build_letters(n: int, failed: Sequence[Failed], succeeded: Sequence[tuple[str, int]],
                  *, source: str, dlq: str, records: int, seed: int) -> list[DeadLetter]:
    """``n`` dead letters of the kinds a month of the shop's consumer would leave (module
    doc), oldest last failure first."""
    rng = random.Random(seed)
    now = dt.datetime.now(dt.UTC)
    out: list[DeadLetter] = []

    def letter(kind: str, error_class: str, message: str, attempts: int, key: str | None,
               first: dt.datetime, last: dt.datetime, *, partition: int, offset: int,
               kafka_key: bytes | None, value: bytes) -> DeadLetter:
        stamp = int((first - dt.timedelta(seconds=1)).timestamp() * 1000)
        msg = FakeMessage(source, partition=partition, offset=offset, key=kafka_key,
                          value=value, headers=_original_headers(rng, len(out)),
                          timestamp=stamp)
        return DeadLetter(dlq_topic=dlq, source=msg, kind=kind, error_class=error_class,
                          error_message=message, attempts=attempts, consumer_group=GROUP,
                          handler=HANDLER, idempotency_key=key, namespace=NAMESPACE,
                          first_failure_at=first, last_failure_at=last)

    # the failed records' own letters, a tenth of them dead-lettered twice
    for f in failed[: max(n * 3 // 10, 0)]:
        order_id = f.key.removeprefix("order-")
        value = _order_value(order_id, rng, SCRIPT if "<script>" in f.error_message else None)
        times = [f.last_failure_at]
        if rng.random() < 0.1:
            times.insert(0, f.first_failure_at + (f.last_failure_at - f.first_failure_at) / 3)
        for last in times:
            out.append(letter(f.kind, f.error_class, f.error_message, f.attempts, f.key,
                              f.first_failure_at, last, partition=f.partition,
                              offset=f.offset, kafka_key=order_id.encode(), value=value))
    # payload conflicts: a succeeded key sent again with another amount
    for key, attempts in succeeded[: n // 10]:
        order_id = key.removeprefix("order-")
        when = now - dt.timedelta(days=28 * rng.random())
        message = (f"key {key!r} was first used with a different payload (request hash "
                   f"v1:sha256:{rng.getrandbits(256):064x} differs from the stored one)")
        out.append(letter("payload_conflict", "PayloadConflict", message, attempts, key, when,
                          when, partition=rng.randrange(PARTITIONS),
                          offset=records + len(out), kafka_key=order_id.encode(),
                          value=_order_value(order_id, rng)))
    # undecodable: not JSON, not UTF-8, no key built
    for j in range(n // 10):
        when = now - dt.timedelta(days=28 * rng.random())
        raw = (b"\xff\xfe\x00\x01" + rng.randbytes(40) if j % 2 else
               b'{"order_id": "' + str(j).encode() + b'", "amount_cents": ')
        if j % 50 == 0:
            raw = SCRIPT.encode() + b"\xff"
        message = ("value is not JSON: 'utf-8' codec can't decode byte 0xff in position 0"
                   if j % 2 else "value is not JSON: Expecting value: line 1 column 37")
        out.append(letter("undecodable", "Undecodable", message, 0, None, when, when,
                          partition=rng.randrange(PARTITIONS), offset=records + len(out),
                          kafka_key=None if j % 3 else b"\xc3\x28-not-utf8", value=raw))
    # the rest: letters of keys since purged from the store (exhausted or permanent)
    purged = records
    while len(out) < n:
        purged += 1
        order_id = f"{purged:08d}"
        first = now - dt.timedelta(days=28 * rng.random())
        if rng.random() < 0.5:
            kind, cls, attempts = "exhausted", rng.choice(["TimeoutError", "ConnectionError"]), 5
            last = min(first + dt.timedelta(minutes=30 * rng.random()), now)
            message = (f"5 attempts reached the limit of 5; last error: upstream did not "
                       f"answer in 10s (order {order_id})")
        else:
            kind, cls, attempts, last = "permanent", rng.choice(PERMANENT), 1, first
            message = {"ValueError": f"amount must be positive, got -{rng.randrange(1, 9000)}",
                       "KeyError": "'customer'",
                       "Permanent": f"order-{order_id} was cancelled before it was paid"}[cls]
        if purged % 997 == 0:
            message = f"bad customer name: {SCRIPT}"
        out.append(letter(kind, cls, message, attempts, f"order-{order_id}", first, last,
                          partition=purged % PARTITIONS, offset=purged // PARTITIONS,
                          kafka_key=order_id.encode(), value=_order_value(order_id, rng)))
    out.sort(key=lambda d: d.last_failure_at or now)
    return out[:n]


def produce_letters(s: Settings, letters: Sequence[DeadLetter]) -> float:
    """Produce every letter's record (as the framework's ``DeadLetterer`` would, without
    its one flush per batch) with one batching producer; return the seconds it took."""
    conf = {**s.producer_config(), "linger.ms": 50, "batch.num.messages": 10_000,
            "batch.size": 1_000_000, "compression.type": "lz4",
            "queue.buffering.max.messages": 500_000, "queue.buffering.max.kbytes": 1_048_576}
    producer = Producer(conf)
    errors: list[str] = []

    def on_delivery(err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            errors.append(err.str())

    t0 = time.perf_counter()
    for d in letters:
        rec = d.record(HEADER_LIMIT)
        stamp = int((d.last_failure_at or dt.datetime.now(dt.UTC)).timestamp() * 1000)
        while True:
            try:
                producer.produce(rec.topic, key=rec.key, value=rec.value, headers=rec.headers,
                                 timestamp=stamp, on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
    left = producer.flush(120)
    if left or errors:
        raise RuntimeError(f"{left} dead letters not acknowledged, {len(errors)} refused: "
                           f"{errors[:3]}")
    return time.perf_counter() - t0


def watermarks(s: Settings, topic: str) -> dict[int, tuple[int, int]]:
    probe = Consumer(s.consumer_config(f"bench-console-probe-{uuid.uuid4().hex[:8]}"))
    try:
        return {p: probe.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                for p in range(PARTITIONS)}
    finally:
        probe.close()


def read_letters(s: Settings, topic: str, limit: int | None = None) -> list[DlqRecord]:
    """The first ``limit`` letters of each partition (all: ``None``), parsed as ``dlq``
    commands parse them."""
    marks = watermarks(s, topic)
    want = {p: hi if limit is None else min(hi, lo + limit) for p, (lo, hi) in marks.items()
            if hi > lo}
    consumer = Consumer({**s.consumer_config(f"bench-console-read-{uuid.uuid4().hex[:8]}"),
                         "enable.auto.commit": False})
    out: list[DlqRecord] = []
    try:
        consumer.assign([TopicPartition(topic, p, marks[p][0]) for p in want])
        deadline = time.monotonic() + 120
        while want and time.monotonic() < deadline:
            for m in consumer.consume(1000, timeout=0.5):
                if m.error() is not None:
                    continue
                p, off = int(m.partition() or 0), int(m.offset() or 0)
                if p in want and off < want[p]:
                    out.append(DlqRecord.from_message(m))
                    if off + 1 >= want[p]:
                        del want[p]
        if want:
            raise RuntimeError(f"could not read {topic} to the end: partitions {sorted(want)}")
    finally:
        consumer.close()
    return out


def check_letters(records: Sequence[DlqRecord]) -> list[str]:
    """What is wrong with these letters as the framework writes them (empty: nothing)."""
    problems = []
    for r in records:
        names = {k for k, _ in r.headers}
        missing = [h for h in REQUIRED_HEADERS if h not in names]
        if missing:
            problems.append(f"{r.partition}:{r.offset} lacks {missing}")
        if r.kind not in ERROR_KINDS or r.handler != HANDLER or r.namespace != NAMESPACE:
            problems.append(f"{r.partition}:{r.offset}: kind {r.kind!r}, handler {r.handler!r}")
        if r.kind != "undecodable" and not r.idempotency_key:
            problems.append(f"{r.partition}:{r.offset}: no idem.key")
        if r.last_failure_at is None or r.original_offset is None:
            problems.append(f"{r.partition}:{r.offset}: failure time or offset unreadable")
    return problems


# --- 3. the console process -------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_mb(pid: int) -> dict[str, float]:
    """``VmRSS`` and ``VmHWM`` (peak) of ``pid`` in MB; empty when it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(rest.split()[0]) / 1024
    return out


class ConsoleProcess:
    """The console (or anything that serves its URLs) as a child process on ``port``."""

    def __init__(self, argv: Sequence[str], port: int, env: dict[str, str], log: Path) -> None:
        self.argv, self.port, self.env, self.log_path = list(argv), port, env, log
        self.base = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0

    def start(self) -> ConsoleProcess:
        self.started = time.perf_counter()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_for(self, client: httpx.Client, path: str, timeout: float,
                 between: Callable[[], None] | None = None) -> float:
        """Poll ``path`` until it answers 200; return the seconds since the start.
        ``between``: called after every unanswered poll (the overview's samples)."""
        deadline = time.perf_counter() + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"the console exited ({self.proc and self.proc.returncode}) "
                                   f"before {path} answered 200:\n{self.log_tail()}")
            try:
                if client.get(path, timeout=5).status_code == 200:
                    return time.perf_counter() - self.started
            except httpx.TransportError:
                pass
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{path} did not answer 200 in {timeout:.0f}s:\n"
                                   f"{self.log_tail()}")
            if between is not None:
                between()
            time.sleep(0.2)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        return self.proc.returncode


# --- 4. the pages -----------------------------------------------------------------------


def server_ms(headers: httpx.Headers) -> float | None:
    """The ``app`` metric's ``dur`` of the ``Server-Timing`` header(s), in ms."""
    for value in headers.get_list("server-timing"):
        for metric in value.split(","):
            name, *params = (part.strip() for part in metric.split(";"))
            if name != "app":
                continue
            for param in params:
                key, _, raw = param.partition("=")
                if key.strip() == "dur":
                    try:
                        return float(raw.strip().strip('"'))
                    except ValueError:
                        return None
    return None


class _NextLink(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "a" and found.get("id") == "next-page" and self.href is None:
            self.href = found.get("href")


def next_page(page_url: str, body: str) -> str | None:
    """The ``<a id="next-page" href>`` of a page, as a URL relative to the server root."""
    parser = _NextLink()
    parser.feed(body)
    if not parser.href:
        return None
    absolute = urljoin("http://console" + page_url, parser.href)
    return absolute.removeprefix("http://console")


@dataclass
class Page:
    """One row of the table: a URL, or one URL per request (``urls``)."""

    name: str
    url: str = ""
    urls: list[str] = field(default_factory=list)  # request i gets urls[i % len]
    follow: str | None = None  # a page URL whose next-page link this row requests

    def url_for(self, i: int) -> str:
        return self.urls[i % len(self.urls)] if self.urls else self.url


@dataclass
class Timed:
    name: str
    url: str
    server: list[float] = field(default_factory=list)
    client: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    no_header: int = 0
    error: str | None = None

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    @property
    def ok(self) -> bool:
        return (self.error is None and self.requests > 0 and self.no_header == 0
                and set(self.statuses) == {200})

    def to_json(self) -> dict[str, Any]:
        def stats(xs: list[float]) -> dict[str, float | None]:
            return {"p50": percentile(xs, 50), "p95": percentile(xs, 95),
                    "max": max(xs) if xs else None}

        p95 = percentile(self.server, 95)
        return {"page": self.name, "url": self.url, "requests": self.requests,
                "statuses": {str(k): v for k, v in self.statuses.items()},
                "without_server_timing": self.no_header, "error": self.error,
                "server_ms": stats(self.server), "client_ms": stats(self.client),
                "under_target": p95 is not None and p95 < TARGET_MS, "ok": self.ok}


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile, linear between the closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def request(client: httpx.Client, url: str, into: Timed | None = None) -> httpx.Response:
    t0 = time.perf_counter()
    response = client.get(url)
    response.read()
    wall = (time.perf_counter() - t0) * 1000
    if into is not None:
        into.statuses[response.status_code] += 1
        into.client.append(wall)
        ms = server_ms(response.headers)
        if ms is None:
            into.no_header += 1
        else:
            into.server.append(ms)
    return response


def measure(client: httpx.Client, page: Page, *, warmup: int, requests: int) -> Timed:
    """``warmup`` untimed requests, then ``requests`` timed ones; a page that cannot be
    requested (no next-page link, a transport error) says why in ``error``."""
    url = page.url_for(0)
    if page.follow is not None:
        first = client.get(page.follow)
        found = next_page(page.follow, first.text) if first.status_code == 200 else None
        if found is None:
            return Timed(page.name, page.follow, error=f"no <a id=\"next-page\"> on "
                         f"{page.follow} (HTTP {first.status_code})")
        page = Page(page.name, url=found)
        url = found
    shown = url if len(page.urls) < 2 else f"{url} (and {len(page.urls) - 1} others)"
    out = Timed(page.name, shown)
    try:
        for i in range(warmup):
            request(client, page.url_for(i))
        for i in range(requests):
            request(client, page.url_for(warmup + i), out)
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


def pages(*, dlq: str, record_key: str, exact_key: str, letters: list[str],
          now: dt.datetime) -> list[Page]:
    """Every page of the console's URL contract, with the filters the module doc names."""
    def q(path: str, **params: str) -> str:
        return f"{path}?{urlencode(params)}" if params else path

    day = now.replace(microsecond=0)
    return [
        Page("overview", "/"),
        Page("overview fragment (self-refresh)", q("/", fragment="1")),
        Page("records", "/records"),
        Page("records, failed", q("/records", status="failed")),
        Page("records, succeeded in one day", q(
            "/records", status="succeeded", since=(day - dt.timedelta(days=8)).isoformat(),
            until=(day - dt.timedelta(days=7)).isoformat())),
        Page("records, namespace + handler", q("/records", namespace=NAMESPACE,
                                               handler="ship_order")),
        Page("records, exact key", q("/records", key=exact_key)),
        Page("records, key prefix", q("/records", prefix="order-0001")),
        Page("records, next page", follow="/records"),
        Page("record (audit trail, letters)", q("/record", ns=NAMESPACE, key=record_key)),
        Page("dlq (all topics)", "/dlq"),
        Page("dlq, kind permanent", q("/dlq", topic=dlq, kind="permanent")),
        Page("dlq, error class ValueError", q("/dlq", topic=dlq, error_class="ValueError")),
        Page("dlq, handler + since", q("/dlq", topic=dlq, handler=HANDLER,
                                       since=(day - dt.timedelta(days=7)).isoformat())),
        Page("dlq, next page", follow=q("/dlq", topic=dlq)),
        Page("letter (a different one each time)", urls=letters),
        Page("redrive form, kind exhausted", q("/redrive", topic=dlq, kind="exhausted")),
    ]


def letter_urls(dlq: str, marks: dict[int, tuple[int, int]], n: int, seed: int) -> list[str]:
    """``n`` distinct letters (as many as there are, if fewer), in random order."""
    rng = random.Random(seed)
    every = [(p, o) for p, (lo, hi) in marks.items() for o in range(lo, hi)]
    picked = rng.sample(every, min(n, len(every)))
    return [f"/letter?{urlencode({'topic': dlq, 'partition': p, 'offset': o})}"
            for p, o in picked]


# --- 5. output ----------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


def render(rows: Sequence[Timed], setup: dict[str, Any]) -> Table:
    table = Table(title=f"kafka_idem console: server time per page (Server-Timing app;dur), "
                  f"{setup['records']:,} records, {setup['letters']:,} dead letters; "
                  f"target p95 < {TARGET_MS:.0f} ms", title_justify="left")
    for col in ("page", "requests", "p50 ms", "p95 ms", "max ms", "client p95 ms",
                f"p95 < {TARGET_MS:.0f} ms", "url / problem"):
        table.add_column(col, justify="left" if col in ("page", "url / problem") else "right")
    for t in rows:
        p95 = percentile(t.server, 95)
        verdict = ("—" if p95 is None else "[green]yes" if p95 < TARGET_MS else "[red]no")
        problem = t.error or (f"HTTP {dict(t.statuses)}" if set(t.statuses) - {200} else None)
        if t.no_header:
            problem = f"{t.no_header} responses without Server-Timing app;dur"
        table.add_row(
            escape(t.name), str(t.requests), _ms(percentile(t.server, 50)), _ms(p95),
            _ms(max(t.server) if t.server else None), _ms(percentile(t.client, 95)),
            verdict, f"[red]{escape(problem)}" if problem else escape(t.url[:90]))
    return table


def setup_line(setup: dict[str, Any]) -> str:
    rss = setup.get("rss_ready_mb")
    data = (f"set-up: {setup['records']:,} records loaded in {setup['load_s']:.1f}s, "
            f"{setup['letters']:,} dead letters produced in {setup['produce_s']:.1f}s")
    if "up_s" not in setup:
        return data
    return (f"{data}; console up in {_s(setup.get('up_s'))}, DLQ indexed (ready) in "
            f"{_s(setup.get('ready_s'))} from its start; console RSS "
            f"{_mb(rss)} once ready, "
            f"{_mb(setup.get('rss_end_mb'))} at the end (peak {_mb(setup.get('rss_peak_mb'))}); "
            f"client p50 - server p50, median page: {_ms(setup.get('client_minus_server_ms'))} ms")


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}s"


def _mb(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f} MB"


# --- the run ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.console",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="100,000 records, 10,000 letters")
    parser.add_argument("--records", type=int, help="records in the store [1000000]")
    parser.add_argument("--letters", type=int, help="dead letters in the DLQ [100000]")
    parser.add_argument("--requests", type=int, default=50, help="timed requests per page [50]")
    parser.add_argument("--warmup", type=int, default=5, help="untimed requests per page [5]")
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds to wait for the console's DLQ index [600]")
    parser.add_argument("--no-console", action="store_true",
                        help="make and check the data only (no console, no pages)")
    parser.add_argument("--seed", type=int, default=None, help="the letters' seed")
    parser.add_argument("--keep", action="store_true", help="keep the schema and the topics")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.records = args.records or (100_000 if args.quick else 1_000_000)
    args.letters = args.letters or (10_000 if args.quick else 100_000)
    if args.records < 1 or args.letters < 1 or args.requests < 1 or args.warmup < 0:
        parser.error("need --records, --letters, --requests >= 1 and --warmup >= 0")
    return args


@dataclass
class Data:
    """What the data steps made: the names a run cleans up and the pages use."""

    run_id: str
    schema: str
    topics: dict[str, str]
    store: Store | None = None
    produce_s: float = 0.0
    record_key: str = ""
    exact_key: str = ""
    marks: dict[int, tuple[int, int]] = field(default_factory=dict)
    checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def letters(self) -> int:
        return sum(hi - lo for lo, hi in self.marks.values())


def names(run_id: str) -> tuple[str, dict[str, str]]:
    base = f"bench-console-{run_id}"
    return f"bench_console_{run_id}", {
        "orders": f"{base}.orders", "dlq": f"{base}.orders.dlq",
        "shipments": f"{base}.shipments", "invoices": f"{base}.invoices"}


def make_data(s: Settings, admin: AdminClient, data: Data, *, records: int, letters: int,
              seed: int) -> None:
    """Steps 1 and 2: the store, the app's topics, the dead letters, the checks."""
    console.print(f"filling store schema {data.schema} with {records:,} records ...")
    data.store = fill_store(s.dsn, data.schema, records, data.topics)
    console.print(f"  {data.store.seconds:.1f}s: {data.store.by_status}, "
                  f"{data.store.audit_rows:,} audit rows")
    app_topics.create(build_app(data.topics["orders"]), admin, partitions=PARTITIONS)
    failed = failed_records(s.dsn, data.schema)
    conflicts = succeeded_keys(s.dsn, data.schema, letters // 10)
    dead = build_letters(letters, failed, conflicts, source=data.topics["orders"],
                         dlq=data.topics["dlq"], records=records, seed=seed)
    lettered = Counter(d.idempotency_key for d in dead if d.idempotency_key)
    with_letters = [f for f in failed if lettered[f.key]]
    # the record page's key: a failed record with an audit trail and the most letters
    best = max(with_letters, key=lambda f: (lettered[f.key], f.offset % 6 == 0), default=None)
    data.record_key = best.key if best else (failed[0].key if failed else "order-00000000")
    data.exact_key = failed[len(failed) // 2].key if failed else "order-00000001"
    console.print(f"producing {len(dead):,} dead letters to {data.topics['dlq']} "
                  f"({dict(Counter(d.kind for d in dead))}) ...")
    data.produce_s = produce_letters(s, dead)
    del dead
    data.marks = watermarks(s, data.topics["dlq"])
    sample = read_letters(s, data.topics["dlq"], limit=250)
    data.checked = len(sample)
    data.problems = check_letters(sample)
    if data.letters != letters:
        data.problems.insert(0, f"the DLQ holds {data.letters} letters, expected {letters}")
    console.print(f"  {data.produce_s:.1f}s; {data.letters:,} on the topic, {data.checked} "
                  f"read back and parsed: {'ok' if not data.problems else data.problems[:3]}")


def console_env(s: Settings, data: Data) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "KAFKA_IDEM_DATABASE_URL": s.dsn,
            "KAFKA_IDEM_BOOTSTRAP_SERVERS": s.bootstrap_servers,
            "KAFKA_IDEM_SCHEMA_NAME": data.schema, "KAFKA_IDEM_TABLE": TABLE,
            TOPIC_VAR: data.topics["orders"],
            "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def run_pages(proc: ConsoleProcess, page_list: Sequence[Page], setup: dict[str, Any], *,
              warmup: int, requests: int, ready_timeout: float) -> list[Timed]:
    """Step 4: start the console, wait for it to be ready, time every page."""
    rows: list[Timed] = []
    with httpx.Client(base_url=proc.base, timeout=60) as client:
        proc.start()
        setup["up_s"] = proc.wait_for(client, "/healthz", 120)
        console.print(f"  console up in {setup['up_s']:.1f}s (pid {proc.pid}); waiting for "
                      "its DLQ index ...")
        indexing = Timed("overview while indexing (not in the target)", "/")
        last = [0.0]

        def sample_overview() -> None:  # the overview as an operator sees it meanwhile
            if time.perf_counter() - last[0] >= 1.0:
                last[0] = time.perf_counter()
                try:
                    request(client, "/", indexing)
                except httpx.HTTPError as exc:
                    indexing.error = f"{type(exc).__name__}: {exc}"

        setup["ready_s"] = proc.wait_for(client, "/healthz?ready=1", ready_timeout,
                                         sample_overview)
        mem = rss_mb(proc.pid)
        setup["rss_ready_mb"] = mem.get("VmRSS")
        console.print(f"  ready in {setup['ready_s']:.1f}s, RSS {_mb(mem.get('VmRSS'))}")
        for page in page_list:
            timed = measure(client, page, warmup=warmup, requests=requests)
            console.print(f"  {page.name}: p95 {_ms(percentile(timed.server, 95))} ms"
                          + (f" [red]{escape(timed.error)}" if timed.error else ""))
            rows.append(timed)
        if indexing.requests or indexing.error:
            rows.append(indexing)
        mem = rss_mb(proc.pid)
        setup["rss_end_mb"], setup["rss_peak_mb"] = mem.get("VmRSS"), mem.get("VmHWM")
    # what the server time leaves out: the transfer, the client, TCP (the median page's)
    gaps = [c - s for t in rows if (c := percentile(t.client, 50)) is not None
            and (s := percentile(t.server, 50)) is not None]
    setup["client_minus_server_ms"] = percentile(gaps, 50)
    return rows


def cleanup(s: Settings, admin: AdminClient, data: Data) -> list[str]:
    problems = []
    try:
        with psycopg.connect(s.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                sql.Identifier(data.schema)))
    except psycopg.Error as exc:
        problems.append(f"dropping schema {data.schema}: {exc}")
    wanted = [data.topics["orders"], data.topics["dlq"]]
    for topic, fut in admin.delete_topics(wanted, operation_timeout=30).items():
        try:
            fut.result(30)
        except KafkaException as exc:
            if exc.args and exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                problems.append(f"deleting topic {topic}: {exc}")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    s = load_settings()
    run_id = uuid.uuid4().hex[:8]
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    admin = AdminClient(s.admin_config())
    schema, topic_names = names(run_id)
    data = Data(run_id, schema, topic_names)
    setup: dict[str, Any] = {"run": run_id, "seed": seed, "schema": schema,
                             "dlq_topic": topic_names["dlq"], "records": args.records,
                             "letters": args.letters, "loadavg_start": os.getloadavg()}
    rows: list[Timed] = []
    failure: str | None = None
    log = Path(tempfile.mkdtemp(prefix=f"bench-console-{run_id}-")) / "console.log"
    proc: ConsoleProcess | None = None
    console.print(f"bench.console {run_id}: seed {seed}; load average "
                  f"{setup['loadavg_start'][0]:.2f}")
    try:
        make_data(s, admin, data, records=args.records, letters=args.letters, seed=seed)
        assert data.store is not None
        setup.update(load_s=data.store.seconds, by_status=data.store.by_status,
                     audit_rows=data.store.audit_rows, produce_s=data.produce_s,
                     letters_on_topic=data.letters, letters_checked=data.checked,
                     letter_problems=data.problems[:20], record_key=data.record_key)
        if data.problems:
            failure = "the dead letters are not what the framework writes"
        elif not args.no_console:
            port = free_port()
            argv_console = [sys.executable, "-m", "kafka_idem.cli", "console",
                            "bench.console_app:app", "--port", str(port)]
            proc = ConsoleProcess(argv_console, port, console_env(s, data), log)
            console.print(f"starting the console on 127.0.0.1:{port} (log {log}) ...")
            page_list = pages(
                dlq=data.topics["dlq"], record_key=data.record_key, exact_key=data.exact_key,
                letters=letter_urls(data.topics["dlq"], data.marks,
                                    args.warmup + args.requests, seed),
                now=dt.datetime.now(dt.UTC))
            rows = run_pages(proc, page_list, setup, warmup=args.warmup,
                             requests=args.requests, ready_timeout=args.ready_timeout)
    except (RuntimeError, psycopg.Error, KafkaException, httpx.HTTPError) as exc:
        failure = f"{type(exc).__name__}: {exc}"
    finally:
        if proc is not None:
            setup["console_exit"] = proc.stop()
        problems = [] if args.keep else cleanup(s, admin, data)
        for p in problems:
            console.print(f"[yellow]clean-up: {escape(p)}")
        if args.keep:
            console.print(f"kept schema {schema}, topics {topic_names['orders']} and "
                          f"{topic_names['dlq']}")
    setup["loadavg_end"] = os.getloadavg()
    out = Console(width=max(Console().width, 160))
    if rows:
        out.print(render(rows, setup))
    if "load_s" in setup:
        out.print(setup_line(setup))
    if failure:
        console.print(f"[red]bench.console: {escape(failure)}")
    if args.json is not None:
        args.json.write_text(json.dumps({"setup": setup, "pages": [r.to_json() for r in rows],
                                         "failure": failure}, indent=2, default=str))
        console.print(f"results written to {args.json}")
    return 0 if failure is None and all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
