"""The app's own tables: which ones, which of their columns say what a handler did,
and how two states of them differ.

The tables are the ones the app's migrations (and the harness's ``setup``) created,
found by listing the database's tables before and after them, or the ones a user
names. A column is left out of comparisons when the database fills it with a value
of its own that differs from run to run however correct the handler is: an identity
column, a sequence or a volatile default (``now()``, ``clock_timestamp()``,
``gen_random_uuid()``...), and a column that references one of those by foreign key.
A user may leave out more (``ignore``): e.g. an id a remote service makes up.
A column whose value the handler's own SQL makes anew (``VALUES (now())``) is found
by delivering the reference twice (:func:`drifting`) and left out too, said so.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from psycopg import sql

from kafka_idem.store import Conn

# A default the database computes anew for each row (case-insensitive: pg_get_expr
# writes CURRENT_TIMESTAMP in capitals and functions in lower case).
_VOLATILE = re.compile(
    r"nextval\(|\bnow\(\)|clock_timestamp|statement_timestamp|transaction_timestamp|timeofday"
    r"|\bcurrent_(timestamp|date|time)\b|\blocal(timestamp|time)\b|gen_random_uuid|uuid_generate"
    r"|\brandom\(",
    re.IGNORECASE,
)


def list_tables(conn: Conn) -> set[str]:
    """Every ordinary or partitioned table outside the system schemas, as
    ``schema.table`` (the partitions of a partitioned table are read through it)."""
    rows = conn.execute(
        "SELECT n.nspname, c.relname FROM pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition"
        "   AND n.nspname NOT IN ('pg_catalog', 'information_schema')"
        "   AND n.nspname NOT LIKE 'pg\\_toast%%' AND n.nspname NOT LIKE 'pg\\_temp%%'"
    ).fetchall()
    return {f"{schema}.{name}" for schema, name in rows}


def split_name(name: str) -> tuple[str, str]:
    """``schema.table`` (or ``table``, in ``public``) as its two parts."""
    schema, _, table = name.rpartition(".")
    return schema or "public", table


@dataclass(frozen=True)
class Table:
    """One table compared, and the columns that are not (with why)."""

    name: str  # schema.table
    columns: tuple[str, ...]
    left_out: tuple[tuple[str, str], ...] = ()

    @property
    def identifier(self) -> sql.Identifier:
        return sql.Identifier(*split_name(self.name))


def describe_tables(
    conn: Conn, names: Iterable[str], ignore: Mapping[str, Iterable[str]] | None = None
) -> list[Table]:
    """The tables ``names`` with their compared columns, sorted by name; a name that is
    no table is a ``ValueError``."""
    ignored = {_qualified(k): set(v) for k, v in (ignore or {}).items()}
    columns: dict[str, list[str]] = {}
    left_out: dict[str, dict[str, str]] = {}
    for name in sorted({_qualified(n) for n in names}):
        schema, table = split_name(name)
        rows = conn.execute(
            "SELECT a.attname, a.attidentity, pg_get_expr(d.adbin, d.adrelid)"
            " FROM pg_attribute a"
            " LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum"
            " WHERE a.attrelid = to_regclass(format('%%I.%%I', %s::text, %s::text))"
            "   AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            (schema, table),
        ).fetchall()
        if not rows:
            raise ValueError(f"no table {name!r} in the test database")
        columns[name] = [r[0] for r in rows]
        out = left_out.setdefault(name, {})
        for column, identity, default in rows:
            if identity:
                out[column] = "identity"
            elif default and _VOLATILE.search(default):
                out[column] = f"default {default}"
        unknown = set(ignored.get(name, ())) - set(columns[name])
        if unknown:
            raise ValueError(f"ignore names columns {sorted(unknown)} that {name} lacks")
        for column in ignored.get(name, ()):
            out[column] = "ignored"
    _follow_foreign_keys(conn, left_out)
    return [
        Table(name, tuple(c for c in cols if c not in left_out[name]),
              tuple((c, left_out[name][c]) for c in cols if c in left_out[name]))
        for name, cols in columns.items()
    ]


def _qualified(name: str) -> str:
    schema, table = split_name(name)
    return f"{schema}.{table}"


def _follow_foreign_keys(conn: Conn, left_out: dict[str, dict[str, str]]) -> None:
    """A column that references a left-out column takes its run-to-run value: leave it
    out too (to a fixpoint: a chain of references)."""
    links: list[tuple[str, list[str], str, list[str]]] = []
    for name in left_out:
        schema, table = split_name(name)
        rows = conn.execute(
            "SELECT (SELECT array_agg(a.attname ORDER BY k.n) FROM unnest(c.conkey)"
            "          WITH ORDINALITY AS k(attnum, n)"
            "          JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum),"
            "       fn.nspname || '.' || fc.relname,"
            "       (SELECT array_agg(a.attname ORDER BY k.n) FROM unnest(c.confkey)"
            "          WITH ORDINALITY AS k(attnum, n)"
            "          JOIN pg_attribute a ON a.attrelid = c.confrelid AND a.attnum = k.attnum)"
            " FROM pg_constraint c JOIN pg_class fc ON fc.oid = c.confrelid"
            " JOIN pg_namespace fn ON fn.oid = fc.relnamespace"
            " WHERE c.contype = 'f' AND c.conrelid = to_regclass(format('%%I.%%I', %s::text,"
            "       %s::text))",
            (schema, table),
        ).fetchall()
        links.extend((name, list(cols), ref, list(refcols)) for cols, ref, refcols in rows)
    changed = True
    while changed:
        changed = False
        for name, cols, ref, refcols in links:
            for col, refcol in zip(cols, refcols, strict=True):
                if refcol in left_out.get(ref, {}) and col not in left_out[name]:
                    left_out[name][col] = f"{REFERENCES}{ref}.{refcol}"
                    changed = True


# --- states and differences -------------------------------------------------------------


def _frozen(value: Any) -> Any:
    """A hashable stand-in for a column value (JSON documents and arrays included)."""
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True, default=str)
    if isinstance(value, memoryview):
        return bytes(value)
    return value


@dataclass
class Rows:
    """One table's rows (the compared columns), as a multiset."""

    table: Table
    rows: list[dict[str, Any]] = field(default_factory=list)

    def counted(self) -> Counter[tuple[Any, ...]]:
        return Counter(tuple(_frozen(r[c]) for c in self.table.columns) for r in self.rows)

    def pick(self, keys: Counter[tuple[Any, ...]]) -> list[dict[str, Any]]:
        """The rows whose frozen form is among ``keys`` (as many times as counted)."""
        left = Counter(keys)
        out = []
        for r in self.rows:
            k = tuple(_frozen(r[c]) for c in self.table.columns)
            if left[k] > 0:
                left[k] -= 1
                out.append(r)
        return out


State = dict[str, Rows]


def snapshot(conn: Conn, tables: Iterable[Table]) -> State:
    """The compared columns of every row of ``tables``."""
    state: State = {}
    for table in tables:
        if table.columns:
            query = sql.SQL("SELECT {} FROM {}").format(
                sql.SQL(", ").join(sql.Identifier(c) for c in table.columns), table.identifier)
            cur = conn.execute(query)
            rows = [dict(zip(table.columns, r, strict=True)) for r in cur.fetchall()]
        else:
            rows = []
        state[table.name] = Rows(table, rows)
    return state


@dataclass(frozen=True)
class TableDiff:
    """How a table differs from what was expected."""

    table: str
    missing: list[dict[str, Any]]  # expected, not found
    extra: list[dict[str, Any]]  # found, not expected

    def lines(self, *, expected: str, limit: int = 8) -> list[str]:
        missing = f"{len(self.missing)} row(s) of {expected} missing"
        extra = f"{len(self.extra)} row(s) more than {expected}"
        said = (f"{missing}, {len(self.extra)} row(s) more" if self.missing and self.extra
                else missing if self.missing else extra)
        out = [f"table {self.table}: {said}"]
        for label, rows in (("missing", self.missing), ("extra  ", self.extra)):
            for row in rows[:limit]:
                out.append(f"  {label} {show_row(row)}")
            if len(rows) > limit:
                out.append(f"  ... and {len(rows) - limit} more {label.strip()} row(s)")
        return out


DRIFTING = ("differs between two deliveries of the reference: a value the handler makes "
            "anew, e.g. now(), a random id or a counter of the process")
ORM_DEFAULT = "made by SQLAlchemy's client-side default"
"""How the reason begins for a drifting column an ORM model's Python default fills
(:mod:`kafka_idem.testing.orm_defaults`)."""


REFERENCES = "references "
"""How the reason begins for a column left out as it references a left-out column."""


def made_anew(why: str) -> bool:
    """``why`` (a left-out column's reason) says the handler's side made the value anew
    in each delivery (:data:`DRIFTING`, :data:`ORM_DEFAULT`), not the database."""
    return why == DRIFTING or why.startswith(ORM_DEFAULT)


def drifting(first: State, second: State) -> dict[str, list[str]]:
    """The compared columns whose values differ between two states that should be
    equal (two correct runs of the same delivery), by table: each column's values are
    compared as a multiset, so rows need no order."""
    out: dict[str, list[str]] = {}
    for name, rows in first.items():
        other = second[name]
        for column in rows.table.columns:
            values = Counter(_frozen(r[column]) for r in rows.rows)
            if values != Counter(_frozen(r[column]) for r in other.rows):
                out.setdefault(name, []).append(column)
    return out


def drifting_result(first: Any, second: Any) -> frozenset[str]:
    """The top-level keys of two stored results (JSON objects) that differ; ``{""}``:
    the whole result differs (not objects)."""
    if first == second:
        return frozenset()
    if isinstance(first, dict) and isinstance(second, dict):
        return frozenset(k for k in first.keys() | second.keys() if first.get(k) != second.get(k))
    return frozenset({""})


def steady_result(result: Any, drift: frozenset[str]) -> Any:
    """``result`` without what :func:`drifting_result` found differing."""
    if not drift:
        return result
    if "" in drift or not isinstance(result, dict):
        return "(differs between deliveries: not compared)"
    return {k: v for k, v in result.items() if k not in drift}


def leave_out(tables: Iterable[Table], columns: Mapping[str, Iterable[str]],
              why: str) -> list[Table]:
    """``tables`` with ``columns`` no longer compared (left out, with ``why``)."""
    out = []
    for table in tables:
        gone = set(columns.get(table.name, ()))
        out.append(Table(table.name, tuple(c for c in table.columns if c not in gone),
                         table.left_out + tuple((c, why) for c in table.columns if c in gone)))
    return out


def compare(expected: State, got: State) -> list[TableDiff]:
    """The tables whose rows differ, in name order."""
    diffs = []
    for name in sorted(expected):
        want, have = expected[name].counted(), got[name].counted()
        if want != have:
            diffs.append(TableDiff(name, expected[name].pick(want - have),
                                   got[name].pick(have - want)))
    return diffs


def show_value(value: Any) -> str:
    if isinstance(value, Decimal | int | float) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    return repr(value)


def show_row(row: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{k}: {show_value(v)}" for k, v in row.items()) + "}"


def freeze(effect: Any) -> Any:
    """A remote effect or a field value, hashable (JSON text when it is not)."""
    try:
        hash(effect)
        return effect
    except TypeError:
        return json.dumps(effect, sort_keys=True, default=str)
