"""One claim for the new keys of the messages a dispatch round starts together.

The key-ordered path starts a few messages per loop round. Claimed alone, each key
costs a round trip and a commit (an fsync) of its own; the round's keys are claimed
in one statement instead (the batch path's ``batch_claim_insert``, on an autocommit
connection: one commit), sent by the first of the round's jobs to start, so the
loop thread never waits on the database. Each job then finds its key's fencing
token in the answer, or claims alone as before: a key that already existed (busy
under another lease, succeeded, failed, conflicting) gets the per-message claim's
decision, and a reentrant key (our own live claim from a deferred try) never joins
a round. A round whose claim fails leaves every job to its per-message claim.

A job that will not start (its partition leaving, the member stopping) takes its
key out of the round if the claim has not been sent yet; once sent, the job reads
its token and, its call never starting (:mod:`~kafka_idem.consume.paths.slots`), withdraws
the claim: the lease ends, no attempt charged. A member that dies after the claim
commits and before a job starts leaves that key ``processing`` under a lease
nobody renews: its successor takes it over once the lease ends, charging an
attempt and reconciling first, like any claimed key whose owner died
(docs/PROTOCOL.md).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kafka_idem.store import AsyncConn, Conn, Delivery, Store, describe, translate_errors

log = logging.getLogger(__name__)

Tokens = dict[str, uuid.UUID]


@dataclass(frozen=True, slots=True)
class Wanted:
    """A key the round claims, with what its record keeps."""

    key: str
    request_hash: str
    delivery: Delivery
    shard: str | None = None  # the handler's shard key (stored with the record)


class RoundClaim:
    """The keys of one dispatch round (distinct) and, once sent, their claim."""

    def __init__(self, wanted: Sequence[Wanted]) -> None:
        self._wanted = {w.key: w for w in wanted}
        self._lock = threading.Lock()
        self._future: Future[Tokens] | None = None

    def covers(self, key: str, delivery: Delivery) -> bool:
        """Whether the round claims ``key`` for this message (a second message of the
        same key, on another partition, claims alone)."""
        wanted = self._wanted.get(key)
        return wanted is not None and wanted.delivery == delivery

    def withdraw(self, key: str, delivery: Delivery) -> bool:
        """The message's job will not start: True when the round does not claim its key
        (taken out before the claim was sent, or never in); False when the claim covers
        it (its key may be ours: the job reads its token, then withdraws the claim)."""
        with self._lock:
            if not self.covers(key, delivery):
                return True
            if self._future is None:
                del self._wanted[key]
                return True
            return False

    def _begin(self) -> tuple[Future[Tokens], list[Wanted] | None]:
        """The round's answer, and the keys to claim when the caller is the first."""
        with self._lock:
            if self._future is not None:
                return self._future, None
            self._future = Future()
            self._future.set_running_or_notify_cancel()  # a waiter's cancel never ends it
            return self._future, list(self._wanted.values())

    def tokens(self, run: Callable[[list[Wanted]], Tokens]) -> Tokens | None:
        """The round's tokens (``run`` claims them here if no job has yet); ``None``
        when the claim failed (each job claims alone)."""
        future, todo = self._begin()
        if todo is not None:
            _settle(future, lambda: run(todo))
        return answer(future)

    def future(self, submit: Callable[[list[Wanted]], Future[Tokens]]) -> Future[Tokens]:
        """The round's answer to wait on (``submit`` sends the claim elsewhere, a claim
        thread, if no job has yet): for an ``async def`` handler's task."""
        future, todo = self._begin()
        if todo is not None:
            sent = submit(todo)
            sent.add_done_callback(lambda f: _settle(future, f.result))
        return future


def _settle(future: Future[Tokens], fn: Callable[[], Tokens]) -> None:
    try:
        future.set_result(fn())
    except Exception as exc:
        future.set_exception(exc)


def answer(future: Future[Tokens]) -> Tokens | None:
    try:
        return future.result()
    except Exception as exc:  # the per-message claims decide (and report) it
        log.debug("round claim failed (%s); claiming alone", describe(exc),
                  extra={"action": "round_claim_failed"})
        return None


def claim_round(store: Store, conn: Conn, wanted: Sequence[Wanted],
                lease_seconds: float) -> Tokens:
    """Claim every new key of ``wanted`` in one statement, committed alone
    (autocommit); ``{key: token}`` for those that were new."""
    wanted = sorted(wanted, key=lambda w: w.key)  # a stable lock order, as the batch path's
    conn.autocommit = True
    try:
        with translate_errors():
            return store.claim_batch(
                conn, lease_seconds=lease_seconds, keys=[w.key for w in wanted],
                hashes=[w.request_hash for w in wanted],
                deliveries=[w.delivery for w in wanted], shards=[w.shard for w in wanted])
    finally:
        if not conn.closed:
            conn.autocommit = False


async def claim_round_async(store: Store, conn: AsyncConn, wanted: Sequence[Wanted],
                            lease_seconds: float) -> Tokens:
    """:func:`claim_round` on an autocommit async connection (the event loop's)."""
    wanted = sorted(wanted, key=lambda w: w.key)
    with translate_errors():
        return await store.claim_batch_async(
            conn, lease_seconds=lease_seconds, keys=[w.key for w in wanted],
            hashes=[w.request_hash for w in wanted],
            deliveries=[w.delivery for w in wanted], shards=[w.shard for w in wanted])
