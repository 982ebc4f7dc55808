"""Local mode, message by message: for handlers whose effects live only in this database.

Each message runs in a transaction of its own: claim, handler, events, completion,
COMMIT. Nothing a message locks (its key's record, the handler's rows, its events'
slots) is held while the next one runs, so two units on shared rows (two members'
partitions charging the same tenant's balance) wait for each other at most once and
never form a cycle; and a unit that waits on locks stops between messages once it
has run for its budget, so the loop polls in time. A crash loses no committed
message: the ones not committed are redelivered.

This is the reference path: the batch path (:mod:`kafka_idem.consume.paths.batch_path`) hands
every case it does not take on to it (a handler error, a busy key, a deadlock or a
lock timeout among batches).
"""

from __future__ import annotations

import time

import psycopg

from kafka_idem.consume.outcome import (
    Deferred,
    Message,
    Parts,
    Prepared,
    Reason,
    Result,
    Results,
)
from kafka_idem.consume.paths.database import Database
from kafka_idem.consume.paths.steps import Steps, log
from kafka_idem.consume.paths.verdicts import where
from kafka_idem.errors import (
    ConfigError,
    FrameworkError,
    MessageError,
    StaleOwner,
    TransientStoreError,
)
from kafka_idem.store import Conn, Outcome, describe, is_data_error, rejected


class LocalPath:
    def __init__(self, steps: Steps, db: Database) -> None:
        self.steps = steps
        self.db = db

    def run(self, parts: Parts) -> Results:
        """Process each partition's messages in order, each in a transaction of its own.

        A partition stops at its first deferred message. A message whose commit is
        refused for its data (a deferred constraint of a business table) is
        dead-lettered alone. A lost connection defers every message not committed yet
        (nothing of them committed, nothing charged); the ones committed keep their
        results. A unit that has run for :meth:`budget` seconds defers the rest (not
        charged: taken on the next round, after the loop polled).
        """
        self.steps.wake = set()
        try:
            return self._run(parts)
        finally:
            self._wake()

    def _run(self, parts: Parts) -> Results:
        results: Results = {tp: [] for tp, _ in parts}
        until = time.monotonic() + self.budget()
        for i, (tp, msgs) in enumerate(parts):
            for msg in msgs:
                if time.monotonic() > until and any(results.values()):
                    results[tp].append(Deferred(0.0, Reason.BUSY))
                    break
                try:
                    with self.db.unavailable():
                        result = self._one(self.db.connection(), msg)
                except (FrameworkError, psycopg.Error) as exc:
                    if is_data_error(exc):  # its commit was refused for its data
                        result = self._refused(msg, exc)
                    elif self.db.gone(exc):
                        return self._defer_rest(results, parts[i:], exc)
                    else:  # its commit failed (a serialization failure...): it waits
                        result = self._commit_failed(msg, exc)
                results[tp].append(result)
                if isinstance(result, Deferred):
                    break
        return results

    def _wake(self) -> None:
        """Wake the relays of the shards the unit's events went to, once: a notifying
        commit takes a server-wide lock through its flush, so one per message made the
        unit's commits queue behind each other. Best effort: a relay polls anyway
        (``outbox_poll_seconds``)."""
        notes, self.steps.wake = self.steps.wake, None
        if not notes:
            return
        try:
            with self.db.unavailable():
                conn = self.db.connection()
                with conn.transaction():
                    self.steps.store.outbox_wake(conn, sorted(notes))
        except (FrameworkError, psycopg.Error) as exc:
            self.db.gone(exc)
            log.debug("relays not woken (%s): they poll", describe(exc))

    def budget(self) -> float:
        """How long one unit may run before it defers the rest: a quarter of
        ``max_poll_interval_ms``, so a unit waiting on other members' locks never
        costs the member its place in the group."""
        return self.steps.settings.max_poll_interval_ms / 4000

    def _defer_rest(self, results: Results, rest: Parts, exc: BaseException) -> Results:
        """The connection is gone: every partition not finished waits at its next
        message; what was committed keeps its results."""
        waiting = [(tp, msgs[len(results[tp]):]) for tp, msgs in rest
                   if len(results[tp]) < len(msgs)]
        for tp, result in self.steps.defer_all(waiting, exc).items():
            results[tp].extend(result)
        return results

    def _refused(self, msg: Message, exc: BaseException) -> Result:
        """The commit was refused for the message's data: dead-lettered alone."""
        handler = self.steps.handler(msg)
        verdict = self.steps.undecodable(handler, msg, rejected(exc),
                                         key=self.steps.key_of(handler, msg))
        verdict.note.write(log)
        return verdict.result

    def _commit_failed(self, msg: Message, exc: BaseException) -> Result:
        log.info("commit failed (%s); will retry", describe(exc),
                 extra={"action": "deferred", **where(msg)})
        self.steps.metrics.framework_errors.labels(type(exc).__name__).inc()
        return Deferred(self.steps.settings.busy_retry_seconds, Reason.FRAMEWORK)

    def _one(self, conn: Conn, msg: Message) -> Result:
        steps = self.steps
        handler = steps.handler(msg)
        try:
            prep = steps.prepare_or_reject(handler, msg)
        except ConfigError as exc:  # e.g. an app's own codec: held, never charged
            return steps.hold.hold(handler, msg, exc)
        if not isinstance(prep, Prepared):
            return prep
        try:
            with conn.transaction():  # BEGIN ... COMMIT: this message alone
                claim = steps.claim(conn, handler, msg, prep)
                if claim.outcome is Outcome.CLAIMED:
                    return steps.execute(conn, handler, msg, prep, claim)
                verdict = steps.not_claimed(handler, msg, prep, claim)
            verdict.note.write(log)
            return verdict.result
        except MessageError as exc:  # the claim refused the message's data: no record
            verdict = steps.undecodable(handler, msg, exc, key=prep.key)
            verdict.note.write(log)
            return verdict.result
        except ConfigError as exc:  # rolled back with its transaction: held, never charged
            return steps.hold.hold(handler, msg, exc)
        except (TransientStoreError, StaleOwner) as exc:
            self.db.raise_if_gone(exc)
            log.info("transient store error (%s); will retry", describe(exc),
                     extra={"action": "deferred", "key": prep.key, **where(msg)})
            return Deferred(self.steps.settings.busy_retry_seconds, Reason.FRAMEWORK)
