"""The nine checks: :func:`check` judges a payments run from durable state only.

It reads the source topic, the DLQ topic and the group's committed offsets
(:mod:`~kafka_idem.chaos.kafka_state`) and PostgreSQL
(:mod:`~kafka_idem.chaos.db_state`), decodes every source message as the
handler does (:mod:`~kafka_idem.chaos.intents`) and returns a
:class:`~kafka_idem.chaos.report.Report`. Per idempotency key, the *accepted*
payload is the first message whose request hash equals the record's stored
hash; in the payments example every message of a key is on one partition (the
Kafka key is the order id), so that must also be the key's *first-seen* payload.

The nine checks (a count of anomalies each, with a few examples):

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
   :data:`kafka_idem.dlq.REQUIRED_HEADERS`, an unknown error kind, an
   ``idem.original.*`` that names no source message, key or value bytes that
   differ from that source message, an ``idem.key`` that is not its key.
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
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from kafka_idem.chaos.db_state import GUARD_TRIGGERS, read_database
from kafka_idem.chaos.intents import Intent, PaymentsDecoder
from kafka_idem.chaos.kafka_state import KafkaRecord, committed_offsets, patiently, read_topic
from kafka_idem.chaos.report import Check, Liveness, Report
from kafka_idem.dlq import ERROR_KINDS, REQUIRED_HEADERS

FAILED_KINDS = ("permanent", "exhausted")

TITLES = {
    1: "lost",
    2: "duplicate or wrong effects",
    3: "contradictory outcomes",
    4: "DLQ record integrity",
    5: "stale-owner commits",
    6: "illegal or stuck records",
    7: "committed offsets ahead of outcomes",
    8: "retry limit exceeded",
    9: "liveness (lag back to 0)",
}

Pos = tuple[int, int]  # (partition, offset)


def _where(pos: Pos) -> str:
    return f"p{pos[0]}@{pos[1]}"


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
) -> Report:
    """Judge the payments example's run on ``topic`` by ``group`` from durable state.

    ``liveness`` is what the run measured after healing (check 9 also looks at
    the lag itself). ``acknowledged`` optionally maps each send the broker
    acknowledged, ``(partition, offset)``, to its value bytes (check 1).
    ``kafka`` passes librdkafka options (SASL/TLS) to the checker's clients.
    """
    dlq_topic = dlq_topic or f"{topic}.dlq"
    started = time.monotonic()
    source, marks = patiently(lambda: read_topic(bootstrap, topic, kafka=kafka))
    dead, _ = patiently(lambda: read_topic(bootstrap, dlq_topic, kafka=kafka))
    committed = patiently(lambda: committed_offsets(bootstrap, group, topic, marks,
                                                    kafka=kafka))
    records, ledger_rows, balance, guard = read_database(dsn, schema, table, ledger, balances)

    checks = {n: Check(n, title) for n, title in TITLES.items()}
    decode = PaymentsDecoder(topic)
    by_pos: dict[Pos, KafkaRecord] = {(m.partition, m.offset): m for m in source}
    decoded: dict[Pos, Intent | str] = {pos: decode(m.value) for pos, m in by_pos.items()}
    by_key: dict[str, list[tuple[Pos, Intent]]] = defaultdict(list)
    for pos in sorted(decoded):
        d = decoded[pos]
        if isinstance(d, Intent):
            by_key[d.key].append((pos, d))

    # DLQ records by the source message they name.
    dlq_for: dict[Pos, list[dict[str, str]]] = defaultdict(list)
    dlq_kinds: Counter[str] = Counter()
    c4 = checks[4]
    for letter in dead:
        h = letter.header_map()
        where = f"dlq p{letter.partition}@{letter.offset}"
        kind = h.get("idem.error.kind", "?")
        dlq_kinds[kind] += 1
        missing = [name for name in REQUIRED_HEADERS if name not in h]
        if missing:
            c4.add(f"{where}: missing {', '.join(missing)}")
        try:
            pos = (int(h["idem.original.partition"]), int(h["idem.original.offset"]))
        except (KeyError, ValueError):
            if not missing:
                c4.add(f"{where}: unparsable original partition/offset")
            continue
        src = by_pos.get(pos)
        if h.get("idem.original.topic") != topic or src is None:
            if not missing:
                c4.add(f"{where}: names {h.get('idem.original.topic')} {_where(pos)}, "
                       "no such source message")
            continue
        # It names a source message: an outcome for check 1 (any damage is counted here).
        dlq_for[pos].append(h)
        if missing:
            continue
        d = decoded[pos]
        stated = h.get("idem.key")
        if kind not in ERROR_KINDS:
            c4.add(f"{where}: unknown error kind {kind!r}")
        elif src.key != letter.key or src.value != letter.value:
            which = "key" if src.key != letter.key else "value"
            c4.add(f"{where}: {which} bytes differ from source {_where(pos)}")
        elif stated is not None and isinstance(d, Intent) and stated != d.key:
            c4.add(f"{where}: idem.key {stated!r} is not the message's key {d.key!r}")
    c4.examined = f"{len(dead)} DLQ records"

    # Accepted payloads, wrong effects, duplicates, balances (check 2).
    c2 = checks[2]
    accepted: dict[str, Intent] = {}
    spread = 0
    for key, rec in records.items():
        seen = by_key.get(key, [])
        match = [(pos, d) for pos, d in seen if d.request_hash == rec["request_hash"]]
        if not match:
            continue  # check 6: phantom record
        accepted[key] = match[0][1]
        if len({pos[0] for pos, _ in seen}) > 1:
            spread += 1  # no order between partitions: any matching payload is accepted
        elif rec["status"] == "succeeded" and seen[0][0] != match[0][0]:
            c2.add(f"{key}: a later payload ({_where(match[0][0])}) took effect, not the "
                   f"first-seen one ({_where(seen[0][0])})")
    for key, rows in ledger_rows.items():
        owner = records.get(key)
        if len(rows) > 1:
            c2.add(f"{key}: {len(rows)} ledger rows")
        if owner is None or owner["status"] != "succeeded":
            c2.add(f"{key}: ledger row without a succeeded record "
                   f"({owner['status'] if owner else 'no record'})")
            continue
        want = accepted.get(key)
        if want is not None and any(
            (r["tenant_id"], r["order_id"], Decimal(r["amount"]), r["currency"])
            != (want.tenant, want.order, want.amount, want.currency) for r in rows
        ):
            c2.add(f"{key}: ledger row differs from the accepted payload")
    expected: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
    for key, rec in records.items():
        if rec["status"] == "succeeded" and key in accepted:
            expected[(accepted[key].tenant, accepted[key].currency)] += accepted[key].amount
    for pair in sorted(expected.keys() | balance.keys()):
        if expected.get(pair, Decimal(0)) != balance.get(pair, Decimal(0)):
            c2.add(f"balance {pair[0]}/{pair[1]}: {balance.get(pair, 0)} != "
                   f"{expected.get(pair, 0)} (sum of accepted intents)")
    c2.examined = (f"{sum(len(r) for r in ledger_rows.values())} ledger rows, "
                   f"{len(balance)} balances")

    # Per source message: outcome (1), committed ahead (7), contradictions (3).
    c1, c3, c7 = checks[1], checks[3], checks[7]
    for pos in sorted(decoded):
        d = decoded[pos]
        letters = dlq_for.get(pos, [])
        stored = records.get(d.key) if isinstance(d, Intent) else None
        if isinstance(d, Intent) and stored is not None:
            for h in letters:
                kind = h.get("idem.error.kind", "?")
                if kind == "payload_conflict" and stored["request_hash"] == d.request_hash:
                    c3.add(f"{_where(pos)} {d.key}: dead-lettered as payload_conflict "
                           "with the stored request hash")
        for h in letters:
            if h.get("idem.error.kind") == "undecodable" and isinstance(d, Intent):
                c3.add(f"{_where(pos)}: dead-lettered as undecodable but decodes ({d.key})")
        effect = (isinstance(d, Intent) and stored is not None
                  and stored["status"] == "succeeded"
                  and stored["request_hash"] == d.request_hash and bool(ledger_rows.get(d.key)))
        if effect or letters:
            continue
        what = d.key if isinstance(d, Intent) else d
        c1.add(f"{_where(pos)} {what}: no effect, no DLQ record")
        if committed.get(pos[0], -1) > pos[1]:
            c7.add(f"{_where(pos)} {what}: below committed offset {committed[pos[0]]}")
    if acknowledged is not None:
        for pos, value in sorted(acknowledged.items()):
            got = by_pos.get(pos)
            if got is None or got.value != value:
                c1.add(f"{_where(pos)}: acknowledged send "
                       + ("not on the topic" if got is None else "has other bytes on the topic"))
    c1.examined = f"{len(source)} source messages" + (
        f", {len(acknowledged)} acknowledged sends" if acknowledged is not None else "")
    for p, (_low, high) in sorted(marks.items()):
        if committed.get(p, -1) > high:
            c7.add(f"p{p}: committed offset {committed[p]} past the end {high}")
    c7.examined = f"{len(marks)} partitions, committed {_total(committed)}"

    # Contradictions between a key's record and its DLQ records / the business rule (3).
    for key, seen in by_key.items():
        known = records.get(key)
        if known is None:
            continue
        kinds = {h.get("idem.error.kind", "?") for pos, _ in seen for h in dlq_for.get(pos, [])}
        if known["status"] == "succeeded":
            bad = kinds & set(FAILED_KINDS)
            if bad:
                c3.add(f"{key}: succeeded and dead-lettered as {'/'.join(sorted(bad))}")
            if key in accepted and not accepted[key].valid:
                c3.add(f"{key}: an invalid charge took effect")
        elif (known["status"] == "failed" and known["error_kind"] == "permanent"
              and key in accepted and accepted[key].valid):
            c3.add(f"{key}: a valid charge failed as permanent")
    c3.examined = f"{len(by_key)} keys"

    # Records: stale owners (5), illegal or stuck (6), retry limits (8).
    c5, c6, c8 = checks[5], checks[6], checks[8]
    for name in GUARD_TRIGGERS:
        if guard.get(name) not in ("O", "A"):
            c5.add("transition guard trigger "
                   + ("missing" if name not in guard else "disabled") + f" ({name})")
    statuses: Counter[str] = Counter()
    failed_kinds: Counter[str] = Counter()
    for key, rec in sorted(records.items()):
        status = rec["status"]
        statuses[status] += 1
        if status == "failed":
            failed_kinds[rec["error_kind"] or "none"] += 1
        if status == "succeeded" and (rec["completed_token"] is None
                                      or rec["owner_token"] is not None
                                      or rec["lease_until"] is not None):
            c5.add(f"{key}: succeeded with completed_token={rec['completed_token']}, "
                   f"owner_token={rec['owner_token']}")
        problem = None
        if status in ("processing", "retryable_failed"):
            problem = f"still {status} (attempts {rec['attempts']})"
        elif status == "failed" and rec["error_kind"] not in FAILED_KINDS:
            problem = f"failed with error kind {rec['error_kind']!r}"
        elif status == "succeeded" and rec["completed_at"] is None:
            problem = "succeeded without completed_at"
        elif status not in ("succeeded", "failed"):
            problem = f"unknown status {status!r}"
        elif rec["attempts"] < 1 or rec["attempt_base"] > rec["attempts"]:
            problem = f"attempts {rec['attempts']}, attempt_base {rec['attempt_base']}"
        elif key not in by_key:
            problem = "its key is on no source message"
        elif key not in accepted:
            problem = "its request hash is on none of its key's messages"
        if problem:
            c6.add(f"{key}: {problem}")
        if rec["attempts"] - rec["attempt_base"] > max_attempts:
            c8.add(f"{key}: {rec['attempts'] - rec['attempt_base']} attempts > {max_attempts}")
    c5.examined = f"{statuses['succeeded']} succeeded records, guard triggers"
    c6.examined = f"{len(records)} records"
    c8.examined = f"{len(records)} records, limit {max_attempts}"

    # Liveness (9).
    c9 = checks[9]
    lag = {p: high - max(committed.get(p, -1), low) for p, (low, high) in marks.items()}
    for p, n in sorted(lag.items()):
        if n > 0:
            c9.add(f"p{p}: lag {n}")
    if liveness is not None and (liveness.healed_in is None
                                 or liveness.healed_in > liveness.bound):
        c9.add(f"lag not back to 0 within {liveness.bound:.0f}s of the heal")
    c9.examined = f"{len(marks)} partitions" + (
        "" if liveness is None else f", healed in {_secs(liveness.healed_in)} "
        f"(bound {liveness.bound:.0f}s)")

    decodable = sum(1 for d in decoded.values() if isinstance(d, Intent))
    same = sum(1 for d in decoded.values() if isinstance(d, Intent) and d.key in accepted
               and accepted[d.key].request_hash == d.request_hash)
    figures: dict[str, Any] = {
        "source messages": len(source),
        "decodable / not": f"{decodable} / {len(source) - decodable}",
        "distinct keys": len(by_key),
        "messages repeating the accepted payload": same - len(accepted),
        "messages with another payload (conflicts)": decodable - same,
        "records by status": dict(sorted(statuses.items())),
        "failed records by kind": dict(sorted(failed_kinds.items())),
        "records with attempts > 1 (taken over or retried)": sum(
            1 for r in records.values() if r["attempts"] > 1),
        "ledger rows": sum(len(r) for r in ledger_rows.values()),
        "balances (tenant, currency)": len(balance),
        "DLQ records by kind": dict(sorted(dlq_kinds.items())),
        "source messages dead-lettered more than once": sum(
            1 for v in dlq_for.values() if len(v) > 1),
        "keys spread over partitions": spread,
        "committed / end offsets": f"{_total(committed)} / {sum(h for _, h in marks.values())}",
        "checker seconds": round(time.monotonic() - started, 1),
    }
    return Report([checks[n] for n in sorted(checks)], figures)


def _total(offsets: Mapping[int, int]) -> int:
    return sum(max(o, 0) for o in offsets.values())


def _secs(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f}s"
