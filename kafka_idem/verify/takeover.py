"""Scenario 4: a member SIGKILLed after its claim. Its lease expires by the database
clock, a new member reclaims with a new token (attempts 2) and finishes; and, shown
with the store API, the old token's completion is refused and its business write rolls
back with it."""

from __future__ import annotations

from typing import Any

from psycopg import sql

from kafka_idem.errors import StaleOwner
from kafka_idem.keys import request_hash
from kafka_idem.store import Delivery, Outcome, connect
from kafka_idem.verify.app import HANDLER, encode, key_of
from kafka_idem.verify.kafka import wait_for
from kafka_idem.verify.report import Outcome as Result
from kafka_idem.verify.workspace import TABLE, Workspace


def _expired(ws: Workspace, key: str, token: Any) -> bool:
    return bool(ws.value(
        sql.SQL("SELECT lease_until < clock_timestamp() FROM {} WHERE idempotency_key = %s "
                "AND status = 'processing' AND owner_token = %s")
        .format(sql.Identifier(ws.store_schema, TABLE)), (key, token)))


def _fence_with_the_store_api(ws: Workspace, out: Result) -> None:
    key = key_of("t1", "fence")
    h = request_hash({"amount": "1.00", "currency": "EUR"})
    ledger = sql.Identifier(ws.biz_schema, "ledger")

    def claim(conn: Any, lease: float) -> Any:
        with conn.transaction():
            return ws.store.claim(conn, key=key, request_hash=h,
                                  delivery=Delivery(ws.topic, 0, 0, HANDLER), lease_seconds=lease,
                                  max_attempts=5, max_elapsed_seconds=3600)

    def write_and_complete(conn: Any, token: Any, who: str) -> None:
        with conn.transaction():
            conn.execute(sql.SQL("INSERT INTO {} (idempotency_key, order_id, amount, currency, "
                                 "charge_id, pid, attempt) VALUES (%s, 'fence', 1, 'EUR', %s, "
                                 "pg_backend_pid(), 0)").format(ledger), (key, who))
            ws.store.complete(conn, key=key, token=token, result={"by": who})

    a_conn, b_conn = connect(ws.dsn), connect(ws.dsn)
    try:
        a = claim(a_conn, 1.0)
        early = claim(b_conn, 30)
        wait_for(lambda: _expired(ws, key, a.token), timeout=30,
                 what="token A's lease to expire by the database clock")
        b = claim(b_conn, 30)
        try:
            write_and_complete(a_conn, a.token, "A")
            refused = "no: A completed"
        except StaleOwner:
            refused = "StaleOwner"
        rows_a = [r for r in ws.ledger(key) if r["charge_id"] == "A"]
        write_and_complete(b_conn, b.token, "B")
    finally:
        a_conn.close()
        b_conn.close()
    rec = ws.record(key)
    out.figure(api_tokens={"A": str(a.token), "B": str(b.token)},
               api_attempts=rec and rec["attempts"], api_rows_from_a=len(rows_a),
               api_rows=len(ws.ledger(key)))
    out.check("store API: while A's lease is live another claim is busy",
              early.outcome is Outcome.BUSY, early.outcome.value)
    out.check("store API: after expiry B takes over (new token, attempts 2)",
              b.outcome is Outcome.CLAIMED and b.took_over and b.token != a.token
              and b.attempts == 2, (b.outcome.value, b.attempts))
    out.check("store API: A's write + completion in one transaction is refused (StaleOwner)",
              refused == "StaleOwner", refused)
    out.check("store API: A's business write rolled back (0 rows from A)", not rows_a,
              len(rows_a))
    out.check("store API: B completes; record names B's token",
              rec is not None and rec["status"] == "succeeded"
              and rec["completed_token"] == b.token and rec["result_json"] == {"by": "B"})


def sigkill_after_claim(ws: Workspace, out: Result) -> None:
    ws.setup_db()
    _fence_with_the_store_api(ws, out)

    ws.setup_topics(partitions=1)
    key = key_of("t1", "o1")
    ws.kafka.produce(ws.topic, [(b"o1", encode("t1", "o1", "5.00"), None)])
    slow = ws.config(mode="leased", slow_seconds=600, slow_attempts=1)
    first = ws.start(slow)
    claimed = wait_for(lambda: (r := ws.record(key)) and r["status"] == "processing" and r,
                       timeout=60, what="the first member to claim")
    token_a = claimed["owner_token"]
    wait_for(lambda: ws.calls(key, "start"), timeout=30,
             what="the first member's handler to run (business write made, uncommitted)")
    wait_for(lambda: len([h for h in ws.history(key) if h["owner_token"] == token_a]) >= 2,
             timeout=30, what="a heartbeat to extend the first member's lease")
    status = first.kill()
    wait_for(lambda: _expired(ws, key, token_a), timeout=30,
             what="the killed member's lease to expire by the database clock")
    expired_at = ws.value("SELECT clock_timestamp()")
    second = ws.start(slow)  # same fault hooks: only attempt 1 is slowed
    wait_for(lambda: ws.kafka.caught_up(ws.group, ws.topic), timeout=90,
             what="the new member to reclaim, finish and commit")
    rec = ws.record(key)
    tokens = ws.tokens(key)
    rows = ws.ledger(key)
    history = ws.history(key)
    held = [h for h in history if h["owner_token"] == token_a]
    lease_a = held[-1]["lease_until"] if held else None
    taken = [h for h in history if len(tokens) > 1 and h["owner_token"] == tokens[1]]
    reclaimed_at = taken[0]["updated_at"] if taken else None
    out.figure(records=ws.status_counts(), record=rec and rec["status"],
               tokens_seen=[str(t) for t in tokens],
               first_owner_token=str(token_a),
               completed_token=rec and str(rec["completed_token"]),
               attempts=rec and rec["attempts"], business_rows=len(rows),
               killed_exit_status=status,
               killed_lease_until=lease_a and lease_a.isoformat(),
               killed_heartbeats=max(len(held) - 1, 0),
               expired_seen_at=expired_at.isoformat(),
               reclaimed_at=reclaimed_at and reclaimed_at.isoformat(),
               handler_calls=len(ws.calls(key, "start")))
    out.check("member 1 claimed (attempts 1), its heartbeat kept the lease, then SIGKILL "
              "in its handler", claimed["attempts"] == 1 and len(held) >= 2 and status == -9,
              f"heartbeats={len(held) - 1} exit={status}")
    out.check("its lease expired by the database clock before the reclaim",
              lease_a is not None and reclaimed_at is not None
              and lease_a < expired_at and lease_a <= reclaimed_at,
              f"lease_until={lease_a} reclaimed_at={reclaimed_at}")
    out.check("a new member reclaimed with a new token: two tokens seen",
              len(tokens) == 2 and tokens[0] == token_a and tokens[1] != token_a,
              [str(t) for t in tokens])
    out.check("the record completed with the new token, attempts 2",
              rec is not None and rec["status"] == "succeeded" and rec["attempts"] == 2
              and rec["completed_token"] == tokens[-1] != token_a,
              rec and (rec["status"], rec["attempts"]))
    out.check("one business row, written by the new member (none from the killed one)",
              len(rows) == 1 and rows[0]["pid"] == second.pid and rows[0]["attempt"] == 2,
              [(r["pid"], r["attempt"]) for r in rows])
