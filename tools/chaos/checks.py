"""The checks: :func:`check` judges a payments run from durable state only.

It reads and indexes that state once (:func:`~tools.chaos.evidence.gather`:
the source topic, the DLQ topic, the group's committed offsets and PostgreSQL,
every source message decoded as the handler does), then runs one function per
check over it and returns a :class:`~tools.chaos.report.Report`. Per
idempotency key, the *accepted* payload is the first message whose request hash
equals the record's stored hash; in the payments example every message of a key
is on one partition (the Kafka key is the order id), so that must also be the
key's *first-seen* payload.

The checks (a count of anomalies each, with a few examples; 1-9 always, 10 and 11 when
asked for):

1. **lost**: a source message with neither its effect (the key's record is
   ``succeeded`` with the message's request hash, and the ledger has the row)
   nor a DLQ record naming its partition and offset; also (optional input) a
   send the broker acknowledged that is not on the topic with the same bytes.
2. **duplicate or wrong effects**: more than one ledger row for a key; a ledger
   row without a succeeded record, or with another amount/currency/tenant than
   the accepted payload; a key whose accepted payload is not its first-seen
   one; a (tenant, currency) balance different from the sum of the accepted
   amounts of the succeeded keys.
3. **contradictory outcomes**: a key both succeeded and dead-lettered as
   ``permanent``/``exhausted`` (a ``payload_conflict`` record for a succeeded
   key is expected: the conflicting message was rejected, the original kept);
   a ``payload_conflict`` record for a message whose hash *is* the stored one;
   an ``undecodable`` record for a message that decodes; the example's business
   rule contradicted (an invalid charge succeeded, a valid one failed as
   ``permanent``).
4. **DLQ record integrity**: a record without one of
   :data:`kafka_idem.deadletters.dead_letter.REQUIRED_HEADERS`, an unknown error kind, an
   ``idem.original.*`` that names no source message, key or value bytes that
   differ from that source message (a letter sent slim must name the value by
   its length and SHA-256), an ``idem.key`` that is not its key.
5. **stale-owner commits**: the store keeps only the current owner token and
   the token that completed (``completed_token``), not the history of claims,
   so "completed by its last claim's token" is checked through what it leaves:
   ``succeeded`` has a ``completed_token`` and no ``owner_token``/lease, and
   the transition guard triggers (the update one refuses a completion whose
   token is not the current owner's, SQLSTATE KI002) are present and enabled. A stale
   owner's business write that slipped through would also show in check 2.
6. **illegal or stuck records**: ``processing`` or ``retryable_failed`` after
   healing; ``failed`` without a known error kind; ``succeeded`` without
   ``completed_at``; ``attempts`` < 1 or below ``attempt_base``; a record whose
   key is on no source message, or whose stored hash is on none of its key's
   messages.
7. **committed ahead**: a committed offset past a message that has no outcome
   (counted per message), or past the end of the partition.
8. **retry limit exceeded**: ``attempts - attempt_base > max_attempts``.
9. **liveness**: a partition whose committed offset is not its end offset
   (lag), and, when the run passes it, lag not back to 0 within the bound.
10. **key order** (when the run says the handler keeps an order, ``ordered_by``):
   for every ordering key (the tenant) in each partition, effects applied out of
   offset order: a ledger row (rows are numbered as they are inserted, and one
   tenant's charges run one after another) whose accepted message comes after
   that of a row inserted later. A local-mode batch inserts its rows in claim
   order, not offset order, so only per-message runs are asked for it.
11. **outbox events** (when the run names the event topic, ``events_topic``):
   the topic read as ``read_committed``; a succeeded intent without exactly one
   event (``idem.key`` its key); an event for an intent that did not succeed (a
   replay, a conflict or a failure emits nothing); an outbox row published twice
   (one ``idem.outbox.id`` on two events); an event whose Kafka key is not the
   order id, whose value is not the ``ChargeCompleted`` of the accepted charge
   and its ledger row, or whose ``idem.source.*`` headers name no message of its
   key; with ``event_order``, one event key's events on two partitions, or out
   of the order their transactions committed (the outbox ids: one Kafka key's
   charges are applied one transaction after another, and a transaction's rows
   are numbered in emit order); and outbox rows never published.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from kafka_idem.deadletters.dead_letter import ERROR_KINDS, REQUIRED_HEADERS
from tools.chaos.db_state import GUARD_TRIGGERS
from tools.chaos.event_checks import events_check, key_order
from tools.chaos.evidence import Evidence, gather, has_outcome, names_source, original
from tools.chaos.evidence import Pos as Pos  # part of the checker's public names
from tools.chaos.intents import Intent
from tools.chaos.report import TITLES as TITLES  # the checker's table titles
from tools.chaos.report import Check, Liveness, Report, place, secs

FAILED_KINDS = ("permanent", "exhausted")


def _what(d: Intent | str) -> str:
    return d.key if isinstance(d, Intent) else d


def check(
    *,
    bootstrap: str,
    dsn: str,
    topic: str,
    group: str,
    dlq_topic: str | None = None,
    schema: str = "kafka_idem",
    table: str = "task_idempotency",
    max_attempts: int = 5,
    liveness: Liveness | None = None,
    acknowledged: Mapping[Pos, bytes | None] | None = None,
    ledger: tuple[str, str] = ("payments", "ledger"),
    balances: tuple[str, str] = ("payments", "balances"),
    kafka: Mapping[str, Any] | None = None,
    ordered_by: str | None = None,
    events_topic: str | None = None,
    event_order: bool = True,
) -> Report:
    """Judge the payments example's run on ``topic`` by ``group`` from durable state.

    ``liveness`` is what the run measured after healing (check 9 also looks at
    the lag itself). ``acknowledged`` optionally maps each send the broker
    acknowledged, ``(partition, offset)``, to its value bytes (check 1).
    ``kafka`` passes librdkafka options (SASL/TLS) to the checker's clients.
    ``ordered_by="tenant"``: the handler applied each tenant's charges of a
    partition in offset order (check 10; not run without it). ``events_topic``: the
    outbox's event topic (check 11; not run without it); ``event_order=False`` when
    one Kafka key's charges may run concurrently (leased, key-ordered by idempotency
    key or tenant), so their commit order is not known.
    """
    dlq_topic = dlq_topic or f"{topic}.dlq"
    started = time.monotonic()
    ev = gather(bootstrap=bootstrap, dsn=dsn, topic=topic, group=group, dlq_topic=dlq_topic,
                schema=schema, table=table, ledger=ledger, balances=balances, kafka=kafka,
                events_topic=events_topic)
    checks = [
        _lost(ev, acknowledged),
        _wrong_effects(ev),
        _contradictions(ev),
        _dlq_integrity(ev),
        _stale_owners(ev),
        _illegal_records(ev),
        _committed_ahead(ev),
        _retry_limit(ev, max_attempts),
        _liveness(ev, liveness),
    ]
    if ordered_by is not None:
        checks.append(key_order(ev, ordered_by))
    if events_topic is not None:
        checks.append(events_check(ev, event_order))
    return Report(checks, _figures(ev, started))


# --- the checks ------------------------------------------------------------------


def _lost(ev: Evidence, acknowledged: Mapping[Pos, bytes | None] | None) -> Check:
    c1 = Check(1, TITLES[1])
    for pos in sorted(ev.decoded):
        if not has_outcome(ev, pos):
            c1.add(f"{place(pos)} {_what(ev.decoded[pos])}: no effect, no DLQ record")
    if acknowledged is not None:
        for pos, value in sorted(acknowledged.items()):
            got = ev.by_pos.get(pos)
            if got is None or got.value != value:
                c1.add(f"{place(pos)}: acknowledged send "
                       + ("not on the topic" if got is None else "has other bytes on the topic"))
    c1.examined = f"{len(ev.source)} source messages" + (
        f", {len(acknowledged)} acknowledged sends" if acknowledged is not None else "")
    return c1


def _wrong_effects(ev: Evidence) -> Check:
    """Accepted payloads, wrong effects, duplicates, balances."""
    c2 = Check(2, TITLES[2])
    for key, rec in ev.records.items():
        if key not in ev.accepted or key in ev.spread:
            continue
        first = ev.by_key[key][0][0]
        if rec["status"] == "succeeded" and first != ev.accepted_at[key]:
            c2.add(f"{key}: a later payload ({place(ev.accepted_at[key])}) took effect, not "
                   f"the first-seen one ({place(first)})")
    for key, rows in ev.ledger_rows.items():
        owner = ev.records.get(key)
        if len(rows) > 1:
            c2.add(f"{key}: {len(rows)} ledger rows")
        if owner is None or owner["status"] != "succeeded":
            c2.add(f"{key}: ledger row without a succeeded record "
                   f"({owner['status'] if owner else 'no record'})")
            continue
        want = ev.accepted.get(key)
        if want is not None and any(
            (r["tenant_id"], r["order_id"], Decimal(r["amount"]), r["currency"])
            != (want.tenant, want.order, want.amount, want.currency) for r in rows
        ):
            c2.add(f"{key}: ledger row differs from the accepted payload")
    expected: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
    for key, rec in ev.records.items():
        if rec["status"] == "succeeded" and key in ev.accepted:
            expected[(ev.accepted[key].tenant, ev.accepted[key].currency)] += (
                ev.accepted[key].amount)
    for pair in sorted(expected.keys() | ev.balance.keys()):
        if expected.get(pair, Decimal(0)) != ev.balance.get(pair, Decimal(0)):
            c2.add(f"balance {pair[0]}/{pair[1]}: {ev.balance.get(pair, 0)} != "
                   f"{expected.get(pair, 0)} (sum of accepted intents)")
    c2.examined = (f"{sum(len(r) for r in ev.ledger_rows.values())} ledger rows, "
                   f"{len(ev.balance)} balances")
    return c2


def _contradictions(ev: Evidence) -> Check:
    """A message's DLQ records against the store; a key's record against its DLQ
    records and the example's business rule."""
    c3 = Check(3, TITLES[3])
    for pos in sorted(ev.decoded):
        d = ev.decoded[pos]
        if not isinstance(d, Intent):
            continue
        letters = ev.dlq_for.get(pos, [])
        stored = ev.records.get(d.key)
        if stored is not None:
            for h in letters:
                kind = h.get("idem.error.kind", "?")
                if kind == "payload_conflict" and stored["request_hash"] == d.request_hash:
                    c3.add(f"{place(pos)} {d.key}: dead-lettered as payload_conflict "
                           "with the stored request hash")
        for h in letters:
            if h.get("idem.error.kind") == "undecodable":
                c3.add(f"{place(pos)}: dead-lettered as undecodable but decodes ({d.key})")
    for key, seen in ev.by_key.items():
        known = ev.records.get(key)
        if known is None:
            continue
        kinds = {h.get("idem.error.kind", "?") for pos, _ in seen for h in ev.dlq_for.get(pos, [])}
        accepted = ev.accepted.get(key)
        if known["status"] == "succeeded":
            bad = kinds & set(FAILED_KINDS)
            if bad:
                c3.add(f"{key}: succeeded and dead-lettered as {'/'.join(sorted(bad))}")
            if accepted is not None and not accepted.valid:
                c3.add(f"{key}: an invalid charge took effect")
        elif (known["status"] == "failed" and known["error_kind"] == "permanent"
              and accepted is not None and accepted.valid):
            c3.add(f"{key}: a valid charge failed as permanent")
    c3.examined = f"{len(ev.by_key)} keys"
    return c3


def _dlq_integrity(ev: Evidence) -> Check:
    c4 = Check(4, TITLES[4])
    for letter in ev.dead:
        h = letter.header_map()
        where = f"dlq p{letter.partition}@{letter.offset}"
        missing = [name for name in REQUIRED_HEADERS if name not in h]
        if missing:
            c4.add(f"{where}: missing {', '.join(missing)}")
            continue  # what else it lacks is beside the point
        pos = original(h)
        if pos is None:
            c4.add(f"{where}: unparsable original partition/offset")
            continue
        if not names_source(ev, h, pos):
            c4.add(f"{where}: names {h.get('idem.original.topic')} {place(pos)}, "
                   "no such source message")
            continue
        src, d = ev.by_pos[pos], ev.decoded[pos]
        kind = h.get("idem.error.kind", "?")
        stated = h.get("idem.key")
        if kind not in ERROR_KINDS:
            c4.add(f"{where}: unknown error kind {kind!r}")
        elif not _same_bytes(src.key, letter.key, h, "key"):
            c4.add(f"{where}: key bytes differ from source {place(pos)}")
        elif not _same_bytes(src.value, letter.value, h, "value"):
            c4.add(f"{where}: value bytes differ from source {place(pos)}")
        elif stated is not None and isinstance(d, Intent) and stated != d.key:
            c4.add(f"{where}: idem.key {stated!r} is not the message's key {d.key!r}")
    c4.examined = f"{len(ev.dead)} DLQ records"
    return c4


def _same_bytes(source: bytes | None, letter: bytes | None, h: dict[str, str],
               part: str) -> bool:
    """The letter carries the source's bytes, or says it left them out (a record too
    large for the DLQ, sent slim: dlq.DeadLetter.slim) and, for the value, names them
    by length and SHA-256. A DLQ topic whose limit is lowered for a moment (the
    ``dlq_outage`` fault) can make a letter go out slim."""
    if source == letter:
        return True
    if part not in h.get("idem.truncated", "").split(","):
        return False
    if part == "key":
        return letter is None
    value = source or b""
    return (h.get("idem.original.value_bytes") == str(len(value))
            and h.get("idem.original.value_sha256") == hashlib.sha256(value).hexdigest())


def _stale_owners(ev: Evidence) -> Check:
    c5 = Check(5, TITLES[5])
    for name in GUARD_TRIGGERS:
        if ev.guard.get(name) not in ("O", "A"):
            c5.add("transition guard trigger "
                   + ("missing" if name not in ev.guard else "disabled") + f" ({name})")
    succeeded = 0
    for key, rec in sorted(ev.records.items()):
        if rec["status"] != "succeeded":
            continue
        succeeded += 1
        if (rec["completed_token"] is None or rec["owner_token"] is not None
                or rec["lease_until"] is not None):
            c5.add(f"{key}: succeeded with completed_token={rec['completed_token']}, "
                   f"owner_token={rec['owner_token']}")
    c5.examined = f"{succeeded} succeeded records, guard triggers"
    return c5


def _illegal_records(ev: Evidence) -> Check:
    c6 = Check(6, TITLES[6])
    for key, rec in sorted(ev.records.items()):
        problem = _record_problem(ev, key, rec)
        if problem:
            c6.add(f"{key}: {problem}")
    c6.examined = f"{len(ev.records)} records"
    return c6


def _record_problem(ev: Evidence, key: str, rec: Mapping[str, Any]) -> str | None:
    status = rec["status"]
    if status in ("processing", "retryable_failed"):
        return f"still {status} (attempts {rec['attempts']})"
    if status == "failed" and rec["error_kind"] not in FAILED_KINDS:
        return f"failed with error kind {rec['error_kind']!r}"
    if status == "succeeded" and rec["completed_at"] is None:
        return "succeeded without completed_at"
    if status not in ("succeeded", "failed"):
        return f"unknown status {status!r}"
    if rec["attempts"] < 1 or rec["attempt_base"] > rec["attempts"]:
        return f"attempts {rec['attempts']}, attempt_base {rec['attempt_base']}"
    if key not in ev.by_key:
        return "its key is on no source message"
    if key not in ev.accepted:
        return "its request hash is on none of its key's messages"
    return None


def _committed_ahead(ev: Evidence) -> Check:
    c7 = Check(7, TITLES[7])
    for pos in sorted(ev.decoded):
        if not has_outcome(ev, pos) and ev.committed.get(pos[0], -1) > pos[1]:
            c7.add(f"{place(pos)} {_what(ev.decoded[pos])}: below committed offset "
                   f"{ev.committed[pos[0]]}")
    for p, (_low, high) in sorted(ev.marks.items()):
        if ev.committed.get(p, -1) > high:
            c7.add(f"p{p}: committed offset {ev.committed[p]} past the end {high}")
    c7.examined = f"{len(ev.marks)} partitions, committed {_total(ev.committed)}"
    return c7


def _retry_limit(ev: Evidence, max_attempts: int) -> Check:
    c8 = Check(8, TITLES[8])
    for key, rec in sorted(ev.records.items()):
        if rec["attempts"] - rec["attempt_base"] > max_attempts:
            c8.add(f"{key}: {rec['attempts'] - rec['attempt_base']} attempts > {max_attempts}")
    c8.examined = f"{len(ev.records)} records, limit {max_attempts}"
    return c8


def _liveness(ev: Evidence, liveness: Liveness | None) -> Check:
    c9 = Check(9, TITLES[9])
    lag = {p: high - max(ev.committed.get(p, -1), low) for p, (low, high) in ev.marks.items()}
    for p, n in sorted(lag.items()):
        if n > 0:
            c9.add(f"p{p}: lag {n}")
    if liveness is not None and (liveness.healed_in is None
                                 or liveness.healed_in > liveness.bound):
        c9.add(f"lag not back to 0 within {liveness.bound:.0f}s of the heal")
    c9.examined = f"{len(ev.marks)} partitions" + (
        "" if liveness is None else f", healed in {secs(liveness.healed_in)} "
        f"(bound {liveness.bound:.0f}s)")
    return c9


def _figures(ev: Evidence, started: float) -> dict[str, Any]:
    decoded = ev.decoded.values()
    decodable = sum(1 for d in decoded if isinstance(d, Intent))
    same = sum(1 for d in decoded if isinstance(d, Intent) and d.key in ev.accepted
               and ev.accepted[d.key].request_hash == d.request_hash)
    statuses = Counter(rec["status"] for _, rec in sorted(ev.records.items()))
    failed_kinds = Counter(rec["error_kind"] or "none" for _, rec in sorted(ev.records.items())
                           if rec["status"] == "failed")
    return {
        "source messages": len(ev.source),
        "decodable / not": f"{decodable} / {len(ev.source) - decodable}",
        "distinct keys": len(ev.by_key),
        "messages repeating the accepted payload": same - len(ev.accepted),
        "messages with another payload (conflicts)": decodable - same,
        "records by status": dict(sorted(statuses.items())),
        "failed records by kind": dict(sorted(failed_kinds.items())),
        "records with attempts > 1 (taken over or retried)": sum(
            1 for r in ev.records.values() if r["attempts"] > 1),
        "ledger rows": sum(len(r) for r in ev.ledger_rows.values()),
        "balances (tenant, currency)": len(ev.balance),
        "DLQ records by kind": dict(sorted(ev.dlq_kinds.items())),
        "source messages dead-lettered more than once": sum(
            1 for v in ev.dlq_for.values() if len(v) > 1),
        "keys spread over partitions": len(ev.spread),
        **({} if ev.events_topic is None else {
            "outbox events": len(ev.events),
            "event keys with more than one event": sum(
                1 for n in Counter(e.key for e in ev.events).values() if n > 1)}),
        "committed / end offsets": (f"{_total(ev.committed)} / "
                                    f"{sum(h for _, h in ev.marks.values())}"),
        "checker seconds": round(time.monotonic() - started, 1),
    }


def _total(offsets: Mapping[int, int]) -> int:
    return sum(max(o, 0) for o in offsets.values())
