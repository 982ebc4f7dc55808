"""The set statements of the batch path and of the leased path's rounds (a base of
:class:`~kafka_idem.store.Store`): a whole batch's keys read, claimed, locked or written
done in one statement each.

Like the protocol's methods they never commit: the caller's transaction decides.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from json.encoder import (  # type: ignore[attr-defined]
    c_make_encoder,
    encode_basestring_ascii,
)
from typing import Any, NamedTuple

import psycopg
from psycopg import postgres
from psycopg.adapt import Buffer, Dumper
from psycopg.pq import Format
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from kafka_idem.errors import ResultNotJSON
from kafka_idem.store.errors import translate_errors
from kafka_idem.store.outbox import OutboxQueries
from kafka_idem.store.types import AsyncConn, Conn, Delivery, Token

# json.dumps's defaults, but NaN and the infinities, which jsonb refuses (json.dumps
# writes them as NaN and Infinity, which are not JSON)
_encoder = json.JSONEncoder(allow_nan=False)
_encode = _encoder.encode
# The C encoder json.dumps builds for every call, built once: half the time of a small
# result. Without a circular-reference check, so that it keeps no state between calls
# (and threads); whatever it cannot encode, a cycle included (it then recurses until
# RecursionError), is encoded again by json.dumps's own path, which says why.
_fast_encode = None if c_make_encoder is None else c_make_encoder(
    None, _encoder.default, encode_basestring_ascii, None, _encoder.key_separator,
    _encoder.item_separator, False, False, False)


def result_dumps(obj: Any) -> str:
    """``json.dumps`` of a handler's result (the same text), whose failure names what to
    fix: without it the user sees psycopg's bare ``TypeError`` and a stack trace from
    the batch path. Refused as well: what PostgreSQL's ``jsonb`` cannot hold (NaN, an
    infinity, U+0000 or a lone surrogate in a string), which the database would refuse
    as the message's data."""
    text = None
    if _fast_encode is not None:
        with contextlib.suppress(Exception):  # the standard path below says what is wrong
            text = "".join(_fast_encode(obj, 0))
    try:
        if text is None:
            text = _encode(obj)
        # ASCII text: such a string shows as an escape (rare: emoji's pairs, U+0000)
        if "\\u0000" in text or "\\ud" in text:
            _check_jsonb_strings(text)
    except (TypeError, ValueError) as exc:
        raise ResultNotJSON(
            f"the handler's result is not JSON-serialisable ({exc}): return only dict, "
            "list, str, int, float, bool or None (it is stored in result_json and given "
            "back to every duplicate)") from None
    return text


def _check_jsonb_strings(text: str) -> None:
    """Raise ``ValueError`` when a string or a key of ``text`` (JSON) holds what
    ``jsonb`` cannot store: U+0000, or a surrogate that is not half of a pair."""
    stack: list[Any] = [json.loads(text)]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str):
            if "\x00" in value:
                raise ValueError("a string holds U+0000, which PostgreSQL's jsonb cannot "
                                 "store")
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string holds a lone surrogate, which is not Unicode "
                                 "text") from None


@dataclass(frozen=True)
class Found:
    """A record a batch read found: its request hash, its status, its (succeeded)
    result and its attempts (a conflict's dead letter says them)."""

    request_hash: str
    status: str
    result: Any
    attempts: int


class Done(NamedTuple):
    """A new key whose handler succeeded in the batch's transaction: its record, to be
    written once, as succeeded (:meth:`BatchQueries.write_done`): its owner token and
    where its message came from (topic, partition, offset, handler)."""

    key: str
    request_hash: str
    token: Token
    topic: str
    partition: int
    offset: int
    handler: str
    shard: str | None
    result: Any


class _TokenDumper(Dumper):
    """uuid's binary form of a :class:`Token`: its 16 bytes as they are."""

    format = Format.BINARY
    oid = postgres.types["uuid"].oid

    def dump(self, obj: Any) -> Buffer:
        token: bytes = obj
        return token


class _JsonbText(bytes):
    """A result already encoded as JSON (UTF-8), for the records' COPY."""


class _JsonbTextDumper(Dumper):
    """jsonb's binary form of :class:`_JsonbText`: a version byte and the JSON text, so
    the COPY sends each result as ``result_dumps`` encoded it, once."""

    format = Format.BINARY
    oid = postgres.types["jsonb"].oid

    def dump(self, obj: Any) -> Buffer:
        text: bytes = obj
        return b"\x01" + text


# The columns of batch_copy_done, in its order: the types the COPY sends them as. The
# three timestamps come last: a row is made before the clock is read (_copy_rows).
_DONE_TYPES = ("text", "text", "text", "text", "uuid", "int4", "jsonb", "text", "text",
               "int4", "int8", "text", "timestamptz", "timestamptz", "timestamptz")


class BatchQueries(OutboxQueries):
    def found(self, conn: Conn, keys: Sequence[str]) -> dict[str, Found]:
        """The records of ``keys`` (distinct) that exist, read without a lock."""
        with translate_errors():
            rows = conn.execute(
                self.q["succeeded_results"], {"ns": self.ns, "keys": list(keys)}
            ).fetchall()
        return {r[0]: Found(r[1], r[3], r[2], r[4]) for r in rows}

    #: A batch of at least this many new records writes them by COPY, a smaller one by
    #: an INSERT in the handlers' pipeline (measured on the bench: the COPY's two round
    #: trips cost more than it saves below a few dozen records).
    copy_from: int = 64

    def write_done(self, conn: Conn, done: Sequence[Done]) -> Callable[[], bool]:
        """Write every one of ``done`` as a succeeded record, in key order (byte order),
        from inside the caller's pipeline; call what this returns once the pipeline has
        ended. It is False when a key exists by now: the caller must then roll back,
        since that key's handler's effect may not stand. Fewer than ``copy_from`` records
        go in the pipeline (:meth:`insert_done`); more, by a COPY after it
        (:meth:`copy_done`), the clock they are stamped with read in the pipeline and
        their rows made here, while the server runs the handlers' statements."""
        if not done:
            return lambda: True
        if len(done) < self.copy_from:
            inserted = self.insert_done(conn, done)
            return lambda: inserted.rowcount == len(done)
        clock = self.batch_clock(conn)
        rows = self._copy_rows(done)
        return lambda: self.copy_done(conn, rows, clock)

    def insert_done(self, conn: Conn, done: Sequence[Done]) -> psycopg.Cursor[Any]:
        """Write every one of ``done`` as a succeeded record in one statement, in key
        order (byte order). The cursor's rowcount (read after the pipeline ends) is how
        many were written: a key that exists by now is not, and the caller must then
        roll back, since its handler's effect may not stand."""
        ordered = sorted(done, key=lambda d: d.key)
        return conn.execute(self.q["batch_insert_done"], {
            "ns": self.ns,
            "keys": [d.key for d in ordered],
            "hashes": [d.request_hash for d in ordered],
            "handlers": [d.handler for d in ordered],
            "topics": [d.topic for d in ordered],
            "parts": [d.partition for d in ordered],
            "offs": [d.offset for d in ordered],
            "shards": [self.shard_of(d.key, d.shard) for d in ordered],
            "tokens": [uuid.UUID(bytes=d.token) for d in ordered],
            "results": Jsonb([d.result for d in ordered], dumps=result_dumps),
        })

    def batch_clock(self, conn: Conn) -> psycopg.Cursor[Any]:
        """The database's clock, for :meth:`copy_done` (a cursor: sent in the caller's
        pipeline, read after it)."""
        return conn.execute(self.q["batch_clock"])

    def _copy_rows(self, done: Sequence[Done]) -> list[tuple[Any, ...]]:
        """The rows of :meth:`copy_done`, in key order (byte order: Python sorts ``str``
        by code point, UTF-8's byte order), each but its three timestamps; every result
        encoded here, so one that is not JSON raises before the COPY starts."""
        ns, shard_of = self.ns, self.shard_of
        rows = []
        for d in sorted(done, key=lambda d: d.key):
            rows.append((ns, d.key, d.request_hash, "succeeded", d.token, 1,
                         _JsonbText(result_dumps(d.result).encode()), d.handler, d.topic,
                         d.partition, d.offset, shard_of(d.key, d.shard)))
        return rows

    def copy_done(
        self, conn: Conn, rows: Sequence[tuple[Any, ...]], clock: psycopg.Cursor[Any]
    ) -> bool:
        """:meth:`insert_done` by one COPY of ``rows`` (:meth:`_copy_rows`), every record
        stamped with the time ``clock`` read (:meth:`batch_clock`, its pipeline ended);
        outside a pipeline (a COPY cannot be pipelined). False when a key exists by now
        (the COPY failed on its primary key, and the transaction with it): the caller
        must roll back."""
        row = clock.fetchone()
        assert row is not None
        at: datetime = row[0]
        stamps = (at, at, at)
        cur = conn.cursor()
        cur.adapters.register_dumper(_JsonbText, _JsonbTextDumper)
        cur.adapters.register_dumper(Token, _TokenDumper)  # this cursor's uuid columns
        try:
            with cur.copy(self.q["batch_copy_done"]) as copy:
                copy.set_types(list(_DONE_TYPES))
                write = copy.write_row
                for r in rows:
                    write(r + stamps)
        except psycopg.errors.UniqueViolation:  # the records' only unique index: the key
            return False
        return True

    def claim_batch(
        self, conn: Conn, *, lease_seconds: float, keys: Sequence[str],
        hashes: Sequence[str], deliveries: Sequence[Delivery],
        shards: Sequence[str | None] | None = None,
    ) -> dict[str, uuid.UUID]:
        """Claim every new key of ``keys`` (sorted: a stable lock order) in one
        statement; ``{key: owner token}`` for the keys that were new. ``shards``: each
        key's handler's shard key (stored as the per-message claim stores it)."""
        rows = conn.execute(
            self.q["batch_claim_insert"],
            self._batch_claim_params(lease_seconds, keys, hashes, deliveries, shards),
        ).fetchall()
        return {key: token for key, token in rows}

    def _batch_claim_params(
        self, lease_seconds: float, keys: Sequence[str], hashes: Sequence[str],
        deliveries: Sequence[Delivery], shards: Sequence[str | None] | None,
    ) -> dict[str, Any]:
        return {
            "shards": [self.shard_of(k, s)
                       for k, s in zip(keys, shards or [None] * len(keys), strict=True)],
            "ns": self.ns,
            "lease": lease_seconds,
            "keys": list(keys),
            "hashes": list(hashes),
            "handlers": [d.handler for d in deliveries],
            "topics": [d.topic for d in deliveries],
            "parts": [d.partition for d in deliveries],
            "offs": [d.offset for d in deliveries],
        }

    async def claim_batch_async(
        self, conn: AsyncConn, *, lease_seconds: float, keys: Sequence[str],
        hashes: Sequence[str], deliveries: Sequence[Delivery],
        shards: Sequence[str | None] | None = None,
    ) -> dict[str, uuid.UUID]:
        """:meth:`claim_batch` on an autocommit async connection: the same statement."""
        cur = await conn.execute(
            self.q["batch_claim_insert"],
            self._batch_claim_params(lease_seconds, keys, hashes, deliveries, shards))
        return {key: token for key, token in await cur.fetchall()}

    def lock_batch(self, conn: Conn, keys: Sequence[str]) -> list[dict[str, Any]]:
        """Lock the records of ``keys`` in key order and read what to decide on."""
        cur = conn.cursor(row_factory=dict_row)
        return cur.execute(self.q["batch_lock"], {"ns": self.ns, "keys": list(keys)}).fetchall()
