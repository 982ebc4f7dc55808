"""Scenario 7: the transactional outbox. Events exist if and only if their effect
committed, and reach their topic exactly once for ``read_committed`` readers, through
a SIGKILLed relay and a relay SIGSTOPped past its session timeout (a zombie) and
resumed.

1. A member without a relay processes intents, a re-send, a payload conflict and a
   charge that fails permanently after its write: the outbox holds one row per
   succeeded intent (none for the replay, the conflict, the rolled-back failure) and
   nothing is on the event topic.
2. Relay A publishes them; it is SIGSTOPped; more intents are processed; relay B
   takes the shards over once A's session has expired and publishes those; A is
   resumed (fenced: its transactional id has a newer epoch) and more intents follow;
   then every relay is SIGKILLed, more intents are processed, and relay C publishes
   what is left.
3. The event topic, read as ``read_committed``: exactly one event per succeeded
   intent, with its ``idem.*`` headers naming the intent and the message that caused
   it, no outbox row twice, and the outbox empty.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter
from typing import Any

from kafka_idem.verify.app import encode, key_of
from kafka_idem.verify.kafka import headers, wait_for
from kafka_idem.verify.report import Outcome
from kafka_idem.verify.workspace import APP_SPEC, Member, Workspace

HEADERS = ("idem.key", "idem.namespace", "idem.source.topic", "idem.source.partition",
           "idem.source.offset", "idem.outbox.id")


def _topics_create(ws: Workspace, config: Any) -> str:
    """``kafka-idem topics create`` of the verify app: it makes the event topic and the
    relays' control topic (under this scenario's name prefix)."""
    out = subprocess.run([sys.executable, "-m", "kafka_idem.cli", "topics", "create", APP_SPEC,
                          "--partitions", "2"], cwd=ws.logdir,
                         env=ws.env(config, NAME_PREFIX=_prefix(ws)),
                         capture_output=True, text=True, timeout=120, check=False)
    if out.returncode:
        raise RuntimeError(f"kafka-idem topics create exited {out.returncode}: "
                           f"{(out.stdout + out.stderr).strip()[-500:]}")
    prefix = _prefix(ws)
    made = sorted(t for t in ws.kafka.admin.list_topics(timeout=15).topics
                  if t.startswith(prefix) and t not in ws.topics)
    ws.topics.extend(made)
    # the relays' group is named after the control topic: removed with the rest
    ws.groups.extend(t for t in made if "kafka-idem-outbox" in t)
    return out.stdout


def _prefix(ws: Workspace) -> str:
    """This scenario's name prefix (inside the settings' own): the relays' control topic
    and transactional ids are its alone, never another run's."""
    return f"{ws.topic}."


def _intents(ws: Workspace, orders: list[str], **kw: Any) -> list[Any]:
    return ws.kafka.produce(ws.topic, [(o.encode(), encode("t1", o, "3.00", **kw), None)
                                       for o in orders])


def _caught_up(ws: Workspace, what: str) -> None:
    wait_for(lambda: ws.kafka.caught_up(ws.group, ws.topic), timeout=90, what=what)


def _published(ws: Workspace, n: int, what: str) -> list[Any]:
    """Wait until the outbox is empty and the event topic holds ``n`` events."""
    return list(wait_for(lambda: (not ws.outbox() and len(got := ws.kafka.read(events(ws))) >= n
                                  and got), timeout=90, what=what))


def events(ws: Workspace) -> str:
    return f"{ws.topic}.events"


def outbox_exactly_once(ws: Workspace, out: Outcome) -> None:
    ws.setup_db()
    ws.setup_topics(partitions=2)
    config = ws.config(permanent_orders=frozenset({"bad"}), events_topic=events(ws))
    created = _topics_create(ws, config)
    member = ws.start(config, OUTBOX_RELAY="false", NAME_PREFIX=_prefix(ws))

    # 1. the outbox alone: rows iff the effect committed, nothing published yet
    first = [f"o{i}" for i in range(1, 7)]
    _intents(ws, first)
    _intents(ws, ["o1"])  # a re-send: replayed
    ws.kafka.produce(ws.topic, [(b"o2", encode("t1", "o2", "9.99"), None)])  # a conflict
    _intents(ws, ["bad"])  # written, then Permanent: rolled back with its emit
    _caught_up(ws, "the member to process the first intents")
    rows = ws.outbox()
    on_topic = ws.kafka.read(events(ws))
    out.check("without a relay: one outbox row per succeeded intent, nothing published",
              sorted(r["idem_key"] for r in rows) == sorted(key_of("t1", o) for o in first)
              and not on_topic, f"{len(rows)} rows, {len(on_topic)} events")

    # 2. relay A publishes; A stopped (zombie); B takes over; A resumed; all killed; C
    relay_a = ws.start(config, relay=True, NAME_PREFIX=_prefix(ws))
    _published(ws, len(first), "relay A to publish the first events")
    relay_a.proc.send_signal(signal.SIGSTOP)
    second = [f"p{i}" for i in range(1, 5)]
    _intents(ws, second)
    _caught_up(ws, "the member to process intents while relay A is stopped")
    relay_b = ws.start(config, relay=True, NAME_PREFIX=_prefix(ws))
    _published(ws, len(first + second), "relay B to take A's shards over and publish")
    relay_a.proc.send_signal(signal.SIGCONT)
    third = ["q1", "q2"]
    _intents(ws, third)
    _published(ws, len(first + second + third), "the events after relay A resumed")
    killed = [relay.kill() for relay in (relay_a, relay_b)]
    fourth = ["r1", "r2", "r3"]
    _intents(ws, fourth)
    _caught_up(ws, "the member to process intents with every relay killed")
    pending = len(ws.outbox())
    ws.start(config, relay=True, NAME_PREFIX=_prefix(ws))
    succeeded = first + second + third + fourth
    got = _published(ws, len(succeeded), "relay C to publish what was left")

    # 3. the event topic, read_committed
    _judge(ws, out, got, [key_of("t1", o) for o in succeeded], member)
    out.figure(topics_create=created.strip().splitlines()[-3:], killed_relays=killed,
               relay_a_log=_shard_lines(relay_a),
               pending_after_kill=pending, events=len(got), records=ws.status_counts(),
               relay_a_alive_after_resume=relay_a.proc.poll() is None or relay_a.proc.poll())
    out.check("after the relays were killed, the rows waited in the outbox for relay C",
              pending == len(fourth) and all(k == -signal.SIGKILL for k in killed),
              f"{pending} pending, exit {killed}")


def _shard_lines(relay: Member) -> list[str]:
    """What relay A's log says about its shards (taken over, fenced, revoked)."""
    text = relay.log.read_text(errors="replace") if relay.log.exists() else ""
    return [line[-160:] for line in text.splitlines() if "outbox shard" in line][-6:]


def _judge(ws: Workspace, out: Outcome, got: list[Any], succeeded: list[str],
           member: Member) -> None:
    by_key = Counter(headers(m).get("idem.key") for m in got)
    rows = Counter(headers(m).get("idem.outbox.id") for m in got)
    records = {k: ws.record(k) for k in succeeded}
    failed = ws.record(key_of("t1", "bad"))
    out.check("exactly one event per succeeded intent",
              by_key == Counter(succeeded), {k: n for k, n in by_key.items() if n != 1})
    out.check("no event for the replay, the conflict or the failed charge",
              set(by_key) == set(succeeded) and failed is not None
              and failed["status"] == "failed", sorted(set(by_key) - set(succeeded)))
    out.check("no outbox row published twice (idem.outbox.id)",
              all(n == 1 for n in rows.values()) and None not in rows,
              [r for r, n in rows.items() if n != 1])
    bad_headers = [(m.partition(), m.offset()) for m in got
                   if any(h not in headers(m) for h in HEADERS)]
    out.check(f"every event carries {', '.join(HEADERS)}", not bad_headers, bad_headers[:5])
    wrong = []
    for m in got:
        h, value = headers(m), json.loads(m.value())
        rec = records.get(h.get("idem.key", ""))
        if rec is None or value["idempotency_key"] != h["idem.key"] \
                or m.key() != value["order_id"].encode() \
                or h["idem.source.topic"] != ws.topic \
                or (int(h["idem.source.partition"]), int(h["idem.source.offset"])) \
                != (rec["kafka_partition"], rec["kafka_offset"]):
            wrong.append(f"p{m.partition()}@{m.offset()} {h.get('idem.key')}")
    out.check("each event's key, value and idem.source.* are its intent's", not wrong, wrong[:5])
    out.check("the member never published (it ran without a relay)",
              member.metric("kafka_idem_outbox_published_total") == 0,
              member.metric("kafka_idem_outbox_published_total"))
    out.check("the outbox is empty", not ws.outbox(), len(ws.outbox()))
