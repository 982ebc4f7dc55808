"""The durable state of a run, read once, decoded and indexed for the checks.

:func:`gather` reads the source topic, the DLQ topic and the group's committed
offsets (:mod:`~tools.kafka_state`) and PostgreSQL
(:mod:`~tools.chaos.db_state`), decodes every source message as the
handler does (:mod:`~tools.chaos.intents`), and indexes it all as
:class:`Evidence`: messages by position and by idempotency key, DLQ records by
the source message they name, and each key's *accepted* payload (its first
message whose request hash equals the record's stored hash). With an event
topic (the outbox's), also its records (read as ``read_committed``), each
decoded as the example's ``ChargeCompleted``, and the outbox rows left unpublished.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from tools.chaos.db_state import read_database, read_outbox
from tools.chaos.intents import Intent, PaymentsDecoder
from tools.kafka_state import KafkaRecord, committed_offsets, patiently, read_topic

Pos = tuple[int, int]  # (partition, offset)


@dataclass
class Evidence:
    """The durable state of a run, decoded and indexed once for all the checks."""

    topic: str
    source: list[KafkaRecord]
    marks: dict[int, tuple[int, int]]  # partition -> (low, high) of the source topic
    dead: list[KafkaRecord]  # the DLQ topic's records
    committed: dict[int, int]
    records: dict[str, dict[str, Any]]
    ledger_rows: dict[str, list[dict[str, Any]]]
    balance: dict[tuple[str, str], Decimal]
    guard: dict[str, str]  # trigger name -> pg_trigger.tgenabled
    by_pos: dict[Pos, KafkaRecord] = field(default_factory=dict)
    decoded: dict[Pos, Intent | str] = field(default_factory=dict)
    by_key: dict[str, list[tuple[Pos, Intent]]] = field(default_factory=dict)
    # DLQ records' headers by the source message they name, and all records by kind.
    dlq_for: dict[Pos, list[dict[str, str]]] = field(default_factory=dict)
    dlq_kinds: Counter[str] = field(default_factory=Counter)
    accepted: dict[str, Intent] = field(default_factory=dict)
    accepted_at: dict[str, Pos] = field(default_factory=dict)
    spread: set[str] = field(default_factory=set)  # keys on more than one partition
    # The outbox (check 11): the event topic's records and their decoded values (or why
    # not), and (unpublished rows, age of the oldest) of the namespace (None: no table).
    events_topic: str | None = None
    events: list[KafkaRecord] = field(default_factory=list)
    event_values: dict[Pos, Any] = field(default_factory=dict)
    outbox: tuple[int, float | None] | None = None


def gather(
    *,
    bootstrap: str,
    dsn: str,
    topic: str,
    group: str,
    dlq_topic: str,
    schema: str,
    table: str,
    ledger: tuple[str, str],
    balances: tuple[str, str],
    kafka: Mapping[str, Any] | None,
    events_topic: str | None = None,
    namespace: str = "payments",
) -> Evidence:
    """Read the run's durable state (patiently: a broker restart is no verdict) and index it."""
    source, marks = patiently(lambda: read_topic(bootstrap, topic, kafka=kafka))
    dead, _ = patiently(lambda: read_topic(bootstrap, dlq_topic, kafka=kafka))
    committed = patiently(lambda: committed_offsets(bootstrap, group, topic, marks,
                                                    kafka=kafka))
    records, ledger_rows, balance, guard = read_database(dsn, schema, table, ledger, balances)
    ev = Evidence(topic, source, marks, dead, committed, records, ledger_rows, balance, guard)
    decoder = PaymentsDecoder(topic)
    _index(ev, decoder)
    if events_topic is not None:
        ev.events_topic = events_topic
        ev.events, _ = patiently(lambda: read_topic(bootstrap, events_topic, kafka=kafka))
        ev.event_values = {(e.partition, e.offset): decoder.event(e.value) for e in ev.events}
        ev.outbox = read_outbox(dsn, schema, namespace)
    return ev


def _index(ev: Evidence, decode: PaymentsDecoder) -> None:
    ev.by_pos = {(m.partition, m.offset): m for m in ev.source}
    ev.decoded = {pos: decode(m.value) for pos, m in ev.by_pos.items()}
    by_key: dict[str, list[tuple[Pos, Intent]]] = defaultdict(list)
    for pos in sorted(ev.decoded):
        d = ev.decoded[pos]
        if isinstance(d, Intent):
            by_key[d.key].append((pos, d))
    ev.by_key = by_key
    dlq_for: dict[Pos, list[dict[str, str]]] = defaultdict(list)
    for letter in ev.dead:
        h = letter.header_map()
        ev.dlq_kinds[h.get("idem.error.kind", "?")] += 1
        named = original(h)
        if named is not None and names_source(ev, h, named):
            # An outcome for check 1, whatever damage check 4 finds in it.
            dlq_for[named].append(h)
    ev.dlq_for = dlq_for
    # The accepted payload of a key: its first message with the stored request hash.
    for key, rec in ev.records.items():
        seen = ev.by_key.get(key, [])
        match = [(pos, d) for pos, d in seen if d.request_hash == rec["request_hash"]]
        if not match:
            continue  # check 6: phantom record
        ev.accepted_at[key], ev.accepted[key] = match[0]
        if len({pos[0] for pos, _ in seen}) > 1:
            ev.spread.add(key)  # no order between partitions: any matching payload is accepted


def original(h: Mapping[str, str]) -> Pos | None:
    """The source partition and offset a DLQ record names (None: unparsable)."""
    try:
        return int(h["idem.original.partition"]), int(h["idem.original.offset"])
    except (KeyError, ValueError):
        return None


def names_source(ev: Evidence, h: Mapping[str, str], pos: Pos) -> bool:
    return h.get("idem.original.topic") == ev.topic and pos in ev.by_pos


def has_outcome(ev: Evidence, pos: Pos) -> bool:
    """The message took effect (its request hash succeeded and the ledger has its row)
    or was dead-lettered."""
    d = ev.decoded[pos]
    stored = ev.records.get(d.key) if isinstance(d, Intent) else None
    effect = (isinstance(d, Intent) and stored is not None
              and stored["status"] == "succeeded"
              and stored["request_hash"] == d.request_hash and bool(ev.ledger_rows.get(d.key)))
    return effect or bool(ev.dlq_for.get(pos))
