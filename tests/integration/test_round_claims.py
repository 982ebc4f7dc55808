"""The claim shared by the keys a dispatch round starts together (key-ordered leased
path, :mod:`kafka_idem.consume.paths.round_claim`), on real Kafka and PostgreSQL.

Every claim the member makes is recorded at the store (a spy on :class:`Store`'s
claim methods, which still run): which keys each statement claimed, and with what
token. The verdicts are the records (status, attempts, ``completed_token``), the
ledger, the handler's own view of its token, and the committed offsets.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import Counter, defaultdict
from typing import Any

import psycopg
import pytest

from consumers import payments
from consumers.payments import encode_charge
from kafka_idem import AsyncContext, Context, Retryable, RetryPolicy
from kafka_idem.consume.concurrency import keyed_units as ordered
from kafka_idem.consume.paths import async_leased_path as aio
from kafka_idem.consume.paths import leased_path as leased
from kafka_idem.errors import StoreUnavailable
from kafka_idem.keys import hash_payload
from kafka_idem.store import Claim, Delivery, Outcome, Store, connect
from tests.conftest import DB, InProcess, caught_up, committed, produce, wait_for
from tests.integration.test_keyed import Spans, assert_one_at_a_time_in_offset_order, keyed_app

TABLE = "kafka_idem.task_idempotency"
OWNER_SQL = f"SELECT owner_token::text FROM {TABLE} WHERE idempotency_key = %s"


class ClaimSpy:
    """Each claim statement's keys and tokens: the rounds', the new keys' claimed
    alone, and the full claims that claimed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rounds: list[tuple[list[str], dict[str, uuid.UUID]]] = []
        self.alone: dict[str, list[uuid.UUID]] = defaultdict(list)
        self._lock = threading.Lock()
        batch, new, full = Store.claim_batch, Store.claim_new, Store.claim

        def claim_batch(store: Store, conn: Any, **kw: Any) -> dict[str, uuid.UUID]:
            tokens = batch(store, conn, **kw)
            with self._lock:
                self.rounds.append((list(kw["keys"]), dict(tokens)))
            return tokens

        def claim_new(store: Store, conn: Any, **kw: Any) -> Claim | None:
            return self._alone(new(store, conn, **kw))

        def claim(store: Store, conn: Any, **kw: Any) -> Claim:
            got = self._alone(full(store, conn, **kw))
            assert got is not None
            return got

        batch_async, new_async = Store.claim_batch_async, Store.claim_new_async
        full_async = Store.claim_async

        async def claim_batch_async(store: Store, conn: Any, **kw: Any) -> dict[str, uuid.UUID]:
            tokens = await batch_async(store, conn, **kw)
            with self._lock:
                self.rounds.append((list(kw["keys"]), dict(tokens)))
            return tokens

        async def claim_new_async(store: Store, conn: Any, **kw: Any) -> Claim | None:
            return self._alone(await new_async(store, conn, **kw))

        async def claim_async(store: Store, conn: Any, **kw: Any) -> Claim:
            got = self._alone(await full_async(store, conn, **kw))
            assert got is not None
            return got

        monkeypatch.setattr(Store, "claim_batch", claim_batch)
        monkeypatch.setattr(Store, "claim_new", claim_new)
        monkeypatch.setattr(Store, "claim", claim)
        # an async def handler's claims are made on the event loop's connections
        monkeypatch.setattr(Store, "claim_batch_async", claim_batch_async)
        monkeypatch.setattr(Store, "claim_new_async", claim_new_async)
        monkeypatch.setattr(Store, "claim_async", claim_async)

    def _alone(self, claim: Claim | None) -> Claim | None:
        if claim is not None and claim.outcome is Outcome.CLAIMED and claim.token is not None:
            with self._lock:
                self.alone[claim.key].append(claim.token)
        return claim

    def shared(self) -> dict[str, list[uuid.UUID]]:
        out: dict[str, list[uuid.UUID]] = defaultdict(list)
        for _, tokens in self.rounds:
            for key, token in tokens.items():
                out[key].append(token)
        return out


def handler_of(spans: Spans | None, seen: dict[str, list[tuple[int, str]]], *,
               use_async: bool, raises: dict[str, type[Exception]] | None = None) -> Any:
    """A charge that records (attempt, the owner token its transaction sees) per key;
    ``raises``: order id -> what its first attempt raises."""
    raises = raises or {}

    def first_raises(msg: payments.ChargeRequested, ctx: Any) -> None:
        exc = raises.get(msg.order_id)
        if exc is not None and len(seen[ctx.idempotency_key]) == 1:
            raise exc("injected")

    def charge(msg: payments.ChargeRequested, ctx: Context) -> Any:
        if spans is not None:
            spans.mark("start", msg, ctx)
        row = ctx.tx.execute(OWNER_SQL, (ctx.idempotency_key,)).fetchone()
        seen[ctx.idempotency_key].append((ctx.attempt, row[0]))
        first_raises(msg, ctx)
        ctx.tx.execute("SELECT pg_sleep(0.03)")
        result = payments.charge(msg, ctx)
        if spans is not None:
            spans.mark("end", msg, ctx)
        return result

    async def charge_async(msg: payments.ChargeRequested, ctx: AsyncContext) -> Any:
        if spans is not None:
            spans.mark("start", msg, ctx)  # type: ignore[arg-type]
        row = await (await ctx.tx.execute(OWNER_SQL, (ctx.idempotency_key,))).fetchone()
        assert row is not None
        seen[ctx.idempotency_key].append((ctx.attempt, row[0]))
        first_raises(msg, ctx)
        await asyncio.sleep(0.03)
        await ctx.tx.execute(payments.LEDGER_INSERT, payments._ledger_params(
            msg, ctx.idempotency_key))
        if spans is not None:
            spans.mark("end", msg, ctx)  # type: ignore[arg-type]
        return payments.result_of(msg)

    return charge_async if use_async else charge


def records(db: DB) -> dict[str, dict[str, Any]]:
    return {r["idempotency_key"]: r for r in db.rows(
        f"SELECT idempotency_key, status, attempts, request_hash, owner_token,"
        f" completed_token FROM {TABLE}")}


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_the_keys_started_in_one_round_are_claimed_together_once_each_with_their_own_token(
    db: DB, topic: str, group: str, monkeypatch: pytest.MonkeyPatch, use_async: bool
) -> None:
    spy = ClaimSpy(monkeypatch)
    spans = Spans(db)
    seen: dict[str, list[tuple[int, str]]] = defaultdict(list)
    # One partition, six accounts interleaved, each account's charges in offset order.
    produce(topic, [(f"t{i % 6}".encode(), encode_charge(f"t{i % 6}", f"o{i}", "1.00"))
                    for i in range(48)])
    keys = {f"t{i % 6}:charge:o{i}" for i in range(48)}
    app = keyed_app(db, topic, group, handler_of(spans, seen, use_async=use_async),
                    concurrency=8)
    with InProcess(app):
        wait_for(lambda: caught_up(group, topic), timeout=120, what="the topic to drain")
    assert_one_at_a_time_in_offset_order(db)
    assert any(len(tokens) > 1 for _, tokens in spy.rounds), "no round claimed keys together"
    assert all(sorted(ks) == ks and len(set(ks)) == len(ks) for ks, _ in spy.rounds)
    shared, alone = spy.shared(), spy.alone
    claims = Counter({k: len(v) for k, v in shared.items()}) + Counter(
        {k: len(v) for k, v in alone.items()})
    assert claims == dict.fromkeys(keys, 1)  # one claim per key, shared or alone
    token = {k: (shared.get(k) or alone[k])[0] for k in keys}
    recs = records(db)
    assert {k: (r["status"], r["attempts"], r["completed_token"]) for k, r in recs.items()} == {
        k: ("succeeded", 1, token[k]) for k in keys}
    assert dict(seen) == {k: [(1, str(token[k]))] for k in keys}  # its own token, once
    assert db.ledger_counts() == dict.fromkeys(keys, 1)
    assert committed(group, topic) == {0: 48}


def seed_busy(db: DB, app: Any, topic: str, order: str, lease: float) -> str:
    """``order``'s key ``processing`` under another owner's live lease (its real hash)."""
    handler = app.handlers[topic]
    digest = hash_payload(handler.decode(encode_charge("t1", order, "1.00")),
                          handler.hash_fields)
    store = Store(schema="kafka_idem", table="task_idempotency", namespace=app.namespace)
    conn = connect(db.dsn)
    conn.autocommit = True
    try:
        claim = store.claim_new(conn, key=f"t1:charge:{order}", request_hash=digest,
                                delivery=Delivery(topic, 0, 0, "another"), lease_seconds=lease)
    finally:
        conn.close()
    assert claim is not None and claim.token is not None
    return str(claim.token)


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("shared", [True, False], ids=["round", "alone"])
def test_a_round_of_new_replayed_busy_reentrant_retried_and_conflicting_keys_ends_as_alone(
    db: DB, topic: str, group: str, monkeypatch: pytest.MonkeyPatch, use_async: bool,
    shared: bool,
) -> None:
    """One round holds a replay (succeeded), a conflict (another payload, succeeded),
    a key busy under another owner's lease, one the handler's first attempt leaves
    ours to re-enter (a store error), one it leaves to retry, and new ones: the
    outcomes are those of per-message claims (``alone``: the round turned off)."""
    if not shared:
        monkeypatch.setattr(ordered.KeyedUnits, "_round", lambda self, entries: None)
    seen: dict[str, list[tuple[int, str]]] = defaultdict(list)
    fn = handler_of(None, seen, use_async=use_async,
                    raises={"reenter": StoreUnavailable, "retry": Retryable})
    settings = {"busy_retry_seconds": 0.2}
    retry = RetryPolicy(base=0.1, cap=0.1, max_attempts=5)
    first = keyed_app(db, topic, group, fn, concurrency=8, ordering_key=None,
                      retry=retry, **settings)
    produce(topic, [(b"k", encode_charge("t1", o, "1.00")) for o in ("replay", "conflict")])
    with InProcess(first):
        wait_for(lambda: caught_up(group, topic), timeout=60, what="the first charges")
    before = records(db)
    busy_owner = seed_busy(db, first, topic, "busy", lease=2.0)
    seen.clear()
    spy = ClaimSpy(monkeypatch)
    mix = ["replay", "busy", "reenter", "retry", "new1", "new2"]
    produce(topic, [(b"k", encode_charge("t1", o, "1.00")) for o in mix]
            + [(b"k", encode_charge("t1", "conflict", "9.00"))])
    second = keyed_app(db, topic, group, fn, concurrency=8, ordering_key=None,
                       retry=retry, **settings)
    with InProcess(second):
        wait_for(lambda: caught_up(group, topic), timeout=90, what="the mixed round")
    k = {o: f"t1:charge:{o}" for o in [*mix, "conflict"]}
    assert {o: [a for a, _ in seen.get(k[o], [])] for o in k} == {
        "replay": [], "conflict": [], "busy": [2], "reenter": [1, 1], "retry": [1, 2],
        "new1": [1], "new2": [1]}
    recs = records(db)
    assert {o: (recs[k[o]]["status"], recs[k[o]]["attempts"]) for o in k} == {
        "replay": ("succeeded", 1), "conflict": ("succeeded", 1), "busy": ("succeeded", 2),
        "reenter": ("succeeded", 1), "retry": ("succeeded", 2), "new1": ("succeeded", 1),
        "new2": ("succeeded", 1)}
    for o in ("replay", "conflict"):  # untouched by the replay and the conflict
        assert recs[k[o]]["completed_token"] == before[k[o]]["completed_token"]
        assert recs[k[o]]["request_hash"] == before[k[o]]["request_hash"]
    assert str(recs[k["busy"]]["completed_token"]) != busy_owner  # taken over, not stolen
    assert db.ledger_counts() == {key: 1 for key in k.values()}
    assert committed(group, topic) == {0: 9}
    if not shared:
        assert spy.rounds == []
        return
    [(keys, tokens)] = [r for r in spy.rounds if k["new1"] in r[0]]
    assert set(keys) == set(k.values())  # the whole mix went to one round ...
    assert set(tokens) == {k["reenter"], k["retry"], k["new1"], k["new2"]}  # ... new ones won
    for o in ("new1", "new2"):
        assert recs[k[o]]["completed_token"] == tokens[k[o]]
        assert k[o] not in spy.alone  # claimed by the round only
    for o in ("reenter", "retry"):  # the round's token first, then their own next claim
        assert seen[k[o]][0][1] == str(tokens[k[o]])
        assert [str(t) for t in spy.alone[k[o]]] == [seen[k[o]][1][1]]
        assert recs[k[o]]["completed_token"] == spy.alone[k[o]][0]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_member_gone_after_its_round_claim_leaves_the_keys_to_a_successor_exactly_once(
    db: DB, topic: str, group: str, monkeypatch: pytest.MonkeyPatch, use_async: bool
) -> None:
    """The round's claim commits, then the member stops before any of its handlers
    run (the claim never answers them; the stop abandons them): the keys stay
    ``processing`` under leases nobody renews. The next member takes each over when
    its lease ends (attempt 2, reconciler first) and each ends succeeded once, in
    per-account order."""
    spans = Spans(db)
    seen: dict[str, list[tuple[int, str]]] = defaultdict(list)
    asked: list[tuple[str, int]] = []
    hang = threading.Event()
    hung: list[dict[str, uuid.UUID]] = []
    real = leased.claim_round

    def claim_then_hang(*args: Any) -> Any:
        tokens = real(*args)  # committed
        hung.append(tokens)
        hang.wait(120)
        raise RuntimeError("the member is gone")

    real_async = aio.claim_round_async  # an async def handler's new keys: on the event loop

    async def claim_then_hang_async(*args: Any) -> Any:
        tokens = await real_async(*args)  # committed
        hung.append(tokens)
        while not hang.is_set():
            await asyncio.sleep(0.05)
        raise RuntimeError("the member is gone")

    def app_of() -> Any:
        app = keyed_app(db, topic, group, handler_of(spans, seen, use_async=use_async),
                        concurrency=8, drain_seconds=0.5, lease_seconds=2.0)
        handler = app.handlers[topic]
        if use_async:
            async def reconcile(msg: payments.ChargeRequested, ctx: AsyncContext) -> None:
                asked.append((ctx.idempotency_key, ctx.attempt))
            handler.reconciler(reconcile)
        else:
            def reconcile_sync(msg: payments.ChargeRequested, ctx: Context) -> None:
                asked.append((ctx.idempotency_key, ctx.attempt))
            handler.reconciler(reconcile_sync)
        return app

    orders = [(f"t{i % 3}", f"o{i}") for i in range(9)]
    produce(topic, [(t.encode(), encode_charge(t, o, "1.00")) for t, o in orders])
    keys = {f"{t}:charge:{o}" for t, o in orders}
    monkeypatch.setattr(leased, "claim_round", claim_then_hang)
    monkeypatch.setattr(aio, "claim_round_async", claim_then_hang_async)
    try:
        with InProcess(app_of()):
            wait_for(lambda: hung, timeout=60, what="the round's claim")
        [tokens] = hung
        assert set(tokens) == {"t0:charge:o0", "t1:charge:o1", "t2:charge:o2"}
        recs = records(db)
        assert {key: (r["status"], r["owner_token"]) for key, r in recs.items()} == {
            key: ("processing", token) for key, token in tokens.items()}
        assert seen == {} and committed(group, topic).get(0, -1001) <= 0
        monkeypatch.setattr(leased, "claim_round", real)
        monkeypatch.setattr(aio, "claim_round_async", real_async)
        with InProcess(app_of()):
            wait_for(lambda: caught_up(group, topic), timeout=90, what="the successor")
    finally:
        hang.set()  # the gone member's threads end (their claims answer with an error)
    assert sorted(asked) == sorted((key, 2) for key in tokens)  # reconciled first, once
    assert {key: [a for a, _ in v] for key, v in seen.items()} == {
        key: [2 if key in tokens else 1] for key in keys}
    recs = records(db)
    assert {key: (r["status"], r["attempts"]) for key, r in recs.items()} == {
        key: ("succeeded", 2 if key in tokens else 1) for key in keys}
    assert all(recs[key]["completed_token"] != token for key, token in tokens.items())
    assert_one_at_a_time_in_offset_order(db)
    assert db.ledger_counts() == dict.fromkeys(keys, 1)
    assert committed(group, topic) == {0: 9}


def test_the_spy_sees_what_the_store_holds(db: DB) -> None:
    """The spy's premise: a batch claim's answer is the tokens its records hold."""
    store = Store(schema="kafka_idem", table="task_idempotency", namespace="spy")
    with psycopg.connect(db.dsn, autocommit=True) as conn:
        got = store.claim_batch(conn, lease_seconds=5, keys=["a", "b"], hashes=["h", "h"],
                                deliveries=[Delivery("t", 0, i, "h") for i in range(2)])
        rows = dict(conn.execute(f"SELECT idempotency_key, owner_token FROM {TABLE}"
                                 " WHERE namespace = 'spy'").fetchall())
    assert got == rows and set(got) == {"a", "b"}
