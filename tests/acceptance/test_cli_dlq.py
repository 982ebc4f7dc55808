"""``kafka-idem dlq list|show|replay``: the installed CLI against the real broker and database.

The DLQ comes from one mixed run of the payments example (see ``conftest.mixed``):
permanent failures of two handlers, undecodable bytes and a payload conflict, in two
waves a known instant apart. Expectations are computed from that ground truth (the
DLQ read directly), never from the CLI's own output.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import signal
import subprocess
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient

from kafka_idem.deadletters.dead_letter import REQUIRED_HEADERS
from tests.acceptance.conftest import (
    EXPECTED_DLQ,
    KAFKA_IDEM,
    MIXED_APP,
    SECOND_WAVE,
    MixedRun,
    Result,
    headers_of,
    kafka_idem,
    read_all,
    set_topic_config,
)
from tests.conftest import BOOTSTRAP, DB, ROOT, Topics, committed, end_offsets, wait_for

LINEAGE = ("idem.replay.at", "idem.replay.by", "idem.replay.source_topic",
           "idem.replay.source_partition", "idem.replay.source_offset")
SUCCEEDED_KEYS = {"t1:charge:o1"}  # the payload conflict's key: the original succeeded
# The mixed run's keyed records failed permanently: a replay sends them only when it
# re-runs them (test_cli_redrive.py covers the decisions themselves).
REDRIVE = ("--include-permanent", "--reason", "acceptance: replay mechanics")


def kind(m: Any) -> str:
    return headers_of(m)["idem.error.kind"]


def dlq_key(m: Any) -> str | None:
    return headers_of(m).get("idem.key")


# A filter: CLI arguments and the DLQ records it must select, both from the ground truth.
Filter = tuple[Callable[[MixedRun], list[str]], Callable[[MixedRun, Any], bool]]


def _busiest(run: MixedRun) -> int:
    partition: int = Counter(m.partition() for m in run.dlq_records).most_common(1)[0][0]
    return partition


FILTERS: dict[str, Filter] = {
    "kind": (lambda run: ["--kind", "permanent"], lambda run, m: kind(m) == "permanent"),
    "error-class": (lambda run: ["--error-class", "Undecodable"],
                    lambda run, m: headers_of(m)["idem.error.class"] == "Undecodable"),
    "key": (lambda run: ["--key", "t1:charge:o6"], lambda run, m: m.key() == b"o6"),
    "handler": (lambda run: ["--handler", "refund"], lambda run, m: m.key() == b"r1"),
    "since": (lambda run: ["--since", run.between.isoformat()],
              lambda run, m: m.key() in SECOND_WAVE),
    "until": (lambda run: ["--until", run.between.isoformat()],
              lambda run, m: m.key() not in SECOND_WAVE),
    "partition": (lambda run: ["--partition", str(_busiest(run))],
                  lambda run, m: m.partition() == _busiest(run)),
    "offset-range": (
        lambda run: ["--partition", str(_busiest(run)), "--from-offset", "1", "--to-offset", "2"],
        lambda run, m: m.partition() == _busiest(run) and 1 <= m.offset() <= 2,
    ),
    "combined": (lambda run: ["--kind", "undecodable", "--since", run.between.isoformat()],
                 lambda run, m: m.key() == b"g2"),
}


def expected(run: MixedRun, name: str) -> list[Any]:
    chosen = [m for m in run.dlq_records if FILTERS[name][1](run, m)]
    assert 0 < len(chosen) < len(run.dlq_records), f"filter {name} must narrow the DLQ"
    return chosen


def positions(records: list[Any]) -> set[tuple[int, int]]:
    return {(m.partition(), m.offset()) for m in records}


def replay(run: MixedRun, db: DB, *args: str) -> Result:
    """``dlq replay`` of the mixed run's DLQ within its app (``--app``), re-running the
    failed keys it names."""
    return kafka_idem("dlq", "replay", "--dlq", run.dlq, "--app", MIXED_APP, "--no-progress",
                      *REDRIVE, *args, db=db, env=run.env())


def replay_json(run: MixedRun, db: DB, *args: str) -> dict[str, Any]:
    r = replay(run, db, "--json", *args)
    assert r.code == 0, r.err
    summary: dict[str, Any] = r.json()
    return summary


def audit_rows(db: DB) -> list[dict[str, Any]]:
    return db.rows("SELECT * FROM kafka_idem.admin_audit WHERE action = 'replay' ORDER BY id")


def assert_replayed(run: MixedRun, target: str, sources: list[Any]) -> None:
    """``target`` holds each source DLQ record exactly once: same key and value bytes,
    the original non-``idem.`` headers, lineage headers and no error headers."""
    got = read_all(target)
    by_source = Counter((headers_of(m)["idem.replay.source_partition"],
                         headers_of(m)["idem.replay.source_offset"]) for m in got)
    assert by_source == Counter((str(m.partition()), str(m.offset())) for m in sources)
    truth = {(m.partition(), m.offset()): m for m in sources}
    for m in got:
        h = headers_of(m)
        src = truth[(int(h["idem.replay.source_partition"]), int(h["idem.replay.source_offset"]))]
        assert m.key() == src.key()
        assert m.value() == src.value()
        assert set(LINEAGE) <= set(h)
        assert h["idem.replay.source_topic"] == run.dlq
        assert h["idem.replay.by"] == "acceptance"
        assert dt.datetime.fromisoformat(h["idem.replay.at"]).tzinfo is not None
        assert not {k for k in h if k.startswith("idem.") and not k.startswith("idem.replay.")}
        original = [(k, v) for k, v in (src.headers() or []) if not k.startswith("idem.")]
        assert [(k, v) for k, v in (m.headers() or []) if not k.startswith("idem.")] == original


def should_send(records: list[Any]) -> list[Any]:
    return [m for m in records if dlq_key(m) not in SUCCEEDED_KEYS]


# --- list / show -------------------------------------------------------------------


def test_list_shows_every_dead_lettered_record_with_its_metadata(
    mixed: MixedRun, mixed_db: DB
) -> None:
    table = kafka_idem("dlq", "list", "--topic", mixed.charges, db=mixed_db)
    assert table.code == 0, table.err
    for kafka_key, (kind_, key, handler) in EXPECTED_DLQ.items():
        assert kind_ in table.out and handler in table.out
        assert key is None or key in table.out, kafka_key
    assert "amount must be positive" in table.out

    rows = kafka_idem("dlq", "list", "--dlq", mixed.dlq, "--json", db=mixed_db).json()
    assert {(r["partition"], r["offset"]) for r in rows} == positions(mixed.dlq_records)
    by_pos = {(r["partition"], r["offset"]): r for r in rows}
    for m in mixed.dlq_records:
        row, h = by_pos[(m.partition(), m.offset())], headers_of(m)
        kind_, key, handler = EXPECTED_DLQ[m.key()]
        assert (row["kind"], row["idempotency_key"], row["handler"]) == (kind_, key, handler)
        assert row["namespace"] == h["idem.namespace"] == "payments"
        assert row["error_class"] == h["idem.error.class"]
        assert row["error_message"] == h["idem.error.message"]
        assert row["attempts"] == int(h["idem.attempts"])
        assert row["original_topic"] == (mixed.refunds if handler == "refund" else mixed.charges)
        assert row["original_offset"] == int(h["idem.original.offset"])
        assert row["last_failure_at"] == dt.datetime.fromisoformat(
            h["idem.last_failure_at"]).isoformat()
        assert row["kafka_key"] == m.key().decode()
        assert row["value_size"] == len(m.value())


@pytest.mark.parametrize("name", list(FILTERS))
def test_list_filter_narrows_to_exactly_the_matching_records(
    mixed: MixedRun, mixed_db: DB, name: str
) -> None:
    r = kafka_idem("dlq", "list", "--dlq", mixed.dlq, "--json", *FILTERS[name][0](mixed),
                   db=mixed_db)
    assert r.code == 0, r.err
    assert {(row["partition"], row["offset"]) for row in r.json()} == positions(
        expected(mixed, name))


def test_list_limit_caps_the_records_listed(mixed: MixedRun, mixed_db: DB) -> None:
    r = kafka_idem("dlq", "list", "--dlq", mixed.dlq, "--json", "--limit", "2", db=mixed_db)
    assert r.code == 0, r.err
    assert len(r.json()) == 2


def test_show_prints_every_header_the_key_and_the_value_size(
    mixed: MixedRun, mixed_db: DB
) -> None:
    m = mixed.by_kafka_key()[b"o6"]
    args = ("dlq", "show", "--topic", mixed.charges, "--partition", str(m.partition()),
            "--offset", str(m.offset()))
    text = kafka_idem(*args, db=mixed_db)
    assert text.code == 0, text.err
    for name in (*REQUIRED_HEADERS, "idem.key", "trace-id"):
        assert name in text.out
    assert "t1:charge:o6" in text.out and "unknown currency" in text.out
    assert f"{len(m.value())} bytes" in text.out

    shown = kafka_idem(*args, "--json", db=mixed_db).json()
    assert shown["headers"] == [[k, (v or b"").decode()] for k, v in m.headers()]
    assert shown["kafka_key"] == "o6"
    assert shown["value_size"] == len(m.value())
    assert ["idem.stale", "dropped by the DLQ"] not in shown["headers"]


def test_show_payload_decodes_with_the_handlers_codec_or_gives_the_raw_bytes(
    mixed: MixedRun, mixed_db: DB
) -> None:
    app = {"PAYMENTS_TOPIC": mixed.charges}  # consumers.payments:app reads the mixed run's

    def show(kafka_key: bytes, *extra: str) -> Result:
        m = mixed.by_kafka_key()[kafka_key]
        return kafka_idem("dlq", "show", "--topic", mixed.charges, "--partition",
                          str(m.partition()), "--offset", str(m.offset()), "--payload", *extra,
                          db=mixed_db, env=app)

    text = show(b"o6", "--app", "consumers.payments:app")
    assert text.code == 0, text.err
    assert "payload (handler 'charge', avro):" in text.out
    decoded = json.loads(text.out[text.out.index("payload (handler"):].split("\n", 1)[1])
    assert (decoded["order_id"], decoded["amount"], decoded["currency"]) == ("o6", "5.00", "XXX")
    as_json = show(b"o6", "--app", "consumers.payments:app", "--json").json()
    assert as_json["payload"] == {"decoded_by": "handler 'charge', avro", "value": decoded}

    junk = mixed.by_kafka_key()[b"g1"].value()
    bad = show(b"g1", "--app", "consumers.payments:app", "--json").json()["payload"]
    assert bad["decoded_by"] is None and bad["error"].startswith("avro: ")
    assert base64.b64decode(bad["base64"]) == junk
    raw = show(b"o6")  # no --app: Avro is not JSON text
    assert "payload does not decode: not JSON text; give --app MODULE:APP" in raw.out
    assert "raw bytes (base64): " in raw.out
    text_junk = show(b"g2")  # not JSON, but text: shown as it is (control characters escaped)
    assert "payload does not decode: not JSON text" in text_junk.out
    assert "raw text: garbage, second wave" in text_junk.out
    assert "base64" not in text_junk.out
    assert show(b"g2", "--json").json()["payload"]["text"] == "garbage, second wave"
    assert bad["text"] == junk.decode("utf-8")  # a NUL is UTF-8 too
    assert "raw text: \\x00not avro at all" in show(b"g1").out


# --- replay ------------------------------------------------------------------------


def test_dry_run_prints_what_would_be_sent_and_changes_nothing(
    mixed: MixedRun, mixed_db: DB, topics: Topics
) -> None:
    target = topics(dlq=False)
    r = replay(mixed, mixed_db, "--to", target, "--dry-run")
    assert r.code == 0, r.err
    would = [line for line in r.out.splitlines() if line.startswith("would send")]
    assert len(would) == len(should_send(mixed.dlq_records))
    assert "skipped (key already succeeded) 1" in r.out
    group = next(line.split(": ", 1)[1] for line in r.out.splitlines()
                 if line.startswith("replay group: "))

    as_json = replay_json(mixed, mixed_db, "--to", target, "--dry-run")
    assert as_json["group"] == group
    assert {(r["partition"], r["offset"]) for r in as_json["would_send_records"]} == positions(
        should_send(mixed.dlq_records))

    assert end_offsets(target) == {0: 0}
    assert all(offset < 0 for offset in committed(group, mixed.dlq).values())
    assert audit_rows(mixed_db) == []


@pytest.mark.parametrize("name", list(FILTERS))
def test_replay_with_a_filter_sends_exactly_the_matching_records_once(
    mixed: MixedRun, mixed_db: DB, topics: Topics, name: str
) -> None:
    target = topics(partitions=2, dlq=False)
    chosen = expected(mixed, name)
    summary = replay_json(mixed, mixed_db, "--to", target, *FILTERS[name][0](mixed))
    assert summary["matched"] == len(chosen)
    assert summary["sent"] == len(should_send(chosen))
    assert summary["skipped_succeeded"] == len(chosen) - len(should_send(chosen))
    assert_replayed(mixed, target, should_send(chosen))

    [row] = audit_rows(mixed_db)
    assert row["actor"] == "acceptance"
    assert row["counts"]["sent"] == summary["sent"]
    assert row["counts"]["matched"] == summary["matched"]
    assert row["selection"]["to_topic"] == target
    assert row["selection"]["dlq_topic"] == mixed.dlq


def test_replay_skips_keys_that_already_succeeded_and_counts_them(
    mixed: MixedRun, mixed_db: DB, topics: Topics
) -> None:
    target = topics(dlq=False)
    assert mixed_db.record("t1:charge:o1")["status"] == "succeeded"  # type: ignore[index]
    summary = replay_json(mixed, mixed_db, "--to", target, "--kind", "payload_conflict")
    assert (summary["matched"], summary["sent"], summary["skipped_succeeded"]) == (1, 0, 1)
    assert read_all(target) == []
    [row] = audit_rows(mixed_db)
    assert row["counts"]["skipped_succeeded"] == 1


def test_replay_without_to_goes_back_to_the_original_topic_and_partition(
    mixed: MixedRun, mixed_db: DB
) -> None:
    before = end_offsets(mixed.refunds)
    summary = replay_json(mixed, mixed_db, "--handler", "refund")
    assert summary["sent"] == 1 and summary["targets"] == {mixed.refunds: 1}
    [new] = [m for m in read_all(mixed.refunds) if m.offset() >= before[0]]
    src = mixed.by_kafka_key()[b"r1"]
    assert int(headers_of(src)["idem.original.partition"]) == new.partition()
    assert (new.key(), new.value()) == (src.key(), src.value())
    assert headers_of(new)["idem.replay.source_offset"] == str(src.offset())


def test_replay_stopped_by_limit_resumes_and_sends_each_record_once(
    mixed: MixedRun, mixed_db: DB, topics: Topics
) -> None:
    target = topics(partitions=2, dlq=False)
    first = replay_json(mixed, mixed_db, "--to", target, "--limit", "2")
    assert first["sent"] == 2 and first["limited"] is True
    assert len(read_all(target)) == 2

    rest = replay_json(mixed, mixed_db, "--to", target)
    assert rest["sent"] == len(should_send(mixed.dlq_records)) - 2
    assert_replayed(mixed, target, should_send(mixed.dlq_records))
    assert committed(rest["group"], mixed.dlq) == end_offsets(mixed.dlq)

    again = replay(mixed, mixed_db, "--to", target)
    # run again: nothing new past its position, which is done, not an error
    assert again.code == 0, again.err
    assert "nothing new to replay: an earlier run of this replay" in again.out
    assert_replayed(mixed, target, should_send(mixed.dlq_records))
    assert [r["counts"]["sent"] for r in audit_rows(mixed_db)] == [2, rest["sent"], 0]


def test_replay_killed_mid_way_resumes_without_double_sending(
    mixed: MixedRun, mixed_db: DB, topics: Topics
) -> None:
    target = topics(dlq=False)
    group = replay_json(mixed, mixed_db, "--to", target, "--dry-run")["group"]
    # --rate 2: a batch (one transaction) of 2 records every second or so.
    proc = subprocess.Popen(
        [*KAFKA_IDEM, "--database-url", mixed_db.dsn, "--bootstrap-servers", BOOTSTRAP,
         "dlq", "replay", "--dlq", mixed.dlq, "--app", MIXED_APP, "--to", target, "--rate", "2",
         "--no-progress", *REDRIVE],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "KAFKA_IDEM_ACTOR": "acceptance", **mixed.env()},
    )
    try:
        wait_for(lambda: sum(max(o, 0) for o in committed(group, mixed.dlq).values()) > 0,
                 what="the first batch to commit", interval=0.05)
        assert proc.poll() is None, "the replay must still be running when it is killed"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert 0 < len(read_all(target)) < len(should_send(mixed.dlq_records))

    resumed = replay_json(mixed, mixed_db, "--to", target)
    assert 0 < resumed["sent"] < len(should_send(mixed.dlq_records))
    assert_replayed(mixed, target, should_send(mixed.dlq_records))


def test_rate_limited_replay_completes_with_the_right_counts(
    mixed: MixedRun, mixed_db: DB, topics: Topics
) -> None:
    target = topics(dlq=False)
    summary = replay_json(mixed, mixed_db, "--to", target, "--kind", "permanent", "--rate", "20")
    chosen = [m for m in mixed.dlq_records if kind(m) == "permanent"]
    assert (summary["matched"], summary["sent"]) == (len(chosen), len(chosen))
    assert_replayed(mixed, target, chosen)


def failed_keys(db: DB) -> set[str]:
    return {r["idempotency_key"] for r in db.records() if r["status"] == "failed"}


def test_records_their_target_cannot_take_are_skipped_and_reported_and_their_keys_stay_failed(
    mixed: MixedRun, mixed_db: DB, topics: Topics, admin: AdminClient
) -> None:
    """Found before signing existed: one record the broker refused aborted every run of
    the replay (exit 3), and a batch's keys were re-run before their records went. Now a
    record its target cannot take (here: over the topic's max.message.bytes, found from
    the topic's config before anything is re-run) is skipped with its position and
    reason, its key stays failed, and the run goes on and exits 0."""
    target = topics(dlq=False)
    failed = failed_keys(mixed_db)
    assert failed, "the mixed run leaves failed keys"
    set_topic_config(admin, target, "max.message.bytes", "200")
    dry = replay_json(mixed, mixed_db, "--to", target, "--dry-run")
    summary = replay_json(mixed, mixed_db, "--to", target)
    assert summary["sent"] == 0
    sendable = positions(should_send(mixed.dlq_records))
    assert {(u["partition"], u["offset"]) for u in summary["unsendable"]} == sendable
    assert all(u["reason"].startswith("too_large: ") for u in summary["unsendable"])
    assert summary["skipped_unsendable"] == len(sendable) == dry["skipped_unsendable"]
    assert read_all(target) == []
    assert failed_keys(mixed_db) == failed  # no key re-run without its message
    assert mixed_db.rows("SELECT 1 FROM kafka_idem.admin_audit WHERE action = 'rerun'") == []

    # After the fix, a replay of those positions (a new selection: its own position).
    set_topic_config(admin, target, "max.message.bytes", None)
    again = replay_json(mixed, mixed_db, "--to", target, "--from-offset", "0")
    assert again["sent"] == len(sendable)
    assert_replayed(mixed, target, should_send(mixed.dlq_records))


# --- exit codes and help ---------------------------------------------------------------


def test_nothing_matched_exits_1_and_sends_nothing(
    mixed: MixedRun, mixed_db: DB, topics: Topics
) -> None:
    target = topics(dlq=False)
    nope = ("--key", "t9:charge:nope")
    assert kafka_idem("dlq", "list", "--dlq", mixed.dlq, *nope, db=mixed_db).code == 1
    assert kafka_idem("dlq", "show", "--dlq", mixed.dlq, "--partition", "0", "--offset",
                      "9999", db=mixed_db).code == 1
    r = kafka_idem("dlq", "replay", "--dlq", mixed.dlq, "--to", target, "--no-progress", *nope,
                   *REDRIVE, db=mixed_db)
    assert r.code == 1
    assert "no record" in r.err
    assert read_all(target) == []


@pytest.mark.parametrize("args", [
    ("dlq", "list"),  # no topic
    ("dlq", "list", "--dlq", "a", "--topic", "b"),
    ("dlq", "list", "--dlq", "{dlq}", "--kind", "bogus"),
    ("dlq", "list", "--dlq", "{dlq}", "--since", "yesterday"),
    ("dlq", "list", "--dlq", "t-does-not-exist"),
    ("dlq", "replay", "--dlq", "{dlq}", "--to", "t-does-not-exist", "--no-progress"),
    ("dlq", "show", "--dlq", "{dlq}", "--offset", "0"),  # no --partition
])
def test_usage_errors_exit_2(mixed: MixedRun, mixed_db: DB, args: tuple[str, ...]) -> None:
    r = kafka_idem(*(a.format(dlq=mixed.dlq) for a in args), db=mixed_db)
    assert r.code == 2, (r.out, r.err)
    assert audit_rows(mixed_db) == []


NO_DLQ = ("the DLQ of --topic SOURCE is SOURCE + the dlq_suffix setting '.dlq'; "
          "--dlq TOPIC names a DLQ itself")


@pytest.mark.parametrize(("args", "line"), [
    (("dlq", "list", "--topic", "t-nope"),
     f"error: --topic t-nope: topic 't-nope.dlq' does not exist ({NO_DLQ})"),
    (("dlq", "show", "--topic", "t-nope", "--partition", "0", "--offset", "0"),
     f"error: --topic t-nope: topic 't-nope.dlq' does not exist ({NO_DLQ})"),
    (("dlq", "replay", "--topic", "t-nope", "--dry-run", "--no-progress"),
     f"error: --topic t-nope: topic 't-nope.dlq' does not exist ({NO_DLQ})"),
    (("dlq", "list", "--dlq", "t-nope.dlq"),
     "error: --dlq t-nope.dlq: topic 't-nope.dlq' does not exist"),
    (("dlq", "replay", "--dlq", "t-nope.dlq", "--dry-run", "--no-progress"),
     "error: --dlq t-nope.dlq: topic 't-nope.dlq' does not exist"),
    (("dlq", "list", "--dlq", "{dlq}", "--partition", "7"),
     "error: --partition 7: topic '{dlq}' has no partition 7 (partitions 0..1)"),
    (("dlq", "show", "--dlq", "{dlq}", "--partition", "7", "--offset", "0"),
     "error: --partition 7: topic '{dlq}' has no partition 7 (partitions 0..1)"),
    (("dlq", "replay", "--dlq", "{dlq}", "--partition", "7", "--dry-run", "--no-progress"),
     "error: --partition 7: topic '{dlq}' has no partition 7 (partitions 0..1)"),
    (("dlq", "replay", "--dlq", "{dlq}", "--to", "t-nope", "--no-progress", *REDRIVE),
     "error: --to t-nope: target topic 't-nope' does not exist"),
    (("dlq", "replay", "--dlq", "{dlq}", "--to", "{dlq}", "--no-progress", *REDRIVE),
     "error: --to {dlq}: the target topic cannot be the DLQ topic itself"),
    (("dlq", "show", "--dlq", "{dlq}", "--partition", "0", "--offset", "0", "--payload",
      "--app", "no_such_module:app"),
     "error: Invalid value for '--app': cannot import 'no_such_module': No module named "
     "'no_such_module'"),
    (("rerun", "--kind", "permanent", "--dlq", "t-nope.dlq", "--dry-run", "--no-progress"),
     "error: --dlq t-nope.dlq: topic 't-nope.dlq' does not exist"),
    (("purge", "--older-than", "30x"),
     "error: Invalid value for '--older-than': '30x' is not a duration like 90s, 15m, 12h, "
     "30d or 2w"),
    (("status", "--long-running", "soon"),
     "error: Invalid value for '--long-running': 'soon' is not a duration like 90s, 15m, "
     "12h, 30d or 2w"),
])
def test_a_bad_topic_or_partition_is_named_as_the_user_typed_it(
    mixed: MixedRun, mixed_db: DB, args: tuple[str, ...], line: str
) -> None:
    """The one error line names the option given (--topic, --dlq, --partition, --to,
    --app), never a parameter the user cannot set (``setting=dlq``)."""
    r = kafka_idem(*(a.format(dlq=mixed.dlq) for a in args), db=mixed_db)
    assert r.code == 2, (r.out, r.err)
    assert r.err.strip().splitlines() == [line.format(dlq=mixed.dlq)]
    assert "setting=" not in r.err
    assert audit_rows(mixed_db) == []


def test_every_dlq_command_has_help() -> None:
    for args in (("dlq",), ("dlq", "list"), ("dlq", "show"), ("dlq", "replay")):
        r = kafka_idem(*args, "--help")
        assert r.code == 0 and "Usage:" in r.out, args
