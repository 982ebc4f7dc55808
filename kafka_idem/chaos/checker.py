"""The anomaly checker: exactly-once effects judged from durable state only.

It reads the source topic (every record from the low watermark to the end),
the DLQ topic, the consumer group's committed offsets and PostgreSQL (the
idempotency records, the payments example's ledger and balances). It never asks
the producer or the consumers what they did, so it can judge any run after the
fact, including one whose processes were killed.

Each message of the source topic is decoded the way the payments handler
decodes it (Avro, pydantic, key ``{tenant_id}:charge:{order_id}``, request
hash over amount and currency). Per idempotency key, the *accepted* payload is
the first message whose request hash equals the record's stored hash; in the
payments example every message of a key is on one partition (the Kafka key is
the order id), so that must also be the key's *first-seen* payload.

The nine checks (a count of anomalies each, with a few examples):

1. **lost**: a source message with neither its effect (the key's record is
   ``succeeded`` with the message's request hash, and the ledger has the row)
   nor a DLQ record naming its partition and offset; also (optional input) a
   send the broker acknowledged that is not on the topic with the same bytes.
2. **duplicate or wrong effects**: more than one ledger row for a key; a ledger
   row without a succeeded record, or with another amount/currency/tenant than
   the accepted payload; a key whose accepted payload is not its first-seen
   one; a (tenant, currency) balance different from the sum of the accepted
   amounts of the succeeded keys.
3. **contradictory outcomes**: a key both succeeded and dead-lettered as
   ``permanent``/``exhausted`` (a ``payload_conflict`` record for a succeeded
   key is expected: the conflicting message was rejected, the original kept);
   a ``payload_conflict`` record for a message whose hash *is* the stored one;
   an ``undecodable`` record for a message that decodes; the example's business
   rule contradicted (an invalid charge succeeded, a valid one failed as
   ``permanent``).
4. **DLQ record integrity**: a record without one of
   :data:`kafka_idem.dlq.REQUIRED_HEADERS`, an unknown error kind, an
   ``idem.original.*`` that names no source message, key or value bytes that
   differ from that source message, an ``idem.key`` that is not its key.
5. **stale-owner commits**: the store keeps only the current owner token and
   the token that completed (``completed_token``), not the history of claims,
   so "completed by its last claim's token" is checked through what it leaves:
   ``succeeded`` has a ``completed_token`` and no ``owner_token``/lease, and
   the transition guard triggers (the update one refuses a completion whose
   token is not the current owner's, SQLSTATE KI002) are present and enabled. A stale
   owner's business write that slipped through would also show in check 2.
6. **illegal or stuck records**: ``processing`` or ``retryable_failed`` after
   healing; ``failed`` without a known error kind; ``succeeded`` without
   ``completed_at``; ``attempts`` < 1 or below ``attempt_base``; a record whose
   key is on no source message, or whose stored hash is on none of its key's
   messages.
7. **committed ahead**: a committed offset past a message that has no outcome
   (counted per message), or past the end of the partition.
8. **retry limit exceeded**: ``attempts - attempt_base > max_attempts``.
9. **liveness**: a partition whose committed offset is not its end offset
   (lag), and, when the run passes it, lag not back to 0 within the bound.

    report = check(bootstrap="127.0.0.1:39092", dsn=..., topic="t", group="g")
    Console().print(report.table())
    assert report.ok
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from confluent_kafka import Consumer, KafkaException, TopicPartition
from psycopg import sql
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from kafka_idem.codec import AvroCodec
from kafka_idem.dlq import ERROR_KINDS, REQUIRED_HEADERS
from kafka_idem.errors import MessageError
from kafka_idem.keys import hash_payload

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = 5  # offending keys/offsets kept per check
FAILED_KINDS = ("permanent", "exhausted")

TITLES = {
    1: "lost",
    2: "duplicate or wrong effects",
    3: "contradictory outcomes",
    4: "DLQ record integrity",
    5: "stale-owner commits",
    6: "illegal or stuck records",
    7: "committed offsets ahead of outcomes",
    8: "retry limit exceeded",
    9: "liveness (lag back to 0)",
}

Pos = tuple[int, int]  # (partition, offset)
T = TypeVar("T")


class CheckerError(Exception):
    """The checker could not read the durable state it needs."""


@dataclass
class Check:
    number: int
    title: str
    examined: str = ""
    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, example: str, n: int = 1) -> None:
        self.count += n
        if len(self.examples) < EXAMPLES:
            self.examples.append(example)


@dataclass(frozen=True)
class Liveness:
    """What the run measured: seconds from the heal to lag 0 (None: never), and the bound."""

    healed_in: float | None
    bound: float


@dataclass
class Report:
    checks: list[Check]
    figures: dict[str, Any]

    @property
    def anomalies(self) -> int:
        return sum(c.count for c in self.checks)

    @property
    def ok(self) -> bool:
        return self.anomalies == 0

    def count(self, number: int) -> int:
        return self.by_number(number).count

    def by_number(self, number: int) -> Check:
        return next(c for c in self.checks if c.number == number)

    def failing(self) -> set[int]:
        return {c.number for c in self.checks if c.count}

    def to_json(self) -> dict[str, Any]:
        return {
            "anomalies": self.anomalies,
            "ok": self.ok,
            "checks": [
                {"number": c.number, "title": c.title, "count": c.count,
                 "examined": c.examined, "examples": c.examples}
                for c in self.checks
            ],
            "figures": self.figures,
        }

    def table(self) -> Table:
        t = Table(title="Checker (durable state only)", title_justify="left")
        for col in ("#", "check", "", "anomalies", "examined", "examples"):
            t.add_column(col, justify="right" if col in ("#", "anomalies") else "left")
        for c in self.checks:
            verdict = "[green]PASS[/]" if not c.count else "[bold red]FAIL[/]"
            t.add_row(str(c.number), c.title, verdict, str(c.count), c.examined,
                      "\n".join(c.examples))
        return t

    def figures_table(self) -> Table:
        t = Table(title="Durable figures", title_justify="left")
        t.add_column("figure")
        t.add_column("value", justify="right")
        for name, value in self.figures.items():
            if isinstance(value, dict):
                value = ", ".join(f"{k} {v}" for k, v in value.items()) or "-"
            t.add_row(name, str(value))
        return t


# --- reading Kafka ---


@dataclass(frozen=True, slots=True)
class KafkaRecord:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]

    def header_map(self) -> dict[str, str]:
        return {k: v.decode("utf-8", "replace") for k, v in self.headers}


def _client_conf(bootstrap: str, kafka: Mapping[str, Any] | None) -> dict[str, Any]:
    conf = {k: v for k, v in (kafka or {}).items() if not k.startswith(("group.", "fetch."))}
    conf.update({
        "bootstrap.servers": bootstrap,
        "group.id": f"kafka-idem-checker-{uuid.uuid4().hex[:12]}",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": False,
        "auto.offset.reset": "earliest",
        "log_level": 2,  # connection errors during a broker restart are retried, not news
    })
    return conf


def read_topic(
    bootstrap: str, topic: str, *, kafka: Mapping[str, Any] | None = None,
    timeout: float = 300.0,
) -> tuple[list[KafkaRecord], dict[int, tuple[int, int]]]:
    """Every record of ``topic`` (low watermark to end) and ``{partition: (low, high)}``."""
    consumer = Consumer(_client_conf(bootstrap, kafka))
    try:
        meta = consumer.list_topics(topic, timeout=30).topics.get(topic)
        if meta is None or meta.error is not None:
            raise CheckerError(f"topic {topic!r} not found: {meta.error if meta else 'absent'}")
        marks = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
                 for p in sorted(meta.partitions)}
        left = {p: high for p, (low, high) in marks.items() if high > low}
        consumer.assign([TopicPartition(topic, p, marks[p][0]) for p in left])
        out: list[KafkaRecord] = []
        deadline = time.monotonic() + timeout
        while left:
            if time.monotonic() > deadline:
                raise CheckerError(f"could not read {topic!r} to its end in {timeout:.0f}s: "
                                   f"partitions {sorted(left)} unfinished")
            for m in consumer.consume(2000, timeout=0.1):
                if m.error() is not None:
                    continue
                p, off = int(m.partition() or 0), int(m.offset() or 0)
                if p not in left or off >= left[p]:
                    continue
                out.append(KafkaRecord(p, off, m.key(), m.value(), _headers(m.headers())))
                if off + 1 >= left[p]:
                    del left[p]
        return out, marks
    finally:
        consumer.close()


def _headers(raw: Any) -> tuple[tuple[str, bytes], ...]:
    out = []
    for k, v in raw or []:
        out.append((str(k), v.encode() if isinstance(v, str) else bytes(v or b"")))
    return tuple(out)


def _patiently(read: Callable[[], T], attempts: int = 6, pause: float = 5.0) -> T:
    """``read()``, again after a pause when Kafka does not answer (e.g. a broker restart
    by someone else): an unreadable state is an error, never a verdict."""
    for attempt in range(attempts):
        try:
            return read()
        except (KafkaException, CheckerError):
            if attempt == attempts - 1:
                raise
            time.sleep(pause)
    raise AssertionError("unreachable")


def committed_offsets(
    bootstrap: str, group: str, topic: str, partitions: Iterable[int], *,
    kafka: Mapping[str, Any] | None = None,
) -> dict[int, int]:
    """The group's committed offset per partition (negative: none), without joining it."""
    conf = _client_conf(bootstrap, kafka)
    conf["group.id"] = group
    consumer = Consumer(conf)
    try:
        tps = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=30)
        return {tp.partition: tp.offset for tp in tps}
    finally:
        consumer.close()


# --- decoding like the payments handler ---


@dataclass(frozen=True, slots=True)
class Intent:
    key: str
    request_hash: str
    tenant: str
    order: str
    amount: Decimal
    currency: str
    valid: bool


class PaymentsDecoder:
    """Decodes a source message exactly as ``consumers.payments`` does (or says why not)."""

    def __init__(self, topic: str) -> None:
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        from consumers.payments import CURRENCIES, SCHEMAS_DIR, build_app

        self.handler = build_app(topic=topic).handlers[topic]
        self.codec = AvroCodec.from_dir(SCHEMAS_DIR)
        self.currencies = CURRENCIES

    def __call__(self, value: bytes | None) -> Intent | str:
        h = self.handler
        try:
            _name, record = self.codec.decode(value, reader=h.schema)
            model = h.model.model_validate(record)
            key = h.key.build(model)
        except ValidationError:
            return "invalid payload"
        except MessageError as exc:
            return f"{type(exc).__name__}"
        amount = Decimal(model.amount)
        return Intent(key, hash_payload(model, h.hash_fields), model.tenant_id, model.order_id,
                      amount, model.currency, amount > 0 and model.currency in self.currencies)


# --- reading PostgreSQL ---


# The transition guard's triggers (migration 0003: one per event, each with its WHEN).
GUARD_TRIGGERS = ("guard_transitions", "guard_transitions_insert", "guard_transitions_delete")


def _read_db(
    dsn: str, schema: str, table: str, ledger: tuple[str, str], balances: tuple[str, str]
) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict[str, Any]]],
           dict[tuple[str, str], Decimal], dict[str, str]]:
    from psycopg.rows import dict_row

    with psycopg.connect(dsn, application_name="chaos-checker") as conn:
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        cur = conn.cursor(row_factory=dict_row)
        records = {r["idempotency_key"]: r for r in cur.execute(sql.SQL(
            "SELECT idempotency_key, request_hash, status, owner_token, completed_token, "
            "lease_until, attempts, attempt_base, error_kind, completed_at, kafka_partition, "
            "kafka_offset FROM {}").format(sql.Identifier(schema, table))).fetchall()}
        rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in cur.execute(sql.SQL(
                "SELECT id, idempotency_key, tenant_id, order_id, amount, currency FROM {} "
                "ORDER BY id").format(sql.Identifier(*ledger))).fetchall():
            rows[r["idempotency_key"]].append(r)
        bal = {(r["tenant_id"], r["currency"]): Decimal(r["balance"]) for r in cur.execute(
            sql.SQL("SELECT tenant_id, currency, balance FROM {}").format(
                sql.Identifier(*balances))).fetchall()}
        trig = conn.execute(
            "SELECT t.tgname, t.tgenabled FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = %s AND t.tgname = ANY(%s)",
            (schema, table, list(GUARD_TRIGGERS))).fetchall()
    enabled = {str(name): str(state) for name, state in trig}
    return records, rows, bal, enabled


# --- the checks ---


def _where(pos: Pos) -> str:
    return f"p{pos[0]}@{pos[1]}"


def check(
    *,
    bootstrap: str,
    dsn: str,
    topic: str,
    group: str,
    dlq_topic: str | None = None,
    schema: str = "kafka_idem",
    table: str = "task_idempotency",
    max_attempts: int = 5,
    liveness: Liveness | None = None,
    acknowledged: Mapping[Pos, bytes | None] | None = None,
    ledger: tuple[str, str] = ("payments", "ledger"),
    balances: tuple[str, str] = ("payments", "balances"),
    kafka: Mapping[str, Any] | None = None,
) -> Report:
    """Judge the payments example's run on ``topic`` by ``group`` from durable state.

    ``liveness`` is what the run measured after healing (check 9 also looks at
    the lag itself). ``acknowledged`` optionally maps each send the broker
    acknowledged, ``(partition, offset)``, to its value bytes (check 1).
    ``kafka`` passes librdkafka options (SASL/TLS) to the checker's clients.
    """
    dlq_topic = dlq_topic or f"{topic}.dlq"
    started = time.monotonic()
    source, marks = _patiently(lambda: read_topic(bootstrap, topic, kafka=kafka))
    dead, _ = _patiently(lambda: read_topic(bootstrap, dlq_topic, kafka=kafka))
    committed = _patiently(lambda: committed_offsets(bootstrap, group, topic, marks,
                                                     kafka=kafka))
    records, ledger_rows, balance, guard = _read_db(dsn, schema, table, ledger, balances)

    checks = {n: Check(n, title) for n, title in TITLES.items()}
    decode = PaymentsDecoder(topic)
    by_pos: dict[Pos, KafkaRecord] = {(m.partition, m.offset): m for m in source}
    decoded: dict[Pos, Intent | str] = {pos: decode(m.value) for pos, m in by_pos.items()}
    by_key: dict[str, list[tuple[Pos, Intent]]] = defaultdict(list)
    for pos in sorted(decoded):
        d = decoded[pos]
        if isinstance(d, Intent):
            by_key[d.key].append((pos, d))

    # DLQ records by the source message they name.
    dlq_for: dict[Pos, list[dict[str, str]]] = defaultdict(list)
    dlq_kinds: Counter[str] = Counter()
    c4 = checks[4]
    for letter in dead:
        h = letter.header_map()
        where = f"dlq p{letter.partition}@{letter.offset}"
        kind = h.get("idem.error.kind", "?")
        dlq_kinds[kind] += 1
        missing = [name for name in REQUIRED_HEADERS if name not in h]
        if missing:
            c4.add(f"{where}: missing {', '.join(missing)}")
        try:
            pos = (int(h["idem.original.partition"]), int(h["idem.original.offset"]))
        except (KeyError, ValueError):
            if not missing:
                c4.add(f"{where}: unparsable original partition/offset")
            continue
        src = by_pos.get(pos)
        if h.get("idem.original.topic") != topic or src is None:
            if not missing:
                c4.add(f"{where}: names {h.get('idem.original.topic')} {_where(pos)}, "
                       "no such source message")
            continue
        # It names a source message: an outcome for check 1 (any damage is counted here).
        dlq_for[pos].append(h)
        if missing:
            continue
        d = decoded[pos]
        stated = h.get("idem.key")
        if kind not in ERROR_KINDS:
            c4.add(f"{where}: unknown error kind {kind!r}")
        elif src.key != letter.key or src.value != letter.value:
            which = "key" if src.key != letter.key else "value"
            c4.add(f"{where}: {which} bytes differ from source {_where(pos)}")
        elif stated is not None and isinstance(d, Intent) and stated != d.key:
            c4.add(f"{where}: idem.key {stated!r} is not the message's key {d.key!r}")
    c4.examined = f"{len(dead)} DLQ records"

    # Accepted payloads, wrong effects, duplicates, balances (check 2).
    c2 = checks[2]
    accepted: dict[str, Intent] = {}
    spread = 0
    for key, rec in records.items():
        seen = by_key.get(key, [])
        match = [(pos, d) for pos, d in seen if d.request_hash == rec["request_hash"]]
        if not match:
            continue  # check 6: phantom record
        accepted[key] = match[0][1]
        if len({pos[0] for pos, _ in seen}) > 1:
            spread += 1  # no order between partitions: any matching payload is accepted
        elif rec["status"] == "succeeded" and seen[0][0] != match[0][0]:
            c2.add(f"{key}: a later payload ({_where(match[0][0])}) took effect, not the "
                   f"first-seen one ({_where(seen[0][0])})")
    for key, rows in ledger_rows.items():
        owner = records.get(key)
        if len(rows) > 1:
            c2.add(f"{key}: {len(rows)} ledger rows")
        if owner is None or owner["status"] != "succeeded":
            c2.add(f"{key}: ledger row without a succeeded record "
                   f"({owner['status'] if owner else 'no record'})")
            continue
        want = accepted.get(key)
        if want is not None and any(
            (r["tenant_id"], r["order_id"], Decimal(r["amount"]), r["currency"])
            != (want.tenant, want.order, want.amount, want.currency) for r in rows
        ):
            c2.add(f"{key}: ledger row differs from the accepted payload")
    expected: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
    for key, rec in records.items():
        if rec["status"] == "succeeded" and key in accepted:
            expected[(accepted[key].tenant, accepted[key].currency)] += accepted[key].amount
    for pair in sorted(expected.keys() | balance.keys()):
        if expected.get(pair, Decimal(0)) != balance.get(pair, Decimal(0)):
            c2.add(f"balance {pair[0]}/{pair[1]}: {balance.get(pair, 0)} != "
                   f"{expected.get(pair, 0)} (sum of accepted intents)")
    c2.examined = (f"{sum(len(r) for r in ledger_rows.values())} ledger rows, "
                   f"{len(balance)} balances")

    # Per source message: outcome (1), committed ahead (7), contradictions (3).
    c1, c3, c7 = checks[1], checks[3], checks[7]
    for pos in sorted(decoded):
        d = decoded[pos]
        letters = dlq_for.get(pos, [])
        stored = records.get(d.key) if isinstance(d, Intent) else None
        if isinstance(d, Intent) and stored is not None:
            for h in letters:
                kind = h.get("idem.error.kind", "?")
                if kind == "payload_conflict" and stored["request_hash"] == d.request_hash:
                    c3.add(f"{_where(pos)} {d.key}: dead-lettered as payload_conflict "
                           "with the stored request hash")
        for h in letters:
            if h.get("idem.error.kind") == "undecodable" and isinstance(d, Intent):
                c3.add(f"{_where(pos)}: dead-lettered as undecodable but decodes ({d.key})")
        effect = (isinstance(d, Intent) and stored is not None
                  and stored["status"] == "succeeded"
                  and stored["request_hash"] == d.request_hash and bool(ledger_rows.get(d.key)))
        if effect or letters:
            continue
        what = d.key if isinstance(d, Intent) else d
        c1.add(f"{_where(pos)} {what}: no effect, no DLQ record")
        if committed.get(pos[0], -1) > pos[1]:
            c7.add(f"{_where(pos)} {what}: below committed offset {committed[pos[0]]}")
    if acknowledged is not None:
        for pos, value in sorted(acknowledged.items()):
            got = by_pos.get(pos)
            if got is None or got.value != value:
                c1.add(f"{_where(pos)}: acknowledged send "
                       + ("not on the topic" if got is None else "has other bytes on the topic"))
    c1.examined = f"{len(source)} source messages" + (
        f", {len(acknowledged)} acknowledged sends" if acknowledged is not None else "")
    for p, (_low, high) in sorted(marks.items()):
        if committed.get(p, -1) > high:
            c7.add(f"p{p}: committed offset {committed[p]} past the end {high}")
    c7.examined = f"{len(marks)} partitions, committed {_total(committed)}"

    # Contradictions between a key's record and its DLQ records / the business rule (3).
    for key, seen in by_key.items():
        known = records.get(key)
        if known is None:
            continue
        kinds = {h.get("idem.error.kind", "?") for pos, _ in seen for h in dlq_for.get(pos, [])}
        if known["status"] == "succeeded":
            bad = kinds & set(FAILED_KINDS)
            if bad:
                c3.add(f"{key}: succeeded and dead-lettered as {'/'.join(sorted(bad))}")
            if key in accepted and not accepted[key].valid:
                c3.add(f"{key}: an invalid charge took effect")
        elif (known["status"] == "failed" and known["error_kind"] == "permanent"
              and key in accepted and accepted[key].valid):
            c3.add(f"{key}: a valid charge failed as permanent")
    c3.examined = f"{len(by_key)} keys"

    # Records: stale owners (5), illegal or stuck (6), retry limits (8).
    c5, c6, c8 = checks[5], checks[6], checks[8]
    for name in GUARD_TRIGGERS:
        if guard.get(name) not in ("O", "A"):
            c5.add("transition guard trigger "
                   + ("missing" if name not in guard else "disabled") + f" ({name})")
    statuses: Counter[str] = Counter()
    failed_kinds: Counter[str] = Counter()
    for key, rec in sorted(records.items()):
        status = rec["status"]
        statuses[status] += 1
        if status == "failed":
            failed_kinds[rec["error_kind"] or "none"] += 1
        if status == "succeeded" and (rec["completed_token"] is None
                                      or rec["owner_token"] is not None
                                      or rec["lease_until"] is not None):
            c5.add(f"{key}: succeeded with completed_token={rec['completed_token']}, "
                   f"owner_token={rec['owner_token']}")
        problem = None
        if status in ("processing", "retryable_failed"):
            problem = f"still {status} (attempts {rec['attempts']})"
        elif status == "failed" and rec["error_kind"] not in FAILED_KINDS:
            problem = f"failed with error kind {rec['error_kind']!r}"
        elif status == "succeeded" and rec["completed_at"] is None:
            problem = "succeeded without completed_at"
        elif status not in ("succeeded", "failed"):
            problem = f"unknown status {status!r}"
        elif rec["attempts"] < 1 or rec["attempt_base"] > rec["attempts"]:
            problem = f"attempts {rec['attempts']}, attempt_base {rec['attempt_base']}"
        elif key not in by_key:
            problem = "its key is on no source message"
        elif key not in accepted:
            problem = "its request hash is on none of its key's messages"
        if problem:
            c6.add(f"{key}: {problem}")
        if rec["attempts"] - rec["attempt_base"] > max_attempts:
            c8.add(f"{key}: {rec['attempts'] - rec['attempt_base']} attempts > {max_attempts}")
    c5.examined = f"{statuses['succeeded']} succeeded records, guard triggers"
    c6.examined = f"{len(records)} records"
    c8.examined = f"{len(records)} records, limit {max_attempts}"

    # Liveness (9).
    c9 = checks[9]
    lag = {p: high - max(committed.get(p, -1), low) for p, (low, high) in marks.items()}
    for p, n in sorted(lag.items()):
        if n > 0:
            c9.add(f"p{p}: lag {n}")
    if liveness is not None and (liveness.healed_in is None
                                 or liveness.healed_in > liveness.bound):
        c9.add(f"lag not back to 0 within {liveness.bound:.0f}s of the heal")
    c9.examined = f"{len(marks)} partitions" + (
        "" if liveness is None else f", healed in {_secs(liveness.healed_in)} "
        f"(bound {liveness.bound:.0f}s)")

    decodable = sum(1 for d in decoded.values() if isinstance(d, Intent))
    same = sum(1 for d in decoded.values() if isinstance(d, Intent) and d.key in accepted
               and accepted[d.key].request_hash == d.request_hash)
    figures: dict[str, Any] = {
        "source messages": len(source),
        "decodable / not": f"{decodable} / {len(source) - decodable}",
        "distinct keys": len(by_key),
        "messages repeating the accepted payload": same - len(accepted),
        "messages with another payload (conflicts)": decodable - same,
        "records by status": dict(sorted(statuses.items())),
        "failed records by kind": dict(sorted(failed_kinds.items())),
        "records with attempts > 1 (taken over or retried)": sum(
            1 for r in records.values() if r["attempts"] > 1),
        "ledger rows": sum(len(r) for r in ledger_rows.values()),
        "balances (tenant, currency)": len(balance),
        "DLQ records by kind": dict(sorted(dlq_kinds.items())),
        "source messages dead-lettered more than once": sum(
            1 for v in dlq_for.values() if len(v) > 1),
        "keys spread over partitions": spread,
        "committed / end offsets": f"{_total(committed)} / {sum(h for _, h in marks.values())}",
        "checker seconds": round(time.monotonic() - started, 1),
    }
    return Report([checks[n] for n in sorted(checks)], figures)


def _total(offsets: Mapping[int, int]) -> int:
    return sum(max(o, 0) for o in offsets.values())


def _secs(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f}s"


def main(argv: list[str] | None = None) -> int:
    """``python -m kafka_idem.chaos.checker``: check a (kept) run again."""
    from kafka_idem.settings import load_settings

    ap = argparse.ArgumentParser(prog="python -m kafka_idem.chaos.checker",
                                 description="Check a payments run from durable state.")
    ap.add_argument("--topic", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--dlq", help="DLQ topic (default: <topic>.dlq)")
    ap.add_argument("--max-attempts", type=int, help="default: KAFKA_IDEM_MAX_ATTEMPTS")
    ap.add_argument("--json", type=Path, help="write the report here")
    args = ap.parse_args(argv)
    s = load_settings()
    report = check(bootstrap=s.bootstrap_servers, dsn=s.dsn, topic=args.topic, group=args.group,
                   dlq_topic=args.dlq, schema=s.schema_name, table=s.table,
                   max_attempts=args.max_attempts or s.max_attempts, kafka=s.kafka)
    console = Console()
    console.print(report.figures_table())
    console.print(report.table())
    if args.json:
        args.json.write_text(json.dumps(report.to_json(), indent=2, default=str))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
