"""The kafka_idem demo: exactly-once effects while a group member is SIGKILLed mid-stream.

    python -m consumers.demo [--intents 3000] [--members 2] [--mode local] [--seed N] [--keep]

Each run is fresh and uniquely named: topic ``demo.<run>.charge-requested``
(4 partitions) and its ``.dlq``, the example's event topic
``demo.<run>.charge-completed`` and its outbox control topic (``kafka-idem topics
create``, name prefix ``demo.<run>.``), store schema ``demo_<run>``, group
``demo-<run>``, tenants ``t<run>-NN``. The example's ``payments`` tables are
shared, so every business check filters on this run's tenants.

It produces charge requests at a steady pace (duplicates as a retrying producer
sends them, payload conflicts, invalid requests, undecodable bytes) to a group
of ``kafka-idem run consumers.payments:app`` processes, SIGKILLs one once about
a third is committed, starts a replacement, waits until the group has caught
up, then checks the ledger, the balances, the store, the DLQ and the events the
members' relays published (one ``ChargeCompleted`` per charge that took effect)
against what it sent. Exit status 0 only if every check passes. Everything is removed at the
end unless ``--keep`` is given or a check failed (then it is kept to inspect).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from decimal import Decimal
from pathlib import Path
from typing import IO, Any, TypeVar

import psycopg
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from psycopg import sql
from rich.columns import Columns
from rich.console import Console
from rich.table import Table

from consumers.payments import CURRENCIES, encode_charge, events_topic
from kafka_idem.keys import hash_payload
from kafka_idem.settings import Settings, load_settings
from tools.kafka_state import read_topic

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
APP = "consumers.payments:app"
PARTITIONS, TENANTS, GARBAGE = 4, 20, 10
# Members' settings unless already set: a dead member leaves the group after 6 s,
# rebalances propagate within 1 s, a dead member's leased claims expire after 10 s.
MEMBER_ENV = {"KAFKA_IDEM_SESSION_TIMEOUT_MS": "6000", "KAFKA_IDEM_LEASE_SECONDS": "10",
              "KAFKA_IDEM_KAFKA": '{"heartbeat.interval.ms": 1000}'}
# a member's rebalance lines, by their structured action (not a logger name)
REBALANCE = re.compile(r": (assigned|revoked|lost) (\S+) action=\1(?=\s|$)")
ROUTINE = ("payload conflict", "cannot be processed", "dead-lettering", "permanent failure")
console = Console(highlight=False)
T0 = time.monotonic()


def say(text: str) -> None:
    console.print(f"[dim]{time.monotonic() - T0:5.1f}s[/] {text}", soft_wrap=True)


@dataclass(frozen=True)
class Intent:
    tenant: str
    order: str
    amount: Decimal
    currency: str

    @property
    def key(self) -> str:
        return f"{self.tenant}:charge:{self.order}"

    @property
    def valid(self) -> bool:
        return self.amount > 0 and self.currency in CURRENCIES


@dataclass
class Msg:
    kind: str  # original | duplicate | conflict | garbage
    intent: Intent | None  # what it asks for (a conflict: its changed amount); None for garbage
    raw: bytes = b""  # a garbage message's value
    where: tuple[int, int] | None = None  # (partition, offset) once acknowledged

    @property
    def dlq_kind(self) -> str | None:
        """The DLQ record this message must end up with, if any."""
        if self.intent is None:
            return "undecodable"
        if self.kind == "conflict":
            return "payload_conflict"
        return None if self.intent.valid else "permanent"

    def value(self) -> bytes:
        if self.intent is None:
            return self.raw
        i = self.intent  # a fresh request_id and requested_at per send, as a producer retry
        return encode_charge(i.tenant, i.order, i.amount, i.currency,
                             request_id=str(uuid.uuid4()), requested_at=dt.datetime.now(dt.UTC))


def plan(n: int, run: str, rng: random.Random) -> tuple[list[Intent], list[Msg]]:
    """The intents, and the messages in send order (an original before its re-sends)."""
    tenants = [f"t{run}-{i:02d}" for i in range(TENANTS)]
    intents = [Intent(rng.choice(tenants), f"o-{i:05d}", Decimal(rng.randint(100, 50_000)) / 100,
                      rng.choice(sorted(CURRENCIES))) for i in range(n)]
    for j, i in enumerate(rng.sample(range(n), max(2, round(n * 0.02)))):  # invalid ones
        bad = intents[i]
        intents[i] = (replace(bad, amount=Decimal(0) if j % 4 == 0 else -bad.amount)
                      if j % 2 == 0 else replace(bad, currency="XXX"))
    slots = [(float(i), Msg("original", it)) for i, it in enumerate(intents)]
    for _ in range(round(n * 0.25)):  # re-sends: some right away, some much later
        i = rng.randrange(n)
        at = i + 0.5 if rng.random() < 0.4 else rng.uniform(i + 1, n)
        slots.append((at, Msg("duplicate", intents[i])))
    for i in rng.sample([i for i, it in enumerate(intents) if it.valid], max(1, round(n * 0.02))):
        other = replace(intents[i], amount=intents[i].amount + Decimal(rng.randint(1, 999)) / 100)
        slots.append((rng.uniform(i + 1, n + 1), Msg("conflict", other)))
    good = encode_charge("t", "o", "1.00")
    junk = [b"", b"not avro", b'{"tenant_id": "t1", "amount": 10}', good[:12],  # truncated
            b"\xc3\x01" + rng.randbytes(8) + good[10:], b"\x00\x00\x00\x00\x01" + good[10:]]
    for g in range(GARBAGE):
        raw = junk[g] if g < len(junk) else rng.randbytes(rng.randint(1, 64))
        slots.append((rng.uniform(0, n), Msg("garbage", None, raw=raw)))
    slots.sort(key=lambda s: s[0])  # stable: an immediate re-send stays after its original
    return intents, [m for _, m in slots]


class Feed(threading.Thread):
    """Sends the messages at a steady pace (idempotent producer, acks=all)."""

    def __init__(self, bootstrap: str, topic: str, msgs: list[Msg], seconds: float) -> None:
        super().__init__(name="demo-feed", daemon=True)
        self.topic, self.msgs, self.seconds = topic, msgs, seconds
        self.producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                                  "acks": "all", "linger.ms": 5})
        self.sent = 0
        self.errors: list[str] = []

    def run(self) -> None:
        start = time.monotonic()
        for i, msg in enumerate(self.msgs):
            wait = start + self.seconds * i / len(self.msgs) - time.monotonic()
            if wait > 0.005:
                time.sleep(wait)
            key = msg.intent.order.encode() if msg.intent else b"garbage-%d" % i
            self.producer.produce(self.topic, key=key, value=msg.value(),
                                  on_delivery=self._acked(msg))
            self.producer.poll(0)
            self.sent = i + 1
        if self.producer.flush(30):
            self.errors.append("messages not acknowledged within 30 s")

    def _acked(self, msg: Msg) -> Callable[[Any, Any], None]:
        def on_delivery(err: Any, record: Any) -> None:
            if err is not None:
                self.errors.append(str(err))
            else:
                msg.where = (record.partition(), record.offset())
        return on_delivery


class Member:
    """One ``kafka-idem run`` process: full log to a file, rebalances and surprises shown."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.partitions: set[int] = set()
        self.joined = threading.Event()
        self.killed = False
        assert self.proc.stdout is not None
        threading.Thread(target=self._read, args=(self.proc.stdout, log), daemon=True).start()
        say(f"{name} started (pid {self.proc.pid})")

    def _read(self, stream: IO[str], log: Path) -> None:
        seen: set[str] = set()
        with log.open("w") as out:
            for line in stream:
                out.write(line)
                event = REBALANCE.search(line)
                if event:
                    parts = {int(p) for p in re.findall(r"\[(\d+)\]", event[2])}
                    if event[1] == "assigned":
                        self.partitions |= parts
                        self.joined.set()
                    else:
                        self.partitions -= parts
                    if parts:
                        say(f"{self.name} {event[1]} {sorted(parts)}, holds "
                            f"{sorted(self.partitions)}")
                elif re.search(r" (ERROR|CRITICAL|WARNING) |Traceback", line) and not any(
                        r in line for r in ROUTINE):
                    text = line.strip().split(" ", 2)[-1][:240]  # without the timestamp
                    if text not in seen:  # each distinct surprise once
                        seen.add(text)
                        say(f"{self.name}: [yellow]{text}[/]")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.killed = True


def stop(members: list[Member], quiet: bool = False) -> dict[str, int | None]:
    """SIGTERM the live members, wait for them; their exit codes (None: had to be killed)."""
    live = [m for m in members if m.proc.poll() is None]
    for m in live:
        m.proc.send_signal(signal.SIGTERM)
    codes: dict[str, int | None] = {}
    for m in (m for m in members if not m.killed):
        try:
            codes[m.name] = m.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            m.proc.kill()
            codes[m.name] = None
        if not quiet:
            say(f"{m.name} stopped, exit {codes[m.name]}")
    return codes


class Offsets:
    """The group's committed offsets (asked without joining it) and the end offsets."""

    def __init__(self, bootstrap: str, group: str, topic: str) -> None:
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                                  "enable.auto.commit": False})
        self.tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]

    def committed(self) -> list[int]:
        got = self._retrying(lambda: self.consumer.committed(self.tps, timeout=10))
        return [max(tp.offset, 0) for tp in got]

    def ends(self) -> list[int]:
        return self._retrying(
            lambda: [self.consumer.get_watermark_offsets(tp, timeout=10)[1] for tp in self.tps]
        )

    @staticmethod
    def _retrying(ask: Callable[[], T]) -> T:
        """A moved group coordinator or a restarting broker is a pause, not a failure."""
        for _ in range(30):
            try:
                return ask()
            except KafkaException as exc:
                if not exc.args[0].retriable() and exc.args[0].code() not in (
                    KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE,
                    KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN):
                    raise
                time.sleep(1)
        return ask()


def read_dlq(bootstrap: str, topic: str) -> list[dict[str, str]]:
    """The headers of every DLQ record, read to the end of each partition."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{topic}-reader",
                         "enable.auto.commit": False})
    left = {p: end for p in range(PARTITIONS)
            if (end := consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1])}
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in left])
    records: list[dict[str, str]] = []
    deadline = time.monotonic() + 60
    while left and time.monotonic() < deadline:
        batch: list[Any] = consumer.consume(500, timeout=1)
        for m in batch:
            if m.error() is None:
                records.append({k: (v or b"").decode() for k, v in m.headers() or []})
                if m.offset() + 1 >= left.get(m.partition(), 0):
                    left.pop(m.partition(), None)
    consumer.close()
    return records


def wait_until(what: str, done: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            say(f"[red]gave up after {timeout:.0f}s waiting for {what}[/]")
            return False
        time.sleep(0.2)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m consumers.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--intents", type=int, default=3000, help="business intents (default 3000)")
    ap.add_argument("--members", type=int, default=2, help="group members (default 2)")
    ap.add_argument("--mode", choices=("local", "leased"), default="local",
                    help="the handler's processing mode (default local)")
    ap.add_argument("--seed", type=int, help="random seed (default: a new one, printed)")
    ap.add_argument("--produce-seconds", type=float, default=10.0, help="spread sends over this")
    ap.add_argument("--timeout", type=float, default=180.0, help="longest wait to catch up")
    ap.add_argument("--keep", action="store_true", help="keep topics, schema, rows and logs")
    args = ap.parse_args(argv)
    if args.intents < 100 or not 1 <= args.members <= PARTITIONS:
        ap.error(f"--intents must be at least 100 and --members 1 to {PARTITIONS}")
    s = load_settings()
    run = uuid.uuid4().hex[:8]
    seed = args.seed if args.seed is not None else random.randrange(1_000_000)
    topic, schema, group = f"demo.{run}.charge-requested", f"demo_{run}", f"demo-{run}"
    tenants, logs = f"t{run}-%", Path(tempfile.mkdtemp(prefix=f"kafka-idem-demo-{run}-"))
    console.rule(f"kafka_idem demo: run {run}, seed {seed}, {args.mode} mode")
    say(f"Kafka {s.bootstrap_servers}, PostgreSQL {s.redacted()['database_url']}")
    admin = AdminClient(s.admin_config())
    members: list[Member] = []
    passed = False
    try:
        new = [NewTopic(t, PARTITIONS, 1) for t in (topic, topic + ".dlq")]
        for f in admin.create_topics(new).values():
            f.result(timeout=30)
        say(f"created topics {topic} and its .dlq, {PARTITIONS} partitions each")
        cli = [*kafka_idem_cli(), "--schema", schema]
        env = {**MEMBER_ENV, **os.environ, "PAYMENTS_TOPIC": topic, "PAYMENTS_MODE": args.mode,
               "KAFKA_IDEM_NAME_PREFIX": f"demo.{run}.",  # the relays' control topic: ours
               "KAFKA_IDEM_BOOTSTRAP_SERVERS": s.bootstrap_servers,
               "KAFKA_IDEM_DATABASE_URL": s.dsn,
               "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.getenv("PYTHONPATH"))))}
        out = subprocess.run([*cli, "migrate", "--app", APP], env=env, cwd=ROOT, text=True,
                             capture_output=True, check=False)
        if out.returncode:
            console.print(out.stdout + out.stderr, markup=False)
            raise RuntimeError("kafka-idem migrate failed")
        say(f"kafka-idem migrate: {out.stdout.strip()}")
        out = subprocess.run([*cli, "topics", "create", APP, "--partitions", str(PARTITIONS)],
                             env=env, cwd=ROOT, text=True, capture_output=True, check=False)
        if out.returncode:
            console.print(out.stdout + out.stderr, markup=False)
            raise RuntimeError("kafka-idem topics create failed")
        say(f"kafka-idem topics create: {out.stdout.strip().splitlines()[-1]}")
        intents, msgs = plan(args.intents, run, random.Random(seed))
        say(f"planned {len(intents)} intents as {len(msgs)} messages: "
            + ", ".join(f"{v} {k}" for k, v in Counter(m.kind for m in msgs).items()))

        def member(n: int) -> Member:
            cmd = [*cli, "run", APP, "--group-id", group]
            return Member(f"member-{n}", cmd, env, logs / f"member-{n}.log")

        members = [member(n + 1) for n in range(args.members)]
        ready = wait_until("every member to get partitions", lambda: all(
            m.partitions for m in members) and sum(len(m.partitions) for m in members)
            == PARTITIONS, 60)
        offsets = Offsets(s.bootstrap_servers, group, topic)
        feed = Feed(s.bootstrap_servers, topic, msgs, args.produce_seconds)
        feed.start()
        say(f"producing {len(msgs)} messages over ~{args.produce_seconds:.0f}s")
        last, now = 0.0, ([0], [0])

        def poll() -> tuple[list[int], list[int]]:
            nonlocal last, now
            now = offsets.committed(), offsets.ends()
            if time.monotonic() - last >= 2:
                last = time.monotonic()
                say(f"sent {feed.sent}, committed {sum(now[0])}, lag {sum(now[1]) - sum(now[0])}")
            return now

        wait_until("a third to be committed", lambda: sum(poll()[0]) >= len(msgs) / 3, 60)
        victim = max(members, key=lambda m: len(m.partitions))
        held, done, sent = sorted(victim.partitions), sum(now[0]), feed.sent
        victim.kill()
        say(f"[bold red]SIGKILL {victim.name}[/] (pid {victim.proc.pid}, partitions {held}) "
            f"with {done}/{len(msgs)} committed, {sent} sent")
        members.append(replacement := member(args.members + 1))

        def caught_up() -> bool:
            committed, ends = poll()
            return not feed.is_alive() and committed == ends

        in_time = wait_until("the group to catch up", caught_up, args.timeout)
        published = wait_until("the outbox to be published",
                               lambda: not outbox_left(s, schema), 60)
        say(f"[red]producer errors: {feed.errors[:3]}[/]" if feed.errors else
            f"all {feed.sent} messages acknowledged; " + ("caught up: committed == end offsets "
                                                          "on every partition" if in_time else ""))
        codes = stop(members)
        final = offsets.committed(), offsets.ends()
        offsets.consumer.close()
        joined = replacement.joined.is_set()
        checks = [("setup: members assigned, sends acknowledged", ready and not feed.errors, ""),
                  *verify(s, schema, tenants, intents, msgs,
                          read_dlq(s.bootstrap_servers, topic + ".dlq")),
                  ("(e) committed offsets == end offsets", in_time and final[0] == final[1],
                   f"{final[0]}"),
                  events_check(s, schema, events_topic(topic), published),
                  ("(f) member SIGKILLed mid-run, replacement joined",
                   bool(held) and done < len(msgs) and joined,
                   f"{victim.name} killed holding {held} at {done}/{len(msgs)} committed; "
                   f"{replacement.name} {'got partitions' if joined else 'got none'}"),
                  ("members exit 0 on SIGTERM", all(c == 0 for c in codes.values()),
                   ", ".join(f"{k} {v}" for k, v in codes.items()))]
        passed = show_checks(checks)
        say(f"done in {time.monotonic() - T0:.1f}s")
    finally:
        stop(members, quiet=True)
        keep = args.keep or not passed
        say(f"artefacts: schema {schema}, topic {topic} (+ .dlq), group {group}, rows of "
            f"tenants {tenants} in payments.*, member logs {logs}: "
            + ("kept" if keep else "removing"))
        if not keep:
            ours = [t for t in admin.list_topics(timeout=15).topics if t.startswith(f"demo.{run}.")]
            cleanup(s, admin, schema, tenants, ours, [group, *(
                t for t in ours if "kafka-idem-outbox" in t)], logs)
    return 0 if passed else 1


def kafka_idem_cli() -> list[str]:
    script = Path(sys.executable).with_name("kafka-idem")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kafka_idem.cli"]


def table(title: str, columns: Iterable[str], rows: Iterable[Iterable[Any]],
          right: tuple[int, ...] = (1,)) -> Table:
    t = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        t.add_column(col, justify="right" if i in right else "left")
    for row in rows:
        t.add_row(*(str(v) for v in row))
    return t


def verify(s: Settings, schema: str, tenants: str, intents: list[Intent], msgs: list[Msg],
           dead_letters: list[dict[str, str]]) -> list[tuple[str, bool, str]]:
    """Print what happened; return checks (a) to (d)."""
    with psycopg.connect(s.dsn) as conn:
        ledger: dict[str, int] = dict(conn.execute(
            "SELECT idempotency_key, count(*) FROM payments.ledger WHERE tenant_id LIKE %s "
            "GROUP BY 1", (tenants,)).fetchall())
        balances = {(t, c): b for t, c, b in conn.execute(
            "SELECT tenant_id, currency, balance FROM payments.balances WHERE tenant_id LIKE %s",
            (tenants,))}
        store = {k: (st, h, n) for k, st, h, n in conn.execute(sql.SQL(
            "SELECT idempotency_key, status, request_hash, attempts FROM {}").format(
            sql.Identifier(schema, s.table)))}
    valid = {i.key: i for i in intents if i.valid}
    expected: dict[tuple[str, str], Decimal] = defaultdict(Decimal)
    for i in valid.values():
        expected[(i.tenant, i.currency)] += i.amount
    dlq: dict[tuple[int, int], list[str]] = defaultdict(list)
    for h in dead_letters:
        source = (int(h["idem.original.partition"]), int(h["idem.original.offset"]))
        dlq[source].append(h["idem.error.kind"])
    want = {m.where: m.dlq_kind for m in msgs if m.dlq_kind}
    by_kind, want_kind = Counter(h["idem.error.kind"] for h in dead_letters), Counter(want.values())
    statuses = Counter(st for st, _, _ in store.values())
    kinds = Counter(m.kind for m in msgs)
    rows, to_valid = sum(ledger.values()), sum(
        1 for m in msgs if m.kind != "conflict" and m.intent and m.intent.valid)
    console.print(table("What happened", ("", "count", "expected"), [
        ("intents (valid + invalid)", f"{len(intents)} ({len(valid)} + "
         f"{len(intents) - len(valid)})", ""),
        ("messages produced", len(msgs), " + ".join(f"{v} {k}" for k, v in kinds.items())),
        ("ledger rows", rows, len(valid)),
        ("distinct keys in ledger", len(ledger), len(valid)),
        ("duplicates suppressed", to_valid - rows, to_valid - len(valid)),
        *((f"{label} (DLQ {kind})", by_kind[kind], want_kind[kind]) for label, kind in (
            ("conflicts", "payload_conflict"), ("failures", "permanent"),
            ("undecodable", "undecodable"))),
        ("DLQ records sent again after the kill", sum(len(v) - 1 for v in dlq.values()), "0+"),
        ("records with attempts > 1", sum(1 for *_, n in store.values() if n > 1), "0+"),
    ], right=(1, 2)))
    console.print(Columns([table("DLQ records by kind", ("idem.error.kind", "records"),
                                 sorted(by_kind.items())),
                           table("Store records by status", ("status", "records"),
                                 sorted(statuses.items()))]))

    def lacking(kind: str) -> list[Any]:
        return [w for w, k in want.items() if k == kind and kind not in dlq.get(w or (-1, -1), [])]

    wrong_rows = [k for k in valid if ledger.get(k) != 1] + [k for k in ledger if k not in valid]
    wrong_sums = sorted(k for k in expected.keys() | balances.keys()
                        if expected.get(k) != balances.get(k))
    invalid = [i.key for i in intents if not i.valid]
    not_failed = [k for k in invalid if store.get(k, ("",))[0] != "failed"]
    conflicted = [m.intent.key for m in msgs if m.kind == "conflict" and m.intent]
    changed = [k for k in conflicted if store.get(k, ("",))[:2] != (
        "succeeded", hash_payload(valid[k], ("amount", "currency")))]
    stuck = statuses["processing"] + statuses["retryable_failed"]
    return [
        ("(a) one ledger row per valid intent, no other", not wrong_rows,
         f"{len(valid)} keys x 1 row" if not wrong_rows else f"{len(wrong_rows)} keys wrong: "
         + ", ".join(f"{k}={ledger.get(k, 0)}" for k in wrong_rows[:5])),
        ("(b) balances == sums of valid intents", not wrong_sums,
         f"{len(expected)} (tenant, currency)" if not wrong_sums else f"{len(wrong_sums)} differ: "
         + ", ".join(f"{k} {balances.get(k)} != {expected.get(k)}" for k in wrong_sums[:3])),
        ("(c) invalid intents failed, dead-lettered", not not_failed and not lacking("permanent"),
         f"{len(invalid)} keys; not failed: {not_failed[:3]}, no DLQ: {lacking('permanent')[:3]}"),
        ("(c) conflicts dead-lettered, original kept", not changed
         and not lacking("payload_conflict"), f"{len(conflicted)} messages; original changed: "
         f"{changed[:3]}, no DLQ: {lacking('payload_conflict')[:3]}"),
        ("(c) undecodable dead-lettered", not lacking("undecodable"),
         f"{kinds['garbage']} messages; no DLQ: {lacking('undecodable')[:3]}"),
        ("(c) nothing else dead-lettered", not dlq.keys() - want.keys(),
         f"{len(dlq.keys() - want.keys())} other messages in the DLQ"),
        ("(d) no record stuck", not stuck and len(store) == len(intents),
         f"{len(store)} records, {stuck} processing or retryable_failed"),
    ]


def show_checks(checks: list[tuple[str, bool, str]]) -> bool:
    console.print(table("Checks", ("check", "", "detail"), (
        (name, "[green]PASS[/]" if ok else "[bold red]FAIL[/]", detail)
        for name, ok, detail in checks), right=()))
    ok = all(c[1] for c in checks)
    console.print("[bold green]Every intent took effect exactly once.[/]" if ok
                  else "[bold red]Some checks failed.[/]")
    return ok


def outbox_left(s: Settings, schema: str) -> int:
    with psycopg.connect(s.dsn) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(
            sql.Identifier(schema, "outbox"))).fetchone()
    return int(row[0]) if row else 0


def events_check(s: Settings, schema: str, events: str, published: bool) -> tuple[str, bool, str]:
    """(g): the event topic, read as read_committed: one event per succeeded intent."""
    with psycopg.connect(s.dsn) as conn:
        done = {r[0] for r in conn.execute(sql.SQL(
            "SELECT idempotency_key FROM {} WHERE status = 'succeeded'").format(
                sql.Identifier(schema, "task_idempotency"))).fetchall()}
    records, _ = read_topic(s.bootstrap_servers, events, kafka=s.kafka)
    got = Counter(dict(r.headers).get("idem.key", b"").decode() for r in records)
    ok = published and set(got) == done and all(n == 1 for n in got.values())
    return ("(g) one charge-completed event per charge that took effect (read_committed)", ok,
            f"{len(records)} events for {len(done)} succeeded intents; "
            f"{sum(1 for n in got.values() if n > 1)} keys twice, "
            f"{len(set(got) - done)} for no success, {len(done - set(got))} missing")


def cleanup(s: Settings, admin: AdminClient, schema: str, tenants: str, topics: list[str],
            groups: list[str], logs: Path) -> None:
    with psycopg.connect(s.dsn) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        for name in ("ledger", "balances"):
            conn.execute(sql.SQL("DELETE FROM {} WHERE tenant_id LIKE %s").format(
                sql.Identifier("payments", name)), (tenants,))
    futures = [*admin.delete_topics(topics, operation_timeout=30).values(),
               *admin.delete_consumer_groups(groups, request_timeout=30).values()]
    for f in futures:
        try:
            f.result(timeout=30)
        except Exception as exc:  # best effort: say so and go on
            say(f"[yellow]cleanup: {exc}[/]")
    shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
