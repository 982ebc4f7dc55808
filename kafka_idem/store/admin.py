"""The store's admin queries: status, inspect, audited re-run and purge, the audit
trail, the re-drive's record states, the bulk re-run's selection and the adoption
of records written before namespaces. Methods of :class:`~kafka_idem.store.Store`
(this is its base class), so every statement kafka_idem runs on its own tables
goes through the store; the callers (``admin``, ``audit``, ``namespaces``,
``replay``) decide, the store runs SQL.

Like the protocol's methods they never commit: the caller owns the transaction.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from kafka_idem.store.errors import translate_errors
from kafka_idem.store.types import Conn

Rows = list[dict[str, Any]]

# The columns a page of records shows (the console's records list).
BROWSE_COLUMNS = ("namespace", "idempotency_key", "status", "handler", "attempts", "error_kind",
                  "error_class", "error_message", "updated_at", "kafka_topic", "kafka_partition",
                  "kafka_offset", "lease_until")
BY_RECENCY = sql.SQL("updated_at DESC, namespace DESC, idempotency_key DESC")


class AdminQueries:
    q: dict[str, sql.SQL]
    namespace: str | None
    schema: str
    table: str
    distributed: bool

    def shard_of(self, key: str, shard: str | None) -> str | None:
        """The shard key a record (or event) of ``key`` is stored with: the handler's
        (``shard``), else the key itself on a distributed store; ``None`` (not stored)
        on one PostgreSQL."""
        if shard is not None:
            return shard
        return key if self.distributed else None

    @property
    def ns(self) -> str:
        """The namespace every runtime query runs in (a store without one is a bug)."""
        if self.namespace is None:
            raise TypeError("this Store has no namespace; use store.scoped(namespace)")
        return self.namespace

    def _rows(self, conn: Conn, name: str, params: dict[str, Any] | None = None) -> Rows:
        with translate_errors(key=(params or {}).get("key")):
            cur = conn.cursor(row_factory=dict_row)
            return cur.execute(self.q[name], params).fetchall()

    def admin_action(self, conn: Conn, action: str) -> None:
        """Set ``kafka_idem.admin_action`` for the rest of the transaction: the guard
        lets the audited admin transitions through only with it. On a distributed
        store the guard runs on the workers, so the setting is a ``SET LOCAL`` that
        Citus sends to each node the transaction reaches
        (``citus.propagate_set_commands = 'local'``, for this transaction only);
        ``set_config`` is not propagated."""
        with translate_errors():
            if not self.distributed:
                conn.execute("SELECT set_config('kafka_idem.admin_action', %s, true)",
                             (action,))
                return
            conn.execute("SET LOCAL citus.propagate_set_commands = 'local'")
            conn.execute(sql.SQL("SET LOCAL kafka_idem.admin_action = {}").format(
                sql.Literal(action)))

    # --- status and the records ------------------------------------------------

    def status_rows(self, conn: Conn, *, namespace: str | None,
                    long_running_seconds: float) -> tuple[Rows, Rows]:
        """Counts per (namespace, status), and failed records per (namespace, kind)."""
        params = {"ns": namespace, "long_running": long_running_seconds}
        return (self._rows(conn, "status_summary", params),
                self._rows(conn, "failed_by_kind", params))

    def namespaces(self, conn: Conn) -> list[str]:
        """Every namespace that has records ('' = written before namespaces, unassigned)."""
        return [r["namespace"] for r in self._rows(conn, "namespaces")]

    def find(self, conn: Conn, key: str, namespaces: Sequence[str]) -> Rows:
        """The records of ``key`` in any of ``namespaces``, by namespace."""
        return self._rows(conn, "get_record", {"nss": list(namespaces), "key": key})

    def keys_among(self, conn: Conn, keys: Sequence[str], namespaces: Sequence[str]) -> list[str]:
        """Which of ``keys`` have a record in any of ``namespaces`` (at most five)."""
        return [r["idempotency_key"] for r in
                self._rows(conn, "keys_among", {"nss": list(namespaces), "keys": list(keys)})]

    def lock_record(self, conn: Conn, key: str,
                    shard: str | None = None) -> dict[str, Any] | None:
        """Lock ``key``'s record in this namespace (``FOR UPDATE``) and read it, its
        ``shard_key`` included. On a distributed store the lock is routed to the record's
        one shard: ``shard`` (its ``shard_key``, read with the record by the caller's
        selection), else the shard key is first read from the record itself."""
        params: dict[str, Any] = {"ns": self.ns, "key": key, "shard": shard}
        if self.distributed and shard is None:
            shards = self._rows(conn, "record_shard", params)
            if not shards:
                return None
            params["shard"] = shards[0]["shard_key"]
        rows = self._rows(conn, "lock_record", params)
        return rows[0] if rows else None

    def rerun(self, conn: Conn, key: str, shard: str | None = None) -> None:
        """``failed -> retryable_failed``, due now, a fresh budget (the caller has set
        the admin action and writes the audit row in the same transaction). ``shard``:
        the record's ``shard_key`` (from :meth:`lock_record`), which a distributed store
        needs to route the update to the record's shard."""
        with translate_errors(key=key):
            conn.execute(self.q["rerun"], {"ns": self.ns, "key": key, "shard": shard})

    def topics_seen(self, conn: Conn) -> list[str]:
        """The source topics of this namespace's records (every namespace's if none)."""
        return [r["kafka_topic"] for r in
                self._rows(conn, "topics_seen", {"ns": self.namespace})]

    def purge_batch(self, conn: Conn, *, statuses: Sequence[str], older_than: float,
                    batch_size: int) -> int:
        """Delete one batch of old terminal records; how many went."""
        with translate_errors():
            return conn.execute(self.q["purge_batch"], {
                "ns": self.namespace, "statuses": list(statuses), "older_than": older_than,
                "batch": batch_size}, prepare=False).rowcount  # planned for its bound

    def retention_turn(self, conn: Conn, *, take: bool) -> bool:
        """Take (``take``) or give back this namespace's background-retention lock, a
        session advisory lock keyed by schema, table and namespace; whether it was."""
        what = f"{self.schema}.{self.table}:{self.ns}"
        with translate_errors():
            row = conn.execute(self.q["retention_lock" if take else "retention_unlock"],
                               {"what": what}).fetchone()
        return bool(row and row[0])

    def retention_last(self, conn: Conn, namespace: str | None) -> Rows:
        """The latest retention run that removed records, per namespace (or ``namespace``'s)."""
        return self._rows(conn, "retention_last", {"ns": namespace})

    def purge_count(self, conn: Conn, *, statuses: Sequence[str],
                    older_than: float) -> dict[str, int]:
        """What :meth:`purge_batch` would delete now, by status (a dry run)."""
        rows = self._rows(conn, "purge_count", {
            "ns": self.namespace, "statuses": list(statuses), "older_than": older_than})
        return {r["status"]: int(r["n"]) for r in rows}

    def browse(self, conn: Conn, *, statuses: Sequence[str], namespace: str | None = None,
               handler: str | None = None, since: dt.datetime | None = None,
               until: dt.datetime | None = None,
               after: tuple[dt.datetime, str, str] | None = None, limit: int = 50,
               error_kind: str | None = None) -> Rows:
        """A page of records, the most recently changed first (``updated_at``, then
        namespace and key, descending), of any of ``statuses``; ``after`` is the last
        row of the previous page (keyset pagination). Each status is read down the
        status index (status, updated_at), and the branches merged, so a page costs
        about ``limit`` index entries per status whatever the table's size (more when
        ``namespace`` or ``handler`` are rare: they filter the rows read)."""
        branches = []
        params: dict[str, Any] = {"ns": namespace, "limit": limit}
        where = _filters(params, handler=handler, error_kind=error_kind, since=since,
                         until=until)
        if namespace is not None:
            where.append(sql.SQL("namespace = %(ns)s"))
        if after is not None:
            params.update(a_at=after[0], a_ns=after[1], a_key=after[2])
            where.append(sql.SQL("updated_at <= %(a_at)s AND (updated_at, namespace, "
                                 "idempotency_key) < (%(a_at)s, %(a_ns)s, %(a_key)s)"))
        columns = sql.SQL(", ").join(map(sql.Identifier, BROWSE_COLUMNS))
        for i, status in enumerate(statuses):
            params[f"s{i}"] = status
            cond = sql.SQL(" AND ").join([sql.SQL("status = ") + sql.Placeholder(f"s{i}"),
                                          *where])
            branches.append(sql.SQL("(SELECT {c} FROM {t} WHERE {w} ORDER BY {o} "
                                    "LIMIT %(limit)s)").format(
                c=columns, t=self._table(), w=cond, o=BY_RECENCY))
        if not branches:
            return []
        query = sql.SQL("SELECT * FROM ({u}) AS r ORDER BY {o} LIMIT %(limit)s").format(
            u=sql.SQL(" UNION ALL ").join(branches), o=BY_RECENCY)
        return self._composed(conn, query, params)

    def browse_prefix(self, conn: Conn, *, prefix: str, namespaces: Sequence[str],
                      statuses: Sequence[str], handler: str | None = None,
                      since: dt.datetime | None = None, until: dt.datetime | None = None,
                      after: tuple[str, str] | None = None, limit: int = 50,
                      ranged: bool = True, error_kind: str | None = None) -> Rows:
        """A page of the records whose key starts with ``prefix``, by namespace and key;
        ``after`` is the (namespace, key) of the previous page's last row. ``ranged``:
        the keys sort by code point (the column's collation is C), so the prefix is a
        range of the primary key; else every key of the namespaces is tested."""
        params: dict[str, Any] = {"nss": list(namespaces), "p": prefix,
                                  "statuses": list(statuses), "limit": limit}
        where: list[sql.Composable] = [
            sql.SQL("namespace = n.ns"), sql.SQL("starts_with(idempotency_key, %(p)s)"),
            sql.SQL("status = ANY(%(statuses)s)")]
        if ranged and prefix:
            where.append(sql.SQL("idempotency_key >= %(p)s"))
            upper = _next_prefix(prefix)
            if upper is not None:
                params["hi"] = upper
                where.append(sql.SQL("idempotency_key < %(hi)s"))
        where += _filters(params, handler=handler, error_kind=error_kind, since=since,
                          until=until)
        if after is not None:
            params.update(a_ns=after[0], a_key=after[1])
            where.append(sql.SQL("(namespace, idempotency_key) > (%(a_ns)s, %(a_key)s)"))
        columns = sql.SQL(", ").join(map(sql.Identifier, BROWSE_COLUMNS))
        if self.distributed:
            # Citus does not push a LIMIT down into a LATERAL subquery joined with
            # unnest: the namespaces are one condition, the same rows in the same order
            # (each shard reads its first rows, the coordinator merges them)
            where[0] = sql.SQL("namespace = ANY(%(nss)s::text[])")
            query = sql.SQL("SELECT {c} FROM {t} WHERE {w} ORDER BY namespace, "
                            "idempotency_key LIMIT %(limit)s").format(
                c=columns, t=self._table(), w=sql.SQL(" AND ").join(where))
            return self._composed(conn, query, params)
        query = sql.SQL(
            "SELECT r.* FROM unnest(%(nss)s::text[]) AS n(ns) CROSS JOIN LATERAL ("
            "SELECT {c} FROM {t} WHERE {w} ORDER BY idempotency_key LIMIT %(limit)s) AS r "
            "ORDER BY r.namespace, r.idempotency_key LIMIT %(limit)s").format(
            c=columns, t=self._table(), w=sql.SQL(" AND ").join(where))
        return self._composed(conn, query, params)

    def collation_is_bytewise(self, conn: Conn) -> bool:
        """Whether the keys sort by code point (the table's key column collates as C,
        C.UTF-8 or POSIX), so a key prefix is a range of the primary key."""
        rows = self._rows(conn, "key_collation", {"schema": self.schema, "table": self.table})
        name = (rows[0]["collation"] if rows else "") or ""
        return name.split(".")[0].upper() in ("C", "POSIX", "UCS_BASIC")

    def handler_counts(self, conn: Conn) -> Rows:
        """Records per (namespace, handler, status)."""
        return self._rows(conn, "handler_counts")

    def _table(self) -> sql.Composable:
        return sql.Identifier(self.schema, self.table)

    def _composed(self, conn: Conn, query: sql.Composed, params: dict[str, Any]) -> Rows:
        with translate_errors():
            cur = conn.cursor(row_factory=dict_row)
            # never prepared: each filter's plan is made for its values
            rows: Rows = cur.execute(query, params, prepare=False).fetchall()
            return rows

    # --- the audit trail ---------------------------------------------------------

    def audit_insert(self, conn: Conn, *, actor: str, action: str, key: str | None,
                     selection: dict[str, Any] | None, reason: str | None,
                     previous_status: str | None, previous_error: str | None,
                     counts: dict[str, Any] | None) -> int:
        """Append one row (namespace: this store's, ``None`` for every namespace)."""
        with translate_errors(key=key):
            row = conn.execute(self.q["audit_insert"], {
                "ns": self.namespace, "actor": actor, "action": action, "key": key,
                "selection": Jsonb(selection) if selection is not None else None,
                "reason": reason, "previous_status": previous_status,
                "previous_error": previous_error,
                "counts": Jsonb(counts) if counts is not None else None,
            }).fetchone()
        assert row is not None
        return int(row[0])

    def audit_of(self, conn: Conn, after_id: int, *, runs: Sequence[str] = (),
                 via: str | None = None, limit: int = 200) -> Rows:
        """The audit rows after row ``after_id`` that name one of the replay ``runs`` or
        the caller ``via`` in their selection, oldest first (what one action wrote)."""
        return self._rows(conn, "audit_of", {"after": after_id, "runs": list(runs),
                                             "via": via, "limit": limit})

    def audit_last_id(self, conn: Conn) -> int:
        """The id of the latest audit row (0: none)."""
        rows = self._rows(conn, "audit_last_id")
        return int(rows[0]["id"]) if rows else 0

    def audit_for_key(self, conn: Conn, key: str) -> Rows:
        return self._rows(conn, "audit_for_key", {"ns": self.ns, "key": key})

    # --- paused handlers (migration 0008) --------------------------------------------

    def pause_insert(self, conn: Conn, *, handler: str, reason: str, actor: str,
                     channel: str) -> dict[str, Any] | None:
        """Pause ``handler`` in this namespace, notifying ``channel`` at the commit;
        ``None`` when it was paused already (nothing changed)."""
        rows = self._rows(conn, "pause_insert", {"ns": self.ns, "handler": handler,
                                                 "reason": reason, "actor": actor,
                                                 "channel": channel})
        return rows[0] if rows else None

    def pause_delete(self, conn: Conn, *, handler: str, channel: str) -> dict[str, Any] | None:
        """Resume ``handler``: its pause row, gone (``None``: it was not paused)."""
        rows = self._rows(conn, "pause_delete", {"ns": self.ns, "handler": handler,
                                                 "channel": channel})
        return rows[0] if rows else None

    def pauses_of(self, conn: Conn, namespace: str | None) -> Rows:
        """The paused handlers of ``namespace`` (every namespace's with ``None``)."""
        return self._rows(conn, "pauses_of", {"ns": namespace})

    # --- re-drive and bulk re-run --------------------------------------------------

    def redrive_states(self, conn: Conn, pairs: Sequence[tuple[str, str]]) -> Rows:
        """The state and latest audit row of each (namespace, key) that has a record."""
        return self._rows(conn, "redrive_states", {
            "nss": [p[0] for p in pairs], "keys": [p[1] for p in pairs]})

    def failed_selection(self, conn: Conn, *, namespace: str | None, kind: str | None,
                         handler: str | None, since: dt.datetime | None,
                         until: dt.datetime | None, key_prefix: str | None,
                         limit: int | None) -> Rows:
        """The failed records a bulk re-run's filter selects, oldest failure first."""
        return self._rows(conn, "failed_selection", {
            "ns": namespace, "kind": kind, "handler": handler, "since": since,
            "until": until, "prefix": key_prefix, "limit": limit})

    # --- records written before namespaces ------------------------------------------

    def unassigned(self, conn: Conn, pairs: Sequence[tuple[str, str]]) -> Rows:
        """Unassigned records of these (topic, handler) pairs that this namespace would
        adopt: ``kafka_topic``, ``handler``, ``n``."""
        return self._rows(conn, "unassigned", {
            "ns": self.ns, "topics": [p[0] for p in pairs], "handlers": [p[1] for p in pairs]})

    def adopt(self, conn: Conn, pairs: Sequence[tuple[str, str]]) -> Rows:
        """Move them into this namespace (admin action 'adopt' set by the caller)."""
        return self._rows(conn, "adopt", {
            "ns": self.ns, "topics": [p[0] for p in pairs], "handlers": [p[1] for p in pairs]})


def _filters(params: dict[str, Any], *, handler: str | None, error_kind: str | None,
             since: dt.datetime | None, until: dt.datetime | None) -> list[sql.Composable]:
    """The conditions of the records pages' optional filters (their values put in
    ``params``): only those given, so each query's plan is made for them."""
    given = {"handler": (handler, "handler = %(handler)s"),
             "kind": (error_kind, "error_kind = %(kind)s"),
             "since": (since, "updated_at >= %(since)s"),
             "until": (until, "updated_at < %(until)s")}
    where: list[sql.Composable] = []
    for name, (value, condition) in given.items():
        if value is not None:
            params[name] = value
            where.append(sql.SQL(condition))
    return where


def _next_prefix(prefix: str) -> str | None:
    """The smallest text above every text that starts with ``prefix`` in code point
    order (``None``: there is none: the last character is the highest code point)."""
    last = ord(prefix[-1])
    if last >= 0x10FFFF:
        return None
    bump = last + 1
    if 0xD800 <= bump <= 0xDFFF:  # surrogates are not text
        bump = 0xE000
    return prefix[:-1] + chr(bump)
