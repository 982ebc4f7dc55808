"""Re-driving dead letters: ``dlq replay`` re-runs failed keys and ``rerun`` in bulk.

The scenario is issue 10's: a handler raised Retryable until its budget ran out
(``tests.apps.stock``: no stock yet), its keys were dead-lettered as ``exhausted``
and are ``failed``; the cause is fixed (the stock arrives: a row the test inserts)
and the dead letters are re-driven through the CLI, a subprocess against the real
broker and database. Outcomes are durable state: record states and attempts, audit
rows, ledger rows, DLQ sizes, committed offsets.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from consumers.payments import encode_charge
from kafka_idem import replay
from kafka_idem.replay import Selection
from kafka_idem.replay import transaction as transaction_module
from kafka_idem.settings import Settings
from tests.acceptance.conftest import (
    Result,
    headers_of,
    kafka_idem,
    produce_with_headers,
    read_all,
)
from tests.apps.stock import CREATE
from tests.conftest import (
    BOOTSTRAP,
    DB,
    Members,
    Topics,
    committed,
    member_env,
    produce,
    wait_for,
)

STOCK = "tests.apps.stock:app"
MAX_ATTEMPTS = 2
REASON = "INC-7: stock arrived"


@dataclass
class Exhausted:
    """What the exhausting run left: ``keys`` failed as exhausted, each dead-lettered
    once, and the ``doubled`` ones twice (a duplicate delivery of a failed key)."""

    topic: str
    dlq: str
    group: str
    keys: list[str]
    doubled: list[str]
    member: subprocess.Popen[bytes] | None

    def replay(self, db: DB, *args: str) -> Result:
        """``dlq replay`` of the DLQ within its app (``--app``: its handler's topic, its
        namespace, values that build their keys)."""
        return kafka_idem("dlq", "replay", "--dlq", self.dlq, "--app", STOCK, "--no-progress",
                          *args, db=db, env={"PAYMENTS_TOPIC": self.topic})


def env(db: DB, topic: str) -> dict[str, str]:
    return member_env(db, topic, KAFKA_IDEM_MAX_ATTEMPTS=str(MAX_ATTEMPTS),
                      KAFKA_IDEM_BACKOFF_BASE_SECONDS="0.05",
                      KAFKA_IDEM_BACKOFF_CAP_SECONDS="0.2")


def key(order: str) -> str:
    return f"t1:charge:{order}"


def failed_keys(db: DB) -> set[str]:
    return {r["idempotency_key"] for r in db.records() if r["status"] == "failed"}


def reruns(db: DB) -> list[dict[str, Any]]:
    return db.rows("SELECT * FROM kafka_idem.admin_audit WHERE action = 'rerun' ORDER BY id")


def consumed_all(group: str, topic: str) -> bool:
    """``group`` committed past every record of ``topic`` (a replay's records come in
    Kafka transactions: the end offset counts their commit markers too)."""
    last: dict[int, int] = {}
    for m in read_all(topic):
        last[m.partition()] = max(last.get(m.partition(), -1), m.offset())
    done = committed(group, topic)
    return all(done.get(p, -1) > offset for p, offset in last.items())


def replayed(topic: str) -> list[Any]:
    return [m for m in read_all(topic) if "idem.replay.at" in headers_of(m)]


def exhaust(db: DB, topics: Topics, members: Members, group: str, *, n: int = 12,
            doubled: int = 3, keep_running: bool = False,
            extra: list[tuple[bytes, bytes]] | None = None, extra_dlq: int = 0) -> Exhausted:
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(CREATE)
    topic = topics(partitions=2)
    orders = [f"o{i:03d}" for i in range(n)]
    records = [(o.encode(), encode_charge("t1", o, "10.00")) for o in orders]
    # Duplicates (same intent, a new request id) of failed keys: dead-lettered again.
    records += [(o.encode(), encode_charge("t1", o, "10.00")) for o in orders[:doubled]]
    produce(topic, [*records, *(extra or [])])
    member = members.start(STOCK, env(db, topic), group=group)
    keys = [key(o) for o in orders]
    dlq = f"{topic}.dlq"
    wait_for(lambda: consumed_all(group, topic) and set(keys) <= failed_keys(db)
             and len(read_all(dlq)) == n + doubled + extra_dlq,
             timeout=90, what="every key exhausted and dead-lettered")
    assert {r["error_kind"] for r in db.records() if r["idempotency_key"] in keys} == {
        "exhausted"}
    if not keep_running:
        stop(member)
    return Exhausted(topic, dlq, group, keys, [key(o) for o in orders[:doubled]],
                     member if keep_running else None)


def stop(member: subprocess.Popen[bytes]) -> None:
    member.terminate()
    assert member.wait(timeout=30) == 0


def fix(db: DB) -> None:
    """The stock arrives."""
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO stock.arrived VALUES ('*')")


def assert_each_key_succeeded_once(db: DB, ex: Exhausted, summary: dict[str, Any], *,
                                   via: str = "dlq replay") -> None:
    wait_for(lambda: all((db.record(k) or {}).get("status") == "succeeded" for k in ex.keys)
             and consumed_all(ex.group, ex.topic), timeout=90, what="every key succeeded")
    assert db.ledger_counts() == {k: 1 for k in ex.keys}
    for k in ex.keys:
        rec = db.record(k)
        assert rec is not None
        # MAX_ATTEMPTS failed attempts, then the re-run's one successful attempt.
        assert rec["attempts"] == MAX_ATTEMPTS + 1, (k, rec["attempts"])
    rows = reruns(db)
    assert Counter(r["idempotency_key"] for r in rows) == {k: 1 for k in ex.keys}
    for r in rows:
        assert (r["actor"], r["reason"], r["previous_status"]) == ("acceptance", REASON,
                                                                    "failed")
        assert r["previous_error"].startswith("exhausted: ")
        assert r["selection"]["via"] == via
        if via == "dlq replay":
            assert r["selection"]["group"] == summary["group"]
    assert consumed_all(ex.group, ex.topic)


def test_exhausted_keys_fixed_and_replayed_succeed_once_each(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    ex = exhaust(db, topics, members, group)
    dlq_size = len(read_all(ex.dlq))
    fix(db)

    r = ex.replay(db, "--kind", "exhausted", "--reason", REASON, "--json")
    assert r.code == 0, r.err
    summary = r.json()
    assert (summary["sent"], summary["rerun"], summary["skipped_duplicate"]) == (
        len(ex.keys), len(ex.keys), len(ex.doubled))
    # One message per key, although some keys were dead-lettered twice.
    assert Counter(m.key() for m in replayed(ex.topic)) == {
        k.rsplit(":", 1)[1].encode(): 1 for k in ex.keys}
    assert {r["status"] for r in db.records()} == {"retryable_failed"}
    [row] = db.rows("SELECT * FROM kafka_idem.admin_audit WHERE action = 'replay'")
    assert row["counts"]["rerun"] == len(ex.keys)
    assert (row["actor"], row["reason"]) == ("acceptance", REASON)
    assert all(r["selection"]["run"] == summary["run"] for r in reruns(db))

    members.start(STOCK, env(db, ex.topic), group=group)
    assert_each_key_succeeded_once(db, ex, summary)
    assert len(read_all(ex.dlq)) == dlq_size  # nothing dead-lettered again


def test_replay_while_the_consumer_group_runs(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    ex = exhaust(db, topics, members, group, keep_running=True)
    dlq_size = len(read_all(ex.dlq))
    fix(db)
    r = ex.replay(db, "--kind", "exhausted", "--reason", REASON, "--json")
    assert r.code == 0, r.err
    assert r.json()["rerun"] == len(ex.keys)
    assert_each_key_succeeded_once(db, ex, r.json())
    assert len(read_all(ex.dlq)) == dlq_size

    # Run again: every key succeeded, nothing is re-run or sent twice.
    again = ex.replay(db, "--kind", "exhausted", "--reason", REASON, "--json",
                      "--group", "kafka-idem-replay-again")
    assert again.code == 0, again.err
    assert (again.json()["sent"], again.json()["skipped_succeeded"]) == (
        0, len(ex.keys) + len(ex.doubled))
    assert len(reruns(db)) == len(ex.keys)


def test_a_replay_killed_after_its_database_commit_and_run_again_loses_no_key(
    db: DB, topics: Topics, members: Members, group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay dies after a batch's re-runs committed in the database and before its
    Kafka transaction (the records and the position) committed: the keys are
    ``retryable_failed`` with no message on the way ("stranded"). ``rerun KEY`` takes
    one back, naming the replay; the same replay run again sends the others
    ("resend"); nothing is sent twice and every key succeeds once."""
    ex = exhaust(db, topics, members, group, n=6, doubled=1)
    fix(db)
    selection = Selection(kind="exhausted", namespace="stock")
    settings = Settings(database_url=db.dsn, bootstrap_servers=BOOTSTRAP)

    def killed(_producer: Any) -> None:
        raise KeyboardInterrupt("killed between the two commits")

    monkeypatch.setattr(transaction_module, "_commit", killed)
    with pytest.raises(KeyboardInterrupt):
        replay.replay(settings, None, ex.dlq, selection, actor="acceptance", reason=REASON)
    monkeypatch.undo()
    stranded = {r["idempotency_key"] for r in reruns(db)}
    assert stranded == set(ex.keys)  # one batch: every key re-run, none sent
    assert replayed(ex.topic) == []
    assert all(db.record(k)["status"] == "retryable_failed"  # type: ignore[index]
               for k in stranded)

    # One key by hand: rerun takes a stranded key and says which replay stranded it.
    one = sorted(stranded)[0]
    by_hand = kafka_idem("rerun", one, "--reason", REASON, db=db)
    assert by_hand.code == 0, by_hand.err
    assert "retryable_failed since replay kafka-idem-replay." in by_hand.out
    [row] = [r for r in reruns(db) if r["idempotency_key"] == one and
             r["selection"].get("stranded_by")]
    assert row["previous_status"] == "retryable_failed"
    assert row["selection"]["stranded_by"]["group"].startswith(f"kafka-idem-replay.{ex.dlq}.")
    assert kafka_idem("rerun", one, "--reason", REASON, db=db).code == 1  # not twice

    resumed = kafka_idem("dlq", "replay", "--dlq", ex.dlq, "--kind", "exhausted",
                         "--namespace", "stock", "--reason", REASON, "--no-progress", "--json",
                         db=db)
    assert resumed.code == 0, resumed.err
    summary = resumed.json()
    assert summary["resend"] == len(stranded) - 1
    # the one rerun sent: each of its dead letters left to the consumer
    assert summary["skipped_in_progress"] == sum(
        headers_of(m).get("idem.key") == one for m in read_all(ex.dlq))
    assert failed_keys(db) == set()
    assert Counter(m.key() for m in replayed(ex.topic)) == {
        k.rsplit(":", 1)[1].encode(): 1 for k in ex.keys}

    members.start(STOCK, env(db, ex.topic), group=group)
    wait_for(lambda: all((db.record(k) or {}).get("status") == "succeeded" for k in ex.keys),
             timeout=90, what="every key succeeded")
    assert db.ledger_counts() == {k: 1 for k in ex.keys}


def test_dry_run_counts_equal_the_real_run_and_foreign_records_are_left_alone(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        conn.execute(CREATE)
        conn.execute("INSERT INTO stock.arrived VALUES ('ok1'), ('bad1')")
    extra = [
        (b"ok1", encode_charge("t1", "ok1", "1.00")),  # succeeds
        (b"ok1", encode_charge("t1", "ok1", "2.00")),  # payload conflict, key succeeded
        (b"bad1", encode_charge("t1", "bad1", "0")),  # permanent: amount must be positive
        (b"junk", b"\x00not avro"),  # undecodable
    ]
    ex = exhaust(db, topics, members, group, n=5, doubled=1, extra=extra, extra_dlq=3)
    produce_with_headers(ex.dlq, [(b"foreign", b"written by someone else", None)])
    foreign = next(m for m in read_all(ex.dlq) if m.key() == b"foreign")
    dlq_size = len(read_all(ex.dlq))
    fix(db)

    dry = ex.replay(db, "--reason", REASON, "--dry-run", "--json")
    assert dry.code == 0, dry.err
    text = ex.replay(db, "--dry-run")
    assert "skipped (failed permanently; --include-permanent re-runs them) 1" in text.out
    assert "exhausted: would re-run 5, skipped duplicate 1" not in text.out  # names, not verbs
    assert "  exhausted: re-run 5, skipped duplicate 1" in text.out
    real = ex.replay(db, "--reason", REASON, "--json")
    assert real.code == 0, real.err
    assert f"[{foreign.partition()}]@{foreign.offset()}" in real.err
    assert "no idem.* headers" in real.err

    d, s = dry.json(), real.json()
    counts = ("scanned", "matched", "rerun", "resend", "as_is", "skipped_succeeded",
              "skipped_permanent", "skipped_in_progress", "skipped_duplicate",
              "skipped_truncated", "skipped_foreign", "by_kind", "targets")
    assert {c: d[c] for c in counts} == {c: s[c] for c in counts}
    assert d["would_send"] == s["sent"]
    assert Counter(r["action"] for r in d["would_send_records"]) == {"rerun": 5, "as_is": 1}
    assert "note: re-running these 5 failed key(s) needs --reason" in text.err
    assert s["by_kind"] == {
        "(foreign)": {"skipped_foreign": 1},
        "exhausted": {"rerun": 5, "skipped_duplicate": 1},
        "payload_conflict": {"skipped_succeeded": 1},
        "permanent": {"skipped_permanent": 1},
        "undecodable": {"as_is": 1},
    }
    assert s["sent"] == 6
    assert db.record(key("bad1"))["status"] == "failed"  # type: ignore[index]
    assert len(reruns(db)) == 5
    assert len(read_all(ex.dlq)) == dlq_size  # the foreign record is still there
    assert not any(headers_of(m).get("idem.replay.source_offset") == str(foreign.offset())
                   and m.key() == b"foreign" for m in read_all(ex.topic))


def test_re_running_failed_keys_without_a_reason_is_refused_and_sends_nothing(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    ex = exhaust(db, topics, members, group, n=3, doubled=0)
    for args in ((), ("--reason", "   ")):
        r = ex.replay(db, "--kind", "exhausted", *args)
        assert r.code == 1, (r.out, r.err)
        lines = [ln for ln in r.err.strip().splitlines() if not ln.startswith("%")]
        assert len(lines) == 1 and lines[0].startswith("refused: ")
        assert "--reason" in lines[0]
    assert replayed(ex.topic) == []
    assert reruns(db) == []
    assert failed_keys(db) == set(ex.keys)


def test_bulk_rerun_re_runs_every_selected_key_once_and_is_idempotent(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    ex = exhaust(db, topics, members, group, n=40, doubled=2)
    fix(db)

    def rerun(*args: str) -> Result:
        return kafka_idem("rerun", "--no-progress", *args, db=db)

    nothing = rerun("--key-prefix", "t9:", "--reason", REASON)
    assert (nothing.code, nothing.err.strip()) == (
        1, 'error: no failed record matches {"key_prefix": "t9:"}')
    for refused in (rerun("--kind", "exhausted"), rerun("--kind", "exhausted", "--reason", " ")):
        assert refused.code == 1, refused.err
        [line] = refused.err.strip().splitlines()
        assert line.startswith("refused: a reason is required")
    unknown = rerun("t9:charge:nope", "--reason", REASON)
    assert (unknown.code, unknown.err.strip()) == (
        1, "refused: no record with this key (key=t9:charge:nope)")
    assert rerun("t1:charge:o001", "--kind", "exhausted", "--reason", REASON).code == 2
    assert reruns(db) == [] and replayed(ex.topic) == []

    dry = rerun("--kind", "exhausted", "--dry-run", "--json")
    assert dry.code == 0, dry.err
    assert (dry.json()["selected"], dry.json()["would_rerun"]) == (40, 40)
    assert dry.json()["dlq_topics"] == {ex.dlq: 40}
    assert reruns(db) == [] and replayed(ex.topic) == []

    first = rerun("--kind", "exhausted", "--reason", REASON, "--limit", "15", "--json")
    assert first.code == 0, first.err
    assert first.json()["rerun"] == 15
    rest = rerun("--kind", "exhausted", "--reason", REASON)
    assert rest.code == 0, rest.err
    assert rest.out.startswith("selected 25 failed key(s), re-run 25")
    # Each key got its latest dead letter once, although some were dead-lettered twice.
    assert Counter(m.key() for m in replayed(ex.topic)) == {
        k.rsplit(":", 1)[1].encode(): 1 for k in ex.keys}
    again = rerun("--kind", "exhausted", "--reason", REASON)
    assert again.code == 1, "nothing failed is left to re-run"
    assert len(reruns(db)) == 40

    members.start(STOCK, env(db, ex.topic), group=group)
    assert_each_key_succeeded_once(db, ex, {}, via="rerun")
    assert {r["selection"]["filter"]["kind"] for r in reruns(db)} == {"exhausted"}


def test_a_replay_run_again_sends_nothing_twice_not_even_its_own_dead_letters_come_back(
    db: DB, topics: Topics, members: Members, group: str
) -> None:
    """The undecodable record it sends as it is comes back (the consumer dead-letters
    the copy again, lineage kept): the same replay run again skips that dead letter
    instead of sending it round again, and says so."""
    ex = exhaust(db, topics, members, group, n=2, doubled=0, keep_running=True,
                 extra=[(b"junk", b"\x00not avro")], extra_dlq=1)
    dlq_size = len(read_all(ex.dlq))
    fix(db)
    first = ex.replay(db, "--reason", REASON, "--json")
    assert first.code == 0, first.err
    assert (first.json()["rerun"], first.json()["as_is"]) == (2, 1)
    assert_each_key_succeeded_once(db, ex, first.json())
    wait_for(lambda: len(read_all(ex.dlq)) == dlq_size + 1, timeout=60,
             what="the junk copy dead-lettered again")
    [back] = [m for m in read_all(ex.dlq) if "idem.replay.at" in headers_of(m)]
    assert headers_of(back)["idem.replay.group"] == first.json()["group"]

    again = ex.replay(db, "--reason", REASON)
    assert again.code == 0, again.err
    assert "sent 0 " in again.out
    assert ("skipped (dead letter of a copy a replay already sent (this replay, or as-is): "
            "sent again it would only come back) 1") in again.out
    assert "  undecodable: skipped replayed 1" in again.out
    # Another replay (another group, from the start) sends the original once more, but
    # not the copy that came back: the same bytes were sent as they are already.
    other = ex.replay(db, "--kind", "undecodable", "--json")
    assert (other.json()["as_is"], other.json()["skipped_replayed"]) == (1, 1), other.out
    assert len(reruns(db)) == 2
