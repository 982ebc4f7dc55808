"""Local mode, message by message: for handlers whose effects live only in this database.

A whole unit of work runs in *one* transaction; each message in its own SAVEPOINT
(claim, handler, completion), so one failing message rolls back alone. One commit,
one WAL flush, for the unit. A crash rolls everything back: nothing partial.

This is the reference path: the batch path (:mod:`kafka_idem.consume.batch`) hands
every case it does not take on to it.
"""

from __future__ import annotations

import psycopg

from kafka_idem.consume.database import Database
from kafka_idem.consume.outcome import (
    Deferred,
    Message,
    Parts,
    Prepared,
    Reason,
    Result,
    Results,
)
from kafka_idem.consume.steps import Steps, log
from kafka_idem.consume.verdicts import where
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
        """Process each partition's messages in order inside one transaction.

        A partition stops at its first deferred message. If the transaction
        itself fails (connection lost, commit refused), every message is
        deferred: nothing was committed, nothing is charged. If the commit was
        refused for a message's data (a deferred constraint of a business table),
        the unit runs again one message per transaction, so only that message is
        dead-lettered.
        """
        results: Results = {tp: [] for tp, _ in parts}
        try:
            with self.db.unavailable():
                conn = self.db.connection()
                with conn.transaction():
                    for tp, msgs in parts:
                        for msg in msgs:
                            result = self._one(conn, msg)
                            results[tp].append(result)
                            if isinstance(result, Deferred):
                                break
        except (FrameworkError, psycopg.Error) as exc:
            if is_data_error(exc):  # the commit was refused for a message's data
                return self._refused(parts, exc)
            return self.steps.defer_all(parts, exc)
        return results

    def _refused(self, parts: Parts, exc: BaseException) -> Results:
        """The commit was refused for a message's data: find the message."""
        if sum(len(msgs) for _, msgs in parts) > 1:
            return self._one_by_one(parts)
        tp, msgs = next((tp, msgs) for tp, msgs in parts if msgs)
        handler = self.steps.handler(msgs[0])
        verdict = self.steps.undecodable(handler, msgs[0], rejected(exc),
                                         key=self.steps.key_of(handler, msgs[0]))
        verdict.note.write(log)
        return {tp: [verdict.result]}

    def _one_by_one(self, parts: Parts) -> Results:
        """Each message in a transaction of its own (after a commit refused for data):
        the message whose commit is refused is dead-lettered alone."""
        log.warning("a commit was refused for a message's data; isolating the message",
                    extra={"action": "isolating"})
        results: Results = {tp: [] for tp, _ in parts}
        for tp, msgs in parts:
            for msg in msgs:
                got = self.run([(tp, [msg])])[tp]
                results[tp].extend(got)
                if not got or isinstance(got[-1], Deferred):
                    break
        return results

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
            with conn.transaction():  # SAVEPOINT: this message rolls back alone
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
        except ConfigError as exc:  # rolled back with its savepoint: held, never charged
            return steps.hold.hold(handler, msg, exc)
        except (TransientStoreError, StaleOwner) as exc:
            self.db.raise_if_gone(exc)
            log.info("transient store error (%s); will retry", describe(exc),
                     extra={"action": "deferred", "key": prep.key, **where(msg)})
            return Deferred(self.steps.settings.busy_retry_seconds, Reason.FRAMEWORK)
