"""The batch path's claim: one read of every key, the new keys' handlers, then one insert
of every success as a succeeded record (one row version per message), as the per-message
claim decides every case; a key someone else wrote meanwhile makes the batch fall back.

Each test runs a real :class:`Processor` and calls ``run_batch`` directly with messages
built in the test, so what the batch path decided (and that it did not fall back) is
seen directly; outcomes are checked in the business tables and the idempotency table.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from consumers.payments import ChargeRequested, encode_charge
from kafka_idem import Context
from kafka_idem.consume.outcome import Deferred, Finished, Result
from kafka_idem.consume.paths.batch_path import Fallback, run_batch
from kafka_idem.consume.paths.processor import Processor
from kafka_idem.store import Delivery, Outcome, Store, connect
from kafka_idem.testing import FakeMessage
from tests.apps.workers import processor
from tests.conftest import DB, wait_for

TOPIC = "claim-order.charge-requested"
TP = (TOPIC, 0)
HANDLERS = pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "per-message"])


def key(order: str) -> str:
    return f"t1:charge:{order}"


class Batches:
    """Messages at increasing offsets of one partition, run through one Processor."""

    def __init__(self, proc: Processor) -> None:
        self.proc = proc
        self.offset = 0
        self.reads: list[list[str]] = []  # the keys of every read of the batch path
        self.after_read: list[Any] = []  # called once each, after the next read
        store = proc.store
        original = store.found

        def found(conn: Any, keys: Any) -> Any:
            self.reads.append(list(keys))
            got = original(conn, keys)
            while self.after_read:
                self.after_read.pop(0)()
            return got

        store.found = found  # type: ignore[method-assign]

    def msgs(self, *charges: tuple[str, str]) -> list[FakeMessage]:
        out = []
        for order, amount in charges:
            out.append(FakeMessage(TOPIC, offset=self.offset, key=order.encode(),
                                   value=encode_charge("t1", order, amount)))
            self.offset += 1
        return out

    def run(self, *charges: tuple[str, str]) -> list[Result]:
        """On the batch path only: a fallback fails the test."""
        return run_batch(self.proc, [(TP, self.msgs(*charges))])[TP]


@pytest.fixture(params=["insert", "copy"])
def batches(db: DB, request: pytest.FixtureRequest) -> Iterator[Batches]:
    """Every test twice: the batch's records written by the INSERT a small batch sends in
    its pipeline, and by the COPY a large one sends after it (``copy_from``)."""
    proc = processor(db.dsn, TOPIC, "local")
    proc.store.copy_from = 1 if request.param == "copy" else 10**9
    yield Batches(proc)
    proc.close()


def outcome(result: Result) -> tuple[str, str | None]:
    if isinstance(result, Finished):
        return result.outcome, result.letter.kind if result.letter else None
    assert isinstance(result, Deferred)
    return "deferred", result.reason


def _durable(rec: dict[str, Any] | None) -> dict[str, Any]:
    assert rec is not None
    return rec


@HANDLERS
def test_new_succeeded_conflicting_and_repeated_keys_in_one_batch(
    db: DB, batches: Batches, bulk: bool
) -> None:
    if not bulk:
        batches.proc.app.handlers[TOPIC].bulk = None
    assert [outcome(r) for r in batches.run(("oA", "10.00"), ("oB", "5.00"))] == [
        ("succeeded", None), ("succeeded", None)]
    before_a, before_b = _durable(db.record(key("oA"))), _durable(db.record(key("oB")))
    batches.reads.clear()

    results = batches.run(
        ("oC", "1.00"),    # new
        ("oA", "10.0"),    # succeeded, same request hash (10.0 is 10.00): replay
        ("oD", "2.00"),    # new ...
        ("oB", "6.00"),    # succeeded, other payload: conflict, record untouched
        ("oD", "2.00"),    # ... twice in the batch: replays the first's result
        ("oA", "10.00"),   # the succeeded key again: replay again
        ("oE", "3.00"),    # new
        ("oD", "2.50"),    # the new key a third time, other payload: conflict
    )
    assert [outcome(r) for r in results] == [
        ("succeeded", None), ("replayed", None), ("succeeded", None),
        ("conflict", "payload_conflict"), ("replayed", None), ("replayed", None),
        ("succeeded", None), ("conflict", "payload_conflict"),
    ]
    # One effect per key; the conflicting payloads wrote nothing.
    assert db.ledger_counts() == {key(o): 1 for o in ("oA", "oB", "oC", "oD", "oE")}
    amounts = {r["order_id"]: r["amount"] for r in db.ledger()}
    assert amounts == {"oA": Decimal("10.00"), "oB": Decimal("5.00"), "oC": Decimal("1.00"),
                       "oD": Decimal("2.00"), "oE": Decimal("3.00")}
    assert db.balances() == {("t1", "EUR"): Decimal("21.00")}
    # The succeeded records were only read: byte for byte what they were.
    assert db.record(key("oA")) == before_a
    assert db.record(key("oB")) == before_b
    records = {r["idempotency_key"]: r for r in db.records()}
    assert {k: r["status"] for k, r in records.items()} == {
        key(o): "succeeded" for o in ("oA", "oB", "oC", "oD", "oE")}
    assert {r["attempts"] for r in records.values()} == {1}
    for o, offset in (("oC", 2), ("oD", 4), ("oE", 8)):  # the first occurrence claimed
        rec = records[key(o)]
        assert rec["kafka_offset"] == offset
        assert rec["owner_token"] is None and rec["completed_token"] is not None
        assert rec["result_json"]["order_id"] == o
    tokens = [records[key(o)]["completed_token"] for o in ("oC", "oD", "oE")]
    assert len(set(tokens)) == 3  # one owner token per claim
    # One read, of every key of the batch, before any handler ran.
    assert batches.reads == [sorted(key(o) for o in ("oA", "oB", "oC", "oD", "oE"))]


def test_a_new_key_is_written_once_in_the_transaction_of_its_effect(
    db: DB, batches: Batches
) -> None:
    """A batch of new keys: each record is one insert, and the records table saw no
    update at all (before: an insert as processing and an update to succeeded)."""
    results = batches.run(*[(f"o{i}", "1.00") for i in range(20)])
    assert {outcome(r) for r in results} == {("succeeded", None)}
    assert db.ledger_counts() == {key(f"o{i}"): 1 for i in range(20)}
    rows = db.rows("SELECT t.status, t.owner_token, t.lease_until, t.completed_token, "
                   "t.attempts FROM kafka_idem.task_idempotency t JOIN payments.ledger l "
                   "USING (idempotency_key)")
    assert len(rows) == 20
    assert {(r["status"], r["owner_token"], r["lease_until"], r["attempts"]) for r in rows} == {
        ("succeeded", None, None, 1)}
    assert len({r["completed_token"] for r in rows}) == 20
    # Written in key order (o10 before o2), the order in which a batch takes its keys,
    # each record with its own message's result and offset. A fresh table: ctid is
    # insertion order.
    written = db.rows("SELECT idempotency_key, result_json, kafka_offset "
                      "FROM kafka_idem.task_idempotency ORDER BY ctid")
    assert [r["idempotency_key"] for r in written] == sorted(key(f"o{i}") for i in range(20))
    assert [r["idempotency_key"] for r in written] != [key(f"o{i}") for i in range(20)]
    for r in written:
        order = r["idempotency_key"].rsplit(":", 1)[1]
        assert r["result_json"] == {"order_id": order, "amount": "1.00", "currency": "EUR"}
        assert r["kafka_offset"] == int(order[1:])

    def counted() -> Any:  # the backend reports its counts once idle (PostgreSQL 15+)
        row = db.rows("SELECT n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables "
                      "WHERE relid = 'kafka_idem.task_idempotency'::regclass")[0]
        return row if row["n_tup_ins"] >= 20 else None

    assert wait_for(counted, timeout=30, what="the table's statistics") == {
        "n_tup_ins": 20, "n_tup_upd": 0, "n_tup_del": 0}


def test_a_batch_stamps_its_records_with_one_time_of_the_database_clock(
    db: DB, batches: Batches
) -> None:
    """Created, updated and completed: the database's time after the handlers ran, the
    same for every record of the batch (read once, as the insert used to take it)."""
    (before,) = db.rows("SELECT clock_timestamp() AS t")
    batches.run(*[(f"o{i}", "1.00") for i in range(5)])
    (after,) = db.rows("SELECT clock_timestamp() AS t")
    stamps = db.rows("SELECT created_at, updated_at, completed_at "
                     "FROM kafka_idem.task_idempotency")
    assert len(stamps) == 5
    times = {t for r in stamps for t in r.values()}
    assert len(times) == 1
    (at,) = times
    assert before["t"] < at < after["t"]
    (ledger_first,) = db.rows("SELECT min(created_at) AS t FROM payments.ledger")
    assert ledger_first["t"] <= at  # after the handlers' own writes


def test_every_multi_key_write_takes_keys_in_byte_order(db: DB, batches: Batches) -> None:
    """The batch's COPY writes its records in the order Python sorts the keys (code
    points, which is UTF-8's byte order) and the SQL statements that take several
    records (its insert among them) sort by "C" (byte order): one order, whatever the
    database's collation, so two batches with keys in common wait for each other and
    cannot deadlock."""
    orders = ["oa", "oB", "o_", "o\u00e9", "oZ", "o1", "o\U0001f600", "oe", "O2"]
    batches.run(*[(o, "1.00") for o in orders])
    written = [r["idempotency_key"] for r in db.rows(
        "SELECT idempotency_key FROM kafka_idem.task_idempotency ORDER BY ctid")]
    by_c = [r["k"] for r in db.rows(
        "SELECT k FROM unnest(%s::text[]) AS k ORDER BY k COLLATE \"C\"",
        ([key(o) for o in orders],))]
    assert written == sorted(key(o) for o in orders) == by_c


def _claimed_elsewhere(
    db: DB, batches: Batches, order: tuple[str, str]
) -> tuple[Store, Any, Any]:
    """Another member's committed claim of ``order``'s key (a live 60 s lease):
    the store, that member's open connection and its claim."""
    proc = batches.proc
    handler = proc.app.handlers[TOPIC]
    (msg,) = batches.msgs(order)
    prep = proc.prepare(handler, msg)
    store = Store(schema="kafka_idem", table="task_idempotency",
                  namespace=proc.app.namespace)
    other = connect(db.dsn)
    with other.transaction():
        theirs = store.claim(other, key=prep.key, request_hash=prep.request_hash,
                             delivery=Delivery(TOPIC, 0, 0, handler.name), lease_seconds=60,
                             max_attempts=5, max_elapsed_seconds=3600)
    assert theirs.outcome is Outcome.CLAIMED and theirs.token is not None
    return store, other, theirs


def test_a_key_under_another_owners_live_lease_falls_back_and_is_not_processed_twice(
    db: DB, batches: Batches, caplog: pytest.LogCaptureFixture
) -> None:
    proc = batches.proc
    # Another member claimed oF (same payload) and is still working on it: live lease.
    store, other, theirs = _claimed_elsewhere(db, batches, ("oF", "4.00"))

    msgs = batches.msgs(("oG", "1.00"), ("oF", "4.00"), ("oH", "2.00"))
    with pytest.raises(Fallback):
        run_batch(proc, [(TP, msgs)])
    # Nothing of the optimistic attempt survived: not even the new keys' claims.
    assert db.ledger_counts() == {}
    assert {r["idempotency_key"] for r in db.records()} == {key("oF")}

    # The per-message path decides: oG done, oF busy (the partition waits there).
    with caplog.at_level(logging.DEBUG):
        results = proc.run_local([(TP, msgs)])[TP]
    # counted and said, with where it was (the operator's view of a slower batch)
    assert proc.metrics.registry.get_sample_value(
        "kafka_idem_batch_fallbacks_total", {"topic": TOPIC}) == 1
    said = [r.getMessage() for r in caplog.records if r.__dict__.get("action") == "batch_fallback"]
    assert said == [f"batch falls back: a key needs the per-message protocol "
                    f"({TOPIC}[0]@{msgs[0].offset()}-{msgs[-1].offset()})"]
    assert [outcome(r) for r in results] == [("succeeded", None), ("deferred", "busy")]
    assert db.ledger_counts() == {key("oG"): 1}
    rec = _durable(db.record(key("oF")))
    assert (rec["status"], rec["owner_token"], rec["attempts"]) == (
        "processing", theirs.token, 1)

    # The other owner finishes; the redelivery of oF replays it, oH is new.
    with other.transaction():
        other.execute("INSERT INTO payments.ledger (tenant_id, order_id, amount, currency, "
                      "idempotency_key) VALUES ('t1', 'oF', 4.00, 'EUR', %s)", (key("oF"),))
        store.complete(other, key=key("oF"), token=theirs.token, result={"by": "other"})
    other.close()
    results = run_batch(proc, [(TP, msgs[1:])])[TP]
    assert [outcome(r) for r in results] == [("replayed", None), ("succeeded", None)]
    assert db.ledger_counts() == {key(o): 1 for o in ("oF", "oG", "oH")}
    assert _durable(db.record(key("oF")))["completed_token"] == theirs.token


def test_a_conflicting_payload_for_a_key_in_flight_elsewhere_is_a_conflict(
    db: DB, batches: Batches
) -> None:
    """Decided in the lock step, without the per-message path: the hash differs."""
    _store, other, _theirs = _claimed_elsewhere(db, batches, ("oF", "4.00"))
    other.close()
    before = db.record(key("oF"))
    results = batches.run(("oF", "9.00"), ("oJ", "1.00"))
    assert [outcome(r) for r in results] == [("conflict", "payload_conflict"),
                                             ("succeeded", None)]
    assert db.record(key("oF")) == before
    assert db.ledger_counts() == {key("oJ"): 1}


@HANDLERS
def test_a_key_another_member_finishes_after_the_read_is_not_written_twice(
    db: DB, batches: Batches, bulk: bool
) -> None:
    """Another member claims and completes oK between the batch's read (oK new) and its
    insert. The insert does not write oK, so the batch falls back and nothing of it
    stays (its handler's charge of oK included); the per-message path replays oK."""
    if not bulk:
        batches.proc.app.handlers[TOPIC].bulk = None
    msgs = batches.msgs(("oJ", "1.00"), ("oK", "4.00"), ("oL", "2.00"))
    theirs: list[Any] = []

    def finish_elsewhere() -> None:  # a handler that wrote nothing of its own
        store, other, claim = _claimed_elsewhere(db, batches, ("oK", "4.00"))
        with other.transaction():
            store.complete(other, key=key("oK"), token=claim.token, result={"by": "other"})
        other.close()
        theirs.append(claim)

    batches.after_read.append(finish_elsewhere)
    with pytest.raises(Fallback, match="written by someone else"):
        run_batch(batches.proc, [(TP, msgs)])
    assert db.ledger_counts() == {}
    assert {r["idempotency_key"] for r in db.records()} == {key("oK")}

    results = batches.proc.run_local([(TP, msgs)])[TP]
    assert [outcome(r) for r in results] == [
        ("succeeded", None), ("replayed", None), ("succeeded", None)]
    assert db.ledger_counts() == {key("oJ"): 1, key("oL"): 1}
    rec = _durable(db.record(key("oK")))
    assert (rec["status"], rec["completed_token"], rec["result_json"]) == (
        "succeeded", theirs[0].token, {"by": "other"})


@pytest.mark.parametrize("theirs_ends", ["commit", "rollback"])
def test_a_key_whose_insert_the_batch_waited_for_is_decided_by_that_transaction(
    db: DB, batches: Batches, theirs_ends: str
) -> None:
    """Another member claims oK after the batch read it (new) and has not committed when
    the batch writes its records: the batch's write (insert or COPY) waits for it. Committed, oK is
    theirs and the batch falls back with nothing of it left; rolled back, the batch
    writes oK itself and nothing falls back."""
    msgs = batches.msgs(("oJ", "1.00"), ("oK", "4.00"), ("oL", "2.00"))
    held: list[Any] = []

    def claim_and_hold() -> None:
        proc = batches.proc
        handler = proc.app.handlers[TOPIC]
        prep = proc.prepare(handler, msgs[1])
        store = Store(schema="kafka_idem", table="task_idempotency",
                      namespace=proc.app.namespace)
        other = connect(db.dsn)
        other.execute("BEGIN")
        claim = store.claim(other, key=prep.key, request_hash=prep.request_hash,
                            delivery=Delivery(TOPIC, 0, 1, handler.name), lease_seconds=60,
                            max_attempts=5, max_elapsed_seconds=3600)
        assert claim.outcome is Outcome.CLAIMED
        held.append((other, claim))

    def waiting() -> Any:  # the batch's backend waits for oK's unfinished insert
        return db.rows("SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                       "AND (query LIKE 'COPY %%' "
                       "     OR query LIKE '%%INSERT INTO%%task_idempotency%%') "
                       "AND datname = current_database()") or None

    seen: list[Any] = []

    def end_once_the_batch_waits() -> None:  # ends the other transaction whatever happens
        try:
            wait_for(lambda: held or None, timeout=30, what="the other member's claim")
            seen.append(wait_for(waiting, timeout=30, what="the batch's write to wait"))
        finally:
            if held:
                other, _claim = held[0]
                other.execute("COMMIT" if theirs_ends == "commit" and seen else "ROLLBACK")
                other.close()

    batches.after_read.append(claim_and_hold)
    ender = threading.Thread(target=end_once_the_batch_waits)
    ender.start()
    try:
        if theirs_ends == "commit":
            with pytest.raises(Fallback, match="written by someone else"):
                run_batch(batches.proc, [(TP, msgs)])
            assert db.ledger_counts() == {}
            rec = _durable(db.record(key("oK")))
            assert (rec["status"], rec["owner_token"]) == ("processing", held[0][1].token)
            assert {r["idempotency_key"] for r in db.records()} == {key("oK")}
        else:
            results = run_batch(batches.proc, [(TP, msgs)])[TP]
            assert [outcome(r) for r in results] == [("succeeded", None)] * 3
            assert db.ledger_counts() == {key(o): 1 for o in ("oJ", "oK", "oL")}
            rec = _durable(db.record(key("oK")))
            assert (rec["status"], rec["attempts"]) == ("succeeded", 1)
            assert rec["completed_token"] != held[0][1].token
    finally:
        ender.join(timeout=60)
    assert not ender.is_alive() and seen  # the write did wait for the other insert


def test_a_bulk_item_rejected_as_permanent_is_failed_without_leaving_the_batch_path(
    db: DB, batches: Batches
) -> None:
    """The bulk handler rejects o2 (a negative amount): o2 is claimed and failed in the
    batch's transaction, dead-lettered once; the others are written succeeded."""
    results = batches.run(("o1", "1.00"), ("o2", "-1.00"), ("o3", "2.00"))
    assert [outcome(r) for r in results] == [
        ("succeeded", None), ("dead_lettered", "permanent"), ("succeeded", None)]
    assert db.ledger_counts() == {key("o1"): 1, key("o3"): 1}
    records = {r["idempotency_key"]: r for r in db.records()}
    assert {k: (r["status"], r["attempts"]) for k, r in records.items()} == {
        key("o1"): ("succeeded", 1), key("o2"): ("failed", 1), key("o3"): ("succeeded", 1)}
    failed = records[key("o2")]
    assert (failed["error_kind"], failed["error_class"], failed["owner_token"]) == (
        "permanent", "Permanent", None)
    # a redelivery of the three: two replays and the failed key dead-lettered again
    again = batches.run(("o1", "1.00"), ("o2", "-1.00"), ("o3", "2.00"))
    assert [outcome(r) for r in again] == [
        ("replayed", None), ("dead_lettered", "permanent"), ("replayed", None)]
    assert db.ledger_counts() == {key("o1"): 1, key("o3"): 1}


def test_a_key_the_bulk_handler_rejects_twice_in_one_batch_stays_on_the_batch_path(
    db: DB, batches: Batches
) -> None:
    """A producer retrying a rejected request: the same key twice (and once more with
    another payload) in one batch. The first occurrence is failed in the batch; the
    next is dead-lettered again as the failed record it met, the third is a conflict,
    as the per-message claim decides them; the batch does not fall back (it did: every
    success of such a batch went message by message)."""
    results = batches.run(("o1", "1.00"), ("o2", "-1.00"), ("o3", "2.00"), ("o2", "-1.00"),
                          ("o2", "-2.00"))
    assert [outcome(r) for r in results] == [
        ("succeeded", None), ("dead_lettered", "permanent"), ("succeeded", None),
        ("dead_lettered", "permanent"), ("conflict", "payload_conflict")]
    assert db.ledger_counts() == {key("o1"): 1, key("o3"): 1}
    records = {r["idempotency_key"]: r for r in db.records()}
    assert {k: (r["status"], r["attempts"]) for k, r in records.items()} == {
        key("o1"): ("succeeded", 1), key("o2"): ("failed", 1), key("o3"): ("succeeded", 1)}
    # the successes were written once each, as succeeded (the batch path's insert)
    assert {records[key(o)]["owner_token"] for o in ("o1", "o3")} == {None}
    assert records[key("o2")]["kafka_offset"] == 3  # the dead letter's delivery moved
    first, again = results[1], results[3]
    assert isinstance(first, Finished) and isinstance(again, Finished)
    assert first.letter is not None and again.letter is not None
    assert (again.letter.attempts, again.letter.error_class, again.letter.error_message) == (
        first.letter.attempts, first.letter.error_class, first.letter.error_message)


@HANDLERS
def test_a_failed_key_met_again_is_dead_lettered_again_on_the_batch_path(
    db: DB, batches: Batches, bulk: bool
) -> None:
    """A redelivery of a failed key is decided in the batch, as the per-message claim
    decides it: dead-lettered again, its failure time and last delivery moved, nothing
    else changed; the batch does not fall back (``batches.run`` would raise)."""
    if not bulk:
        batches.proc.app.handlers[TOPIC].bulk = None
    first = batches.proc.run_local([(TP, batches.msgs(("oF", "-1.00")))])[TP]
    assert [outcome(r) for r in first] == [("dead_lettered", "permanent")]
    before = _durable(db.record(key("oF")))
    assert before["status"] == "failed"

    results = batches.run(("oG", "1.00"), ("oF", "-1.00"), ("oF", "-1.00"))
    assert [outcome(r) for r in results] == [
        ("succeeded", None), ("dead_lettered", "permanent"), ("dead_lettered", "permanent")]
    after = _durable(db.record(key("oF")))
    moved = {"last_failure_at", "updated_at", "kafka_offset"}
    assert {k: v for k, v in after.items() if k not in moved} == {
        k: v for k, v in before.items() if k not in moved}
    assert after["last_failure_at"] > before["last_failure_at"]
    assert after["kafka_offset"] == 3  # the last occurrence's delivery
    for result in results[1:]:
        assert isinstance(result, Finished) and result.letter is not None
        assert result.letter.attempts == before["attempts"]
        assert result.letter.first_failure_at == before["first_failure_at"]
        assert result.letter.error_message == before["error_message"]
    assert db.ledger_counts() == {key("oG"): 1}



def test_a_conflict_says_the_records_attempts_as_the_per_message_path_does(
    db: DB, batches: Batches
) -> None:
    """A key that succeeded at its third attempt (two owners' leases ran out), met with
    another payload: the conflict's dead letter says 3 attempts on the batch path, as
    on the per-message path (it said 1)."""
    proc = batches.proc
    handler = proc.app.handlers[TOPIC]
    (msg,) = batches.msgs(("oR", "4.00"))
    prep = proc.prepare(handler, msg)
    store = Store(schema="kafka_idem", table="task_idempotency",
                  namespace=proc.app.namespace)
    other = connect(db.dsn)
    for attempt in (1, 2, 3):
        with other.transaction():
            claim = store.claim(other, key=prep.key, request_hash=prep.request_hash,
                                delivery=Delivery(TOPIC, 0, 0, handler.name), lease_seconds=60,
                                max_attempts=5, max_elapsed_seconds=3600)
            assert (claim.outcome, claim.attempts) == (Outcome.CLAIMED, attempt)
            if attempt < 3:  # its owner died: the lease runs out
                other.execute("UPDATE kafka_idem.task_idempotency SET lease_until = "
                              "clock_timestamp() - interval '1 second' "
                              "WHERE idempotency_key = %s", (prep.key,))
    with other.transaction():
        assert claim.token is not None
        store.complete(other, key=prep.key, token=claim.token, result={"by": "other"})
    other.close()

    batch = batches.run(("oR", "9.00"))
    alone = proc.run_local_safe([(TP, batches.msgs(("oR", "9.00")))])[TP]
    for result in (batch[0], alone[0]):
        assert outcome(result) == ("conflict", "payload_conflict")
        assert isinstance(result, Finished) and result.letter is not None
        assert result.letter.attempts == 3


def test_two_handlers_sharing_a_name_each_run_their_own_form_in_one_batch(db: DB) -> None:
    """The app's charge handler (with its bulk form) and another topic's handler given
    the same name, in one batch: each topic's messages go to their own handler (they
    were grouped by name: the other topic's went to the bulk form)."""
    other_topic = "claim-order.other-requested"
    proc = processor(db.dsn, TOPIC, "local")
    calls: list[str] = []

    @proc.app.handler(topic=other_topic, model=ChargeRequested,
                      key="{tenant_id}:other:{order_id}", hash_fields=("amount",),
                      format="avro", schema="payments.ChargeRequested", name="charge")
    def other(msg: ChargeRequested, ctx: Context) -> dict[str, str]:
        calls.append(msg.order_id)
        return {"other": msg.order_id}

    try:
        mine = [FakeMessage(TOPIC, offset=i, key=o.encode(), value=encode_charge("t1", o, "1.00"))
                for i, o in enumerate(("o1", "o2"))]
        theirs = [FakeMessage(other_topic, offset=0, key=b"o3",
                              value=encode_charge("t1", "o3", "1.00"))]
        results = run_batch(proc, [(TP, mine), ((other_topic, 0), theirs)])
        assert [outcome(r) for rs in results.values() for r in rs] == [("succeeded", None)] * 3
        assert calls == ["o3"]
        assert db.ledger_counts() == {key("o1"): 1, key("o2"): 1}
        assert {r["idempotency_key"]: r["result_json"] for r in db.records()
                if r["idempotency_key"] == "t1:other:o3"} == {"t1:other:o3": {"other": "o3"}}
    finally:
        proc.close()
