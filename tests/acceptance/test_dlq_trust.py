"""Who a replay may act for: forged, altered and unsendable dead letters, through the CLI
against the real broker and database.

Two apps share one store and one broker: ``nubapp`` (the payments example on topic
N, namespace ``nubapp``) and ``payments`` (the same code on topic P, its own
namespace). Whoever can write to N's DLQ writes what they like there; a replay of
it, run by an operator, must never change a record of ``payments``, never send
anything to P, never fail because of one record, and never leave a key re-run
without its message on the way. Outcomes are durable state: records and audit rows
in the store, end offsets and records of the topics, the replay's JSON summary.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from consumers.payments import encode_charge
from kafka_idem.deadletters.signing import SIGNATURE, sign
from kafka_idem.keys import request_hash
from kafka_idem.store import Delivery, Store, connect
from tests.acceptance.conftest import Result, headers_of, kafka_idem, read_all
from tests.conftest import (
    ADMIN_DSN,
    BOOTSTRAP,
    DB,
    InProcess,
    Topics,
    app_settings,
    end_offsets,
    produce,
    wait_for,
)

KEY1 = "k" * 24  # signing keys (at least 16 bytes)
KEY2 = "m" * 24
PAYMENTS_APP = "consumers.payments:app"
REASON = ("--include-permanent", "--reason", "INC-30: trust")


def charge_hash(amount: str) -> str:
    return request_hash({"amount": Decimal(amount), "currency": "EUR"})


@dataclass
class Stage:
    """Two apps' topics and one store holding a failed key of each."""

    n: str  # nubapp's topic (its DLQ is n + ".dlq")
    p: str  # payments' topic
    x: str  # a topic neither replay may send to
    db: DB

    @property
    def dlq(self) -> str:
        return f"{self.n}.dlq"

    def env(self, **extra: str) -> dict[str, str]:
        """``--app consumers.payments:app`` as nubapp: its topic and namespace."""
        return {"PAYMENTS_TOPIC": self.n, "KAFKA_IDEM_NAMESPACE": "nubapp", **extra}

    def replay(self, *args: str, env: dict[str, str] | None = None) -> Result:
        return kafka_idem("dlq", "replay", "--dlq", self.dlq, "--no-progress", "--json",
                          *args, db=self.db, env={**self.env(), **(env or {})})

    def records(self, namespace: str) -> list[dict[str, Any]]:
        return self.db.rows(
            "SELECT idempotency_key, status, attempts, attempt_base, updated_at, error_kind "
            "FROM kafka_idem.task_idempotency WHERE namespace = %s ORDER BY 1", (namespace,))

    def audit(self, namespace: str) -> list[dict[str, Any]]:
        return self.db.rows("SELECT * FROM kafka_idem.admin_audit WHERE namespace = %s "
                            "ORDER BY id", (namespace,))


def fail(db: DB, namespace: str, topic: str, key: str, amount: str = "10.00",
         kind: str = "permanent") -> None:
    """A record of ``key`` that failed (as a handler's permanent error or exhaustion)."""
    store = Store(schema="kafka_idem", table="task_idempotency", namespace=namespace)
    conn = connect(db.dsn)
    try:
        with conn.transaction():
            claim = store.claim(conn, key=key, request_hash=charge_hash(amount),
                                delivery=Delivery(topic, 0, 0, "charge"), lease_seconds=60,
                                max_attempts=5, max_elapsed_seconds=3600)
            assert claim.token is not None
            store.fail(conn, key=key, token=claim.token, status="failed", kind=kind,
                       error_class="Permanent", error_message="amount refused")
    finally:
        conn.close()


def letter_headers(*, topic: str | None, partition: str | None = "0", key: str | None,
                   namespace: str | None, kind: str = "permanent") -> list[tuple[str, bytes]]:
    """The ``idem.*`` headers a dead letter has, each one given or left out."""
    now = dt.datetime.now(dt.UTC).isoformat()
    pairs: list[tuple[str, str | None]] = [
        ("idem.original.topic", topic), ("idem.original.partition", partition),
        ("idem.original.offset", "0"), ("idem.original.timestamp", "-1"),
        ("idem.error.kind", kind), ("idem.error.class", "Permanent"),
        ("idem.error.message", "amount refused"), ("idem.attempts", "1"),
        ("idem.first_failure_at", now), ("idem.last_failure_at", now),
        ("idem.consumer_group", "payments"), ("idem.handler", "charge"),
        ("idem.namespace", namespace), ("idem.key", key),
    ]
    return [(k, v.encode()) for k, v in pairs if v is not None]


def signed(headers: list[tuple[str, bytes]], kafka_key: bytes | None, value: bytes | None,
           secret: str = KEY1) -> list[tuple[str, bytes]]:
    return [*headers, (SIGNATURE, sign(secret.encode(), headers, kafka_key, value).encode())]


def write(topic: str, records: list[tuple[bytes | None, bytes | None, list[Any]]]) -> None:
    producer = Producer({"bootstrap.servers": BOOTSTRAP, "enable.idempotence": True})
    for kafka_key, value, hdrs in records:
        producer.produce(topic, key=kafka_key, value=value, headers=hdrs)
    assert producer.flush(30) == 0


@pytest.fixture
def stage(db: DB, topics: Topics) -> Stage:
    n, p = topics(partitions=2, prefix="nub"), topics(partitions=1, prefix="pay")
    x = topics(partitions=1, dlq=False, prefix="other")
    fail(db, "payments", p, "victim:charge:v3")
    fail(db, "nubapp", n, "t1:charge:n1")
    fail(db, "nubapp", n, "t1:charge:n2", kind="exhausted")
    return Stage(n, p, x, db)


def test_forged_headers_never_steer_a_replay_into_another_app(stage: Stage) -> None:
    """Found by an attacker's trial: records produced by hand to nubapp's DLQ naming
    payments' namespace, key and topic re-ran payments' failed key and booked a 700
    charge on payments' topic, with or without --namespace. Now each is skipped as
    untrusted and counted by reason, nubapp's own failed key is still re-driven, and
    every run exits 0."""
    evil = encode_charge("victim", "v3", "700.00")
    write(stage.dlq, [
        (b"v3", evil, letter_headers(topic=stage.p, key="victim:charge:v3",
                                     namespace="payments")),
        (b"v4", encode_charge("victim", "v4", "700.00"),
         letter_headers(topic=stage.p, key=None, namespace=None, kind="undecodable")),
        (b"v5", evil, letter_headers(topic=stage.n, key="victim:charge:v3",
                                     namespace="payments")),
        (b"n1", encode_charge("t1", "n1", "10.00"),
         letter_headers(topic=stage.n, key="t1:charge:n1", namespace="nubapp")),
    ])
    payments_before = stage.records("payments")
    p_end = end_offsets(stage.p)

    bare = stage.replay(*REASON, "--dry-run")
    with_ns = stage.replay(*REASON, "--namespace", "nubapp", "--dry-run")
    with_app = stage.replay(*REASON, "--app", PAYMENTS_APP)
    for r in (bare, with_ns, with_app):
        assert r.code == 0, (r.out, r.err)
    assert bare.json()["untrusted"] == {"other_topic": 2, "no_namespace": 2}
    assert with_ns.json()["untrusted"] == {"other_topic": 2, "other_namespace": 1}
    summary = with_app.json()
    assert summary["untrusted"] == {"other_topic": 2, "other_namespace": 1}
    assert (summary["rerun"], summary["sent"], summary["targets"]) == (1, 1, {stage.n: 1})
    # One line per refusal, naming the record's position and why.
    lines = [ln for ln in with_app.err.splitlines() if "not replayed (untrusted" in ln]
    assert len(lines) == 3 and all(f"{stage.dlq}[" in ln for ln in lines)

    assert stage.records("payments") == payments_before  # nothing of payments changed
    assert stage.audit("payments") == []
    assert end_offsets(stage.p) == p_end  # nothing reached payments' topic
    assert [a["idempotency_key"] for a in stage.audit("nubapp") if a["action"] == "rerun"] == [
        "t1:charge:n1"]


def test_a_value_that_does_not_build_its_key_is_not_re_run(stage: Stage) -> None:
    """With --app, a dead letter naming nubapp's failed key n1 whose value is another
    charge (or n1 with another amount: another request hash) re-runs nothing."""
    write(stage.dlq, [
        (b"a", encode_charge("t1", "fresh", "10.00"),
         letter_headers(topic=stage.n, key="t1:charge:n1", namespace="nubapp")),
        (b"b", encode_charge("t1", "n1", "999.00"),
         letter_headers(topic=stage.n, key="t1:charge:n1", namespace="nubapp")),
        (b"c", b"\x00 not avro",
         letter_headers(topic=stage.n, key="t1:charge:n1", namespace="nubapp")),
    ])
    before = stage.records("nubapp")
    r = stage.replay(*REASON, "--app", PAYMENTS_APP)
    assert r.code == 0, r.err
    assert r.json()["untrusted"] == {"key_mismatch": 3}
    assert r.json()["sent"] == 0
    assert stage.records("nubapp") == before
    assert end_offsets(stage.n) == {0: 0, 1: 0}
    listed = kafka_idem("dlq", "list", "--dlq", stage.dlq, "--app", PAYMENTS_APP, "--json",
                        db=stage.db, env=stage.env())
    assert listed.code == 0, listed.err
    assert [x["trust"] for x in listed.json()] == ["key_mismatch"] * 3
    first = listed.json()[0]
    shown = kafka_idem("dlq", "show", "--dlq", stage.dlq, "--partition",
                       str(first["partition"]), "--offset", str(first["offset"]),
                       "--app", PAYMENTS_APP, db=stage.db, env=stage.env())
    assert shown.code == 0, shown.err
    assert "trust:      key_mismatch (its value does not build" in shown.out
    assert "signature:  unverifiable" in shown.out


def test_a_payload_conflict_letter_is_not_called_a_key_mismatch(stage: Stage) -> None:
    """A payload conflict's dead letter holds another request hash than its key's record
    (that is the conflict): ``dlq list --app`` calls it trusted (the replay skips it as a
    conflict, never re-runs it); a value that does not build the key it names is still a
    mismatch in the list."""
    write(stage.dlq, [
        (b"n1", encode_charge("t1", "n1", "999.00"),
         letter_headers(topic=stage.n, key="t1:charge:n1", namespace="nubapp",
                        kind="payload_conflict")),
        (b"x", encode_charge("t1", "other", "999.00"),
         letter_headers(topic=stage.n, key="t1:charge:n1", namespace="nubapp",
                        kind="payload_conflict")),
    ])
    listed = kafka_idem("dlq", "list", "--dlq", stage.dlq, "--app", PAYMENTS_APP, "--json",
                        db=stage.db, env=stage.env())
    assert listed.code == 0, listed.err
    assert [x["trust"] for x in listed.json()] == ["ok", "key_mismatch"]
    r = stage.replay(*REASON, "--app", PAYMENTS_APP, "--dry-run")
    assert r.code == 0, r.err
    assert (r.json()["skipped_conflict"], r.json()["untrusted"], r.json()["would_send"]) == (
        2, {}, 0)  # a conflict is never re-run: its trust is never in question


def test_an_unsendable_record_neither_blocks_the_replay_nor_strands_its_key(
    stage: Stage,
) -> None:
    """Found by a damaged-DLQ trial: a record whose idem.original.partition is 999 made
    every run abort (exit 3), after the batch's keys had been re-run with no message on
    the way. Now it is skipped as unsendable with its position, its key is not re-run,
    and the rest of the batch goes."""
    write(stage.dlq, [
        (b"n1", encode_charge("t1", "n1", "10.00"),
         letter_headers(topic=stage.n, partition="999", key="t1:charge:n1",
                        namespace="nubapp")),
        (b"n2", encode_charge("t1", "n2", "10.00"),
         letter_headers(topic=stage.n, partition="1", key="t1:charge:n2", namespace="nubapp",
                        kind="exhausted")),
        (b"j", b"junk", letter_headers(topic=stage.n, partition="-3", key=None,
                                       namespace="nubapp", kind="undecodable")),
    ])
    dry = stage.replay(*REASON, "--app", PAYMENTS_APP, "--dry-run")
    r = stage.replay(*REASON, "--app", PAYMENTS_APP)
    assert dry.code == 0 and r.code == 0, (dry.err, r.err)
    summary = r.json()
    assert (summary["sent"], summary["rerun"], summary["skipped_unsendable"]) == (1, 1, 2)
    assert sorted(u["reason"].split(":")[0] for u in summary["unsendable"]) == [
        "no_partition", "no_partition"]
    assert dry.json()["skipped_unsendable"] == 2 and dry.json()["would_send"] == 1
    # one line per record set aside, naming its position and why
    lines = [ln for ln in r.err.splitlines() if "not replayed (unsendable: no_partition)" in ln]
    assert len(lines) == 2 and all(f"{stage.dlq}[" in ln for ln in lines)
    assert any("has no partition 999" in ln for ln in lines)
    status = {rec["idempotency_key"]: rec["status"] for rec in stage.records("nubapp")}
    assert status == {"t1:charge:n1": "failed", "t1:charge:n2": "retryable_failed"}
    [copy] = read_all(stage.n)  # n2's message, on its original partition
    assert (copy.key(), copy.partition()) == (b"n2", 1)


def test_dead_letters_are_signed_and_a_replay_acts_only_on_signatures_that_hold(
    db: DB, topics: Topics,
) -> None:
    """A member with signing keys signs every dead letter; with the keys configured a
    replay sends or re-runs only records whose signature holds, an unsigned one only
    with --trust-unsigned, an altered one never; a rotated key list still verifies
    old letters; `dlq show` says which is which."""
    from consumers.payments import build_app

    topic = topics(partitions=1)
    dlq = f"{topic}.dlq"
    app = build_app(topic=topic, events=False,
                    **app_settings(db, group_id=f"g-{uuid.uuid4().hex[:8]}",
                                   namespace="nubapp", dlq_signing_keys=KEY1))
    produce(topic, [(b"o1", encode_charge("t1", "o1", "0"))])  # permanent: amount
    with InProcess(app):
        wait_for(lambda: len(read_all(dlq)) == 1, what="the dead letter")
    [real] = read_all(dlq)
    assert headers_of(real)[SIGNATURE].startswith("v1:")
    hdrs = list(real.headers() or [])
    altered = [(k, b"payments" if k == "idem.namespace" else v) for k, v in hdrs]
    unsigned = [(k, v) for k, v in hdrs if k != SIGNATURE]
    write(dlq, [(real.key(), encode_charge("t1", "o1", "700"), hdrs),  # value swapped
                (real.key(), real.value(), altered), (real.key(), real.value(), unsigned)])
    env = {"PAYMENTS_TOPIC": topic, "KAFKA_IDEM_NAMESPACE": "nubapp",
           "KAFKA_IDEM_DLQ_SIGNING_KEYS": f"{KEY2},{KEY1}"}  # rotated: KEY2 signs now

    def show(offset: int) -> str:
        r = kafka_idem("dlq", "show", "--dlq", dlq, "--partition", "0", "--offset",
                       str(offset), "--json", db=db, env=env)
        assert r.code == 0, r.err
        return str(r.json()["signature"])

    assert [show(o) for o in range(4)] == ["valid", "invalid", "invalid", "unsigned"]
    no_keys = kafka_idem("dlq", "show", "--dlq", dlq, "--partition", "0", "--offset", "0",
                         db=db, env={"PAYMENTS_TOPIC": topic})
    assert "signature:  unverifiable" in no_keys.out

    def replay(*args: str) -> dict[str, Any]:
        r = kafka_idem("dlq", "replay", "--dlq", dlq, "--app", PAYMENTS_APP, "--no-progress",
                       "--json", "--dry-run", *REASON, *args, db=db, env=env)
        assert r.code == 0, r.err
        return dict(r.json())

    strict = replay()
    assert strict["untrusted"] == {"bad_signature": 2, "unsigned": 1}
    assert [w["offset"] for w in strict["would_send_records"]] == [0]
    loose = replay("--trust-unsigned")
    assert loose["untrusted"] == {"bad_signature": 2}
    # the unsigned copy is the key's latest dead letter: it is the one sent
    assert [w["offset"] for w in loose["would_send_records"]] == [3]
    assert strict["verified"] is True


# --- the property: whatever is written to one app's DLQ -----------------------------


@dataclass
class Shared:
    """One store template holding both apps' records, and the topics, for the property
    test (a fresh database per example, cloned from the template)."""

    n: str
    p: str
    x: str
    template: str


@pytest.fixture(scope="module")
def shared(template_db: str, admin: Any) -> Iterator[Shared]:
    topics = Topics(admin)
    n, p = topics(partitions=2, prefix="nubp"), topics(partitions=1, prefix="payp")
    x = topics(partitions=1, dlq=False, prefix="otherp")
    name = f"kafka_idem_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template_db)))
    base = DB(name)
    for key in ("victim:charge:v1", "victim:charge:v2"):
        fail(base, "payments", p, key)
    for key in ("t1:charge:n1", "t1:charge:n2"):
        fail(base, "nubapp", n, key)
    fail(base, "nubapp", n, "t1:charge:n3", kind="exhausted")
    try:
        yield Shared(n, p, x, name)
    finally:
        topics.delete_all()
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


ORDERS = ("n1", "n2", "n3", "v1", "v2", "fresh")
KINDS = {"n1": "permanent", "n2": "permanent", "n3": "exhausted"}
# What a field of a genuine dead letter of nubapp may be changed to by whoever writes.
MUTATIONS: dict[str, st.SearchStrategy[Any]] = {
    "namespace": st.sampled_from([None, "payments", "", "other"]),
    "key": st.sampled_from([None, "t1:charge:n1", "t1:charge:n3", "victim:charge:v1",
                            "victim:charge:v2", "t1:charge:zz"]),
    "kind": st.sampled_from(["permanent", "exhausted", "payload_conflict", "undecodable",
                             "bogus"]),
    "topic": st.sampled_from(["p", "x", "t-missing-topic", None]),
    "partition": st.sampled_from([None, "1", "999", "-1", "x"]),
    "value": st.sampled_from([*ORDERS, None, "junk", "empty"]),
    "amount": st.just("700.00"),
    "signature": st.sampled_from(["none", "other-key", "garbage"]),
}


@st.composite
def header_sets(draw: st.DrawFn) -> dict[str, Any]:
    """A dead letter of nubapp as its member writes it (a failed key's, or undecodable
    bytes'), with up to three of its fields changed: namespaces, keys, kinds, topics,
    partitions, values and signatures."""
    order = draw(st.sampled_from([*KINDS, "junk"]))
    spec: dict[str, Any] = {
        "namespace": "nubapp", "key": f"t1:charge:{order}" if order in KINDS else None,
        "kind": KINDS.get(order, "undecodable"), "topic": "n", "partition": "0",
        "value": order, "amount": "10.00", "signature": "valid"}
    for field_ in draw(st.lists(st.sampled_from(sorted(MUTATIONS)), max_size=3, unique=True)):
        spec[field_] = draw(MUTATIONS[field_])
    return spec


modes = st.fixed_dictionaries({
    "app": st.booleans(),
    "keys": st.booleans(),
    "trust_unsigned": st.booleans(),
})


def _value(spec: dict[str, Any]) -> bytes | None:
    v = spec["value"]
    if v is None:
        return None
    if v == "junk":
        return b"\x00junk"
    if v == "empty":
        return b""
    tenant = "victim" if v.startswith("v") else "t1"
    return encode_charge(tenant, v, spec["amount"])


def _record(shared: Shared, spec: dict[str, Any]) -> tuple[bytes, bytes | None, list[Any]]:
    topic = {"n": shared.n, "p": shared.p, "x": shared.x}.get(spec["topic"], spec["topic"])
    hdrs: list[Any] = letter_headers(topic=topic, partition=spec["partition"], key=spec["key"],
                                     namespace=spec["namespace"], kind=spec["kind"])
    value, kafka_key = _value(spec), b"k"
    if spec["signature"] == "valid":
        hdrs = signed(hdrs, kafka_key, value)
    elif spec["signature"] == "other-key":
        hdrs = signed(hdrs, kafka_key, value, secret="z" * 20)
    elif spec["signature"] == "garbage":
        hdrs = [*hdrs, (SIGNATURE, b"v1:00")]
    return kafka_key, value, hdrs


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(specs=st.lists(header_sets(), min_size=1, max_size=6), mode=modes)
def test_whatever_is_written_to_one_apps_dlq_a_replay_stays_inside_that_app(
    shared: Shared, specs: list[dict[str, Any]], mode: dict[str, bool],
) -> None:
    name = f"kafka_idem_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(shared.template)))
    db = DB(name)
    try:
        _check_one_example(shared, db, specs, mode)
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


def _check_one_example(shared: Shared, db: DB, specs: list[dict[str, Any]],
                       mode: dict[str, bool]) -> None:
    dlq = f"{shared.n}.dlq"
    before = {t: end_offsets(t) for t in (shared.p, shared.x, dlq)}
    write(dlq, [_record(shared, spec) for spec in specs])
    env = {"PAYMENTS_TOPIC": shared.n, "KAFKA_IDEM_NAMESPACE": "nubapp"}
    if mode["keys"]:
        env["KAFKA_IDEM_DLQ_SIGNING_KEYS"] = KEY1
    args = ["--app", PAYMENTS_APP] if mode["app"] else ["--namespace", "nubapp"]
    if mode["trust_unsigned"]:
        args.append("--trust-unsigned")
    # Only this example's records: its own replay, from where they start.
    starts = ",".join(f"{p}:{o}" for p, o in sorted(before[dlq].items()))
    group = f"prop-{uuid.uuid4().hex[:8]}"
    payments_records = db.rows("SELECT * FROM kafka_idem.task_idempotency "
                               "WHERE namespace = 'payments' ORDER BY idempotency_key")
    n_before = end_offsets(shared.n)

    def run(*extra: str) -> Result:
        return kafka_idem("dlq", "replay", "--dlq", dlq, "--no-progress", "--json",
                          "--group", group, *REASON, *args, *extra, db=db, env=env)

    _skip_earlier(group, dlq, before[dlq])
    dry, real = run("--dry-run"), run()
    assert dry.code == 0 and real.code == 0, (starts, dry.err, real.err)
    d, s = dry.json(), real.json()
    for count in ("scanned", "matched", "by_kind", "untrusted", "unsendable", "targets"):
        assert d[count] == s[count], (count, d[count], s[count])
    assert d["would_send"] == s["sent"]

    # Nothing of payments changed; nothing reached a topic outside nubapp's.
    assert db.rows("SELECT * FROM kafka_idem.task_idempotency WHERE namespace = 'payments' "
                   "ORDER BY idempotency_key") == payments_records
    assert db.rows("SELECT * FROM kafka_idem.admin_audit WHERE namespace <> 'nubapp'") == []
    assert end_offsets(shared.p) == before[shared.p]
    assert end_offsets(shared.x) == before[shared.x]
    assert set(s["targets"]) <= {shared.n}
    # Every key re-run has its message on nubapp's topic (its dead letter's copy).
    copies = [m for m in read_all(shared.n)
              if m.offset() >= n_before.get(m.partition(), 0)]
    sources = {(int(headers_of(m)["idem.replay.source_partition"]),
                int(headers_of(m)["idem.replay.source_offset"])) for m in copies}
    for row in db.rows("SELECT selection FROM kafka_idem.admin_audit WHERE action = 'rerun'"):
        sel = row["selection"]
        assert (sel["partition"], sel["offset"]) in sources, (sel, sources)
    stuck = db.rows("SELECT idempotency_key FROM kafka_idem.task_idempotency "
                    "WHERE status = 'retryable_failed'")
    assert len(stuck) == s["rerun"] == len(copies) - s["as_is"]


def _skip_earlier(group: str, dlq: str, ends: dict[int, int]) -> None:
    """Commit ``group``'s position at ``ends``: the replay reads only what came after."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": group,
                  "enable.auto.commit": False})
    try:
        c.commit(offsets=[TopicPartition(dlq, p, o) for p, o in ends.items()],
                 asynchronous=False)
    finally:
        c.close()


def test_replay_help_names_the_boundary_options() -> None:
    r = kafka_idem("dlq", "replay", "--help")
    assert r.code == 0
    assert "--app MODULE:APP" in r.out and "--trust-unsigned" in r.out
