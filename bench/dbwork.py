"""The database's work per message of each row: statements, row versions written, WAL bytes.

* **statements**: SQL statements the client sent, counted inside psycopg
  (``bench/roundtrips.py``; ``BEGIN`` / ``COMMIT`` and savepoints apart). For the
  pgbench rows: the script's SQL statements per transaction (not ``BEGIN`` /
  ``COMMIT``, not the ``SELECT ... \\gset`` that builds its keys: the framework builds
  them in Python).
* **row versions**: ``n_tup_ins + n_tup_upd + n_tup_del`` of ``pg_stat_user_tables``
  over every table of the row's schemas, and ``n_tup_hot_upd`` (updates that needed
  no new index entry; already in ``n_tup_upd``). A framework row's schemas are its
  store schema (fresh, its own) and ``payments`` (the example's tables, which every
  bench row and test shares: writes by others during the run count too). Backends
  flush their counters when they end (and when idle, at most once a second):
  :class:`RowVersions` reads them after the run's connections closed, until two
  readings half a second apart agree.
* **WAL bytes**: ``pg_current_wal_insert_lsn()`` at the start and at the end of the
  run's clock (a framework row: at its first fetched batch and at the commit that
  reaches the topic's end, read on a connection of the worker's own, outside the
  round-trip count). It is the whole server's WAL: right on a quiet machine, an upper
  bound on a shared one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import psycopg
from rich.table import Table

KINDS = ("ins", "upd", "del", "hot_upd")
STATS = ("SELECT coalesce(sum(n_tup_ins), 0)::bigint, coalesce(sum(n_tup_upd), 0)::bigint,"
         " coalesce(sum(n_tup_del), 0)::bigint, coalesce(sum(n_tup_hot_upd), 0)::bigint"
         " FROM pg_stat_user_tables WHERE schemaname = ANY(%s)")


def _read(conn: psycopg.Connection[Any], schemas: list[str]) -> dict[str, int]:
    row = conn.execute(STATS, (schemas,)).fetchone()
    assert row is not None
    return dict(zip(KINDS, (int(v) for v in row), strict=True))


class RowVersions:
    """Row versions written to ``schemas``' tables between construction and :meth:`settled`."""

    def __init__(self, dsn: str, schemas: Sequence[str]) -> None:
        self.dsn, self.schemas = dsn, list(schemas)
        with psycopg.connect(dsn, autocommit=True) as conn:
            self.before = _read(conn, self.schemas)

    def settled(self, interval: float = 0.5, timeout: float = 10.0) -> dict[str, Any]:
        """The difference once the counters stop moving (autocommit: every reading is a
        fresh snapshot of the statistics)."""
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            last = _read(conn, self.schemas)
            while time.monotonic() < deadline:
                time.sleep(interval)
                now = _read(conn, self.schemas)
                if now == last:
                    break
                last = now
        out: dict[str, Any] = {k: last[k] - self.before[k] for k in KINDS}
        out["row_versions"] = out["ins"] + out["upd"] + out["del"]
        out["schemas"] = self.schemas
        return out


def lsn(conn: psycopg.Connection[Any]) -> int:
    """The WAL insert position in bytes. Sent on the libpq connection itself, so that
    ``bench/roundtrips.py`` does not count it."""
    res = conn.pgconn.exec_(b"SELECT pg_current_wal_insert_lsn()")
    value = res.get_value(0, 0)
    if value is None:
        raise RuntimeError(f"pg_current_wal_insert_lsn(): {res.error_message!r}")
    hi, lo = value.decode().split("/")
    return (int(hi, 16) << 32) + int(lo, 16)


class WalMarks:
    """WAL positions at named moments, on a connection of its own."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.marks: dict[str, int] = {}

    def mark(self, name: str) -> None:
        self.marks[name] = lsn(self.conn)

    def close(self) -> dict[str, int]:
        self.conn.close()
        return dict(self.marks)


def wal_bytes(marks: dict[str, int] | None) -> int | None:
    if not marks or "first" not in marks or "last" not in marks:
        return None
    return marks["last"] - marks["first"]


def merge_wal(outs: list[dict[str, Any]]) -> dict[str, int] | None:
    """Several members of one group: from the first member's start to the last's end."""
    marks = [o.get("wal") or {} for o in outs]
    if not all("first" in m and "last" in m for m in marks):
        return None
    return {"first": min(m["first"] for m in marks), "last": max(m["last"] for m in marks)}


# --- per message, and next to the keyed SQL ------------------------------------------------


class Row(Protocol):
    path: str
    label: str
    throughput: dict[str, Any]

    @property
    def messages(self) -> int: ...

    @property
    def rate(self) -> float: ...

    def cpu_per_1k(self, part: str) -> float | None: ...


def per_message(name: str, label: str, messages: int, rate: float | None,
                pg_cpu_s: float | None, rt: dict[str, Any] | None,
                versions: dict[str, Any] | None, wal: int | None) -> dict[str, Any]:
    """One row of the table (and of ``db_work`` in the results): figures per message."""

    def per(v: float | None) -> float | None:
        return v / messages if v is not None and messages else None

    versions = versions or {}
    return {
        "row": name, "label": label, "messages": messages, "msgs_per_s": rate or None,
        "pg_cpu_ms_per_msg": per(pg_cpu_s * 1000 if pg_cpu_s is not None else None),
        "statements_per_msg": per(rt.get("statements")) if rt else None,
        "round_trips_per_msg": per(rt.get("round_trips")) if rt else None,
        "row_versions_per_msg": per(versions.get("row_versions")),
        **{f"{k}_per_msg": per(versions.get(k)) for k in KINDS},
        "wal_bytes_per_msg": per(wal),
    }


def of_path(m: Row) -> dict[str, Any] | None:
    """A consumer path's row, when its throughput run passed and measured the database's
    work (not raw's: it has none; not the relay's: it fills its outbox off the clock)."""
    t = m.throughput
    if not t.get("ok") or not t.get("row_versions"):
        return None
    return per_message(m.path, m.label, m.messages, m.rate, (t.get("cpu") or {}).get(
        "postgres"), t.get("round_trips") or None, t.get("row_versions"),
        wal_bytes(t.get("wal")))


def of_pgbench(r: Any) -> dict[str, Any] | None:
    """A pgbench row (``bench.pgbench.PgbenchResult``; not gen-only: it writes nothing)."""
    if not r.db or r.error or r.script == "gen_only":
        return None
    n = r.transactions * r.messages_per_tx
    rt = {"statements": r.db["statements_per_tx"] * r.transactions}
    return per_message(f"pgbench_{r.script}_c{r.clients}",
                       f"pgbench {r.script.replace('_', '-')} -c {r.clients}", n, r.msgs_per_s,
                       r.cpu.get("postgres"), rt, r.db.get("row_versions"),
                       r.db.get("wal_bytes"))


def of_keyed(k: Any) -> dict[str, Any]:
    """The keyed SQL row (``bench.keyed.KeyedResult``)."""
    return per_message("keyed_sql", k.label, k.messages, k.rate, k.cpu.get("postgres"),
                       k.round_trips or None, k.row_versions, k.wal_bytes)


def with_ratios(rows: list[dict[str, Any]], keyed: dict[str, Any] | None
                ) -> list[dict[str, Any]]:
    """Each row's msgs/s and PostgreSQL CPU per message ÷ the keyed SQL's."""
    for r in rows:
        for mine, theirs, name in (("msgs_per_s", "msgs_per_s", "x_keyed_msgs_per_s"),
                                   ("pg_cpu_ms_per_msg", "pg_cpu_ms_per_msg",
                                    "x_keyed_pg_cpu")):
            a, b = r.get(mine), (keyed or {}).get(theirs)
            r[name] = a / b if a and b else None
    return rows


def collect(paths: Sequence[Row], pg: Sequence[Any], keyed: Any | None
            ) -> list[dict[str, Any]]:
    """The table's rows: the keyed SQL, the pgbench rows, the consumer paths, each with its
    ratios to the keyed SQL (measured in the same run)."""
    floor = of_keyed(keyed) if keyed is not None and keyed.ok else None
    rows = [floor] if floor is not None else []
    rows += [x for x in (of_pgbench(r) for r in pg) if x is not None]
    rows += [x for x in (of_path(m) for m in paths) if x is not None]
    return with_ratios(rows, floor)


def render(rows: list[dict[str, Any]]) -> Table | None:
    if not rows:
        return None
    table = Table(title="Database work per message over each throughput run (row versions: "
                  "pg_stat_user_tables of the row's schemas; WAL: the whole server's), and "
                  "x the minimal keyed SQL of this run", title_justify="left")
    table.add_column("row")
    for name, _, _ in COLUMNS:
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(r["label"], *cells(r))
    return table


# (header, key of a ``collect`` row, format): the console's table and ``bench.report``'s
COLUMNS = [("msgs/s", "msgs_per_s", "{:,.0f}"), ("x keyed msgs/s", "x_keyed_msgs_per_s", "{:.2f}"),
           ("CPU PG ms", "pg_cpu_ms_per_msg", "{:.3f}"),
           ("x keyed CPU PG", "x_keyed_pg_cpu", "{:.2f}"),
           ("statements", "statements_per_msg", "{:.3f}"),
           ("round trips", "round_trips_per_msg", "{:.3f}"),
           ("row versions", "row_versions_per_msg", "{:.2f}"),
           ("ins", "ins_per_msg", "{:.2f}"), ("upd", "upd_per_msg", "{:.2f}"),
           ("del", "del_per_msg", "{:.2f}"), ("HOT upd", "hot_upd_per_msg", "{:.2f}"),
           ("WAL bytes", "wal_bytes_per_msg", "{:,.0f}")]


def cells(r: dict[str, Any]) -> list[str]:
    return ["—" if r.get(k) is None else fmt.format(r[k]) for _, k, fmt in COLUMNS]
