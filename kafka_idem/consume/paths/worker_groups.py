"""Local mode on a store distributed on Citus: a unit's messages in one transaction per
Citus worker.

On one PostgreSQL the batch path (:mod:`~kafka_idem.consume.paths.batch_path`) runs a
unit in a few set-based statements; on Citus those statements would span shards, and a
transaction that writes on two workers commits with two-phase commit. Here a unit's
decoded messages are grouped by the worker holding their shard (one statement on the
coordinator's metadata per unit), and each group runs in one transaction of its own,
pipelined: per message, in the unit's order, the claim and the handler; then the
group's events and its fenced completions; one ``COMMIT``, one-phase, on one worker.
Every statement about a message is routed to its shard, as on the per-message path.
Measured (docs/SCALING.md): 1.75x the rate of a transaction per message, 0.66x its
PostgreSQL CPU.

A claim that is not the key's at once decides the message as the per-message claim
does (a replay, a conflict, a dead letter again, a busy key waiting), written with the
group. Handlers run without a savepoint (each costs a round trip to the worker on
Citus): a handler's error rolls the group back and runs it again *careful*, each
handler in a savepoint of its own, its failure recorded in the group as the per-message
path records it; a processor stays careful while its groups keep meeting errors. What
neither attempt decides (a lost fence, a write to a table local to the coordinator, a
deadlock, a key met twice that did not succeed the first time) rolls the group back and
its messages run on the per-message path
(:mod:`~kafka_idem.consume.paths.local_path`), which handles every case. A lost
connection defers what was not committed. A partition stops, within its group too, at
its first message that waits.

A group holds its rows' locks until its commit, so members whose groups share rows (a
tenant's balance) wait for each other, and may deadlock (detected after a second or
two). A group that meets a deadlock, a lock timeout or a serialization failure rolls
back, and the processor then runs its units message by message for
:data:`CONTENDED_SECONDS` (a transaction per message holds its locks only for that
message) before it tries groups again.

Groups commit one after another: a partition's messages on two workers commit in two
transactions, so a later message's effect may be visible before an earlier one's of the
same partition. A key's messages are always on one shard, so in one group: per-key order
holds. A partition's results stop at its first message that did not finish; its later
messages, committed or not, come again (and replay).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import psycopg

from kafka_idem.consume.outcome import (
    TP,
    Ahead,
    Deferred,
    Ended,
    Finished,
    Message,
    Parts,
    Reason,
    Results,
)
from kafka_idem.consume.paths.batch_path import (
    Fallback,
    Item,
    committed_note,
    prepare_items,
    replay_or_conflict,
)
from kafka_idem.consume.paths.database import Database
from kafka_idem.consume.paths.local_path import LocalPath
from kafka_idem.consume.paths.steps import Steps, log
from kafka_idem.errors import (
    ConfigError,
    FrameworkError,
    StaleOwner,
    StoreUnavailable,
    TransientStoreError,
)
from kafka_idem.store import (
    AttemptTransaction,
    Claim,
    Conn,
    HandlerBlock,
    Outcome,
    classify_db_error,
)
from kafka_idem.store.citus import workers_of

Done = tuple[Item, Claim, Any]  # a message whose handler succeeded: its claim, its result


class HandlerFailed(Fallback):
    """A handler raised on a group's attempt without savepoints: run it again, careful."""


class Contended(Fallback):
    """A group met other transactions' locks (a deadlock, a lock timeout)."""


CONTENDED_SECONDS = 30.0
"""After a group met contention, how long a processor runs its units message by message."""


class WorkerGroups:
    """The local-mode path of one processor on a distributed store."""

    def __init__(self, steps: Steps, db: Database, local: LocalPath) -> None:
        self.steps = steps
        self.db = db
        self.local = local
        self.careful = False  # a savepoint per handler (the last group met an error)
        self.contended_until = 0.0  # monotonic time: message by message until then

    def run(self, parts: Parts, ahead: Ahead | None = None) -> Results:
        if time.monotonic() < self.contended_until:
            return self.local.run(parts)
        try:
            items = prepare_items(self.steps, parts, ahead)
            with self.db.unavailable():
                groups = self._groups(self.db.connection(), items)
        except (FrameworkError, psycopg.Error) as exc:
            if self.db.gone(exc):
                return self.steps.defer_all(parts, exc)
            return self.local.run(parts)  # e.g. an app's codec misconfigured: held there
        lost: BaseException | None = None
        fallback: list[Item] = []
        stops: dict[TP, int] = {}  # a partition's first message that did not finish
        for group in groups:
            todo = [i for i in group if i.msg.offset() < stops.get(i.tp, 1 << 62)]
            if time.monotonic() < self.contended_until:  # a group before met contention
                fallback.extend(todo)
                continue
            try:
                self._attempt(todo)
            except StoreUnavailable as exc:
                lost = exc
                break
            except Fallback as exc:
                if isinstance(exc, Contended):
                    self._contended(exc)
                log.debug("group falls back: %s", exc, extra={"action": "batch_fallback"})
                fallback.extend(_cleared(todo))
                continue
            for item in todo:
                if isinstance(item.result, Deferred):
                    stops[item.tp] = min(stops.get(item.tp, 1 << 62), item.msg.offset())
        if fallback and lost is None:
            self._per_message(fallback)
        return self._results(parts, items, lost, logged={id(i) for i in fallback})

    def _contended(self, exc: Contended) -> None:
        if time.monotonic() >= self.contended_until:
            log.info("a group met other members' locks (%s): message by message for %.0f s",
                     exc, CONTENDED_SECONDS, extra={"action": "groups_contended"})
        self.contended_until = time.monotonic() + CONTENDED_SECONDS

    def _groups(self, conn: Conn, items: list[Item]) -> list[list[Item]]:
        """The decoded messages grouped by the worker of their shard, each group in the
        unit's order."""
        store = self.steps.store
        shard = {id(i): store.shard_of(i.prep.key, i.prep.shard) or i.prep.key
                 for i in items if i.prep is not None}
        if not shard:
            return []
        conn.autocommit = True  # a read of the coordinator's metadata: no transaction
        try:
            worker = workers_of(conn, store, sorted(set(shard.values())))
        finally:
            if not conn.closed:
                conn.autocommit = False
        groups: dict[int, list[Item]] = {}
        for item in items:
            if id(item) in shard:
                groups.setdefault(worker.get(shard[id(item)], -1), []).append(item)
        return [groups[w] for w in sorted(groups)]

    def _attempt(self, group: list[Item]) -> None:
        """Commit ``group``: without savepoints unless the last group needed them; a
        handler's error there runs it again, careful."""
        if not self.careful:
            try:
                self._commit_group(group, careful=False)
                return
            except HandlerFailed as exc:
                log.debug("group runs again, careful: %s", exc,
                          extra={"action": "batch_fallback"})
                _cleared(group)
        self.careful = self._commit_group(group, careful=True)

    def _commit_group(self, group: list[Item], *, careful: bool) -> bool:
        """One worker's messages in one transaction, committed (their notes logged with
        the unit's results, :meth:`_results`).
        Returns whether a handler failed (recorded: ``careful``). Raises
        :class:`Fallback` (rolled back) for a case left to the per-message path,
        :class:`StoreUnavailable` when the connection is gone (the commit's outcome then
        unknown: the messages come again and replay what committed)."""
        if not group:
            return False
        conn = self.db.connection()
        conn.autocommit = True  # BEGIN and COMMIT travel in the pipeline
        failed: list[Item] = []
        try:
            with conn.pipeline() as pipeline, AttemptTransaction(conn):
                # The queued BEGIN sent and its state reported: psycopg decides savepoint
                # or BEGIN for a block (a handler's ctx.tx.transaction(), the careful
                # call's) from the state the server last reported, which a sync brings.
                pipeline.sync()
                done = self._run_group(conn, group, failed if careful else None)
        except Exception as exc:
            with contextlib.suppress(psycopg.Error):
                conn.rollback()  # an aborted or open transaction (no-op when none is)
            cause = exc.__cause__ if isinstance(exc, HandlerFailed) else exc
            kind = classify_db_error(cause) if cause is not None else None
            if self.db.gone(exc) or kind is StoreUnavailable:
                raise StoreUnavailable(str(exc)) from exc
            if kind is TransientStoreError or isinstance(cause, TransientStoreError):
                raise Contended(f"{type(cause).__name__}: {cause}") from exc
            if isinstance(exc, Fallback):
                raise
            raise Fallback(f"{type(exc).__name__}: {exc}") from exc
        finally:
            if not conn.closed:
                conn.autocommit = False
        for item, _claim, _result in done:
            assert item.prep is not None
            item.result = Finished(Ended.SUCCEEDED, key=item.prep.key)
        return bool(failed)

    def _run_group(self, conn: Conn, group: list[Item], failed: list[Item] | None
                   ) -> list[Done]:
        """Claims and handlers in order (``failed``: careful, the messages whose handler
        failed go there); a key's later occurrences; the events; the fenced completions
        (queued: a stale token fails the ``COMMIT`` after them)."""
        steps = self.steps
        done: list[Done] = []
        first: dict[str, Item] = {}
        again: list[Item] = []
        stopped: set[TP] = set()  # partitions at a message that waits
        for item in group:
            prep = item.prep
            assert prep is not None
            if item.tp in stopped:
                continue
            if prep.key in first:
                again.append(item)
                continue
            first[prep.key] = item
            claim = steps.claim(conn, item.handler, item.msg, prep)
            if claim.outcome is not Outcome.CLAIMED:
                verdict = steps.not_claimed(item.handler, item.msg, prep, claim)
                item.result, item.note = verdict.result, verdict.note
            elif failed is None:
                done.append((item, claim, self._call(conn, item, claim)))
            elif (called := self._call_careful(conn, item, claim)) is not None:
                done.append((item, claim, called[0]))
            else:
                failed.append(item)
            if isinstance(item.result, Deferred):
                stopped.add(item.tp)
        succeeded = {item.prep.key: (result, claim.attempts)
                     for item, claim, result in done if item.prep}
        for item in again:  # exactly like a redelivery after the first occurrence
            prep = item.prep
            assert prep is not None
            if item.tp in stopped:
                continue
            if prep.key not in succeeded:
                raise Fallback("a key met twice did not succeed the first time")
            stored = first[prep.key].prep
            assert stored is not None
            result, attempts = succeeded[prep.key]
            item.result = replay_or_conflict(steps, item, stored.request_hash, result, attempts)
        steps.emitter.flush(conn, *[item.ctx for item, _c, _r in done if item.ctx])
        try:
            steps.store.refuse_local_writes(conn, group[0].handler.name)
        except ConfigError as exc:  # the per-message path names the handler that wrote
            raise Fallback(str(exc)) from exc
        for item, claim, result in done:
            assert item.prep is not None and claim.token is not None
            steps.store.complete(conn, key=item.prep.key, token=claim.token, result=result,
                                 wait=False, shard=item.prep.shard)
        return done

    def _call(self, conn: Conn, item: Item, claim: Claim) -> Any:
        """The message's handler (or its reconciler); its error leaves the group to the
        per-message path, which records it."""
        prep = item.prep
        assert prep is not None
        steps = self.steps
        ctx = item.ctx = steps.context(conn, item.handler, item.msg, prep, claim.attempts)
        with steps.handler_time(item.handler):
            try:
                result, _how = steps.handler_step(item.handler, item.msg, prep, claim, ctx)
            except Exception as exc:
                raise HandlerFailed(f"handler raised {type(exc).__name__}") from exc
        return result

    def _call_careful(self, conn: Conn, item: Item, claim: Claim) -> tuple[Any] | None:
        """The handler in a savepoint: ``(result,)``; or, when it raised, its writes (and
        its events) rolled back, its failure recorded in the group as the per-message path
        records it (``item.result``: a retry waits, a dead letter), and ``None``. A
        deadlock, a lost connection or the framework's own error leaves the group."""
        prep = item.prep
        assert prep is not None
        steps = self.steps
        ctx = item.ctx = steps.context(conn, item.handler, item.msg, prep, claim.attempts)
        try:
            # A savepoint (the group's transaction was reported at its start), synced
            # before it is released: an error of the handler's statements is met inside
            # it, as the handler's.
            with conn.pipeline() as pipeline, steps.handler_time(item.handler), \
                    HandlerBlock(conn):
                result, _how = steps.handler_step(item.handler, item.msg, prep, claim, ctx)
                pipeline.sync()
            return (result,)
        except (FrameworkError, StaleOwner):
            raise
        except Exception as exc:
            if self.db.gone(exc) or classify_db_error(exc) is TransientStoreError:
                raise  # the connection, or contention (a deadlock): not the message's
            item.ctx = None  # its events went with its savepoint
            verdict = steps.record_failure(conn, item.handler, item.msg, prep, claim, exc)
            item.result, item.note = verdict.result, verdict.note
            return None

    def _per_message(self, items: list[Item]) -> None:
        """The per-message path for ``items`` (decoded afresh); their results set."""
        parts: dict[TP, list[Item]] = {}
        for item in items:
            parts.setdefault(item.tp, []).append(item)
        results = self.local.run([(tp, [i.msg for i in its]) for tp, its in parts.items()])
        for tp, its in parts.items():
            for item, result in zip(its, results.get(tp, []), strict=False):
                item.result = result

    def _results(self, parts: Parts, items: list[Item], lost: BaseException | None,
                 logged: set[int]) -> Results:
        """Each partition's results in offset order, up to its first message that did
        not finish (deferred, or not reached: the connection was lost). Each result
        given is logged now (the per-message path's, ``logged``, were already): a later
        message of a partition whose group committed after the partition stopped comes
        again, and what becomes of it is logged then (a dead letter is only sent then)."""
        by_tp: dict[TP, list[Item]] = {}
        for item in items:
            by_tp.setdefault(item.tp, []).append(item)
        out: Results = {}
        waiting: list[tuple[TP, list[Message]]] = []
        for tp, _msgs in parts:
            out[tp] = []
            for item in by_tp.get(tp, []):
                if item.result is None:
                    out[tp].append(Deferred(0.0, Reason.FRAMEWORK))
                    waiting.append((tp, [item.msg]))
                    break
                out[tp].append(item.result)
                if id(item) not in logged:
                    note = item.note or committed_note(item.handler, item.msg, item.result)
                    if note is not None:
                        note.write(log)
                if isinstance(item.result, Deferred):
                    break
        if lost is not None and waiting:
            self.steps.defer_all(waiting, lost)  # logged and counted once
        return out


def _cleared(items: list[Item]) -> list[Item]:
    """``items`` with what a rolled-back attempt decided forgotten."""
    for item in items:
        item.result = item.ctx = item.note = None
    return items
