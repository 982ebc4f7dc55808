"""Throughput of kafka_idem against plain confluent-kafka, on one topic, in one run.

    python -m bench [--messages 20000] [--dup-ratio 0.1] [--batch-size 500] [--keep]

1. Create a fresh topic (4 partitions), fresh store schemas and fresh tenant ids.
2. Produce N payments charge requests (``consumers.payments.encode_charge``), a
   share of them duplicates: the same intent again with a new ``request_id``.
3. Measure, each with a fresh consumer group on that topic:
   a. raw: ``consume(num_messages=500)`` + a synchronous commit per batch;
   b. kafka_idem, ``mode="local"`` (the payments example as shipped);
   c. kafka_idem, ``mode="leased"``.
   A path's clock runs from its first fetched batch to the commit that reaches
   the topic's end offsets (group join time is reported apart). SQL round
   trips are counted client side (see ``bench/roundtrips.py``).
4. Check exactly-once effects after each framework path: one ledger row per
   distinct key, balances moved by exactly the intents' sums.
5. Print a table, write ``bench/results.json``, drop what was created (unless ``--keep``).

No assertions on timing anywhere: numbers are for reading, checks are on effects.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import confluent_kafka
import psycopg
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from psycopg import sql
from rich.console import Console
from rich.table import Table

from bench import roundtrips
from consumers import payments
from kafka_idem.migrate import migrate
from kafka_idem.runner import Runner
from kafka_idem.settings import Settings, load_settings

PARTITIONS = 4
TENANTS = 50
TABLE = "task_idempotency"
RESULTS = Path(__file__).resolve().parent / "results.json"
CURRENCIES = sorted(payments.CURRENCIES)

console = Console(stderr=True)


# --- the workload --------------------------------------------------------------


@dataclass(frozen=True)
class Intent:
    tenant_id: str
    order_id: str
    amount: Decimal
    currency: str

    @property
    def key(self) -> str:
        return f"{self.tenant_id}:charge:{self.order_id}"


def plan(
    n: int, dup_ratio: float, run_id: str, rng: random.Random
) -> tuple[list[Intent], list[Intent]]:
    """Distinct intents, and the N messages to send (intents plus duplicates, shuffled)."""
    distinct = max(1, n - round(n * dup_ratio))
    intents = [
        Intent(
            tenant_id=f"bench-{run_id}-t{i % TENANTS:02d}",
            order_id=f"bench-{run_id}-o{i:07d}",
            amount=Decimal(rng.randint(1, 100_000)) / 100,
            currency=rng.choice(CURRENCIES),
        )
        for i in range(distinct)
    ]
    messages = intents + rng.choices(intents, k=n - distinct)
    rng.shuffle(messages)
    return intents, messages


def produce(s: Settings, topic: str, messages: list[Intent]) -> None:
    producer = Producer({**s.producer_config(), "linger.ms": 20})
    failures: list[str] = []

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is not None:
            failures.append(str(err))

    for i, m in enumerate(messages):
        value = payments.encode_charge(m.tenant_id, m.order_id, m.amount, m.currency)
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
    left = producer.flush(60)
    if left or failures:
        raise SystemExit(f"bench: produce failed ({left} unacknowledged, errors: {failures[:3]})")


def end_offsets(s: Settings, topic: str) -> dict[int, int]:
    probe = Consumer({"bootstrap.servers": s.bootstrap_servers, "group.id": "bench-probe",
                      **{k: v for k, v in s.kafka.items()}})
    try:
        return {
            p: probe.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(PARTITIONS)
        }
    finally:
        probe.close()


# --- measurements ----------------------------------------------------------------


@dataclass
class PathResult:
    path: str
    messages: int
    seconds: float = 0.0
    join_seconds: float = 0.0
    round_trips: dict[str, int] = field(default_factory=dict)
    check: str = ""
    ok: bool = False
    outcomes: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else 0.0


def _reached(done: dict[int, int], ends: dict[int, int]) -> bool:
    return all(done.get(p, -1) >= end for p, end in ends.items())


def run_raw(
    s: Settings, topic: str, group: str, ends: dict[int, int], timeout: float
) -> PathResult:
    total = sum(ends.values())
    result = PathResult("raw confluent-kafka", total)
    consumer = Consumer(s.consumer_config(group))
    consumer.subscribe([topic])
    started = time.perf_counter()
    first: float | None = None
    committed: dict[int, int] = {}
    seen = 0
    try:
        while not _reached(committed, ends):
            if time.perf_counter() - started > timeout:
                result.check = f"timed out after {timeout:.0f}s with {seen}/{total} consumed"
                return result
            batch = consumer.consume(num_messages=500, timeout=1.0)
            nxt: dict[int, int] = {}
            for msg in batch:
                part, offset = msg.partition(), msg.offset()
                if msg.error() is not None or part is None or offset is None:
                    continue
                if first is None:
                    first = time.perf_counter()
                seen += 1
                nxt[part] = offset + 1
            if nxt:
                consumer.commit(
                    offsets=[TopicPartition(topic, p, o) for p, o in nxt.items()],
                    asynchronous=False,
                )
                committed.update(nxt)
        end = time.perf_counter()
        broker = {tp.partition: tp.offset for tp in consumer.committed(
            [TopicPartition(topic, p) for p in ends], timeout=10)}
    finally:
        consumer.close()
    assert first is not None
    result.seconds = end - first
    result.join_seconds = first - started
    result.ok = broker == ends and seen == total
    result.check = (
        f"{seen} consumed, committed = end offsets" if result.ok
        else f"committed {broker} != ends {ends} ({seen} consumed)"
    )
    return result


class TimedConsumer:
    """Stands in for the runner's consumer: notes the first fetched batch and the
    offsets each successful commit stored, then delegates everything."""

    def __init__(self, inner: Consumer) -> None:
        self.inner = inner
        self.first_batch: float | None = None
        self.committed: dict[int, int] = {}
        self.last_commit = 0.0

    def consume(self, *args: Any, **kwargs: Any) -> Any:
        batch = self.inner.consume(*args, **kwargs)
        if batch and self.first_batch is None:
            self.first_batch = time.perf_counter()
        return batch

    def commit(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner.commit(*args, **kwargs)
        for tp in kwargs.get("offsets") or []:
            self.committed[tp.partition] = max(self.committed.get(tp.partition, -1), tp.offset)
        self.last_commit = time.perf_counter()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def run_framework(
    s: Settings, *, mode: str, topic: str, group: str, schema: str, batch_size: int,
    ends: dict[int, int], intents: list[Intent], timeout: float,
) -> PathResult:
    total = sum(ends.values())
    result = PathResult(f"kafka_idem {mode}", total)
    app = payments.build_app(
        topic=topic, mode=mode, name=f"bench-{mode}", group_id=group, schema_name=schema,
        table=TABLE, batch_size=batch_size, bootstrap_servers=s.bootstrap_servers,
        database_url=s.dsn, kafka=s.kafka,
    )
    tenants = sorted({i.tenant_id for i in intents})
    ledger_mark, balances_before = ledger_state(s.dsn, tenants)
    runner = Runner(app)
    tps = [TopicPartition(topic, p) for p in ends]
    roundtrips.install()
    with roundtrips.counting() as counts:
        runner.start()
        assert runner.consumer is not None
        timed = TimedConsumer(runner.consumer)
        runner.consumer = timed  # type: ignore[assignment]
        started = time.perf_counter()
        last_check = 0.0
        done = False
        try:
            while not done:
                now = time.perf_counter()
                if now - started > timeout:
                    break
                runner.step()
                now = time.perf_counter()
                # The broker's committed offsets are the stop condition, asked at most
                # every 0.25 s or as soon as our own commits say the end was reached.
                if _reached(timed.committed, ends) or now - last_check >= 0.25:
                    last_check = now
                    stored = timed.inner.committed(tps, timeout=10)
                    done = _reached({tp.partition: tp.offset for tp in stored}, ends)
        finally:
            end = timed.last_commit
            runner.close()
    result.round_trips = roundtrips.summary(counts)
    result.outcomes = {
        outcome: sum(
            sample.value
            for metric in runner.metrics.messages.collect()
            for sample in metric.samples
            if sample.name.endswith("_total") and sample.labels.get("outcome") == outcome
        )
        for outcome in ("succeeded", "replayed", "busy", "conflict", "retried", "dead_lettered")
    }
    if not done:
        result.check = f"timed out after {timeout:.0f}s; committed {timed.committed} of {ends}"
        return result
    assert timed.first_batch is not None
    result.seconds = end - timed.first_batch
    result.join_seconds = timed.first_batch - started
    result.ok, result.check = check_effects(s.dsn, schema, intents, ledger_mark, balances_before)
    return result


# --- exactly-once checks -----------------------------------------------------------


def ledger_state(dsn: str, tenants: list[str]) -> tuple[int, dict[tuple[str, str], Decimal]]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT coalesce(max(id), 0) FROM payments.ledger").fetchone()
        balances = conn.execute(
            "SELECT tenant_id, currency, balance FROM payments.balances WHERE tenant_id = ANY(%s)",
            (tenants,),
        ).fetchall()
    assert row is not None
    return int(row[0]), {(t, c): b for t, c, b in balances}


def check_effects(
    dsn: str, schema: str, intents: list[Intent], mark: int,
    before: dict[tuple[str, str], Decimal],
) -> tuple[bool, str]:
    """One ledger row per distinct key (rows this run wrote), balances moved by the intents."""
    tenants = sorted({i.tenant_id for i in intents})
    expected_keys = {i.key for i in intents}
    with psycopg.connect(dsn) as conn:
        rows, keys, dup_keys = conn.execute(
            "SELECT count(*), count(DISTINCT idempotency_key),"
            " (SELECT count(*) FROM (SELECT 1 FROM payments.ledger WHERE tenant_id = ANY(%(t)s)"
            "   AND id > %(mark)s GROUP BY idempotency_key HAVING count(*) > 1) d)"
            " FROM payments.ledger WHERE tenant_id = ANY(%(t)s) AND id > %(mark)s",
            {"t": tenants, "mark": mark},
        ).fetchone() or (0, 0, 0)
        written = {
            r[0] for r in conn.execute(
                "SELECT DISTINCT idempotency_key FROM payments.ledger"
                " WHERE tenant_id = ANY(%s) AND id > %s", (tenants, mark)
            )
        }
        succeeded = conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE status = 'succeeded'").format(
                sql.Identifier(schema, TABLE)
            )
        ).fetchone()
        after = {
            (t, c): b for t, c, b in conn.execute(
                "SELECT tenant_id, currency, balance FROM payments.balances"
                " WHERE tenant_id = ANY(%s)", (tenants,)
            )
        }
    sums: Counter[tuple[str, str]] = Counter()
    for i in intents:
        sums[(i.tenant_id, i.currency)] += i.amount  # type: ignore[assignment]
    moved = {
        k: after.get(k, Decimal(0)) - before.get(k, Decimal(0))
        for k in after.keys() | sums.keys()
    }
    balances_ok = all(moved[k] == sums.get(k, Decimal(0)) for k in moved)
    store_ok = succeeded is not None and succeeded[0] == len(expected_keys)
    ok = rows == keys == len(expected_keys) and dup_keys == 0 and written == expected_keys
    ok = ok and balances_ok and store_ok
    text = (
        f"{rows} ledger rows / {keys} keys / {len(expected_keys)} intents; "
        f"{dup_keys} doubled; balances {'ok' if balances_ok else 'WRONG'}; "
        f"{succeeded[0] if succeeded else 0} succeeded records"
    )
    return ok, ("ok: " if ok else "FAILED: ") + text


# --- set-up and clean-up --------------------------------------------------------------


def create_topic(admin: AdminClient, topic: str) -> None:
    for fut in admin.create_topics([NewTopic(topic, PARTITIONS, 1)]).values():
        fut.result(30)


def create_payments_tables(dsn: str) -> None:
    for attempt in range(3):  # concurrent first-time CREATE ... IF NOT EXISTS can collide
        try:
            with psycopg.connect(dsn) as conn:
                payments.create_tables(conn)
            return
        except psycopg.errors.UniqueViolation:
            if attempt == 2:
                raise
            time.sleep(0.2)


def cleanup(
    s: Settings, admin: AdminClient, topic: str, schemas: list[str], groups: list[str],
    tenants: list[str],
) -> list[str]:
    problems = []
    try:
        with psycopg.connect(s.dsn) as conn:
            for schema in schemas:
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                        sql.Identifier(schema)
                    )
                )
            conn.execute("DELETE FROM payments.ledger WHERE tenant_id = ANY(%s)", (tenants,))
            conn.execute("DELETE FROM payments.balances WHERE tenant_id = ANY(%s)", (tenants,))
    except psycopg.Error as exc:
        problems.append(f"database clean-up: {exc}")
    for name, futures in (
        ("topic", admin.delete_topics([topic, f"{topic}.dlq"])),
        ("group", admin.delete_consumer_groups(groups) if groups else {}),
    ):
        for what, fut in futures.items():
            try:
                fut.result(30)
            except KafkaException as exc:
                code = exc.args[0].code() if exc.args else None
                if code not in (confluent_kafka.KafkaError.UNKNOWN_TOPIC_OR_PART,
                                confluent_kafka.KafkaError.GROUP_ID_NOT_FOUND):
                    problems.append(f"{name} {what}: {exc}")
    return problems


# --- output -----------------------------------------------------------------------------


def per_message(r: PathResult, *kinds: str) -> float | None:
    if not r.round_trips:
        return None
    return sum(r.round_trips[k] for k in kinds) / r.messages


def render(results: list[PathResult], raw_rate: float | None) -> Table:
    table = Table(title="kafka_idem benchmark", title_justify="left")
    for col, justify in [("path", "left"), ("messages", "right"), ("seconds", "right"),
                         ("msgs/s", "right"), ("ratio to raw", "right"),
                         ("SQL round trips/msg", "right"), ("transactions/msg", "right"),
                         ("check", "left")]:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in results:
        rt = r.round_trips
        per_msg = f"{rt['round_trips'] / r.messages:.2f}" if rt else "—"
        txs = f"{(rt['commit'] + rt['rollback']) / r.messages:.3f}" if rt else "—"
        ratio = f"{r.rate / raw_rate:.3f}" if raw_rate and r.rate else "—"
        table.add_row(
            r.path, str(r.messages), f"{r.seconds:.2f}" if r.seconds else "—",
            f"{r.rate:,.0f}" if r.rate else "—", ratio, per_msg, txs,
            ("[green]" if r.ok else "[red]") + r.check,
        )
    return table


def render_round_trips(results: list[PathResult]) -> Table | None:
    rows = [r for r in results if r.round_trips]
    if not rows:
        return None
    table = Table(title="SQL per message, by kind (round trips = waits for the server; "
                  "statements and commands sent in a pipeline share one)", title_justify="left")
    columns = [("round trips", "round_trips"), ("pipeline waits", "pipeline_waits"),
               ("statements", "statements"), ("pipelined sends", "pipelined"),
               ("BEGIN", "begin"), ("COMMIT", "commit"), ("ROLLBACK", "rollback"),
               ("SAVEPOINT", "savepoint"), ("RELEASE", "release"),
               ("ROLLBACK TO", "rollback_to")]
    table.add_column("path")
    for name, _ in columns:
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(r.path, *(f"{r.round_trips[k] / r.messages:.3f}" for _, k in columns))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=20_000, help="messages to produce")
    parser.add_argument("--dup-ratio", type=float, default=0.1, help="share of duplicates")
    parser.add_argument("--batch-size", type=int, default=500, help="framework batch size")
    parser.add_argument("--paths", default="raw,local,leased", help="comma-separated subset")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per path")
    parser.add_argument("--seed", type=int, default=None, help="workload seed")
    parser.add_argument("--keep", action="store_true", help="keep topic, schemas and rows")
    parser.add_argument("--verbose", action="store_true", help="kafka_idem logs at INFO")
    args = parser.parse_args(argv)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if unknown := set(paths) - {"raw", "local", "leased"}:
        parser.error(f"unknown paths {sorted(unknown)}")
    if not 0 <= args.dup_ratio < 1 or args.messages < 1:
        parser.error("need --messages >= 1 and 0 <= --dup-ratio < 1")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")

    s = load_settings()
    run_id = uuid.uuid4().hex[:8]
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    topic = f"bench.{run_id}.charge-requested"
    schemas = {mode: f"bench_{run_id}_{mode}" for mode in ("local", "leased") if mode in paths}
    groups = {p: f"bench-{run_id}-{p}" for p in paths}
    admin = AdminClient(s.admin_config())
    intents, messages = plan(args.messages, args.dup_ratio, run_id, random.Random(seed))
    tenants = sorted({i.tenant_id for i in intents})
    results: list[PathResult] = []
    console.print(f"bench {run_id}: {len(messages)} messages, {len(intents)} intents, "
                  f"topic {topic}, seed {seed}")
    try:
        create_topic(admin, topic)
        create_payments_tables(s.dsn)
        for schema in schemas.values():
            migrate(s.dsn, schema, TABLE)
        t0 = time.perf_counter()
        produce(s, topic, messages)
        console.print(f"produced in {time.perf_counter() - t0:.1f}s")
        ends = end_offsets(s, topic)
        if sum(ends.values()) != len(messages):
            raise SystemExit(
                f"bench: topic holds {sum(ends.values())} messages, expected {len(messages)}"
            )
        for path in paths:
            console.print(f"measuring {path} ...")
            if path == "raw":
                results.append(run_raw(s, topic, groups[path], ends, args.timeout))
            else:
                results.append(run_framework(
                    s, mode=path, topic=topic, group=groups[path], schema=schemas[path],
                    batch_size=args.batch_size, ends=ends, intents=intents, timeout=args.timeout,
                ))
            console.print(f"  {results[-1].check}")
    finally:
        problems = [] if args.keep else cleanup(
            s, admin, topic, list(schemas.values()), list(groups.values()), tenants
        )
        for p in problems:
            console.print(f"[yellow]clean-up: {p}")
        if args.keep:
            console.print(
                f"kept topic {topic}, schemas {list(schemas.values())}, tenants bench-{run_id}-*"
            )

    raw = next((r for r in results if r.path.startswith("raw") and r.ok), None)
    raw_rate = raw.rate if raw else None
    out = Console(width=max(Console().width, 180))
    out.print(render(results, raw_rate))
    if (by_kind := render_round_trips(results)) is not None:
        out.print(by_kind)
    joins = ", ".join(f"{r.path} {r.join_seconds:.2f}s" for r in results if r.join_seconds)
    out.print(f"group join + first fetch (not in 'seconds'): {joins}")
    RESULTS.write_text(json.dumps({
        "run_id": run_id,
        "seed": seed,
        "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "messages": len(messages),
        "intents": len(intents),
        "duplicates": len(messages) - len(intents),
        "partitions": PARTITIONS,
        "batch_size": args.batch_size,
        "versions": {
            "python": platform.python_version(),
            "confluent_kafka": confluent_kafka.version()[0],
            "librdkafka": confluent_kafka.libversion()[0],
            "psycopg": psycopg.__version__,
        },
        "paths": [
            {
                **asdict(r),
                "msgs_per_s": r.rate,
                "ratio_to_raw": (r.rate / raw_rate) if raw_rate and r.rate else None,
                "round_trips_per_msg": per_message(r, "round_trips"),
                "transactions_per_msg": per_message(r, "commit", "rollback"),
            }
            for r in results
        ],
    }, indent=2, default=str) + "\n")
    console.print(f"results written to {RESULTS}")
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
