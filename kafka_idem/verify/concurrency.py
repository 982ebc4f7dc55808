"""Scenarios 1 and 2: the same key, concurrently.

1. N spawned processes, released by a barrier, each run the real Processor (leased
   mode, the winner holding its claim for a while) on the same message.
2. Three ``kafka-idem run`` members, one partition each, get the same key with three
   different payloads at once; the conflicts go through the runner to the DLQ.
"""

from __future__ import annotations

import multiprocessing as mp
from collections import Counter
from decimal import Decimal
from typing import Any

from kafka_idem.keys import request_hash
from kafka_idem.verify.app import encode, key_of
from kafka_idem.verify.kafka import headers, wait_for
from kafka_idem.verify.report import Outcome
from kafka_idem.verify.workers import race_one
from kafka_idem.verify.workspace import TABLE, Workspace

RACERS = 6
HOLD = 0.6  # the winner holds its claim this long (< the lease): the others meet it
LEASE = 1.5


def race(ws: Workspace, values: list[bytes], *, mode: str) -> list[dict[str, Any]]:
    """One spawned process per value, released together; their reports."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(values))
    queue = ctx.Queue()
    conf = {"dsn": ws.dsn, "bootstrap": ws.settings.bootstrap_servers, "topic": ws.topic,
            "store_schema": ws.store_schema, "biz_schema": ws.biz_schema, "table": TABLE,
            "distributed": ws.distributed,
            "mode": mode, "hold": HOLD, "lease": LEASE, "group": ws.group}
    procs = [ctx.Process(target=race_one, args=(conf, value, i, barrier, queue), daemon=True)
             for i, value in enumerate(values)]
    for p in procs:
        p.start()
    try:
        return [queue.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()  # only our own child, by its pid
                p.join(10)


def concurrent_duplicates(ws: Workspace, out: Outcome) -> None:
    ws.setup_db()
    key = key_of("t1", "o1")
    value = encode("t1", "o1", "10.00")
    results = race(ws, [value] * RACERS, mode="leased")
    outcomes = Counter(r["result"] for r in results)
    rec = ws.record(key)
    rows = ws.ledger(key)
    tokens = ws.tokens(key)
    calls = ws.calls(key, "start")
    out.figure(processes=RACERS, outcomes=dict(outcomes), records=ws.status_counts(),
               tokens_seen=len(tokens), attempts=rec["attempts"] if rec else None,
               handler_calls=len(calls), business_rows=len(rows))
    errors = [r.get("error") for r in results if r["result"] == "error"]
    out.check(f"{RACERS} processes released by one barrier all answered",
              len(results) == RACERS and not errors, errors)
    out.check("exactly one executor succeeded", outcomes["succeeded"] == 1, dict(outcomes))
    out.check("the others got busy or the stored result",
              set(outcomes) <= {"succeeded", "busy", "replayed"}, dict(outcomes))
    out.check("contention was real: the winner's live lease was met (busy >= 1)",
              outcomes["busy"] >= 1, dict(outcomes))
    out.check("the handler ran once (one call, one token ever claimed)",
              len(calls) == 1 and len(tokens) == 1, f"calls={len(calls)} tokens={len(tokens)}")
    out.check("one business row", len(rows) == 1, len(rows))
    out.check("record succeeded, attempts 1",
              rec is not None and rec["status"] == "succeeded" and rec["attempts"] == 1,
              rec and (rec["status"], rec["attempts"]))
    out.check("stored result is the effect's",
              rec is not None and rec["result_json"] == {"order_id": "o1", "amount": "10.00",
                                                         "currency": "EUR"},
              rec and rec["result_json"])


def payload_conflict(ws: Workspace, out: Outcome) -> None:
    ws.setup_db()
    n = 3
    ws.setup_topics(partitions=n)
    key = key_of("t1", "o1")
    config = ws.config(mode="leased", slow_seconds=1.0)
    for _ in range(n):
        ws.start(config)
    assignment = wait_for(
        lambda: (a := ws.kafka.assignment(ws.group)) and len(a) == n and all(a) and a,
        timeout=60, what=f"{n} members to own one partition each")
    amounts = ["10.00", "20.00", "30.00"]
    sent = ws.kafka.produce(ws.topic, [(b"o1", encode("t1", "o1", a), p)
                                       for p, a in enumerate(amounts)])
    wait_for(lambda: ws.kafka.caught_up(ws.group, ws.topic), timeout=60,
             what="every intent to be decided and its offset committed")
    letters = ws.dlq_records()
    rec = ws.record(key)
    rows = ws.ledger(key)
    tokens = ws.tokens(key)
    kinds = Counter(headers(m).get("idem.error.kind") for m in letters)
    out.figure(members=len(assignment), partitions_per_member=assignment,
               records=ws.status_counts(), stored_hash=rec and rec["request_hash"][:24] + "...",
               tokens_seen=len(tokens), attempts=rec and rec["attempts"],
               business_rows=len(rows), dlq_records=dict(kinds) or 0,
               committed=ws.kafka.committed(ws.group, ws.topic))
    if not out.check("one business row", len(rows) == 1, len(rows)):
        return
    winner = rows[0]["amount"]
    out.figure(winner_amount=str(winner))
    want = request_hash({"amount": Decimal(winner), "currency": "EUR"})
    out.check("record succeeded once (attempts 1, one token ever claimed)",
              rec is not None and rec["status"] == "succeeded" and rec["attempts"] == 1
              and len(tokens) == 1, rec and (rec["status"], rec["attempts"], len(tokens)))
    out.check("the stored request hash is the winner's",
              rec is not None and rec["request_hash"] == want)
    out.check("stored result is the winner's",
              rec is not None and rec["result_json"].get("amount") == f"{winner:.2f}")
    losers = {s.value for s in sent if Decimal(amounts[s.partition]) != winner}
    out.check(f"{n - 1} conflicts dead-lettered as payload_conflict",
              len(letters) == n - 1 and kinds == Counter({"payload_conflict": n - 1}),
              dict(kinds))
    out.check("DLQ records carry the key and the losers' bytes unchanged",
              {m.value() for m in letters} == losers
              and all(headers(m).get("idem.key") == key for m in letters))
