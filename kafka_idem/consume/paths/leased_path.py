"""Leased mode: for handlers with effects outside this database.

Step 1, a short claim transaction commits ``processing`` with an owner token and a
lease (kept alive by a heartbeat while the handler runs). Step 2, the handler's
writes and the completion fenced by that token commit together, or roll back
together when the token lost the key to a newer owner.

This is a sync handler's path, on its processor's one connection. An ``async def``
handler's runs the same steps on the event loop
(:mod:`~kafka_idem.consume.paths.async_leased_path`) and shares this module's
judgement of the errors around them (:func:`around_failure`) and its withdrawal log
lines (:func:`note_withdrawal`).
"""

from __future__ import annotations

import uuid

import psycopg

from kafka_idem.consume.outcome import Deferred, Message, Prepared, Reason, Result
from kafka_idem.consume.paths.calls import delivery
from kafka_idem.consume.paths.database import Database
from kafka_idem.consume.paths.lease_keeper import LeaseKeeper
from kafka_idem.consume.paths.round_claim import RoundClaim, Tokens, claim_round
from kafka_idem.consume.paths.slots import CallNotStarted, Gate
from kafka_idem.consume.paths.steps import Steps, log
from kafka_idem.consume.paths.verdicts import where
from kafka_idem.errors import ConfigError, FrameworkError, MessageError, StaleOwner
from kafka_idem.store import Claim, Conn, Outcome, describe


class LeasedPath:
    def __init__(self, steps: Steps, db: Database, leases: LeaseKeeper | None) -> None:
        self.steps = steps
        self.db = db
        self.leases = leases  # None: no heartbeat (the lease must outlast the handler)

    def run(
        self, msg: Message, *, reentrant: uuid.UUID | None = None,
        prepared: Prepared | None = None, round: RoundClaim | None = None,
        gate: Gate | None = None,
    ) -> Result:
        """``reentrant`` is our own claim of ``msg``'s key from an earlier try that
        was deferred with its lease still live: re-entered, not waited for.
        ``prepared``: ``msg`` already decoded (key-ordered admission). ``round``: the
        claim shared by the keys started with ``msg``'s
        (:mod:`~kafka_idem.consume.paths.round_claim`)."""
        prep = prepared if prepared is not None else self.prepare(msg, reentrant)
        if not isinstance(prep, Prepared):
            return prep
        claim: Claim | None = None
        # The token our claim takes, known before it is sent: a claim can commit while
        # the connection is lost with its answer (on Citus the worker commits it); the
        # retry then re-enters it (never charged) instead of waiting out its lease.
        token = reentrant or uuid.uuid4()
        try:
            with self.db.unavailable():
                conn = self.db.connection()
                claim = self._claim(conn, msg, prep, reentrant, round, token)
                return self._run_claimed(conn, msg, prep, claim, gate)
        except (MessageError, FrameworkError, psycopg.Error) as exc:
            return self.failed(exc, msg, prep, claim.token if claim is not None else token)
        except CallNotStarted:  # its partition is leaving, or the member stopping
            if claim is not None:
                self._withdraw(claim, prep.shard)
            raise

    def _withdraw(self, claim: Claim, shard: str | None) -> None:
        """Withdraw a claim whose call never started (best effort: else its lease
        runs out, the attempt charged)."""
        if not claim.withdrawable:
            return  # a re-entry's: an earlier claim's attempt, not ours to withdraw
        assert claim.token is not None
        try:
            with self.db.unavailable():
                conn = self.db.connection()
                with conn.transaction():
                    withdrawn = self.steps.store.withdraw_claim(
                        conn, key=claim.key, token=claim.token, took_over=claim.took_over,
                        shard=shard)
        except (FrameworkError, psycopg.Error) as exc:
            note_withdrawal(claim.key, failed=exc)
            return
        if withdrawn:
            note_withdrawal(claim.key)

    def prepare(self, msg: Message, reentrant: uuid.UUID | None = None) -> Prepared | Result:
        """``msg`` decoded, or what becomes of one that cannot be now: its dead letter
        (undecodable, invalid), held (a configuration error) or deferred (e.g. the
        schema registry is down). Shared with the test kit's ``async def`` path."""
        steps = self.steps
        handler = steps.handler(msg)
        try:
            return steps.prepare_or_reject(handler, msg)
        except ConfigError as exc:  # held, never charged (consume/config_hold.py)
            return steps.hold.hold(handler, msg, exc, token=reentrant)
        except FrameworkError as exc:  # e.g. the registry is down: not the message's fault
            steps.metrics.framework_errors.labels(type(exc).__name__).inc()
            log.warning("cannot decode now (%s); will retry", describe(exc),
                        extra={"action": "deferred", **where(msg)})
            return Deferred(steps.settings.busy_retry_seconds, Reason.FRAMEWORK,
                            token=reentrant)

    def failed(
        self, exc: BaseException, msg: Message, prep: Prepared, token: uuid.UUID | None
    ) -> Result:
        return around_failure(self.steps, exc, msg, prep, token)

    def _claim(
        self, conn: Conn, msg: Message, prep: Prepared, reentrant: uuid.UUID | None,
        round: RoundClaim | None = None, token: uuid.UUID | None = None,
    ) -> Claim:
        """Claim and commit: a new key in the round's statement or in one round trip
        of its own, else the full claim (``token``: the one a claim made now takes)."""
        if reentrant is None:
            tokens = self._round_tokens(conn, msg, prep, round)
            if tokens is None:
                claim = self.steps.claim_new(conn, self.steps.handler(msg), msg, prep, token)
                if claim is not None:
                    return claim
            elif prep.key in tokens:
                return Claim.new_key(prep.key, tokens[prep.key])
        return self._claim_existing(conn, msg, prep, reentrant, token)

    def _round_tokens(
        self, conn: Conn, msg: Message, prep: Prepared, round: RoundClaim | None
    ) -> Tokens | None:
        """The tokens of ``msg``'s round, when its key is in one whose claim worked."""
        if round is None or not round.covers(prep.key, delivery(self.steps.handler(msg), msg)):
            return None
        with self.steps.tracing.step(msg, "claim"):
            return round.tokens(lambda todo: claim_round(
                self.steps.store, conn, todo, self.steps.settings.lease_seconds))

    def _claim_existing(
        self, conn: Conn, msg: Message, prep: Prepared, reentrant: uuid.UUID | None,
        token: uuid.UUID | None = None,
    ) -> Claim:
        with conn.transaction():
            return self.steps.claim(conn, self.steps.handler(msg), msg, prep,
                                    reentrant=reentrant, token=token)

    def _run_claimed(
        self, conn: Conn, msg: Message, prep: Prepared, claim: Claim, gate: Gate | None = None,
    ) -> Result:
        steps = self.steps
        handler = steps.handler(msg)
        if claim.outcome is not Outcome.CLAIMED:
            verdict = steps.not_claimed(handler, msg, prep, claim)
            verdict.note.write(log)
            return verdict.result
        assert claim.token is not None
        if self.leases is None:
            return steps.execute(conn, handler, msg, prep, claim, pipelined=True, gate=gate)
        with self.leases.hold(claim.key, claim.token, prep.shard) as hold:  # renewed meanwhile
            return steps.execute(conn, handler, msg, prep, claim, hold=hold, pipelined=True,
                                 gate=gate)


def around_failure(
    steps: Steps, exc: BaseException, msg: Message, prep: Prepared, token: uuid.UUID | None
) -> Result:
    """What an error around the handler (never the handler's own) means; shared by the
    sync and the async path. ``token``: our live claim, if any."""
    if isinstance(exc, MessageError):  # the claim refused the message's data: no record
        verdict = steps.undecodable(steps.handler(msg), msg, exc, key=prep.key)
        verdict.note.write(log)
        return verdict.result
    if isinstance(exc, StaleOwner):
        return Deferred(steps.settings.busy_retry_seconds, Reason.BUSY)
    if isinstance(exc, ConfigError):  # our claim stays ours: re-entered when retried
        return steps.hold.hold(steps.handler(msg), msg, exc, token=token)
    # Our surroundings failed (database down, a store error): never charged.
    steps.metrics.framework_errors.labels(type(exc).__name__).inc()
    log.warning(
        "store error (%s); will retry", describe(exc),
        extra={"action": "deferred", "key": prep.key, **where(msg)},
    )
    return Deferred(steps.settings.busy_retry_seconds, Reason.FRAMEWORK, token=token)


def note_withdrawal(key: str, *, failed: BaseException | None = None) -> None:
    """Log a withdrawn claim, or one that could not be (its lease then runs out)."""
    if failed is not None:
        log.info("the claim of key %r was not withdrawn (%s); its lease ends on its own",
                 key, describe(failed), extra={"action": "abandoned", "key": key})
    else:
        log.info("withdrew the claim of key %r (its call had not started): the next owner "
                 "may take it over now, no attempt charged", key,
                 extra={"action": "abandoned", "key": key})
