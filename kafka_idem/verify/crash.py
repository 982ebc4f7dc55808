"""Scenario 5: a crash after the business write, before the success state.

5a (local effects): a member SIGKILLs itself right after its business write; the
   transaction that held the write and the claim is aborted (its txid's status says
   so), nothing of it remains, and a replacement makes exactly one effect.
5b (remote effect): the example payment gateway applies the charge and drops the
   response; the handler sees an unknown outcome; the next attempt reconciles by
   idempotency key instead of charging again.
"""

from __future__ import annotations

import importlib
import urllib.parse
from pathlib import Path
from typing import Any

from kafka_idem.verify.app import encode, key_of
from kafka_idem.verify.kafka import wait_for
from kafka_idem.verify.report import Outcome
from kafka_idem.verify.workspace import Workspace


def crash_after_local_write(ws: Workspace, out: Outcome) -> None:
    ws.setup_db()
    ws.setup_topics(partitions=1)
    orders = ["o1", "o2", "o3"]
    victim = key_of("t1", "o2")
    ws.kafka.produce(ws.topic, [(o.encode(), encode("t1", o, "2.00"), None) for o in orders])
    killer = ws.start(ws.config(kill_orders=frozenset({"o2"})))
    status = killer.proc.wait(timeout=60)
    (trace,) = wait_for(lambda: ws.calls(victim, "killed_after_write"), timeout=10,
                        what="the killed attempt's trace")
    xact = wait_for(
        lambda: (s := ws.value("SELECT txid_status(%s)", (trace["txid"],))) != "in progress" and s,
        timeout=30, what="the killed transaction to end")
    rows_after_kill = len(ws.ledger(victim))
    rec_after_kill = ws.record(victim)
    committed_after_kill = ws.kafka.committed(ws.group, ws.topic).get(0, -1)

    ws.start(ws.config())  # the replacement, without the fault
    wait_for(lambda: ws.kafka.caught_up(ws.group, ws.topic), timeout=90,
             what="the replacement to process and commit everything")
    rec = ws.record(victim)
    per_key = {o: len(ws.ledger(key_of("t1", o))) for o in orders}
    out.figure(killed_exit_status=status, killed_txid=trace["txid"], killed_txid_status=xact,
               rows_visible_in_killed_tx=trace["visible_rows"],
               after_kill=f"rows={rows_after_kill} record={rec_after_kill and 'present'} "
                          f"committed={committed_after_kill}",
               records=ws.status_counts(), attempts=rec and rec["attempts"],
               business_rows=per_key, handler_calls=len(ws.calls(victim, "start")))
    out.check("the member was SIGKILLed right after its business write",
              status == -9 and trace["visible_rows"] == 1,
              f"status={status} rows visible in its transaction={trace['visible_rows']}")
    out.check("that transaction was aborted (txid_status)", xact == "aborted", xact)
    out.check("both rolled back: no business row, no record for the key",
              rows_after_kill == 0 and rec_after_kill is None,
              f"rows={rows_after_kill} record={rec_after_kill and rec_after_kill['status']}")
    out.check("its offset was not committed", committed_after_kill <= 1, committed_after_kill)
    out.check("after the replacement: one effect per intent",
              per_key == dict.fromkeys(orders, 1), per_key)
    out.check("record succeeded (attempts 1: the killed attempt left nothing)",
              rec is not None and rec["status"] == "succeeded" and rec["attempts"] == 1,
              rec and (rec["status"], rec["attempts"]))


def gateway_module() -> Any:
    """``consumers.gateway`` from the path (``kafka-idem`` put the current directory on
    it: :func:`kafka_idem.cli.common.importable_cwd`); ImportError if absent."""
    return importlib.import_module("consumers.gateway")


def crash_after_remote_write(ws: Workspace, out: Outcome) -> None:
    try:
        gw_mod = gateway_module()
        gateway_cls = gw_mod.Gateway
    except (ImportError, AttributeError) as exc:
        out.skipped = (f"the example gateway (consumers.gateway) is not importable: {exc}; "
                       "run verify from a kafka_idem repository checkout to include 5b")
        return
    ws.pythonpath.append(str(Path(gw_mod.__file__).resolve().parent.parent))
    ws.setup_db()
    ws.setup_topics(partitions=1)
    key = key_of("t1", "o1")
    with gateway_cls() as gw:
        gw.faults(drop_after_apply=1)  # applied, then the connection closed unanswered
        ws.kafka.produce(ws.topic, [(b"o1", encode("t1", "o1", "12.50"), None)])
        ws.start(ws.config(gateway_url=gw.url, gateway_timeout=2.0))
        wait_for(lambda: ws.kafka.caught_up(ws.group, ws.topic), timeout=90,
                 what="the charge to be reconciled and committed")
        charges = [c for c in gw.charges() if c["idempotency_key"] == key]
        posts = gw.requests("POST", key=key)
        gets = gw.requests("GET", path="/charges/" + urllib.parse.quote(key, safe=""))
    rec = ws.record(key)
    rows = ws.ledger(key)
    failures = [h for h in ws.history(key) if h["status"] == "retryable_failed"]
    letters = ws.dlq_records()
    out.figure(gateway_url=gw.url, remote_charges=len(charges), charge_posts=len(posts),
               reconcile_lookups=len(gets), records=ws.status_counts(),
               attempts=rec and rec["attempts"], tokens_seen=len(ws.tokens(key)),
               failures=[f"{h['attempts']}:{h['error_kind']}" for h in failures],
               business_rows=len(rows), dlq_records=len(letters))
    out.check("attempt 1: the charge was applied, the answer lost: unknown outcome recorded",
              [(h["attempts"], h["error_kind"]) for h in failures] == [(1, "unknown_outcome")],
              [(h["attempts"], h["error_kind"]) for h in failures])
    out.check("attempt 2 reconciled by key (one lookup, the charge was not sent again)",
              len(gets) == 1 and len(posts) == 1
              and len(ws.calls(key, "reconciled")) == 1,
              f"lookups={len(gets)} posts={len(posts)}")
    out.check("exactly one remote charge", len(charges) == 1, len(charges))
    charge_id = charges[0]["id"] if charges else None
    out.check("one local success record, attempts 2, naming that charge",
              rec is not None and rec["status"] == "succeeded" and rec["attempts"] == 2
              and rec["result_json"].get("charge_id") == charge_id,
              rec and (rec["status"], rec["attempts"]))
    out.check("one local business row for that charge",
              [r["charge_id"] for r in rows] == [charge_id], [r["charge_id"] for r in rows])
    out.check("nothing dead-lettered", not letters, len(letters))
