"""Bad input never stalls a partition and never merges two intents (docs/BAD_INPUT.md).

Every test runs a real member (a Runner in-process, or ``kafka-idem run``) against the
real broker and database, and checks durable outcomes only: business rows, idempotency
records, dead letters and their ``idem.*`` headers, committed offsets.

* data the database cannot store (NUL in a key field, a key over ``key_max_bytes``, a
  NUL written by the handler, a NUL in the handler's result) is dead-lettered as
  permanent and its partition moves on: on the batch path, the per-message path and in
  leased mode;
* keys can't collide (separators inside values, values that differ by spaces; without a
  model, a number where its text is expected is ``InvalidKey``), blank key fields are
  ``MissingKeyField``, over-long keys are ``InvalidKey``, never truncated;
* a dead letter too large for Kafka goes without its value, and a DLQ suffix that is not
  a topic name is refused at start;
* a fuzz test: one batch of arbitrary messages, every one of which must end succeeded,
  replayed or dead-lettered, exactly as an independent model of the rules predicts.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import io
import json
import random
import subprocess
import sys
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import fastavro
import psycopg
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from psycopg import sql
from pydantic import ValidationError

from consumers import payments
from consumers.payments import encode_charge
from kafka_idem import App, Context, RetryPolicy, errors
from kafka_idem.codecs.avro_codec import fingerprint
from kafka_idem.codecs.base import SINGLE_OBJECT_MAGIC
from kafka_idem.consume.runner import Runner
from kafka_idem.keys import KeyTemplate, hash_payload
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
    end_offsets,
    headers,
    member_env,
    produce,
    read_topic,
    wait_for,
)

TEMPLATE = "{tenant_id}:charge:{order_id}"
HANDLER = "charge"
PATHS = ("batch", "per-message", "leased")
# A retry policy that exhausts quickly: a bad message wrongly classified as retryable
# shows as "exhausted" within seconds instead of waiting out the default backoff.
FAST_RETRY = RetryPolicy(base=0.05, cap=0.2, max_attempts=3, max_elapsed=60)
STALL_TIMEOUT = 30.0


# --- apps -------------------------------------------------------------------------


def charge_app(
    db: DB,
    topic: str,
    group: str,
    fn: Callable[[payments.ChargeRequested, Context], Any] = payments.charge,
    *,
    path: str = "batch",
    bulk: bool = False,
    **settings: Any,
) -> App:
    """The payments model, key and hash with ``fn`` as the handler, on ``path``:
    ``batch`` (the default batch path), ``per-message`` (the handler's ``batch=False``)
    or ``leased`` (``mode="leased"``)."""
    app = App("bad-input", **app_settings(db, group_id=group, schemas_dir=payments.SCHEMAS_DIR,
                                          **settings))
    handler = app.handler(
        topic=topic,
        model=payments.ChargeRequested,
        key=TEMPLATE,
        hash_fields=("amount", "currency"),
        schema=payments.SCHEMA,
        mode="leased" if path == "leased" else "local",
        batch=path != "per-message",
        name=HANDLER,
        retry=FAST_RETRY,
    )(fn)
    if bulk:
        handler.bulk_handler(payments.charge_many)
    return app


# --- durable state ---------------------------------------------------------------------


def record_at(db: DB, offset: int, partition: int = 0) -> dict[str, Any] | None:
    """The record whose last delivery was ``offset`` (None: no record was ever stored)."""
    rows = db.rows("SELECT * FROM kafka_idem.task_idempotency"
                   " WHERE kafka_partition = %s AND kafka_offset = %s", (partition, offset))
    assert len(rows) <= 1
    return rows[0] if rows else None


def letters_by_offset(topic: str) -> dict[tuple[int, int], list[Any]]:
    out: dict[tuple[int, int], list[Any]] = {}
    for m in read_topic(f"{topic}.dlq"):
        h = headers(m)
        out.setdefault((int(h["idem.original.partition"]), int(h["idem.original.offset"])),
                       []).append(m)
    return out


def _short(value: Any, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else f"{text[:n]}...({len(text)} chars)"


def state_of(db: DB, group: str, topic: str) -> str:
    """What a stalled test shows: offsets, records, dead letters."""
    records = [(r["kafka_partition"], r["kafka_offset"], r["status"], r["error_kind"],
                r["error_class"], _short(r["error_message"], 120), r["attempts"])
               for r in db.rows("SELECT * FROM kafka_idem.task_idempotency"
                                " WHERE status <> 'succeeded' OR %s"
                                " ORDER BY kafka_partition, kafka_offset LIMIT 30",
                                (db.value("SELECT count(*) FROM kafka_idem.task_idempotency")
                                 <= 10,))]
    letters = {at: [(headers(m).get("idem.error.kind"), headers(m).get("idem.error.class"),
                     _short(headers(m).get("idem.error.message"), 120)) for m in ms]
               for at, ms in sorted(letters_by_offset(topic).items())[:30]}
    return (f"committed {committed(group, topic)} of end offsets {end_offsets(topic)};\n"
            f"records (partition, offset, status, kind, class, message, attempts): {records};\n"
            f"dead letters by (partition, offset): {letters}")


def settle(db: DB, group: str, topic: str, *, timeout: float = STALL_TIMEOUT,
           about: Callable[[tuple[int, int]], str] | None = None) -> None:
    """Wait until the group committed every partition's end offset; fail with the state
    (a partition that never gets there is stalled), and ``about`` the first message
    not committed in each stalled partition."""
    deadline = time.monotonic() + timeout
    while not caught_up(group, topic):
        if time.monotonic() > deadline:
            ends, got = end_offsets(topic), committed(group, topic)
            stuck = {p: max(got.get(p, 0), 0) for p, end in ends.items()
                     if got.get(p, -1) != end}
            where = "; ".join(f"partition {p} at offset {o}"
                              + (f": {about((p, o))}" if about else "")
                              for p, o in sorted(stuck.items()))
            pytest.fail(f"a partition stalled ({where}): after {timeout}s "
                        f"{state_of(db, group, topic)}")
        time.sleep(0.1)


def assert_permanent_letter(
    letter: Any, *, offset: int, classes: tuple[str, ...]
) -> dict[str, str]:
    h = headers(letter)
    assert h["idem.original.offset"] == str(offset)
    assert h["idem.error.kind"] == "permanent", h
    assert h["idem.error.class"] in classes, (
        f"idem.error.class {h['idem.error.class']!r}, expected one of {classes}; "
        f"message {h.get('idem.error.message')!r}")
    assert h["idem.error.message"].strip(), "the error message is empty"
    return h


# --- 1. data the database cannot store never stalls a partition --------------------

W_NUL = "W-NUL"  # the handler writes a NUL into a business table for this order
R_NUL = "R-NUL"  # the handler returns a result with "\u0000" (jsonb can't hold it)


def nul_prone_charge(msg: payments.ChargeRequested, ctx: Context) -> Any:
    if msg.order_id == W_NUL:
        ctx.tx.execute(
            "INSERT INTO payments.ledger (tenant_id, order_id, amount, currency, idempotency_key)"
            " VALUES (%s, %s, %s, %s, %s)",
            (msg.tenant_id, "note\x00with a NUL", msg.amount, msg.currency, ctx.idempotency_key),
        )
    result = payments.charge(msg, ctx)
    if msg.order_id == R_NUL:
        return {**result, "note": "a\u0000b"}
    return result


@dataclass(frozen=True)
class Bad:
    tenant_id: str
    order_id: str
    classes: tuple[str, ...]  # the acceptable idem.error.class values
    record: str  # "failed": a failed record must exist; "none": none may; "either"


BAD = {
    # The key escapes the NUL; the ledger insert then refuses it (or the key is refused).
    "tenant_nul": Bad("t\x00x", "o-bad", ("DataRejected", "InvalidKey"), "either"),
    # A 3,004-byte key: over key_max_bytes (1024): refused before any record exists.
    "order_3000": Bad("t1", "N" * 2994, ("InvalidKey",), "none"),
    # The handler's own business write carries a NUL.
    "handler_writes_nul": Bad("t1", W_NUL, ("DataRejected",), "failed"),
    # The handler's result carries \u0000, which result_json (jsonb) cannot hold: the
    # handler's result is at fault, refused before it is stored, not the message's data.
    "result_nul": Bad("t1", R_NUL, ("ResultNotJSON",), "failed"),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(BAD))
def test_data_the_database_cannot_store_is_dead_lettered_and_the_partition_moves_on(
    db: DB, topics: Topics, group: str, case: str, path: str
) -> None:
    topic = topics(partitions=1)
    bad = BAD[case]
    produce(topic, [(b"o1", encode_charge("t1", "o1", "1.00")),
                    (b"o2", encode_charge("t1", "o2", "2.00")),
                    (b"bad", encode_charge(bad.tenant_id, bad.order_id, "4.00")),
                    (b"o3", encode_charge("t1", "o3", "8.00")),
                    (b"o4", encode_charge("t1", "o4", "16.00"))])
    with InProcess(charge_app(db, topic, group, nul_prone_charge, path=path)):
        settle(db, group, topic)

    # The bad message: dead-lettered once, as permanent, with the class and a reason.
    letters = letters_by_offset(topic)
    assert list(letters) == [(0, 2)], state_of(db, group, topic)
    (letter,) = letters[(0, 2)]
    h = assert_permanent_letter(letter, offset=2, classes=bad.classes)
    rec = record_at(db, 2)
    if bad.record == "none" or (rec is None and bad.record == "either"):
        assert rec is None, rec
        assert db.value("SELECT count(*) FROM kafka_idem.task_idempotency"
                        " WHERE status <> 'succeeded'") == 0
    else:
        assert rec is not None, "a failed record was expected"
        assert (rec["status"], rec["error_kind"], rec["attempts"]) == ("failed", "permanent", 1)
        assert rec["error_class"] == h["idem.error.class"]
        assert rec["error_message"] == h["idem.error.message"]
        assert h["idem.key"] == rec["idempotency_key"]
    # Its neighbours, before and after it, took effect once each; nothing of it did.
    assert sorted(r["order_id"] for r in db.ledger()) == ["o1", "o2", "o3", "o4"]
    assert db.balances() == {("t1", "EUR"): Decimal("27.00")}
    assert db.status_counts().get("succeeded") == 4
    assert committed(group, topic) == end_offsets(topic) == {0: 5}


# --- 2. keys cannot collide; blank and over-long keys are refused ---------------------


def test_key_field_values_are_kept_apart_and_as_they_are(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=1)
    intents = [("a:charge:x", "y"), ("a", "x:charge:y"),  # one plain join, two intents
               ("t1", " spaced "), ("t1", "spaced"),        # never stripped
               ("t1", "50%"), ("t1", "50%25")]              # an escape can't be posed
    blanks = [("t1", ""), ("t1", "   "), ("", "o1"), (" \t", "o1")]
    records: list[tuple[bytes | str | None, bytes]] = [
        (None, encode_charge(t, o, "5.00")) for t, o in [*intents, *blanks]]
    produce(topic, [*records, (None, encode_charge("t1", "last", "1.00"))])
    app = payments.build_app(topic=topic, **app_settings(db, group_id=group))
    with InProcess(app):
        settle(db, group, topic)

    charged = Counter((r["tenant_id"], r["order_id"]) for r in db.ledger())
    assert charged == Counter([*intents, ("t1", "last")]), "every intent, once"
    keys = {r["idempotency_key"] for r in db.ledger()}
    assert len(keys) == len(intents) + 1, "two intents share a key"
    statuses = {r["idempotency_key"]: r["status"] for r in db.records()}
    assert statuses == dict.fromkeys(keys, "succeeded")
    letters = letters_by_offset(topic)
    first_blank = len(intents)
    assert sorted(letters) == [(0, first_blank + i) for i in range(len(blanks))]
    for (_p, offset), (letter,) in letters.items():
        assert_permanent_letter(letter, offset=offset, classes=("MissingKeyField",))
    assert committed(group, topic) == end_offsets(topic)


def test_without_a_model_a_number_in_a_key_field_is_refused_not_merged_with_its_text(
    db: DB, topics: Topics, group: str
) -> None:
    """A handler with model=None gets the JSON's dict: ``{"tenant": 7}`` and
    ``{"tenant": "7"}`` are two intents, which ``str()`` would give one key ("7:raw:a"),
    the second answered as a duplicate of the first. The number is refused instead
    (InvalidKey, permanent, naming the field), the string takes effect once."""
    topic = topics(partitions=1)
    app = App("raw-keys", **app_settings(db, group_id=group))

    @app.handler(topic=topic, key="{tenant}:raw:{order}", hash_fields=("order",),
                 format="json", name="raw", retry=FAST_RETRY)
    def raw(msg: dict[str, Any], ctx: Context) -> dict[str, str]:
        ctx.tx.execute("INSERT INTO payments.ledger (tenant_id, order_id, amount, currency,"
                       " idempotency_key) VALUES (%s, %s, 1, 'EUR', %s)",
                       (str(msg["tenant"]), msg["order"], ctx.idempotency_key))
        return {"tenant": str(msg["tenant"])}

    produce(topic, [(None, json.dumps({"tenant": 7, "order": "a"}).encode()),
                    (None, json.dumps({"tenant": "7", "order": "a"}).encode())])
    with InProcess(app):
        settle(db, group, topic)

    letters = letters_by_offset(topic)
    assert sorted(letters) == [(0, 0)], state_of(db, group, topic)
    (letter,) = letters[(0, 0)]
    h = assert_permanent_letter(letter, offset=0, classes=("InvalidKey",))
    assert h["idem.error.message"].startswith(
        "key field 'tenant' holds a JSON number, not a string: without a model a key takes "
        "strings only"), h["idem.error.message"]
    assert json.loads(letter.value()) == {"tenant": 7, "order": "a"}  # as it came: replayable
    assert record_at(db, 0) is None  # refused before any record
    assert [(r["tenant_id"], r["order_id"], r["idempotency_key"]) for r in db.ledger()] == [
        ("7", "a", "7:raw:a")]
    assert [(r["idempotency_key"], r["status"], r["kafka_offset"]) for r in db.records()] == [
        ("7:raw:a", "succeeded", 1)]
    assert committed(group, topic) == {0: 2}
    # The app's producer refuses what its consumer would: before anything is sent.
    with app.producer() as producer, pytest.raises(errors.InvalidKey, match="'tenant'"):
        producer.send(topic, {"tenant": 7, "order": "b"})
    assert end_offsets(topic) == {0: 2}


def test_a_key_over_key_max_bytes_is_invalid_and_never_truncated(
    db: DB, topics: Topics, group: str
) -> None:
    topic = topics(partitions=1)
    prefix = "t1:charge:"  # 10 bytes; the default limit is 1024 UTF-8 bytes
    fits, over = "N" * (1024 - len(prefix)), "N" * (1025 - len(prefix))
    fits_wide, over_wide = "é" * 507, "é" * 508  # 1,014 and 1,016 bytes: bytes, not characters
    produce(topic, [(None, encode_charge("t1", fits, "1.00")),
                    (None, encode_charge("t1", over, "2.00")),
                    (None, encode_charge("t1", fits_wide, "4.00")),
                    (None, encode_charge("t1", over_wide, "8.00")),
                    (None, encode_charge("t1", over, "16.00"))])  # the same refusal again
    with InProcess(charge_app(db, topic, group)):
        settle(db, group, topic)

    assert {r["order_id"]: r["idempotency_key"] for r in db.ledger()} == {
        fits: prefix + fits, fits_wide: prefix + fits_wide}
    assert {r["idempotency_key"] for r in db.records()} == {prefix + fits, prefix + fits_wide}
    letters = letters_by_offset(topic)
    assert sorted(letters) == [(0, 1), (0, 3), (0, 4)]
    for (_p, offset), (letter,) in letters.items():
        assert_permanent_letter(letter, offset=offset, classes=("InvalidKey",))
    assert committed(group, topic) == {0: 5}


def test_long_and_newline_keys_reach_the_dlq_whole_and_the_log_escaped(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    """``kafka-idem run`` with KAFKA_IDEM_KEY_MAX_BYTES=2000: a 1,500-byte key is whole
    in ``idem.key``; a 2,001-byte key is InvalidKey; a key with a newline can't start a
    log line of its own."""
    topic = topics(partitions=1)
    prefix = "t1:charge:"
    long_order = "N" * (1500 - len(prefix))
    forged = "FORGED 2099-01-01 00-00-00 ERROR KAFKA_IDEM FAKE LINE"  # nothing to escape
    produce(topic, [(None, encode_charge("t1", long_order, "-1.00")),  # Permanent: bad amount
                    (None, encode_charge("t1", f"o1\n{forged}", "-1.00")),
                    (None, encode_charge("t1", "N" * (2001 - len(prefix)), "1.00")),
                    (None, encode_charge("t1", "o2", "1.00"))])
    members.start("consumers.payments:app",
                  member_env(db, topic, KAFKA_IDEM_KEY_MAX_BYTES="2000"), group=group)
    settle(db, group, topic)
    members.stop_all()  # its log is complete

    letters = letters_by_offset(topic)
    assert sorted(letters) == [(0, 0), (0, 1), (0, 2)], state_of(db, group, topic)
    (long_letter,) = letters[(0, 0)]
    h = assert_permanent_letter(long_letter, offset=0, classes=("Permanent",))
    assert h["idem.key"] == prefix + long_order, "idem.key was cut"
    rec = record_at(db, 0)
    assert rec is not None and rec["idempotency_key"] == prefix + long_order
    (newline_letter,) = letters[(0, 1)]
    h = assert_permanent_letter(newline_letter, offset=1, classes=("Permanent",))
    assert "\n" not in h["idem.key"] and h["idem.key"].endswith("%0A" + forged)
    (over_letter,) = letters[(0, 2)]
    assert_permanent_letter(over_letter, offset=2, classes=("InvalidKey",))
    assert [r["order_id"] for r in db.ledger()] == ["o2"]

    log_text = members.logs()
    assert "%0AFORGED" in log_text, "the member never logged the newline key"
    raw = [line for line in log_text.splitlines() if line.startswith("FORGED")]
    assert not raw, f"a key forged log lines: {raw}"


# --- 3. dead letters that can't be written as they are; DLQ names ---------------------


def _topic_with_config(topics: Topics, config: dict[str, str]) -> str:
    """A topic (one partition) with ``config``, and its default ``.dlq`` topic."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    futures = topics.admin.create_topics([
        NewTopic(name, num_partitions=1, replication_factor=1, config=config),
        NewTopic(f"{name}.dlq", num_partitions=1, replication_factor=1),
    ])
    for f in futures.values():
        f.result(timeout=30)
    topics.created.extend([name, f"{name}.dlq"])

    def ready() -> bool:
        md = topics.admin.list_topics(timeout=10)
        return all(n in md.topics and md.topics[n].error is None
                   and len(md.topics[n].partitions) == 1 for n in (name, f"{name}.dlq"))

    wait_for(ready, timeout=30, what=f"topic {name}")
    return name


def _produce_large(topic: str, values: list[bytes]) -> None:
    producer = Producer({"bootstrap.servers": BOOTSTRAP, "enable.idempotence": True,
                         "acks": "all", "message.max.bytes": 4_000_000})
    failed: list[Any] = []

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is not None:
            failed.append(err)

    for value in values:
        producer.produce(topic, value=value, on_delivery=on_delivery)
    assert producer.flush(60) == 0
    assert not failed, failed


def test_a_dead_letter_too_large_for_kafka_goes_without_its_value(
    db: DB, topics: Topics, group: str
) -> None:
    topic = _topic_with_config(topics, {"max.message.bytes": "4000000"})
    # 1.1 MB: over the DLQ producer's message.max.bytes (1,000,000) and over the DLQ
    # topic's max.message.bytes (1,048,588); a bad amount makes it a permanent failure.
    big = encode_charge("t1", "big", "-1.00", request_id="p" * 1_100_000)
    _produce_large(topic, [encode_charge("t1", "o1", "1.00"), big,
                           encode_charge("t1", "o2", "2.00")])
    with InProcess(charge_app(db, topic, group, bulk=True)):
        settle(db, group, topic, timeout=60)

    letters = letters_by_offset(topic)
    assert sorted(letters) == [(0, 1)]
    (letter,) = letters[(0, 1)]
    h = assert_permanent_letter(letter, offset=1, classes=("Permanent",))
    assert not letter.value(), "the value should have been left out"
    assert "value" in h["idem.truncated"]
    assert h["idem.original.value_bytes"] == str(len(big))
    assert h["idem.original.value_sha256"] == hashlib.sha256(big).hexdigest()
    assert h["idem.original.topic"] == topic
    rec = record_at(db, 1)
    assert rec is not None and (rec["status"], rec["error_class"]) == ("failed", "Permanent")
    assert sorted(r["order_id"] for r in db.ledger()) == ["o1", "o2"]
    assert committed(group, topic) == {0: 3}

    # Operators can't re-drive an empty copy: replay skips it and says so, rerun refuses
    # and points at the original; neither sends anything.
    env = member_env(db, topic)
    replayed = subprocess.run(
        [sys.executable, "-m", "kafka_idem.cli", "dlq", "replay", "--topic", topic, "--json"],
        env=env, capture_output=True, text=True, timeout=120)
    assert replayed.returncode == 0, replayed.stderr
    summary = json.loads(replayed.stdout)
    assert (summary["sent"], summary["skipped_truncated"]) == (0, 1)
    rerun = subprocess.run(
        [sys.executable, "-m", "kafka_idem.cli", "rerun", h["idem.key"],
         "--reason", "retry the big one"],
        env=env, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 1, rerun.stdout + rerun.stderr
    assert f"{topic}[0]@1" in rerun.stdout + rerun.stderr
    assert len(read_topic(topic)) == 3  # nothing republished
    rec = record_at(db, 1)
    assert rec is not None and rec["status"] == "failed"


@pytest.mark.parametrize("suffix", [".dl q", "/dlq", ".dlq\n", ".dlq:x"])
def test_a_dlq_suffix_that_is_no_topic_name_is_refused_at_start(
    db: DB, topics: Topics, group: str, suffix: str
) -> None:
    topic = topics(partitions=1, dlq=False)
    app = charge_app(db, topic, group, dlq_suffix=suffix)
    runner: Runner | None = None
    try:
        with pytest.raises(errors.ConfigError) as info:
            runner = Runner(app)
            runner.start()
    finally:
        if runner is not None and runner.consumer is not None:
            runner.close()
    assert "dlq_suffix" in str(info.value).lower()


def test_kafka_idem_run_exits_2_on_a_dlq_suffix_that_is_no_topic_name(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    topic = topics(partitions=1, dlq=False)
    proc = members.start("consumers.payments:app",
                         member_env(db, topic, KAFKA_IDEM_DLQ_SUFFIX="/dlq"), group=group)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("kafka-idem run started with dlq_suffix='/dlq' and kept running")
    assert code == 2, members.logs()
    assert "dlq_suffix" in members.logs().lower()


# --- the fuzz test ------------------------------------------------------------------

LIMIT = Decimal("9999999999999999.99")  # numeric(18,2) and the schema's decimal(18,2)
TOO_BIG = Decimal(10) ** 16  # the smallest amount numeric(18,2) can't hold
DB_REFUSED = ("DataRejected", "DataError", "NumericValueOutOfRange")  # see Expected.classes

_SPECIAL = [":", "%", ":charge:", "charge", "%3A", "%25", "%%", "\x00", "\n", "\r\n", "\t",
            "\x1b", "\x7f", "\x85", "\u2028", "\u2029", "é", "→", "\U0001f600", "\ufeff",
            "\u200b", " ", "'", '"', "\\", "{", "}", "{tenant_id}", "\u3000"]
_piece = st.one_of(
    st.sampled_from(_SPECIAL),
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=5),  # no surrogates
    st.from_regex(r"[a-z0-9-]{1,6}", fullmatch=True),
)
_ordinary = st.lists(_piece, min_size=1, max_size=5).map("".join)
_whitespace = st.sampled_from(["", " ", "   ", "\t", " \r\n "])
_huge = st.builds(lambda p, n: (p * (n // len(p) + 1))[:n], _piece, st.integers(300, 5000))
texts = st.one_of(_ordinary, _ordinary, _ordinary, _ordinary, _whitespace, _huge)
amounts = st.one_of(
    st.decimals(min_value=Decimal("0.01"), max_value=Decimal("1000"), places=2),
    st.decimals(min_value=-LIMIT, max_value=LIMIT, places=2),
    st.sampled_from([Decimal("0"), Decimal("-0.01"), Decimal("0.01"), LIMIT,
                     Decimal("5000000000000000.00"),
                     # beyond decimal(18,2): only a writer schema of higher precision sends them
                     TOO_BIG, Decimal("123456789012345678901234.56")]),
)
currencies = st.one_of(*[st.sampled_from(sorted(payments.CURRENCIES))] * 3, texts)


def _wide_writer() -> Any:
    """The payments schema with decimal precision 40: the same fingerprint (logical
    types are not in the parsing canonical form), so amounts beyond 18 digits reach
    the member as valid payloads."""
    (path,) = payments.SCHEMAS_DIR.rglob("charge_requested.avsc")
    schema = json.loads(path.read_text())
    for f in schema["fields"]:
        if f["name"] == "amount":
            f["type"]["precision"] = 40
    parsed = fastavro.parse_schema(schema)
    assert fingerprint(parsed) == fingerprint(payments.codec().schema(payments.SCHEMA))
    return parsed


WIDE = _wide_writer()
AT = dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


def encode_any(tenant_id: str, order_id: str, amount: Decimal, currency: str,
               request_id: str) -> bytes:
    buf = io.BytesIO()
    buf.write(SINGLE_OBJECT_MAGIC)
    buf.write(fingerprint(WIDE))
    fastavro.schemaless_writer(buf, WIDE, {
        "tenant_id": tenant_id, "order_id": order_id, "amount": amount.quantize(Decimal("0.01")),
        "currency": currency, "request_id": request_id, "requested_at": AT})
    return buf.getvalue()


class Batch(list[bytes]):
    """Message values; shown short (a failing example's values are megabytes)."""

    def __repr__(self) -> str:
        digest = hashlib.sha256(b"".join(self)).hexdigest()[:16]
        return f"<{len(self)} messages, {sum(map(len, self))} bytes, sha256 {digest}...>"


@st.composite
def message_batches(draw: st.DrawFn) -> Batch:
    """150-250 message values: new intents, duplicates (producer retries: a new
    request id), payload conflicts, and bytes that are no payload at all. Field values
    come from small drawn pools, so tenants, orders and keys repeat."""
    tenants = draw(st.lists(texts, min_size=2, max_size=8))
    orders = draw(st.lists(texts, min_size=4, max_size=30))
    amount_pool = draw(st.lists(amounts, min_size=2, max_size=8))
    currency_pool = draw(st.lists(currencies, min_size=1, max_size=4))
    request_ids = draw(st.lists(texts, min_size=1, max_size=3))
    junk = draw(st.lists(st.binary(max_size=48), min_size=1, max_size=4))
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(150, 250))
    sent: list[tuple[str, str, Decimal, str]] = []
    out: list[bytes] = []
    for _ in range(n):
        r = rnd.random()
        req = (rnd.choice(request_ids) if rnd.random() < 0.2
               else str(uuid.UUID(int=rnd.getrandbits(128))))
        if r < 0.06:
            out.append(rnd.choice(junk))
        elif r < 0.10:  # a real payload cut short, or a real header on a garbage body
            whole = encode_any("t1", rnd.choice(orders), Decimal("1.00"), "EUR", req)
            out.append(whole[: rnd.randrange(1, len(whole))] if rnd.random() < 0.5
                       else whole[:10] + rnd.randbytes(rnd.randrange(0, 30)))
        elif r < 0.35 and sent:  # the same intent again
            out.append(encode_any(*rnd.choice(sent), req))
        elif r < 0.42 and sent:  # the same key, another amount
            t, o, a, c = rnd.choice(sent)
            out.append(encode_any(t, o, a + Decimal("0.01") if a < LIMIT else Decimal(1), c, req))
        else:  # a new intent: drawn values mixed with ordinary ones, so most succeed
            intent = (
                rnd.choice(tenants) if rnd.random() < 0.5 else rnd.choice(["t1", "t2", "t4", "t5"]),
                rnd.choice(orders) if rnd.random() < 0.4 else f"o-{len(out)}",
                rnd.choice(amount_pool) if rnd.random() < 0.4
                else Decimal(rnd.randrange(1, 100_000)) / 100,
                rnd.choice(currency_pool) if rnd.random() < 0.3
                else rnd.choice(sorted(payments.CURRENCIES)),
            )
            sent.append(intent)
            out.append(encode_any(*intent, req))
    return Batch(out)


@dataclass
class Expected:
    """What must become of every message, by an independent model of the rules; the
    key text itself is the library's (its escaping rule is tests/unit/test_keys.py's)."""

    partition_of: list[int] = field(default_factory=list)
    letters: dict[tuple[int, int], tuple[str, tuple[str, ...], str | None]] = field(
        default_factory=dict)  # (partition, offset) -> (kind, classes, idem.key or None)
    ledger: Counter[tuple[str, str, str, Decimal, str]] = field(default_factory=Counter)
    records: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    balances: dict[tuple[str, str], Decimal] = field(default_factory=dict)
    replays: int = 0
    described: dict[tuple[int, int], str] = field(default_factory=dict)
    keys_of: dict[tuple[str, str], str] = field(default_factory=dict)


def _blank(value: str) -> bool:
    return not value or value.isspace()


def expect(values: list[bytes]) -> Expected:
    """Decide every message the way the rules say, partition by partition, in order."""
    invalid_key = getattr(errors, "InvalidKey", None)
    template = KeyTemplate(TEMPLATE)
    exp = Expected()
    decided: list[tuple[str, Any]] = []
    for value in values:
        try:
            _name, record = payments.codec().decode(value, payments.SCHEMA)
        except errors.Undecodable:
            decided.append(("undecodable", None))
            continue
        try:
            decided.append(("model", payments.ChargeRequested.model_validate(record)))
        except ValidationError:
            decided.append(("invalid", None))
    # Every message of a tenant (so of a key, and of a balance) in one partition, in order.
    exp.partition_of = [
        zlib.crc32(m.tenant_id.encode("utf-8")) % 2 if what == "model"
        else zlib.crc32(value) % 2
        for (what, m), value in zip(decided, values, strict=True)
    ]
    next_offset = [0, 0]
    state: dict[str, tuple[str, str, tuple[str, ...]]] = {}  # key -> (status, hash, classes)
    classes: tuple[str, ...]
    for (what, m), p in zip(decided, exp.partition_of, strict=True):
        at = (p, next_offset[p])
        next_offset[p] += 1
        exp.described[at] = (what if m is None else
                             f"tenant={_short(m.tenant_id)} order={_short(m.order_id)} "
                             f"amount={m.amount} currency={_short(m.currency, 20)}")
        if what == "undecodable":
            exp.letters[at] = ("undecodable", ("Undecodable",), None)
            continue
        if what == "invalid":
            exp.letters[at] = ("permanent", ("InvalidPayload",), None)
            continue
        if _blank(m.tenant_id) or _blank(m.order_id):
            exp.letters[at] = ("permanent", ("MissingKeyField",), None)
            continue
        try:
            key = template.build(m)
        except errors.MissingKeyField:
            pytest.fail(f"{exp.described[at]}: a key field that is not blank was refused")
        except Exception as exc:
            if invalid_key is None or not isinstance(exc, invalid_key):
                raise
            exp.letters[at] = ("permanent", ("InvalidKey",), None)
            continue
        if len(key.encode("utf-8")) > 1024:
            exp.letters[at] = ("permanent", ("InvalidKey",), None)
            continue
        exp.keys_of[(m.tenant_id, m.order_id)] = key
        digest = hash_payload(m, ("amount", "currency"))
        if key in state:
            status, stored, classes = state[key]
            if stored != digest:
                exp.letters[at] = ("payload_conflict", ("PayloadConflict",), key)
            elif status == "succeeded":
                exp.replays += 1
            else:
                exp.letters[at] = ("permanent", classes, key)
            continue
        pair = (m.tenant_id, m.currency)
        balance = exp.balances.get(pair, Decimal(0))
        if m.amount <= 0 or m.currency not in payments.CURRENCIES:
            classes = ("Permanent",)  # the example's business rules
        elif "\x00" in m.tenant_id or "\x00" in m.order_id or m.amount >= TOO_BIG:
            classes = DB_REFUSED  # the ledger insert refuses it
        elif balance + m.amount >= TOO_BIG:
            classes = DB_REFUSED  # the balance update overflows
        else:
            state[key] = ("succeeded", digest, ())
            exp.records[key] = ("succeeded", ())
            exp.ledger[(key, m.tenant_id, m.order_id, m.amount, m.currency)] += 1
            exp.balances[pair] = balance + m.amount
            continue
        state[key] = ("failed", digest, classes)
        exp.records[key] = ("failed", classes)
        exp.letters[at] = ("permanent", classes, key)
    return exp


@contextlib.contextmanager
def fresh_db(template_db: str) -> Iterator[DB]:
    name = f"kafka_idem_f_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template_db)))
    try:
        yield DB(name)
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


def produce_to(topic: str, values: list[bytes], partitions: list[int]) -> None:
    producer = Producer({"bootstrap.servers": BOOTSTRAP, "enable.idempotence": True,
                         "acks": "all", "linger.ms": 5})
    acked: dict[int, list[int]] = {0: [], 1: []}
    failed: list[Any] = []

    def on_delivery(err: Any, msg: Any) -> None:
        if err:
            failed.append(err)
        else:
            acked[msg.partition()].append(msg.offset())

    for value, p in zip(values, partitions, strict=True):
        producer.produce(topic, value=value, partition=p, on_delivery=on_delivery)
    assert producer.flush(30) == 0
    assert not failed, failed
    for p in (0, 1):  # a fresh topic: offsets 0, 1, 2... in produce order
        assert sorted(acked[p]) == list(range(partitions.count(p)))


def _mismatches(title: str, got: dict[Any, Any], want: dict[Any, Any],
                described: dict[Any, str] | None = None) -> list[str]:
    out = []
    for k in sorted(set(got) | set(want), key=repr):
        if got.get(k) != want.get(k):
            about = f" [{described[k]}]" if described and k in described else ""
            out.append(f"{title} {_short(k, 80)}: got {_short(got.get(k), 160)}, "
                       f"want {_short(want.get(k), 160)}{about}")
    return out


def verify_fuzz_batch(db: DB, group: str, topic: str, values: list[bytes], exp: Expected,
                      replayed: float) -> None:
    problems: list[str] = []
    # Dead letters: exactly the expected source offsets, once each, kind, class, key.
    got_letters: dict[tuple[int, int], Any] = {}
    for at, ms in letters_by_offset(topic).items():
        hs = [headers(m) for m in ms]
        got_letters[at] = [(h["idem.error.kind"], h["idem.error.class"], h.get("idem.key"))
                           for h in hs]
        if len(ms) == 1:
            kind, cls, key = got_letters[at][0]
            want = exp.letters.get(at)
            if want is not None and kind == want[0] and cls in want[1] and (
                    want[2] is None or key == want[2]) and hs[0]["idem.error.message"].strip():
                got_letters[at] = want  # as expected
    problems += _mismatches("dead letter at", got_letters, exp.letters, exp.described)
    # Business rows: each intent that should take effect, exactly once, under its key.
    got_ledger = Counter((r["idempotency_key"], r["tenant_id"], r["order_id"], r["amount"],
                          r["currency"]) for r in db.ledger())
    problems += _mismatches("ledger row", dict(got_ledger), dict(exp.ledger))
    got_records: dict[str, Any] = {}
    for r in db.records():
        want_rec = exp.records.get(r["idempotency_key"])
        got = (r["status"], r["error_class"] or "")
        ok = want_rec is not None and got[0] == want_rec[0] and (
            (got[0] == "succeeded" and not got[1]) or got[1] in want_rec[1])
        got_records[r["idempotency_key"]] = want_rec if ok else got
    problems += _mismatches("record", got_records, exp.records)
    problems += _mismatches("balance", db.balances(), exp.balances)
    # No two intents share a key: distinct (tenant, order) pairs, distinct keys.
    if len(set(exp.keys_of.values())) != len(exp.keys_of):
        shared = Counter(exp.keys_of.values()).most_common(3)
        problems.append(f"distinct intents share keys: {shared}")
    accounted = sum(got_ledger.values()) + exp.replays + sum(
        len(v) for v in letters_by_offset(topic).values())
    if accounted != len(values):
        problems.append(f"{len(values)} produced, {accounted} accounted for "
                        f"(ledger + {exp.replays} replays + dead letters)")
    if replayed != exp.replays:
        problems.append(f"replayed {replayed}, expected {exp.replays}")
    ends = end_offsets(topic)
    if committed(group, topic) != ends:
        problems.append(f"committed {committed(group, topic)} != end offsets {ends}")
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:40])


FUZZ_SETTINGS = settings(
    max_examples=3,
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),  # no shrinking: ~5 s an example
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large, HealthCheck.large_base_example],
    print_blob=True,
)


@pytest.mark.parametrize("path", PATHS)
@FUZZ_SETTINGS
@given(values=message_batches())
def test_fuzz_every_message_ends_succeeded_replayed_or_dead_lettered(
    template_db: str, topics: Topics, path: str, values: list[bytes]
) -> None:
    exp = expect(values)
    topic = topics(partitions=2)
    group = f"g-{uuid.uuid4().hex[:10]}"
    with fresh_db(template_db) as db:
        produce_to(topic, values, exp.partition_of)
        app = payments.build_app(
            topic=topic, mode="leased" if path == "leased" else "local",
            **app_settings(db, group_id=group, batch_path=path == "batch"))
        with InProcess(app) as member:
            settle(db, group, topic, timeout=45,
                   about=lambda at: exp.described.get(at, "?"))
            replayed = member.runner.metrics.messages.labels(
                topic, HANDLER, "replayed")._value.get()
        verify_fuzz_batch(db, group, topic, values, exp, replayed)
