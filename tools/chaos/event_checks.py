"""Checks 10 and 11 of :func:`~tools.chaos.checks.check` (see its list): effects in
offset order per ordering key, and the outbox's events on the event topic."""

from __future__ import annotations

import itertools
from collections import defaultdict

from tools.chaos.evidence import Evidence
from tools.chaos.report import TITLES, Check, place, secs
from tools.kafka_state import KafkaRecord

EVENT_HEADERS = ("idem.key", "idem.source.topic", "idem.source.partition",
                 "idem.source.offset", "idem.outbox.id")


def key_order(ev: Evidence, ordered_by: str) -> Check:
    if ordered_by != "tenant":
        raise ValueError(f"ordered_by must be 'tenant', not {ordered_by!r}")
    c10 = Check(10, TITLES[10])
    applied: dict[tuple[int, str], list[tuple[int, int, str]]] = defaultdict(list)
    for key, rows in ev.ledger_rows.items():
        pos = ev.accepted_at.get(key)
        if pos is None or len(rows) != 1:
            continue  # no accepted payload, or doubled: check 2's
        applied[(pos[0], ev.accepted[key].tenant)].append((rows[0]["id"], pos[1], key))
    for (p, tenant), effects in sorted(applied.items()):
        effects.sort()  # as they were inserted
        for (_, off_a, key_a), (_, off_b, key_b) in itertools.pairwise(effects):
            if off_a > off_b:
                c10.add(f"p{p} {tenant}: {key_a} (@{off_a}) applied before {key_b} (@{off_b})")
    c10.examined = (f"{sum(len(e) for e in applied.values())} effects over {len(applied)} "
                    "(partition, tenant) pairs")
    return c10


def events_check(ev: Evidence, ordered: bool) -> Check:
    c11 = Check(11, TITLES[11])
    succeeded = {k for k, rec in ev.records.items() if rec["status"] == "succeeded"}
    by_intent: dict[str, list[KafkaRecord]] = defaultdict(list)
    by_row: dict[str, list[KafkaRecord]] = defaultdict(list)
    for e in ev.events:
        h = e.header_map()
        missing = [name for name in EVENT_HEADERS if name not in h]
        if missing:
            c11.add(f"event p{e.partition}@{e.offset}: missing {', '.join(missing)}")
            continue
        by_intent[h["idem.key"]].append(e)
        by_row[h["idem.outbox.id"]].append(e)
    for row, published in sorted(by_row.items()):
        if len(published) > 1:
            c11.add(f"outbox row {row} published {len(published)} times: "
                    + ", ".join(f"p{e.partition}@{e.offset}" for e in published))
    for key in sorted(succeeded | by_intent.keys()):
        got = by_intent.get(key, [])
        rec = ev.records.get(key)
        if key not in succeeded:
            c11.add(f"{key}: {len(got)} event(s) for a "
                    f"{rec['status'] if rec else 'never recorded'} intent")
        elif len(got) != 1:
            c11.add(f"{key}: succeeded, {len(got)} events")
        for e in got[:1] if key in succeeded else ():
            problem = _event_problem(ev, key, e)
            if problem:
                c11.add(f"{key} (event p{e.partition}@{e.offset}): {problem}")
    if ordered:
        _event_order(ev, c11)
    if ev.outbox is not None and ev.outbox[0]:
        c11.add(f"{ev.outbox[0]} outbox rows never published (the oldest "
                f"{secs(ev.outbox[1])} old)", ev.outbox[0])
    c11.examined = (f"{len(ev.events)} events on {ev.events_topic} (read_committed), "
                    f"{len(succeeded)} succeeded intents, outbox "
                    + ("absent" if ev.outbox is None else f"{ev.outbox[0]} rows left"))
    return c11


def _event_problem(ev: Evidence, key: str, e: KafkaRecord) -> str | None:
    """What is wrong with the one event of succeeded intent ``key`` (None: nothing)."""
    h = e.header_map()
    value = ev.event_values.get((e.partition, e.offset))
    want, rows = ev.accepted.get(key), ev.ledger_rows.get(key, [])
    if value is None or isinstance(value, str):
        return f"value {value or 'not decoded'}"
    if want is None or len(rows) != 1:
        return None  # no accepted payload or no single ledger row: checks 2 and 6 say so
    if e.key != want.order.encode():
        return f"Kafka key {e.key!r}, not the order id {want.order!r}"
    got = (value.idempotency_key, value.tenant_id, value.order_id, value.amount, value.currency,
           value.ledger_entry.id)
    if got != (key, want.tenant, want.order, want.amount, want.currency, rows[0]["id"]):
        return f"value {got} is not the charge and its ledger row {rows[0]['id']}"
    try:
        pos = (int(h["idem.source.partition"]), int(h["idem.source.offset"]))
    except ValueError:
        return "unparsable idem.source.partition/offset"
    if h["idem.source.topic"] != ev.topic or pos not in {p for p, _ in ev.by_key.get(key, [])}:
        return f"idem.source names {h['idem.source.topic']} {place(pos)}, no message of its key"
    return None


def _event_order(ev: Evidence, c11: Check) -> None:
    """Per event key: one partition, events in outbox-id order (see check 11)."""
    by_key: dict[bytes | None, list[tuple[int, int, int]]] = defaultdict(list)
    for e in ev.events:
        row = e.header_map().get("idem.outbox.id", "")
        if row.isdigit():
            by_key[e.key].append((e.partition, e.offset, int(row)))
    for key, seen in sorted(by_key.items(), key=lambda kv: kv[0] or b""):
        if len({p for p, _, _ in seen}) > 1:
            c11.add(f"event key {key!r} on partitions {sorted({p for p, _, _ in seen})}")
            continue
        seen.sort()
        for (p, off_a, row_a), (_, off_b, row_b) in itertools.pairwise(seen):
            if row_a > row_b:
                c11.add(f"event key {key!r}: outbox row {row_a} (p{p}@{off_a}) published "
                        f"before row {row_b} (@{off_b})")
