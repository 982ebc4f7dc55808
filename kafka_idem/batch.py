"""The batch transactional path: a whole batch of local-mode messages in a few
round trips, with the same observable guarantees as the per-message path.

Optimistic; the common case only:

1. Decode every message; undecodable ones are dead-lettered as usual.
2. Replay fast path: one snapshot read finds the keys that already succeeded
   (``succeeded`` is terminal, so no lock is needed); their messages replay, or
   conflict when the request hash differs, with no write at all.
3. One ``INSERT ... SELECT FROM unnest(...) ON CONFLICT DO NOTHING`` claims
   every new key, in key order; one ``SELECT ... FOR UPDATE`` (key order again)
   locks the keys that already existed.
4. Handlers run in offset order per partition, in psycopg pipeline mode, so
   their statements travel together; one fenced ``UPDATE ... FROM unnest``
   marks every success; one commit.

Anything off the common path — a handler error, a busy key, a record to take
over or to exhaust — rolls the transaction back and raises :class:`Fallback`:
the batch then runs on the per-message path (a savepoint per message), which
handles every case. Nothing of the optimistic attempt survives a fallback.

The same key twice in a batch behaves exactly like a redelivery: the second
occurrence replays the first's result (or conflicts, when its hash differs).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from kafka_idem.app import Context, Handler
from kafka_idem.errors import MessageError
from kafka_idem.processing import QUIET, Finished, Prepared, Processor, Result, make_context
from kafka_idem.store import Claim, Conn, Outcome, translate_errors


class Fallback(Exception):
    """The optimistic batch met a case it leaves to the per-message path."""


@dataclass
class _Item:
    tp: Any
    msg: Any
    handler: Handler[Any]
    prep: Prepared | None
    result: Result | None = None


def run_batch(
    proc: Processor, parts: Sequence[tuple[Any, Sequence[Any]]]
) -> dict[Any, list[Result]]:
    """Process ``parts`` optimistically; raise :class:`Fallback` (rolled back) when it can't."""
    conn = proc.connection()
    quiet = QUIET.set(True)
    try:
        items = _prepare(proc, parts)
        _replays(proc, conn, items)
        claimed = _claim(proc, conn, items)
        if claimed:
            _run_handlers(proc, conn, items, claimed)
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    finally:
        QUIET.reset(quiet)
    for item in items:
        assert item.result is not None
        proc.log_finished(item.handler, item.msg, item.result)
    out: dict[Any, list[Result]] = {tp: [] for tp, _ in parts}
    for item in items:
        assert item.result is not None
        out[item.tp].append(item.result)
    return out


def _prepare(proc: Processor, parts: Sequence[tuple[Any, Sequence[Any]]]) -> list[_Item]:
    items = []
    for tp, msgs in parts:
        for msg in msgs:
            handler = proc.app.handlers[msg.topic()]
            try:
                items.append(_Item(tp, msg, handler, proc.prepare(handler, msg)))
            except MessageError as exc:
                items.append(_Item(tp, msg, handler, None, proc._undecodable(handler, msg, exc)))
    return items


def _replays(proc: Processor, conn: Conn, items: list[_Item]) -> None:
    """Step 2: duplicates of succeeded keys, answered by one read."""
    keys = sorted({i.prep.key for i in items if i.prep is not None and i.result is None})
    if not keys:
        return
    done = proc.store.succeeded(conn, keys)
    for item in items:
        if item.prep is None or item.result is not None or item.prep.key not in done:
            continue
        stored_hash, result = done[item.prep.key]
        item.result = _replay_or_conflict(proc, item, stored_hash, result)


def _replay_or_conflict(proc: Processor, item: _Item, stored_hash: str, result: Any) -> Result:
    assert item.prep is not None
    outcome = Outcome.REPLAY if stored_hash == item.prep.request_hash else Outcome.CONFLICT
    return proc._not_claimed(
        item.handler, item.msg, item.prep, Claim(outcome, item.prep.key, attempts=1, result=result)
    )


def _claim(proc: Processor, conn: Conn, items: list[_Item]) -> dict[str, Claim]:
    """Step 3: claim the first occurrence of every remaining key; a key that already
    existed is decided for *every* occurrence here (or the batch falls back)."""
    occurrences: dict[str, list[_Item]] = {}
    for item in items:
        if item.prep is not None and item.result is None:
            occurrences.setdefault(item.prep.key, []).append(item)
    first = {key: found[0] for key, found in occurrences.items()}
    if not first:
        return {}
    tokens = {key: uuid.uuid4() for key in first}
    ordered = sorted(first)
    with translate_errors():
        rows = conn.execute(
            proc.store.q["batch_claim_insert"],
            {
                "lease": proc.settings.lease_seconds,
                "keys": ordered,
                "hashes": [first[k].prep.request_hash for k in ordered],  # type: ignore[union-attr]
                "tokens": [tokens[k] for k in ordered],
                "handlers": [first[k].handler.name for k in ordered],
                "topics": [first[k].msg.topic() for k in ordered],
                "parts": [first[k].msg.partition() for k in ordered],
                "offs": [first[k].msg.offset() for k in ordered],
            },
        ).fetchall()
        inserted = {r[0] for r in rows}
        claims = {k: Claim(Outcome.CLAIMED, k, token=tokens[k], attempts=1) for k in inserted}
        existing = [k for k in ordered if k not in inserted]
        if existing:
            cur = conn.cursor(row_factory=dict_row)
            locked = cur.execute(proc.store.q["batch_lock"], {"keys": existing}).fetchall()
            if len(locked) != len(existing):
                raise Fallback("a key vanished between insert and lock (purged)")
            for rec in locked:
                for item in occurrences[rec["idempotency_key"]]:
                    assert item.prep is not None
                    if rec["request_hash"] != item.prep.request_hash:
                        item.result = _replay_or_conflict(proc, item, rec["request_hash"], None)
                    elif rec["status"] == "succeeded":  # finished by someone since step 2
                        item.result = _replay_or_conflict(
                            proc, item, rec["request_hash"], rec["result_json"]
                        )
                    else:
                        raise Fallback("a key needs the per-message protocol")
    return claims


def _run_handlers(
    proc: Processor, conn: Conn, items: list[_Item], claims: dict[str, Claim]
) -> None:
    """Step 4: handlers (pipelined, or one bulk call per handler); then one fenced
    completion. A key's second occurrence replays its first's result."""
    first: dict[str, _Item] = {}
    again: list[_Item] = []
    for item in items:
        if item.result is None and item.prep is not None:
            if item.prep.key not in claims:
                raise Fallback("an undecided message without a claim")  # never expected
            if item.prep.key in first:
                again.append(item)
            else:
                first[item.prep.key] = item
    outcomes: dict[str, Any] = {}
    with translate_errors(), conn.pipeline():
        by_handler: dict[str, list[_Item]] = {}
        for item in first.values():
            by_handler.setdefault(item.handler.name, []).append(item)
        for group in by_handler.values():
            outcomes.update(_run_group(proc, conn, group, claims))
        successes = [
            (key, claims[key].token, value)
            for key, value in outcomes.items()
            if not isinstance(value, Finished)
        ]
        cur = conn.execute(
            proc.store.q["batch_complete"],
            {
                "keys": [s[0] for s in successes],
                "tokens": [s[1] for s in successes],
                "results": Jsonb([s[2] for s in successes]),
            },
        )
    if cur.rowcount != len(successes):
        raise Fallback("a completion lost its fence")
    for key, item in first.items():
        value = outcomes[key]
        item.result = value if isinstance(value, Finished) else Finished("succeeded", key=key)
    for item in again:  # exactly like a redelivery after the first attempt
        assert item.prep is not None
        value = outcomes[item.prep.key]
        if isinstance(value, Finished):  # the first was dead-lettered: so is this one
            raise Fallback("a failed key occurs twice in the batch")
        first_prep = first[item.prep.key].prep
        assert first_prep is not None
        item.result = _replay_or_conflict(proc, item, first_prep.request_hash, value)


def _run_group(
    proc: Processor, conn: Conn, group: list[_Item], claims: dict[str, Claim]
) -> dict[str, Any]:
    """One handler's messages: ``{key: result}``, or a :class:`Finished` dead letter for
    an item a bulk handler rejected as permanent (nothing of it was written)."""
    handler = group[0].handler
    if handler.bulk is None:
        return {item.prep.key: _call(proc, conn, item, claims[item.prep.key])  # type: ignore[union-attr]
                for item in group}
    contexts = [_context(conn, item, claims[item.prep.key]) for item in group]  # type: ignore[union-attr]
    started = time.perf_counter()
    try:
        out = handler.bulk([(item.prep.model, ctx)  # type: ignore[union-attr]
                            for item, ctx in zip(group, contexts, strict=True)], conn)
    except Exception as exc:
        raise Fallback(f"bulk handler raised {type(exc).__name__}") from exc
    finally:
        proc.metrics.handler_seconds.labels(handler.topic, handler.name).observe(
            time.perf_counter() - started
        )
    if len(out) != len(group):
        raise Fallback(f"bulk handler returned {len(out)} results for {len(group)} messages")
    results: dict[str, Any] = {}
    for item, value in zip(group, out, strict=True):
        assert item.prep is not None
        if isinstance(value, BaseException):
            if handler.classify(value) != "permanent":
                raise Fallback("a bulk item failed transiently")
            results[item.prep.key] = proc._record_failure(
                conn, handler, item.msg, item.prep, claims[item.prep.key], value
            )
        else:
            results[item.prep.key] = value
    return results


def _context(conn: Conn, item: _Item, claim: Claim) -> Context:
    assert item.prep is not None
    return make_context(conn, item.handler, item.msg, item.prep, claim)


def _call(proc: Processor, conn: Conn, item: _Item, claim: Claim) -> Any:
    assert item.prep is not None and claim.token is not None
    msg = item.msg
    ctx = _context(conn, item, claim)
    started = time.perf_counter()
    try:
        return item.handler(item.prep.model, ctx)
    except Exception as exc:
        raise Fallback(f"handler raised {type(exc).__name__}") from exc
    finally:
        proc.metrics.handler_seconds.labels(msg.topic(), item.handler.name).observe(
            time.perf_counter() - started
        )
