"""The batch transactional path: a whole batch of local-mode messages in a few
round trips, with the same observable guarantees as the per-message path.

Optimistic; the common case only:

1. Decode every message; undecodable ones are dead-lettered as usual.
2. One snapshot read of every key (no lock): a key that already succeeded replays
   its result, or conflicts when the request hash differs, with no write
   (``succeeded`` is terminal). The keys that exist in another state are locked in
   one ``SELECT ... FOR UPDATE`` (key order) and decided there: a conflicting hash,
   a success since the read, or a ``failed`` record met again.
3. The new keys' handlers run in offset order per partition, in psycopg pipeline
   mode, so their statements travel together, each with an owner token made here.
4. One statement writes every new key's record once, as succeeded with its token (a
   claim and its completion in one row version: the guard allows it, migration
   0010), in key order (byte order, as every multi-key write): an ``INSERT`` in the
   handlers' pipeline, or a binary ``COPY`` after it for a batch of
   ``copy_from`` (64) new keys or more; one commit.

No other transaction can see the batch's records before its commit, so writing them
at the end hides nothing that claiming them first would show. A key someone else
wrote since the read is not written (the insert skips it, the COPY fails on it, each
after waiting for that writer to end, if it had not), and the batch falls back.

A bulk handler's permanent rejections are claimed and failed in the batch, and a later
occurrence of such a key in the same batch is dead-lettered again (or conflicts), as a
redelivery would be. Anything else off the common path — a handler error, a busy key, a
record to take over or to exhaust, a key written by someone else meanwhile — rolls the
transaction back and
raises :class:`Fallback`: the batch then runs on the per-message path
(:mod:`kafka_idem.consume.paths.local_path`, a claim and a savepoint per message),
which handles every case. Nothing of the optimistic attempt survives a fallback.

The same key twice in a batch behaves exactly like a redelivery: the second
occurrence replays the first's result, conflicts when its hash differs, or is
dead-lettered again when the first was rejected.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from kafka_idem.consume.outcome import (
    TP,
    Ahead,
    Ended,
    Finished,
    Message,
    Parts,
    Prepared,
    Result,
    Results,
)
from kafka_idem.consume.paths.calls import delivery
from kafka_idem.consume.paths.database import Database
from kafka_idem.consume.paths.steps import Steps, log
from kafka_idem.consume.paths.verdicts import Note, letter_note, where
from kafka_idem.errors import MessageError, ResultNotJSON
from kafka_idem.handler import Context, Handler
from kafka_idem.store import Claim, Conn, HandlerBlock, Outcome, translate_errors
from kafka_idem.store.batch import Done
from kafka_idem.store.types import Token, new_tokens


class Fallback(Exception):
    """The optimistic batch met a case it leaves to the per-message path."""


class HandlerRaised(Fallback):
    """A handler raised in the batch, or a bulk handler failed an item transiently (its
    ``__cause__``), for the message at ``offset`` of ``tp``: the per-message path
    records its failure (a retry, a dead letter)."""

    def __init__(self, text: str, tp: TP, offset: int) -> None:
        super().__init__(text)
        self.tp = tp
        self.offset = offset


@dataclass
class Item:
    tp: TP
    msg: Message
    handler: Handler[Any]
    prep: Prepared | None
    result: Result | None = None
    ctx: Context | None = None  # the handler's context: its emitted events
    note: Note | None = None  # the line of the verdict that decided it, once committed


class BatchPath:
    """The batch path of one processor: its steps and its connection."""

    def __init__(self, steps: Steps, db: Database) -> None:
        self.steps = steps
        self.db = db

    def run(self, parts: Parts, ahead: Ahead | None = None) -> Results:
        """Process ``parts`` optimistically; raise :class:`Fallback` (rolled back) when
        it can't. Its decisions are logged once, after its commit: never for an attempt
        that falls back (the per-message path then logs its own). What ``ahead`` holds is
        not decoded again."""
        conn = self.db.connection()
        try:
            items = prepare_items(self.steps, parts, ahead)
            new = self._read(conn, items)
            if new:
                self._run_handlers(conn, items, new)
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        out: Results = {tp: [] for tp, _ in parts}
        for item in items:
            assert item.result is not None
            note = item.note or committed_note(item.handler, item.msg, item.result)
            if note is not None:
                note.write(log)
            out[item.tp].append(item.result)
        return out

    def _read(self, conn: Conn, items: list[Item]) -> dict[str, Token]:
        """Step 2: every undecided key read; a key that exists is decided for *every*
        occurrence here (or the batch falls back). Returns the new keys, each with the
        owner token made here for its claim (at its first attempt; nothing is written
        for them yet)."""
        occurrences = _undecided(items)
        if not occurrences:
            return {}
        ordered = sorted(occurrences)
        with translate_errors():
            found = self.steps.store.found(conn, ordered)
            for key, rec in found.items():
                if rec.status == "succeeded":
                    for item in occurrences[key]:
                        item.result = replay_or_conflict(
                            self.steps, item, rec.request_hash, rec.result, rec.attempts)
            others = [k for k in ordered if k in found and found[k].status != "succeeded"]
            if others:
                self._lock_existing(conn, occurrences, others)
        new = [key for key in ordered if key not in found]
        return dict(zip(new, new_tokens(len(new)), strict=True))

    def _lock_existing(
        self, conn: Conn, occurrences: dict[str, list[Item]], existing: list[str]
    ) -> None:
        """Lock the keys that existed and were not found succeeded: a conflicting hash,
        a success since the read, or a ``failed`` record met again (dead-lettered again,
        each occurrence, as the per-message claim does) is decided here; anything else
        (a key in someone's hands, a retry to run or not yet due) falls back."""
        locked = self.steps.store.lock_batch(conn, existing)
        if len(locked) != len(existing):
            raise Fallback("a key vanished between read and lock (purged)")
        for rec in locked:
            for item in occurrences[rec["idempotency_key"]]:
                if rec["request_hash"] != _prep(item).request_hash:
                    item.result = replay_or_conflict(self.steps, item, rec["request_hash"], None,
                                                     rec["attempts"])
                elif rec["status"] == "succeeded":  # finished by someone since the read
                    item.result = replay_or_conflict(
                        self.steps, item, rec["request_hash"], rec["result_json"],
                        rec["attempts"])
                elif rec["status"] == "failed":
                    # Redeliveries and re-sends of failed keys are common (a producer
                    # retrying an invalid request): falling back for them would put the
                    # whole batch on the slower per-message path.
                    claim = self.steps.store.dead(conn, rec, delivery(item.handler, item.msg))
                    verdict = self.steps.not_claimed(item.handler, item.msg, _prep(item), claim)
                    item.result, item.note = verdict.result, verdict.note
                else:
                    raise Fallback("a key needs the per-message protocol")

    def _run_handlers(self, conn: Conn, items: list[Item], tokens: dict[str, Token]) -> None:
        """Steps 3 and 4: handlers (pipelined, or one bulk call per handler); then one
        write of every success. A key's second occurrence replays its first's result."""
        first: dict[str, Item] = {}
        again: list[Item] = []
        for item in items:
            if item.result is None and item.prep is not None:
                if item.prep.key not in tokens:
                    raise Fallback("an undecided message without a claim")  # never expected
                if item.prep.key in first:
                    again.append(item)
                else:
                    first[item.prep.key] = item
        outcomes = self._complete(conn, first, tokens)
        for key, item in first.items():
            value = outcomes[key]
            item.result = value if isinstance(value, Finished) else Finished(
                Ended.SUCCEEDED, key=key)
        failed: dict[str, list[Item]] = {}
        for item in again:  # exactly like a redelivery after the first attempt
            value = outcomes[_prep(item).key]
            if isinstance(value, Finished):  # the first was failed in this batch
                failed.setdefault(_prep(item).key, []).append(item)
            else:
                item.result = replay_or_conflict(
                    self.steps, item, _prep(first[_prep(item).key]).request_hash, value)
        if failed:  # met again as the failed record it now is (a producer's retries)
            with translate_errors():
                self._lock_existing(conn, failed, sorted(failed))

    def _complete(
        self, conn: Conn, first: dict[str, Item], tokens: dict[str, Token]
    ) -> dict[str, Any]:
        """Run the handlers of the first occurrences and write every success in one
        statement: ``{key: result}``, or a :class:`Finished` dead letter."""
        outcomes: dict[str, Any] = {}
        rejected: list[tuple[Item, BaseException]] = []
        try:
            with translate_errors():
                with conn.pipeline():
                    by_handler: dict[str, list[Item]] = {}  # by topic: two may share a name
                    for item in first.values():
                        by_handler.setdefault(item.handler.topic, []).append(item)
                    with HandlerBlock(conn):  # a savepoint: ctx.tx.commit() raises
                        for group in by_handler.values():
                            outcomes.update(self._run_group(conn, group, rejected))
                    # The successes' events, their slots locked in one sorted statement;
                    # a fallback rolls them back and the per-message re-run emits again.
                    self.steps.emitter.flush(conn, *_contexts(first[key] for key in outcomes))
                    finish = self.steps.store.write_done(conn, [
                        _done(first[key], tokens[key], value) for key, value in outcomes.items()])
                    if rejected:
                        outcomes.update(self._record_rejected(conn, rejected))
                written = finish()  # the pipeline has ended: its answers are in
        except ResultNotJSON as exc:
            raise Fallback(str(exc)) from exc
        if not written:
            raise Fallback("a key was written by someone else since the batch read it")
        return outcomes

    def _record_rejected(
        self, conn: Conn, rejected: list[tuple[Item, BaseException]]
    ) -> dict[str, Finished]:
        """Items a bulk handler rejected as permanent (nothing of them was written):
        claimed now, then failed and dead-lettered as the per-message path records it."""
        first = [item for item, _exc in rejected]
        tokens = self.steps.store.claim_batch(
            conn, lease_seconds=self.steps.settings.lease_seconds,
            keys=[_prep(i).key for i in first], hashes=[_prep(i).request_hash for i in first],
            deliveries=[delivery(i.handler, i.msg) for i in first],
            shards=[_prep(i).shard for i in first])
        out: dict[str, Finished] = {}
        for item, exc in rejected:
            prep = _prep(item)
            if prep.key not in tokens:
                raise Fallback("a key was written by someone else since the batch read it")
            claim = Claim.new_key(prep.key, tokens[prep.key])
            # The verdict's note is written once the batch's commit made it stand.
            verdict = self.steps.record_failure(conn, item.handler, item.msg, prep, claim, exc)
            assert isinstance(verdict.result, Finished)
            out[prep.key], item.note = verdict.result, verdict.note
        return out

    def _run_group(
        self, conn: Conn, group: list[Item],
        rejected: list[tuple[Item, BaseException]],
    ) -> dict[str, Any]:
        """One handler's messages: ``{key: result}`` of its successes; an item a bulk
        handler rejected as permanent goes to ``rejected`` (nothing of it was written)."""
        handler = group[0].handler
        if handler.bulk is None:
            return {_prep(item).key: self._call(conn, item) for item in group}
        batch: list[tuple[Any, Context]] = []
        for item in group:
            item.ctx = self.steps.context(conn, handler, item.msg, _prep(item), 1)
            batch.append((_prep(item).model, item.ctx))
        with self.steps.handler_time(handler):
            try:
                out = handler.bulk(batch, conn)
                for _msg, ctx in batch:
                    ctx.settle_session()
            except Exception as exc:
                for _msg, ctx in batch:
                    ctx.discard_session()
                raise Fallback(f"bulk handler raised {type(exc).__name__}") from exc
        if len(out) != len(group):
            raise Fallback(f"bulk handler returned {len(out)} results for {len(group)} messages")
        results: dict[str, Any] = {}
        for item, value in zip(group, out, strict=True):
            if isinstance(value, BaseException):
                if handler.classify(value) != "permanent":
                    raise HandlerRaised("a bulk item failed transiently", item.tp,
                                        item.msg.offset()) from value
                item.ctx = None  # no events of a rejected item
                rejected.append((item, value))
            else:
                results[_prep(item).key] = value
        return results

    def _call(self, conn: Conn, item: Item) -> Any:
        """A new key's handler, at its first attempt."""
        prep = _prep(item)
        ctx = item.ctx = self.steps.context(conn, item.handler, item.msg, prep, 1)
        tracing = self.steps.tracing
        tracing.note(item.msg, handler=item.handler.name, key=prep.key, attempts=1)
        with self.steps.handler_time(item.handler), tracing.step(item.msg, "handler"):
            try:
                result = item.handler(prep.model, ctx)
                ctx.settle_session()  # its ORM writes flushed (ctx.session)
            except Exception as exc:
                ctx.discard_session()
                raise HandlerRaised(f"handler raised {type(exc).__name__}", item.tp,
                                    item.msg.offset()) from exc
            return result


def prepare_items(steps: Steps, parts: Parts, ahead: Ahead | None) -> list[Item]:
    """Every message of ``parts`` decoded (what ``ahead`` holds is taken as it is); an
    undecodable one has its dead-letter result and note already (logged after commit)."""
    items = []
    for tp, msgs in parts:
        for msg in msgs:
            handler = steps.handler(msg)
            try:
                items.append(Item(tp, msg, handler, steps.prepared(handler, msg, ahead)))
            except MessageError as exc:
                verdict = steps.undecodable(handler, msg, exc)
                items.append(Item(tp, msg, handler, None, verdict.result, note=verdict.note))
    return items


def replay_or_conflict(
    steps: Steps, item: Item, stored_hash: str, result: Any, attempts: int = 1
) -> Result:
    """``item`` met a record of its key (stored with ``stored_hash``, after ``attempts``):
    its result replayed, or a conflict when its own hash differs (its dead letter says
    the record's attempts, as the per-message claim's does)."""
    assert item.prep is not None
    outcome = Outcome.REPLAY if stored_hash == item.prep.request_hash else Outcome.CONFLICT
    claim = Claim(outcome, item.prep.key, attempts=attempts, result=result)
    # The verdict's note is dropped: the caller logs its results after its commit.
    return steps.not_claimed(item.handler, item.msg, item.prep, claim).result


def _prep(item: Item) -> Prepared:
    """The item's decoded message (only decoded items get this far)."""
    assert item.prep is not None
    return item.prep


def _done(item: Item, token: Token, result: Any) -> Done:
    """The record to write for ``item``, whose handler succeeded with ``result``."""
    prep, msg = _prep(item), item.msg
    return Done(prep.key, prep.request_hash, token, msg.topic(), msg.partition(), msg.offset(),
                item.handler.name, prep.shard, result)


def _contexts(items: Iterable[Item]) -> list[Context]:
    """The handler contexts of ``items`` (their emitted events)."""
    return [item.ctx for item in items if item.ctx is not None]


def _undecided(items: list[Item]) -> dict[str, list[Item]]:
    """``{key: its undecided items, in batch order}``."""
    occurrences: dict[str, list[Item]] = {}
    for item in items:
        if item.prep is not None and item.result is None:
            occurrences.setdefault(item.prep.key, []).append(item)
    return occurrences


def committed_note(handler: Handler[Any], msg: Message, result: Result) -> Note | None:
    """The log line of a decision the batch made without a verdict of its own (a
    replay, a conflict), once its commit made it stand; the others write their
    verdict's line, the one the per-message path writes for the same decision. A
    success is not logged here."""
    if not isinstance(result, Finished):
        return None
    if result.outcome is Ended.REPLAYED:
        if not log.isEnabledFor(logging.DEBUG):  # most of a duplicate-heavy batch
            return None
        return Note(logging.DEBUG, "replayed stored result", "replayed",
                    {"key": result.key, "handler": handler.name, **where(msg)})
    fields = {"key": result.key, "handler": handler.name, **where(msg)}
    if result.letter is not None:
        action = "conflict" if result.outcome is Ended.CONFLICT else "dead_lettered"
        return letter_note(result.letter, action, fields)
    return None


class HasBatchPath(Protocol):
    """Anything that carries a batch path
    (a :class:`~kafka_idem.consume.paths.processor.Processor`)."""

    @property
    def batch_path(self) -> BatchPath: ...


def run_batch(owner: HasBatchPath, parts: Parts, ahead: Ahead | None = None) -> Results:
    """Run ``parts`` on ``owner``'s batch path only (a case it leaves to the
    per-message path raises :class:`Fallback`)."""
    return owner.batch_path.run(parts, ahead)
