"""The /metrics endpoint of real ``kafka-idem run`` processes, scraped over HTTP.

A member subprocess consumes known traffic (new intents, duplicates, a payload
conflict, a permanent failure, an undecodable message, a transient failure
retried once); the test scrapes ``/metrics`` the way Prometheus does, parses it
with prometheus_client's own parser and checks every count against what
happened: the input, the database, the DLQ topic and the handler calls.

The member runs :data:`counted_app`: the ``tests.apps.variants`` app (same
handler, same fault hooks) whose handler also appends one line per call to
``$HANDLER_CALLS_FILE``, so "handler duration count == handler calls" is
checked against the calls that really happened (the batch path may run a
handler and roll it back before falling back to the per-message path).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import socket
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from consumers import payments
from consumers.payments import encode_charge
from kafka_idem import App, Context, Retryable, RetryPolicy
from kafka_idem.consume.lag import Lag
from kafka_idem.consume.partitions import Partitions
from kafka_idem.observe.health import Health
from kafka_idem.observe.metrics import Metrics
from tests.apps import variants
from tests.conftest import (
    ADMIN_DSN,
    BOOTSTRAP,
    DB,
    InProcess,
    Members,
    Topics,
    app_settings,
    caught_up,
    committed,
    headers,
    member_env,
    produce,
    read_topic,
    wait_for,
)

HANDLER = "charge"
SECRET = "s3cret-pw"
COUNTED = "tests.integration.test_metrics:counted_app"
VARIANTS = "tests.apps.variants:app"
Record = tuple[bytes | str | None, bytes]


def _counted_app() -> App:
    """The variants app (same per-message handler and fault hooks) whose handler calls are
    written to ``$HANDLER_CALLS_FILE``, one line per call: ``one ORDER:ATTEMPT`` for the
    per-message handler, ``bulk ORDER:ATTEMPT,...`` for one call of the bulk handler.
    ``COUNTED_BULK=1`` keeps the example's bulk handler (the batch path's fast way), with
    ``RETRYABLE_ORDERS`` injected there too; otherwise there is none."""
    app = payments.build_app(name="variants")
    handler = app.handlers[payments.TOPIC]
    bulk = payments.charge_many

    def record(kind: str, items: list[tuple[payments.ChargeRequested, Context]]) -> None:
        path = os.environ.get("HANDLER_CALLS_FILE")
        if path:
            with open(path, "a") as f:
                f.write(f"{kind} " + ",".join(f"{m.order_id}:{c.attempt}" for m, c in items)
                        + "\n")

    def charge(msg: payments.ChargeRequested, ctx: Context) -> dict[str, Any]:
        record("one", [(msg, ctx)])
        return variants.charge(msg, ctx)

    def charge_many(items: list[tuple[payments.ChargeRequested, Context]],
                    tx: Any) -> list[Any]:
        record("bulk", items)
        retry = set(filter(None, os.environ.get("RETRYABLE_ORDERS", "").split(",")))
        limit = int(os.environ.get("RETRYABLE_ATTEMPTS", "1"))
        failing = {i for i, (m, c) in enumerate(items) if m.order_id in retry
                   and c.attempt <= limit}
        rest = iter(bulk([it for i, it in enumerate(items) if i not in failing], tx))
        return [Retryable("injected transient failure") if i in failing else next(rest)
                for i in range(len(items))]

    handler.fn = charge
    handler.bulk = charge_many if os.environ.get("COUNTED_BULK") == "1" else None
    return app


counted_app = _counted_app()


# --- scraping ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return str(resp.read().decode())


def parse(text: str) -> list[Any]:
    return list(text_string_to_metric_families(text))


def value(families: list[Any], sample: str, **labels: str) -> float:
    """Sum of the samples named ``sample`` whose labels include ``labels`` (0 if none)."""
    return float(sum(
        s.value
        for f in families
        for s in f.samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    ))


def samples(families: list[Any], sample: str, **labels: str) -> list[Any]:
    return [s for f in families for s in f.samples if s.name == sample
            and all(s.labels.get(k) == v for k, v in labels.items())]


def lag(families: list[Any], topic: str) -> dict[str, float]:
    """Consumer lag gauge per partition of ``topic``."""
    return {s.labels["partition"]: s.value
            for s in samples(families, "kafka_idem_consumer_lag_messages", topic=topic)}


def wait_scrape(port: int, ok: Callable[[list[Any]], bool], what: str,
                timeout: float = 30.0) -> str:
    """Scrape until ``ok(families)``; return that scrape's text."""
    last: dict[str, str] = {}

    def attempt() -> bool:
        try:
            last["text"] = scrape(port)
        except OSError:
            return False
        return ok(parse(last["text"]))

    wait_for(attempt, timeout=timeout, what=what, interval=0.2)
    return last["text"]


def listening(port: int) -> set[str]:
    """IPv4 addresses with a listening TCP socket on ``port`` (from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, hexport = local.split(":")
        if state == "0A" and int(hexport, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return found


def password_dsn(db: DB) -> str:
    """A URL for ``db`` with a password (the local server trusts: the password is ignored)."""
    info = psycopg.conninfo.conninfo_to_dict(ADMIN_DSN)
    host, port, user = info.get("host", "127.0.0.1"), info.get("port", "5432"), info["user"]
    url = f"postgresql://{user}:{SECRET}@{host}:{port}/{db.name}"
    with psycopg.connect(url) as conn:  # the server accepts it
        conn.execute("SELECT 1")
    return url


# --- the tests --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch_path", "bulk"),
    [("false", "0"), ("true", "0"), ("true", "1")],
    ids=["per-message-path", "batch-path", "batch-path-bulk-handler"],
)
def test_metrics_count_what_happened(db: DB, topics: Topics, members: Members, group: str,
                                     tmp_path: Path, batch_path: str, bulk: str) -> None:
    topic = topics(partitions=2)
    t = "t1"

    def charge(order: str, amount: str = "10.00") -> Record:
        return order.encode(), encode_charge(t, order, amount)

    # Partition 0: new intents, duplicates (same intent, new request ids), a conflict.
    p0: list[Record] = [
        charge("o1"), charge("o2"), charge("o1"),   # o1 duplicated once
        charge("o3"), charge("o2"), charge("o2"),   # o2 duplicated twice
        charge("o3", "99.00"),                       # same key, different amount: conflict
        charge("o4"),
    ]
    # Partition 1: a permanent failure, an undecodable message, a transient failure.
    p1: list[Record] = [
        charge("o5"),
        charge("o7", "-5.00"),                       # Permanent: amount must be positive
        (b"junk", b"\x00not avro at all"),           # undecodable
        charge("o8"),                                # Retryable on attempt 1, then succeeds
        charge("o6"),
    ]
    produce(topic, p0, partition=0)
    produce(topic, p1, partition=1)

    valid = {"o1", "o2", "o3", "o4", "o5", "o6", "o8"}
    replayed, conflicts, dead_lettered, retried = 3, 1, 2, 1
    total = len(p0) + len(p1)
    assert len(valid) + replayed + conflicts + dead_lettered == total

    calls_file = tmp_path / "handler-calls.txt"
    port = free_port()
    env = member_env(
        db, topic,
        KAFKA_IDEM_DATABASE_URL=password_dsn(db),
        KAFKA_IDEM_BATCH_PATH=batch_path,
        COUNTED_BULK=bulk,
        RETRYABLE_ORDERS="o8",
        RETRYABLE_ATTEMPTS="1",
        KAFKA_IDEM_BACKOFF_BASE_SECONDS="0.05",
        KAFKA_IDEM_BACKOFF_CAP_SECONDS="0.05",
        KAFKA_IDEM_METRICS_SAMPLE_SECONDS="0.5",
        KAFKA_IDEM_LOG_FORMAT="json",
        KAFKA_IDEM_LOG_LEVEL="DEBUG",
        HANDLER_CALLS_FILE=str(calls_file),
    )
    member = members.start(COUNTED, env, group=group, args=("--metrics-port", str(port)))
    wait_for(lambda: caught_up(group, topic), timeout=90, what="the group to catch up")
    assert member.poll() is None, members.logs()

    # --- database gauges (sampled every 0.5 s) and lag (observed every 5 s) -------------
    in_db = db.status_counts()
    assert in_db == {"succeeded": len(valid), "failed": 1}
    text = wait_scrape(
        port,
        lambda fs: (
            value(fs, "kafka_idem_records", status="succeeded") == in_db["succeeded"]
            and value(fs, "kafka_idem_records", status="failed") == in_db["failed"]
            and lag(fs, topic) == {"0": 0, "1": 0}
        ),
        what="the sampled records gauge to match the database and the lag gauges to read 0",
    )
    fs = parse(text)
    on = {"topic": topic, "handler": HANDLER}

    # --- messages by outcome: exactly what was sent ------------------------------------
    def outcome(name: str) -> float:
        return value(fs, "kafka_idem_messages_total", outcome=name, **on)

    assert outcome("succeeded") == len(valid)
    assert outcome("replayed") == replayed
    assert outcome("conflict") == conflicts
    assert outcome("dead_lettered") == dead_lettered
    assert outcome("retried") == retried
    # "busy" (a key another member holds) is never right here: one member. But a retry
    # can be tried a moment before its backoff ends and count as busy: see
    # test_a_retry_waits_out_its_own_backoff_and_is_not_counted_busy.
    assert {(s.labels["topic"], s.labels["handler"], s.labels["outcome"])
            for s in samples(fs, "kafka_idem_messages_total")
            if s.value and s.labels["outcome"] != "busy"} == {
        (topic, HANDLER, o)
        for o in ("succeeded", "replayed", "conflict", "dead_lettered", "retried")
    }

    # --- DLQ records by kind (the conflict is dead-lettered too), as on the DLQ topic --
    kinds = {s.labels["kind"]: s.value
             for s in samples(fs, "kafka_idem_dead_lettered_total", **on) if s.value}
    assert kinds == {"permanent": 1, "undecodable": 1, "payload_conflict": 1}
    dlq = read_topic(f"{topic}.dlq")
    assert Counter(headers(m)["idem.error.kind"] for m in dlq) == Counter(kinds)
    assert value(fs, "kafka_idem_dlq_produce_failures_total") == 0

    # --- retries, handler latency, duplicate ratio ---------------------------------------
    # One histogram observation per handler call (a bulk call is one call).
    calls = [line.split() for line in calls_file.read_text().splitlines()]
    ran = Counter(item for _kind, items in calls for item in items.split(","))
    assert {item.split(":")[0] for item in ran} == valid | {"o7"}  # + the permanent one
    assert ran["o8:1"] >= 1 and ran["o8:2"] >= 1  # the retried key ran on attempts 1 and 2
    if batch_path == "false":
        assert sorted(ran.elements()) == sorted([f"{o}:1" for o in valid | {"o7"}] + ["o8:2"])
    assert {kind for kind, _items in calls} == ({"one", "bulk"} if bulk == "1" else {"one"})
    assert value(fs, "kafka_idem_retries_total", **on) == retried
    assert value(fs, "kafka_idem_exhausted_total") == 0
    assert value(fs, "kafka_idem_handler_duration_seconds_count", **on) == len(calls)
    assert value(fs, "kafka_idem_handler_duration_seconds_bucket", le="+Inf", **on) == len(calls)
    assert value(fs, "kafka_idem_handler_duration_seconds_sum", **on) > 0
    # Counters a group can sum: every decided delivery once, the duplicates among them.
    assert value(fs, "kafka_idem_deliveries_total", **on) == total
    assert value(fs, "kafka_idem_duplicates_total", **on) == replayed
    ratio = value(fs, "kafka_idem_duplicate_ratio")  # deprecated, kept one release
    assert ratio == pytest.approx(replayed / total), (ratio, replayed, total)

    # --- sampled database gauges -----------------------------------------------------------
    assert value(fs, "kafka_idem_records", status="processing") == 0
    assert value(fs, "kafka_idem_records", status="retryable_failed") == 0
    assert value(fs, "kafka_idem_expired_leases") == 0
    assert value(fs, "kafka_idem_long_running_records") == 0
    assert value(fs, "kafka_idem_framework_errors_total") == 0

    # --- no secret in the metrics or the logs (DEBUG, JSON) --------------------------------
    logs = members.logs()
    assert "metrics endpoint started" in logs
    assert SECRET not in text
    assert SECRET not in logs


def test_metrics_endpoint_serves_prometheus_text(db: DB, topics: Topics, members: Members,
                                                 group: str) -> None:
    """Before any traffic: the endpoint answers with the metric types the dashboard and
    alert rules rely on, and the sampled record gauges for every status."""
    topic = topics(partitions=1)
    port = free_port()
    members.start(VARIANTS, member_env(db, topic, KAFKA_IDEM_METRICS_SAMPLE_SECONDS="0.5"),
                  group=group, args=("--metrics-port", str(port)))
    text = wait_scrape(port, lambda fs: bool(samples(fs, "kafka_idem_records")),
                       what="the endpoint and the first sample")
    assert listening(port) == {"127.0.0.1"}  # by default, this host only
    fs = parse(text)
    types = {f.name: f.type for f in fs}
    assert types["kafka_idem_messages"] == "counter"
    assert types["kafka_idem_dead_lettered"] == "counter"
    assert types["kafka_idem_retries"] == "counter"
    assert types["kafka_idem_dlq_produce_failures"] == "counter"
    assert types["kafka_idem_handler_duration_seconds"] == "histogram"
    assert types["kafka_idem_duplicate_ratio"] == "gauge"
    assert types["kafka_idem_deliveries"] == "counter"
    assert types["kafka_idem_duplicates"] == "counter"
    assert types["kafka_idem_records"] == "gauge"
    assert types["kafka_idem_consumer_lag_messages"] == "gauge"
    assert types["kafka_idem_expired_leases"] == "gauge"
    assert types["kafka_idem_long_running_records"] == "gauge"
    assert {s.labels["status"]: s.value for s in samples(fs, "kafka_idem_records")} == {
        "processing": 0, "succeeded": 0, "retryable_failed": 0, "failed": 0}


def stuck_on_a_missing_dlq(db: DB, topics: Topics, members: Members,
                           group: str) -> tuple[str, int]:
    """A permanent failure (then a valid message) on a topic whose DLQ does not exist:
    the dead-letter produce fails (1 s timeout), over and over, and nothing is committed.
    Returns the topic and the member's metrics port once two failures were counted."""
    topic = topics(partitions=1, dlq=False)
    produce(topic, [(b"o1", encode_charge("t1", "o1", "-1.00")),   # permanent
                    (b"o2", encode_charge("t1", "o2", "2.00"))], partition=0)
    port = free_port()
    env = member_env(db, topic, KAFKA_IDEM_KAFKA='{"message.timeout.ms": 1000}')
    members.start(VARIANTS, env, group=group, args=("--metrics-port", str(port)))
    wait_scrape(
        port,
        lambda fs: value(fs, "kafka_idem_dlq_produce_failures_total",
                         topic=f"{topic}.dlq") >= 2,
        timeout=45, what="DLQ produce failures to be counted",
    )
    assert committed(group, topic).get(0, -1) < 0  # nothing committed: nothing finished
    return topic, port


def test_dlq_produce_failures_are_counted_and_the_message_waits(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    """DLQ produce failures count up while the DLQ refuses records; once the DLQ topic
    exists the message is dead-lettered (once), the group catches up, lag is 0."""
    topic, port = stuck_on_a_missing_dlq(db, topics, members, group)
    dlq_topic = f"{topic}.dlq"
    topics.create([dlq_topic])
    wait_for(lambda: caught_up(group, topic), timeout=60, what="the group to catch up")
    text = wait_scrape(port, lambda fs: lag(fs, topic) == {"0": 0}, timeout=30,
                       what="the lag gauge to read 0")
    fs = parse(text)
    on = {"topic": topic, "handler": HANDLER}
    assert value(fs, "kafka_idem_messages_total", outcome="dead_lettered", **on) == 1
    assert value(fs, "kafka_idem_dead_lettered_total", kind="permanent", **on) == 1
    assert [headers(m)["idem.error.kind"] for m in read_topic(dlq_topic)] == ["permanent"]
    assert db.ledger_counts() == {"t1:charge:o2": 1}


def test_lag_counts_messages_fetched_but_not_finished(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    """While the partition waits on the DLQ, both its messages are unfinished and
    uncommitted: the lag gauge must say 2, not 0 (lag is measured against what is
    finished, not against what was fetched into memory)."""
    topic, port = stuck_on_a_missing_dlq(db, topics, members, group)
    wait_scrape(port, lambda fs: lag(fs, topic) == {"0": 2}, timeout=20,
                what="the lag to count both unfinished messages")


def test_lag_gauge_of_a_partition_moves_with_the_partition(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    """After a rebalance a partition is reported by its new owner only: the member that
    lost it stops exporting its lag (a stale series would be summed into the group's lag
    and alert forever)."""
    topic = topics(partitions=2)
    produce(topic, [(b"a", encode_charge("t1", "a", "1.00"))], partition=0)
    produce(topic, [(b"b", encode_charge("t1", "b", "1.00"))], partition=1)
    port_a, port_b = free_port(), free_port()
    env = member_env(db, topic)
    members.start(VARIANTS, env, group=group, args=("--metrics-port", str(port_a)))
    wait_scrape(port_a, lambda fs: lag(fs, topic) == {"0": 0, "1": 0}, timeout=45,
                what="the first member to report lag for both partitions")

    members.start(VARIANTS, env, group=group, args=("--metrics-port", str(port_b)))
    # Traffic after the second member joined, so both members fetch from what they own.
    rounds = itertools.count()

    def moved() -> bool:
        n = next(rounds)
        produce(topic, [(b"c", encode_charge("t1", f"c{n}", "1.00"))], partition=0)
        produce(topic, [(b"d", encode_charge("t1", f"d{n}", "1.00"))], partition=1)
        try:
            a, b = lag(parse(scrape(port_a)), topic), lag(parse(scrape(port_b)), topic)
        except OSError:
            return False
        return bool(a) and bool(b) and not set(a) & set(b) and set(a) | set(b) == {"0", "1"}

    wait_for(moved, timeout=40, interval=2.0,
             what="each partition's lag to be reported by exactly one member")


def test_metrics_endpoint_binds_the_configured_address(db: DB, topics: Topics,
                                                       members: Members, group: str) -> None:
    """As in docker-compose.yml: KAFKA_IDEM_METRICS_ADDR=0.0.0.0 binds every interface
    (checked in /proc/net/tcp; the test itself only connects to 127.0.0.1)."""
    topic = topics(partitions=1)
    port = free_port()
    env = member_env(db, topic, KAFKA_IDEM_METRICS_ADDR="0.0.0.0")
    members.start(VARIANTS, env, group=group, args=("--metrics-port", str(port)))
    wait_scrape(port, lambda fs: True, what="the endpoint")
    assert listening(port) == {"0.0.0.0"}, members.logs()


class _UpperBound(random.Random):
    """Backoff jitter at its bound: the delay is known in advance."""

    def uniform(self, a: float, b: float) -> float:
        return b


def test_a_retry_waits_out_its_own_backoff_and_is_not_counted_busy(
    db: DB, topics: Topics, group: str
) -> None:
    """A handler that takes 0.5 s and then fails transiently, with a known backoff of
    0.8 s: the member must wait 0.8 s from the failure, claim the key once it is due and
    count nothing as busy (no other member holds it)."""
    topic = topics(partitions=1)
    produce(topic, [(b"o1", encode_charge("t1", "o1", "1.00")),
                    (b"o2", encode_charge("t1", "o2", "1.00"))])
    app = payments.build_app(topic=topic, **app_settings(db, group_id=group))
    handler = app.handlers[topic]

    def slow_then_transient(msg: payments.ChargeRequested, ctx: Context) -> Any:
        if msg.order_id == "o1" and ctx.attempt == 1:
            time.sleep(0.5)
            raise Retryable("transient, after a slow start")
        return payments.charge(msg, ctx)

    handler.fn = slow_then_transient
    handler.bulk = None
    handler.retry_override = RetryPolicy(base=0.8, cap=0.8, max_attempts=5, rng=_UpperBound())
    with InProcess(app) as member:
        wait_for(lambda: caught_up(group, topic), what="the group to catch up")
        fs = parse(generate_latest(member.runner.metrics.registry).decode())
    on = {"topic": topic, "handler": HANDLER}
    assert value(fs, "kafka_idem_messages_total", outcome="retried", **on) == 1
    assert value(fs, "kafka_idem_messages_total", outcome="succeeded", **on) == 2
    assert value(fs, "kafka_idem_retries_total", **on) == 1
    assert value(fs, "kafka_idem_messages_total", outcome="busy", **on) == 0
    assert db.record("t1:charge:o1")["attempts"] == 2  # type: ignore[index]


def json_logs(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def test_each_message_decision_is_logged_once_with_its_coordinates(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    """One batch that falls back (a handler raises): every per-message decision still
    appears once in the JSON log, with topic, partition, offset and handler (the log
    is what an operator counts and greps when the metrics say something happened)."""
    topic = topics(partitions=1)
    produce(topic, [
        (b"o1", encode_charge("t1", "o1", "1.00")),     # 0 succeeded
        (b"o1", encode_charge("t1", "o1", "1.00")),     # 1 replayed
        (b"junk", b"\x00not avro"),                     # 2 rejected (undecodable)
        (b"o2", encode_charge("t1", "o2", "-1.00")),    # 3 failed (permanent): fallback
        (b"o3", encode_charge("t1", "o3", "1.00")),     # 4 succeeded
        (b"o3", encode_charge("t1", "o3", "9.00")),     # 5 conflict
    ], partition=0)
    env = member_env(db, topic, KAFKA_IDEM_LOG_FORMAT="json", KAFKA_IDEM_LOG_LEVEL="DEBUG",
                     KAFKA_IDEM_BATCH_PATH="true", COUNTED_BULK="0")
    members.start(COUNTED, env, group=group)
    wait_for(lambda: caught_up(group, topic), timeout=60, what="the group to catch up")
    decisions = {"replayed": [1], "rejected": [2], "failed": [3], "conflict": [5]}
    logged: dict[str, list[int]] = {a: [] for a in decisions}
    for rec in json_logs(members.logs()):
        if rec.get("action") in decisions:
            assert {"topic", "partition", "offset", "handler"} <= set(rec), rec
            assert rec["topic"] == topic and rec["partition"] == 0, rec
            logged[rec["action"]].append(rec["offset"])
    assert logged == decisions


def test_the_lag_of_partitions_nothing_was_fetched_of_yet_counts_from_their_commit(
    topics: Topics, group: str,
) -> None:
    """During a catch-up, a partition assigned but not fetched from yet (no position,
    nothing queued) is behind by the high watermark minus its committed offset (none:
    the earliest one), in the gauge and in /readyz, not unmeasured or missing."""
    topic = topics(partitions=2)
    for part in (0, 1):
        produce(topic, [(None, b"x")] * 30, partition=part)
    consumer = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": group,
                         "enable.auto.commit": False})
    try:
        consumer.commit(offsets=[TopicPartition(topic, 1, 12)], asynchronous=False)
        consumer.assign([TopicPartition(topic, 0), TopicPartition(topic, 1)])  # not polled
        metrics, health = Metrics(), Health(max_lag=20)
        health.assigned([(topic, 0), (topic, 1)])
        lags = Lag(metrics).observe(consumer, Partitions(), health.assignment(), every=0)
    finally:
        consumer.close()
    assert lags == {(topic, 0): 30, (topic, 1): 18}
    assert metrics.lag.labels(topic, "0")._value.get() == 30
    assert metrics.lag.labels(topic, "1")._value.get() == 18
    health.observed(lags)
    ready = health.ready()
    assert not ready.ok
    assert ready.body["reason"] == "1 of 2 partitions more than 20 messages behind"
