"""The idempotency store: the claim / complete protocol with fencing tokens.

Claim, inside the caller's transaction:

1. ``claim_insert``: a new key is inserted as ``processing`` with a fresh owner
   token and lease, ``ON CONFLICT DO NOTHING``. A returned row means **claimed**.
2. Otherwise ``claim_lock`` locks the existing row (``FOR UPDATE``; a new
   statement, so a row whose insert we just lost a race to is visible) and,
   holding the lock, decides:

   a. request hash differs            -> **conflict** (the record is untouched)
   b. ``succeeded``                   -> **replay** the stored result
   c. ``failed``                      -> **dead**: already dead-lettered, do it again
   d. ``processing`` with a live lease
      or ``retryable_failed`` not yet due -> **busy**, retry in ``retry_in`` seconds
   e. attempts or elapsed time used up -> **exhausted** (moved to ``failed`` here)
   f. otherwise                        -> ``claim_take``: new token, new lease,
                                          attempts + 1: **claimed**

Complete, in the transaction that holds the handler's business writes:
``UPDATE ... SET status='succeeded' WHERE owner_token = mine``. No row means the
lease was taken over; the caller must roll back, and the business writes go
with it. The database's transition guard enforces the same rule.

Every database error leaves this module as a :mod:`kafka_idem.errors` class,
translated in :func:`translate_errors` only.
"""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from kafka_idem.errors import (
    DataRejected,
    IllegalTransition,
    KafkaIdemError,
    StaleOwner,
    StoreError,
    StoreUnavailable,
    TransientStoreError,
)
from kafka_idem.redact import redact
from kafka_idem.sql import compile_queries

Conn = psycopg.Connection[Any]

# SQLSTATEs, never message text (message text changes
# between versions and locales).
TRANSIENT_SQLSTATES = frozenset(
    {
        "40001",  # serialization_failure
        "40P01",  # deadlock_detected
        "55P03",  # lock_not_available
        "57014",  # query_canceled (statement/lock timeout)
        "53300",  # too_many_connections
    }
)
UNAVAILABLE_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "08000", "08003", "08006"})
ILLEGAL_TRANSITION = "KI001"
STALE_OWNER = "KI002"


# Errors caused by the data a message brought, not by the database's state: retrying
# the same message can never succeed, so it is dead-lettered (DataRejected). Class 22
# is "data exception" (invalid byte sequence, NUL in jsonb, numeric overflow, value
# too long), class 23 "integrity constraint violation" (check, not-null, foreign key);
# 54000 is "program limit exceeded" (an index entry over PostgreSQL's B-tree limit).
DATA_SQLSTATE_CLASSES = ("22", "23")
DATA_SQLSTATES = frozenset({"54000"})


def is_data_error(exc: BaseException) -> bool:
    """True when ``exc`` is the database (or psycopg, before sending) refusing a value.

    psycopg itself refuses a NUL in text and a string it cannot encode, with no SQLSTATE.
    """
    if isinstance(exc, UnicodeEncodeError | DataRejected):
        return True
    if not isinstance(exc, psycopg.Error):
        return False
    state = exc.sqlstate or ""
    if state:
        return state[:2] in DATA_SQLSTATE_CLASSES or state in DATA_SQLSTATES
    return isinstance(exc, psycopg.DataError)


def data_error_text(exc: BaseException) -> str:
    """What the database said about the value, without the value itself: the SQLSTATE
    and primary message (never DETAIL/CONTEXT, which may quote the parameters)."""
    if isinstance(exc, psycopg.Error):
        primary = exc.diag.message_primary or str(exc).splitlines()[0]
        state = exc.sqlstate or "client-side"
        return f"SQLSTATE {state}: {primary}"
    return f"{type(exc).__name__}: {exc.reason if isinstance(exc, UnicodeEncodeError) else exc}"


def rejected(exc: BaseException, **context: Any) -> DataRejected:
    """``exc``, a data error of the database (:func:`is_data_error`), as the message's
    own :class:`DataRejected` (an existing one is returned as it is)."""
    if isinstance(exc, DataRejected):
        return exc
    return DataRejected(
        f"the database rejected the message's data ({data_error_text(exc)})", **context)


def storable(text: str) -> str:
    """``text`` as PostgreSQL ``text`` can hold it: NUL removed, lone surrogates
    replaced (error messages quote handler exceptions, which may quote payloads)."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def describe(exc: BaseException) -> str:
    """One line about ``exc`` for a log: a database error's SQLSTATE and primary
    message (also when it is the ``__cause__`` of one of ours), else the class and
    the first line of its text."""
    cause = exc if isinstance(exc, psycopg.Error) else exc.__cause__
    if isinstance(cause, psycopg.Error) and cause.sqlstate:
        return f"{type(exc).__name__}: SQLSTATE {cause.sqlstate}: {cause.diag.message_primary}"
    lines = str(exc).strip().splitlines()
    # A connection error can quote its connection string.
    return redact(f"{type(exc).__name__}: {lines[0]}") if lines else type(exc).__name__


def classify_db_error(exc: BaseException) -> type[KafkaIdemError] | None:
    """The kafka_idem error class for a psycopg error, by SQLSTATE (never by message
    text); ``None`` if not a database error."""
    if is_data_error(exc):
        return DataRejected
    if not isinstance(exc, psycopg.Error):
        return None
    state = exc.sqlstate or ""
    if state == ILLEGAL_TRANSITION:
        return IllegalTransition
    if state == STALE_OWNER:
        return StaleOwner
    if state in TRANSIENT_SQLSTATES:
        return TransientStoreError
    if state in UNAVAILABLE_SQLSTATES or state.startswith("08"):
        return StoreUnavailable
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError) and not state:
        return StoreUnavailable  # connection lost, no server answer
    return StoreError


@contextmanager
def translate_errors(**context: Any) -> Iterator[None]:
    """The one place psycopg errors become kafka_idem errors (``__cause__`` kept)."""
    try:
        yield
    except (psycopg.Error, UnicodeEncodeError) as exc:
        cls = classify_db_error(exc) or StoreError
        if cls is DataRejected:
            raise rejected(exc, **context) from exc
        summary = (cls.__doc__ or "").strip().splitlines()[0]
        raise cls(redact(f"{summary}: {exc}"), **context) from exc


class Outcome(enum.StrEnum):
    CLAIMED = "claimed"
    REPLAY = "replay"
    BUSY = "busy"
    CONFLICT = "conflict"
    DEAD = "dead"
    EXHAUSTED = "exhausted"


@dataclass(frozen=True, slots=True)
class Delivery:
    """Where the message being processed came from (stored as the last delivery)."""

    topic: str
    partition: int
    offset: int
    handler: str


@dataclass(frozen=True, slots=True)
class Claim:
    outcome: Outcome
    key: str
    token: uuid.UUID | None = None
    attempts: int = 0
    budget_used: int = 1  # attempts counted against the retry limit (since the last re-run)
    result: Any = None
    retry_in: float = 0.0
    backoff: bool = False  # busy because a retry is not due yet (not someone's live lease)
    failing_for: float = 0.0  # seconds since the first failure, by the database clock
    took_over: bool = False
    last_chance: bool = False  # limit reached: reconcile, then succeed or be exhausted
    previous_error_kind: str | None = None
    error_kind: str | None = None
    error_class: str | None = None
    error_message: str | None = None
    first_failure_at: dt.datetime | None = None
    last_failure_at: dt.datetime | None = None


@dataclass(frozen=True, slots=True)
class Failure:
    """What :meth:`Store.fail` recorded."""

    attempts: int
    next_attempt_at: dt.datetime | None
    first_failure_at: dt.datetime
    last_failure_at: dt.datetime


class Store:
    """Runs the protocol's SQL on a connection the caller owns.

    Methods never commit: the caller decides the transaction boundaries (one
    for claim+handler+complete in local mode, two in leased mode).
    """

    def __init__(self, *, schema: str, table: str, namespace: str | None = None) -> None:
        self.schema = schema
        self.table = table
        # Records are identified by (namespace, key). A consumer's store has its app's
        # namespace; an admin tool's store may have none (``scoped`` gives one).
        self.namespace = namespace
        self.q = compile_queries(schema, table)

    def scoped(self, namespace: str) -> Store:
        """This store (same queries) for ``namespace``."""
        other = Store.__new__(Store)
        other.schema, other.table, other.q = self.schema, self.table, self.q
        other.namespace = namespace
        return other

    @property
    def ns(self) -> str:
        """The namespace every runtime query runs in (a store without one is a bug)."""
        if self.namespace is None:
            raise TypeError("this Store has no namespace; use store.scoped(namespace)")
        return self.namespace

    # --- claim ---------------------------------------------------------------

    def claim(
        self,
        conn: Conn,
        *,
        key: str,
        request_hash: str,
        delivery: Delivery,
        lease_seconds: float,
        max_attempts: int,
        max_elapsed_seconds: float,
        reentrant_token: uuid.UUID | None = None,
        reconcile_first: bool = False,
    ) -> Claim:
        params = self._claim_params(key, request_hash, delivery, lease_seconds)
        with translate_errors(key=key):
            row = conn.execute(self.q["claim_insert"], params).fetchone()
            if row is not None:
                return Claim(Outcome.CLAIMED, key, token=params["token"], attempts=int(row[0]))
            cur = conn.cursor(row_factory=dict_row)
            rec = cur.execute(self.q["claim_lock"], {"ns": self.ns, "key": key}).fetchone()
            if rec is None:
                # Purged between our insert and our lock: a new key again.
                row = conn.execute(self.q["claim_insert"], params).fetchone()
                if row is None:
                    raise TransientStoreError("claim raced with a purge", key=key)
                return Claim(Outcome.CLAIMED, key, token=params["token"], attempts=int(row[0]))
            return self._decide(
                conn, rec, params, max_attempts, max_elapsed_seconds, reentrant_token,
                reconcile_first,
            )

    def claim_new(
        self, conn: Conn, *, key: str, request_hash: str, delivery: Delivery, lease_seconds: float
    ) -> Claim | None:
        """Step 1 alone: claim ``key`` if it is new, else ``None`` (then call :meth:`claim`).

        On an autocommit connection this is a whole claim in one round trip."""
        params = self._claim_params(key, request_hash, delivery, lease_seconds)
        with translate_errors(key=key):
            row = conn.execute(self.q["claim_insert"], params).fetchone()
        if row is None:
            return None
        return Claim(Outcome.CLAIMED, key, token=params["token"], attempts=int(row[0]))

    def _claim_params(
        self, key: str, request_hash: str, delivery: Delivery, lease_seconds: float
    ) -> dict[str, Any]:
        return {
            "ns": self.ns,
            "key": key,
            "hash": request_hash,
            "token": uuid.uuid4(),
            "lease": lease_seconds,
            "handler": delivery.handler,
            "topic": delivery.topic,
            "partition": delivery.partition,
            "offset": delivery.offset,
        }

    def _decide(
        self,
        conn: Conn,
        rec: dict[str, Any],
        params: dict[str, Any],
        max_attempts: int,
        max_elapsed_seconds: float,
        reentrant_token: uuid.UUID | None,
        reconcile_first: bool,
    ) -> Claim:
        key: str = params["key"]
        status: str = rec["status"]
        now: dt.datetime = rec["db_now"]
        errors = {
            "error_kind": rec["error_kind"],
            "error_class": rec["error_class"],
            "error_message": rec["error_message"],
            "first_failure_at": rec["first_failure_at"],
            "last_failure_at": rec["last_failure_at"],
        }
        if rec["request_hash"] != params["hash"]:
            return Claim(Outcome.CONFLICT, key, attempts=rec["attempts"], **errors)
        if status == "succeeded":
            return Claim(Outcome.REPLAY, key, attempts=rec["attempts"], result=rec["result_json"])
        if status == "failed":
            again = conn.execute(self.q["dead_again"], params).fetchone()
            if again is not None:  # the dead letter about to be sent says "now"
                errors["first_failure_at"], errors["last_failure_at"] = again
            return Claim(Outcome.DEAD, key, attempts=rec["attempts"], **errors)
        reentrant = reentrant_token is not None and rec["owner_token"] == reentrant_token
        if status == "processing" and rec["lease_until"] > now and not reentrant:
            wait = (rec["lease_until"] - now).total_seconds()
            return Claim(Outcome.BUSY, key, attempts=rec["attempts"], retry_in=wait)
        if status == "retryable_failed" and rec["next_attempt_at"] and rec["next_attempt_at"] > now:
            wait = (rec["next_attempt_at"] - now).total_seconds()
            return Claim(
                Outcome.BUSY, key, attempts=rec["attempts"], retry_in=wait, backoff=True
            )
        took_over = status == "processing" and not reentrant
        first = rec["first_failure_at"]
        failing_for = (now - first).total_seconds() if first is not None else 0.0
        elapsed_out = first is not None and failing_for >= max_elapsed_seconds
        used = rec["attempts"] - rec["attempt_base"]  # since the last audited re-run
        last_chance = False
        if not reentrant and (used >= max_attempts or elapsed_out):
            # The limit is reached; but if the last attempt's outcome is unknown (it
            # died mid-flight, or said so), the effect may have happened: a handler
            # with a reconciler asks first, and only then is the key exhausted.
            unknown = took_over or rec["error_kind"] == "unknown_outcome"
            if not (reconcile_first and unknown):
                return self._exhaust(conn, rec, key, took_over)
            last_chance = True
        charge = 0 if reentrant or last_chance else 1
        taken = conn.execute(self.q["claim_take"], {**params, "charge": charge})
        row = taken.fetchone()
        assert row is not None  # we hold the row lock
        previous = "lease_expired" if took_over else rec["error_kind"]
        return Claim(
            Outcome.CLAIMED,
            key,
            token=params["token"],
            attempts=int(row[0]),
            budget_used=int(row[0]) - rec["attempt_base"],
            took_over=took_over,
            failing_for=failing_for,
            last_chance=last_chance,
            previous_error_kind=previous,
            **{k: v for k, v in errors.items() if k != "error_kind"},
        )

    def _exhaust(self, conn: Conn, rec: dict[str, Any], key: str, took_over: bool) -> Claim:
        kind = "exhausted"
        message = rec["error_message"] or (
            "lease expired on the last attempt (the process died or stalled)" if took_over else None
        )
        error_class = rec["error_class"] or ("LeaseExpired" if took_over else None)
        row = conn.execute(
            self.q["exhaust"],
            {"ns": self.ns, "key": key, "error_class": error_class, "error_message": message},
        ).fetchone()
        assert row is not None
        return Claim(
            Outcome.EXHAUSTED,
            key,
            attempts=rec["attempts"],
            error_kind=kind,
            error_class=error_class,
            error_message=message,
            first_failure_at=row[0],
            last_failure_at=row[1],
        )

    # --- complete / fail / heartbeat -----------------------------------------

    def complete(self, conn: Conn, *, key: str, token: uuid.UUID, result: Any) -> None:
        """Mark succeeded if ``token`` still owns ``key``; else raise :class:`StaleOwner`."""
        with translate_errors(key=key):
            row = conn.execute(
                self.q["complete"],
                {"ns": self.ns, "key": key, "token": token, "result": Jsonb(result)},
            ).fetchone()  # a row, not rowcount: rowcount is unknown in pipeline mode
        if row is None:
            raise StaleOwner(key=key)

    def fail(
        self,
        conn: Conn,
        *,
        key: str,
        token: uuid.UUID,
        status: str,
        kind: str,
        error_class: str,
        error_message: str,
        delay: float = 0.0,
    ) -> Failure:
        """Record a failure as ``retryable_failed`` (due in ``delay`` s) or ``failed``."""
        with translate_errors(key=key):
            row = conn.execute(
                self.q["fail"],
                {
                    "ns": self.ns,
                    "key": key,
                    "token": token,
                    "status": status,
                    "kind": kind,
                    "error_class": storable(error_class),
                    "error_message": storable(error_message),
                    "delay": delay,
                },
            ).fetchone()
        if row is None:
            raise StaleOwner(key=key)
        return Failure(int(row[0]), row[1], row[2], row[3])

    def extend_lease(self, conn: Conn, *, key: str, token: uuid.UUID, lease_seconds: float) -> bool:
        with translate_errors(key=key):
            row = conn.execute(
                self.q["extend_lease"],
                {"ns": self.ns, "key": key, "token": token, "lease": lease_seconds},
            ).fetchone()
        return row is not None

    # --- the batch path (kafka_idem.consume.batch) ---------------------------------------

    def claim_batch(
        self, conn: Conn, *, lease_seconds: float, keys: Sequence[str],
        hashes: Sequence[str], deliveries: Sequence[Delivery],
    ) -> dict[str, uuid.UUID]:
        """Claim every new key of ``keys`` (sorted: a stable lock order) in one
        statement; ``{key: owner token}`` for the keys that were new."""
        rows = conn.execute(
            self.q["batch_claim_insert"],
            {
                "ns": self.ns,
                "lease": lease_seconds,
                "keys": list(keys),
                "hashes": list(hashes),
                "handlers": [d.handler for d in deliveries],
                "topics": [d.topic for d in deliveries],
                "parts": [d.partition for d in deliveries],
                "offs": [d.offset for d in deliveries],
            },
        ).fetchall()
        return {key: token for key, token in rows}

    def lock_batch(self, conn: Conn, keys: Sequence[str]) -> list[dict[str, Any]]:
        """Lock the records of ``keys`` in key order and read what to decide on."""
        cur = conn.cursor(row_factory=dict_row)
        return cur.execute(self.q["batch_lock"], {"ns": self.ns, "keys": list(keys)}).fetchall()

    def complete_batch(
        self, conn: Conn, *, keys: Sequence[str], tokens: Sequence[uuid.UUID | None],
        results: Sequence[Any],
    ) -> psycopg.Cursor[Any]:
        """Every success of a batch in one fenced statement; the cursor's rowcount
        (read after the pipeline ends) is how many completions kept their fence."""
        return conn.execute(
            self.q["batch_complete"],
            {"ns": self.ns, "keys": list(keys), "tokens": list(tokens),
             "results": Jsonb(list(results))},
        )

    # --- reads -----------------------------------------------------------------

    def get(self, conn: Conn, key: str) -> dict[str, Any] | None:
        """The record of ``key`` in this store's namespace."""
        found = self.find(conn, key, [self.ns])
        return found[0] if found else None

    def find(self, conn: Conn, key: str, namespaces: Sequence[str]) -> list[dict[str, Any]]:
        """The records of ``key`` in any of ``namespaces`` (admin), by namespace."""
        with translate_errors(key=key):
            cur = conn.cursor(row_factory=dict_row)
            return cur.execute(
                self.q["get_record"], {"nss": list(namespaces), "key": key}
            ).fetchall()

    def namespaces(self, conn: Conn) -> list[str]:
        """Every namespace that has records ('' = written before namespaces, unassigned)."""
        with translate_errors():
            return [r[0] for r in conn.execute(self.q["namespaces"]).fetchall()]

    def succeeded(self, conn: Conn, keys: Sequence[str]) -> dict[str, tuple[str, Any]]:
        """``{key: (request_hash, result)}`` for the keys among ``keys`` that succeeded."""
        with translate_errors():
            rows = conn.execute(
                self.q["succeeded_results"], {"ns": self.ns, "keys": list(keys)}
            ).fetchall()
        return {r[0]: (r[1], r[2]) for r in rows if r[3] == "succeeded"}


def connect(
    dsn: str, *, application_name: str = "kafka_idem", idle_in_transaction_timeout: float = 0.0
) -> Conn:
    """A connection fit for the protocol: synchronous commit on (an
    acknowledged commit must survive a server crash).

    ``idle_in_transaction_timeout`` (seconds, 0 = off) lets the server end the
    session of a member stalled inside a transaction (a zombie), releasing the
    row locks that would otherwise block the member that took its lease over.
    """
    with translate_errors():
        conn = psycopg.connect(dsn, autocommit=False, application_name=application_name)
        # An asynchronously committed success could vanish in a crash after its
        # Kafka offset was committed; insist on synchronous commit.
        conn.execute("SET synchronous_commit = on")
        conn.execute(
            "SELECT set_config('idle_in_transaction_session_timeout', %s, false)",
            (f"{int(idle_in_transaction_timeout * 1000)}ms",),
        )
        conn.commit()
    return conn
