"""Scenario 3: repeat after success. A member processes an intent; the same intent is
sent again (a new request id, as a producer retry or an upstream re-send would); the
stored result is replayed and nothing durable changes."""

from __future__ import annotations

from typing import Any

from kafka_idem.store import Delivery, Outcome, connect
from kafka_idem.verify.app import HANDLER, encode, key_of
from kafka_idem.verify.kafka import wait_for
from kafka_idem.verify.report import Outcome as Result
from kafka_idem.verify.workspace import Workspace


def _durable(rec: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if rec is None else {k: v for k, v in rec.items() if k != "db_now"}


def repeat_after_success(ws: Workspace, out: Result) -> None:
    ws.setup_db()
    ws.setup_topics(partitions=1)
    key = key_of("t1", "o1")
    member = ws.start(ws.config())
    first = ws.kafka.produce(ws.topic, [(b"o1", encode("t1", "o1", "25.00",
                                                       request_id="req-1"), None)])
    wait_for(lambda: ws.kafka.caught_up(ws.group, ws.topic), timeout=60,
             what="the first intent to be processed and committed")
    before = _durable(ws.record(key))
    rows_before = ws.ledger(key)
    history_before = len(ws.history(key))

    again = ws.kafka.produce(ws.topic, [(b"o1", encode("t1", "o1", "25.00",
                                                       request_id="req-2"), None)])
    wait_for(lambda: ws.kafka.caught_up(ws.group, ws.topic), timeout=60,
             what="the repeated intent to be committed")
    after = _durable(ws.record(key))
    rows_after = ws.ledger(key)
    history_after = len(ws.history(key))
    replayed = member.metric("kafka_idem_messages_total", outcome="replayed")

    # What the protocol answers a duplicate: the stored result, with no write.
    conn = connect(ws.dsn)
    try:
        with conn.transaction():
            claim = ws.store.claim(
                conn, key=key, request_hash=(before or {}).get("request_hash", ""),
                delivery=Delivery(ws.topic, 0, again[0].offset, HANDLER), lease_seconds=1.5,
                max_attempts=5, max_elapsed_seconds=3600)
    finally:
        conn.close()
    unchanged_by_claim = _durable(ws.record(key)) == before

    out.figure(records=ws.status_counts(), attempts=after and after["attempts"],
               updated_at=after and after["updated_at"].isoformat(),
               business_rows=len(rows_after), record_writes=history_after,
               handler_calls=len(ws.calls(key, "start")), replayed_metric=replayed,
               committed=ws.kafka.committed(ws.group, ws.topic))
    out.check("first intent: record succeeded, attempts 1, one business row",
              before is not None and before["status"] == "succeeded"
              and before["attempts"] == 1 and len(rows_before) == 1)
    out.check("the re-sent intent is a new message (new request id, same key and hash)",
              first[0].value != again[0].value and again[0].offset == first[0].offset + 1)
    out.check("its offset was committed (decided, not stuck)",
              ws.kafka.committed(ws.group, ws.topic).get(0) == again[0].offset + 1)
    out.check("record unchanged (status, result, attempts, updated_at, tokens)",
              after == before, "differs" if after != before else "")
    out.check("no write to the record at all (history unchanged)",
              history_after == history_before, f"{history_before} -> {history_after}")
    out.check("business rows unchanged (same single row)",
              [r["id"] for r in rows_after] == [r["id"] for r in rows_before],
              f"{len(rows_before)} -> {len(rows_after)}")
    out.check("the handler ran once", len(ws.calls(key, "start")) == 1)
    out.check("the member counted it replayed (/metrics)", replayed >= 1, replayed)
    out.check("a duplicate's claim answers replay with the stored result, writing nothing",
              claim.outcome is Outcome.REPLAY and before is not None
              and claim.result == before["result_json"] and unchanged_by_claim,
              claim.outcome.value)
