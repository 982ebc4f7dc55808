"""Scenario 6: retry limits and permanent errors.

One member, a small retry budget: intent ``r1`` fails with a transient error on every
attempt (after its business write), ``p1`` with a permanent one. Read back: every
committed state of the record (a history trigger in the scenario's own schema), the
jittered delays the store scheduled and when each retry really came, the final error,
the DLQ records and all their headers, and the member's /metrics.
"""

from __future__ import annotations

import datetime as dt
import itertools
from typing import Any

from kafka_idem.dlq import REQUIRED_HEADERS
from kafka_idem.retry import RetryPolicy
from kafka_idem.verify.app import HANDLER, encode, key_of
from kafka_idem.verify.kafka import Sent, headers, wait_for
from kafka_idem.verify.report import Outcome
from kafka_idem.verify.workspace import Workspace

MAX_ATTEMPTS = 4
BASE, CAP = 0.25, 5.0
EPSILON = 0.005  # timestamp rounding (microseconds in PostgreSQL, milliseconds in headers)


def _letter_problems(letter: Any, source: Sent, rec: dict[str, Any], *, kind: str,
                     attempts: int, group: str, key: str) -> list[str]:
    """Everything wrong with one DLQ record against its source and its record."""
    h = headers(letter)
    problems = [f"missing {n}" for n in (*REQUIRED_HEADERS, "idem.key") if n not in h]
    if problems:
        return problems
    want = {
        "idem.original.topic": source.topic,
        "idem.original.partition": str(source.partition),
        "idem.original.offset": str(source.offset),
        "idem.error.kind": kind,
        "idem.error.class": rec["error_class"],
        "idem.error.message": rec["error_message"],
        "idem.attempts": str(attempts),
        "idem.consumer_group": group,
        "idem.handler": HANDLER,
        "idem.key": key,
    }
    problems += [f"{k}={h[k]!r}, want {v!r}" for k, v in want.items() if h[k] != v]
    if letter.key() != source.key or letter.value() != source.value:
        problems.append("key/value bytes differ from the source record")
    for name, column in (("idem.first_failure_at", "first_failure_at"),
                         ("idem.last_failure_at", "last_failure_at")):
        got = dt.datetime.fromisoformat(h[name])
        if abs((got - rec[column]).total_seconds()) > EPSILON:
            problems.append(f"{name}={h[name]} but the record says {rec[column].isoformat()}")
    if int(h["idem.original.timestamp"]) <= 0:
        problems.append("no original timestamp")
    return problems


def _retry_claims(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first committed state of each claim after the first (a new owner token)."""
    seen: set[Any] = set()
    out = []
    for h in history:
        if h["status"] == "processing" and h["owner_token"] not in seen:
            seen.add(h["owner_token"])
            if h["attempts"] > 1:
                out.append(h)
    return out


def retry_limits(ws: Workspace, out: Outcome) -> None:
    ws.setup_db()
    ws.setup_topics(partitions=2)
    transient, permanent = key_of("t1", "r1"), key_of("t1", "p1")
    config = ws.config(retryable_orders=frozenset({"r1"}), retryable_attempts=1000,
                       permanent_orders=frozenset({"p1"}))
    member = ws.start(config, MAX_ATTEMPTS=str(MAX_ATTEMPTS), BACKOFF_BASE_SECONDS=str(BASE),
                      BACKOFF_CAP_SECONDS=str(CAP))
    sent = ws.kafka.produce(ws.topic, [(b"r1", encode("t1", "r1", "3.00"), 0),
                                       (b"p1", encode("t1", "p1", "4.00"), 1)])
    src = {s.key: s for s in sent}
    wait_for(lambda: ws.kafka.caught_up(ws.group, ws.topic), timeout=60,
             what="both intents to be dead-lettered and committed")
    metrics = {
        "exhausted_total": member.metric("kafka_idem_exhausted_total"),
        "retries_total": member.metric("kafka_idem_retries_total"),
        "dead_lettered_exhausted": member.metric("kafka_idem_dead_lettered_total",
                                                 kind="exhausted"),
        "dead_lettered_permanent": member.metric("kafka_idem_dead_lettered_total",
                                                 kind="permanent"),
    }
    records = ws.dlq_records()
    letters = {headers(m).get("idem.key"): m for m in records}
    n_letters = len(records)
    rec, prec = ws.record(transient), ws.record(permanent)
    history = ws.history(transient)
    claims = _retry_claims(history)
    fails = [h for h in history if h["status"] == "retryable_failed"]
    policy = RetryPolicy(base=BASE, cap=CAP, max_attempts=MAX_ATTEMPTS)
    delays = [(f["next_attempt_at"] - f["last_failure_at"]).total_seconds() for f in fails]
    bounds = [policy.bound(f["attempts"]) for f in fails]
    waited = [(c["updated_at"] - f["last_failure_at"]).total_seconds()
              for f, c in zip(fails, claims, strict=False)]
    early = [c["attempts"] for f, c in zip(fails, claims, strict=False)
             if c["updated_at"] < f["next_attempt_at"]]
    pclaims = {h["owner_token"] for h in ws.history(permanent) if h["status"] == "processing"}
    out.figure(records=ws.status_counts(), attempts=rec and rec["attempts"],
               retry_delays_s=[round(d, 3) for d in delays],
               delay_bounds_s=bounds, retry_waited_s=[round(w, 3) for w in waited],
               last_error=rec and f"{rec['error_kind']}/{rec['error_class']}: "
                                  f"{rec['error_message']}",
               permanent=prec and f"{prec['status']}/{prec['error_kind']} "
                                  f"attempts={prec['attempts']}",
               business_rows=len(ws.ledger()), dlq_records=n_letters, metrics=metrics)

    out.check(f"transient failures retried: failures on attempts 1..{MAX_ATTEMPTS - 1}",
              [f["attempts"] for f in fails] == list(range(1, MAX_ATTEMPTS)),
              [f["attempts"] for f in fails])
    out.check("delays jittered (full jitter) within growing bounds",
              len(delays) == MAX_ATTEMPTS - 1
              and all(-EPSILON <= d <= b + EPSILON for d, b in zip(delays, bounds, strict=True))
              and all(x < y for x, y in itertools.pairwise(bounds))
              and any(d < 0.98 * b for d, b in zip(delays, bounds, strict=True))
              and len(set(delays)) == len(delays),
              f"delays={[round(d, 3) for d in delays]} bounds={bounds}")
    out.check("no retry came before its scheduled time",
              len(claims) == MAX_ATTEMPTS - 1 and not early, f"early={early}")
    out.check(f"stopped at the limit: failed/exhausted, attempts == {MAX_ATTEMPTS}",
              rec is not None and rec["status"] == "failed" and rec["error_kind"] == "exhausted"
              and rec["attempts"] == MAX_ATTEMPTS and rec["next_attempt_at"] is None,
              rec and (rec["status"], rec["error_kind"], rec["attempts"]))
    out.check("the last error is recorded",
              rec is not None and rec["error_class"] == "Retryable"
              and f"attempt {MAX_ATTEMPTS}" in (rec["error_message"] or ""),
              rec and rec["error_message"])
    ok = rec is not None and transient in letters
    problems = _letter_problems(letters[transient], src[b"r1"], rec, kind="exhausted",
                                attempts=MAX_ATTEMPTS, group=ws.group,
                                key=transient) if ok and rec else ["no DLQ record"]
    out.check("one DLQ record with full metadata (all idem.* headers, bytes unchanged)",
              not problems and n_letters == 2, "; ".join(problems))
    out.check("alert metric raised (/metrics: kafka_idem_exhausted_total >= 1)",
              metrics["exhausted_total"] >= 1 and metrics["dead_lettered_exhausted"] >= 1,
              metrics)
    out.check("permanent error: failed at once (attempts 1, one claim, never retried)",
              prec is not None and prec["status"] == "failed"
              and prec["error_kind"] == "permanent" and prec["attempts"] == 1
              and len(pclaims) == 1, prec and (prec["status"], prec["attempts"]))
    pproblems = _letter_problems(letters[permanent], src[b"p1"], prec, kind="permanent",
                                 attempts=1, group=ws.group, key=permanent) \
        if prec is not None and permanent in letters else ["no DLQ record"]
    out.check("permanent error dead-lettered with full metadata",
              not pproblems and metrics["dead_lettered_permanent"] >= 1, "; ".join(pproblems))
    out.check("no business effect from either (writes rolled back)", not ws.ledger(),
              len(ws.ledger()))
