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
from dataclasses import dataclass
from typing import Any

from kafka_idem.deadletters.dead_letter import REQUIRED_HEADERS
from kafka_idem.retry import RetryPolicy
from kafka_idem.verify.app import HANDLER, encode, key_of
from kafka_idem.verify.kafka import Sent, headers, wait_for
from kafka_idem.verify.report import Outcome
from kafka_idem.verify.workspace import Member, Workspace

MAX_ATTEMPTS = 4
BASE, CAP = 0.25, 5.0
EPSILON = 0.005  # timestamp rounding (microseconds in PostgreSQL, milliseconds in headers)
TRANSIENT, PERMANENT = key_of("t1", "r1"), key_of("t1", "p1")  # the two intents' keys


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


@dataclass
class _Retries:
    """What the record's history shows of ``r1``'s retries: the failed attempts, the
    claims after the first, the delays the store scheduled (and their bounds), how long
    each retry really waited, and the attempts claimed before their time."""

    fails: list[dict[str, Any]]
    claims: list[dict[str, Any]]
    delays: list[float]
    bounds: list[float]
    waited: list[float]
    early: list[Any]


def _retries(history: list[dict[str, Any]]) -> _Retries:
    claims = _retry_claims(history)
    fails = [h for h in history if h["status"] == "retryable_failed"]
    policy = RetryPolicy(base=BASE, cap=CAP, max_attempts=MAX_ATTEMPTS)
    delays = [(f["next_attempt_at"] - f["last_failure_at"]).total_seconds() for f in fails]
    bounds = [policy.bound(f["attempts"]) for f in fails]
    waited = [(c["updated_at"] - f["last_failure_at"]).total_seconds()
              for f, c in zip(fails, claims, strict=False)]
    early = [c["attempts"] for f, c in zip(fails, claims, strict=False)
             if c["updated_at"] < f["next_attempt_at"]]
    return _Retries(fails, claims, delays, bounds, waited, early)


def _fail_both(ws: Workspace) -> tuple[Member, dict[bytes | None, Sent]]:
    """One member, a small retry budget: ``r1`` fails transiently on every attempt,
    ``p1`` permanently; wait until both are dead-lettered and committed. Returns the
    member and the records sent, by key."""
    ws.setup_db()
    ws.setup_topics(partitions=2)
    config = ws.config(retryable_orders=frozenset({"r1"}), retryable_attempts=1000,
                       permanent_orders=frozenset({"p1"}))
    member = ws.start(config, MAX_ATTEMPTS=str(MAX_ATTEMPTS), BACKOFF_BASE_SECONDS=str(BASE),
                      BACKOFF_CAP_SECONDS=str(CAP))
    sent = ws.kafka.produce(ws.topic, [(b"r1", encode("t1", "r1", "3.00"), 0),
                                       (b"p1", encode("t1", "p1", "4.00"), 1)])
    wait_for(lambda: ws.kafka.caught_up(ws.group, ws.topic), timeout=60,
             what="both intents to be dead-lettered and committed")
    return member, {s.key: s for s in sent}


def _metrics(member: Member) -> dict[str, float]:
    """The member's retry and dead-letter counters, scraped from /metrics."""
    return {
        "exhausted_total": member.metric("kafka_idem_exhausted_total"),
        "retries_total": member.metric("kafka_idem_retries_total"),
        "dead_lettered_exhausted": member.metric("kafka_idem_dead_lettered_total",
                                                 kind="exhausted"),
        "dead_lettered_permanent": member.metric("kafka_idem_dead_lettered_total",
                                                 kind="permanent"),
    }


def _check_retries(out: Outcome, r: _Retries) -> None:
    """The transient failures were retried, each after a jittered delay within its
    growing bound, and never before their time."""
    out.check(f"transient failures retried: failures on attempts 1..{MAX_ATTEMPTS - 1}",
              [f["attempts"] for f in r.fails] == list(range(1, MAX_ATTEMPTS)),
              [f["attempts"] for f in r.fails])
    out.check("delays jittered (full jitter) within growing bounds",
              len(r.delays) == MAX_ATTEMPTS - 1
              and all(-EPSILON <= d <= b + EPSILON
                      for d, b in zip(r.delays, r.bounds, strict=True))
              and all(x < y for x, y in itertools.pairwise(r.bounds))
              and any(d < 0.98 * b for d, b in zip(r.delays, r.bounds, strict=True))
              and len(set(r.delays)) == len(r.delays),
              f"delays={[round(d, 3) for d in r.delays]} bounds={r.bounds}")
    out.check("no retry came before its scheduled time",
              len(r.claims) == MAX_ATTEMPTS - 1 and not r.early, f"early={r.early}")


@dataclass
class _Seen:
    """Everything read back once both intents were dead-lettered."""

    src: dict[bytes | None, Sent]  # the records sent, by key
    metrics: dict[str, float]
    letters: dict[Any, Any]  # the DLQ records, by their idem.key header
    n_letters: int
    rec: dict[str, Any] | None  # r1's record
    prec: dict[str, Any] | None  # p1's record
    retries: _Retries
    pclaims: set[Any]  # p1's owner tokens


def _read_back(ws: Workspace, member: Member, src: dict[bytes | None, Sent]) -> _Seen:
    metrics = _metrics(member)
    records = ws.dlq_records()
    letters = {headers(m).get("idem.key"): m for m in records}
    rec, prec = ws.record(TRANSIENT), ws.record(PERMANENT)
    retries = _retries(ws.history(TRANSIENT))
    pclaims = {h["owner_token"] for h in ws.history(PERMANENT) if h["status"] == "processing"}
    return _Seen(src, metrics, letters, len(records), rec, prec, retries, pclaims)


def _check_exhausted(ws: Workspace, out: Outcome, seen: _Seen) -> None:
    """The transient intent stopped at the retry limit, its last error recorded, one
    DLQ record with full metadata, the alert metric raised."""
    rec, letters, metrics = seen.rec, seen.letters, seen.metrics
    out.check(f"stopped at the limit: failed/exhausted, attempts == {MAX_ATTEMPTS}",
              rec is not None and rec["status"] == "failed" and rec["error_kind"] == "exhausted"
              and rec["attempts"] == MAX_ATTEMPTS and rec["next_attempt_at"] is None,
              rec and (rec["status"], rec["error_kind"], rec["attempts"]))
    out.check("the last error is recorded",
              rec is not None and rec["error_class"] == "Retryable"
              and f"attempt {MAX_ATTEMPTS}" in (rec["error_message"] or ""),
              rec and rec["error_message"])
    ok = rec is not None and TRANSIENT in letters
    problems = _letter_problems(letters[TRANSIENT], seen.src[b"r1"], rec, kind="exhausted",
                                attempts=MAX_ATTEMPTS, group=ws.group,
                                key=TRANSIENT) if ok and rec else ["no DLQ record"]
    out.check("one DLQ record with full metadata (all idem.* headers, bytes unchanged)",
              not problems and seen.n_letters == 2, "; ".join(problems))
    out.check("alert metric raised (/metrics: kafka_idem_exhausted_total >= 1)",
              metrics["exhausted_total"] >= 1 and metrics["dead_lettered_exhausted"] >= 1,
              metrics)


def _check_permanent(ws: Workspace, out: Outcome, seen: _Seen) -> None:
    """The permanent intent failed at once and was dead-lettered with full metadata."""
    prec, letters = seen.prec, seen.letters
    out.check("permanent error: failed at once (attempts 1, one claim, never retried)",
              prec is not None and prec["status"] == "failed"
              and prec["error_kind"] == "permanent" and prec["attempts"] == 1
              and len(seen.pclaims) == 1, prec and (prec["status"], prec["attempts"]))
    pproblems = _letter_problems(letters[PERMANENT], seen.src[b"p1"], prec, kind="permanent",
                                 attempts=1, group=ws.group, key=PERMANENT) \
        if prec is not None and PERMANENT in letters else ["no DLQ record"]
    out.check("permanent error dead-lettered with full metadata",
              not pproblems and seen.metrics["dead_lettered_permanent"] >= 1,
              "; ".join(pproblems))


def retry_limits(ws: Workspace, out: Outcome) -> None:
    member, src = _fail_both(ws)
    seen = _read_back(ws, member, src)
    rec, prec, r = seen.rec, seen.prec, seen.retries
    out.figure(records=ws.status_counts(), attempts=rec and rec["attempts"],
               retry_delays_s=[round(d, 3) for d in r.delays],
               delay_bounds_s=r.bounds, retry_waited_s=[round(w, 3) for w in r.waited],
               last_error=rec and f"{rec['error_kind']}/{rec['error_class']}: "
                                  f"{rec['error_message']}",
               permanent=prec and f"{prec['status']}/{prec['error_kind']} "
                                  f"attempts={prec['attempts']}",
               business_rows=len(ws.ledger()), dlq_records=seen.n_letters,
               metrics=seen.metrics)

    _check_retries(out, r)
    _check_exhausted(ws, out, seen)
    _check_permanent(ws, out, seen)
    out.check("no business effect from either (writes rolled back)", not ws.ledger(),
              len(ws.ledger()))
