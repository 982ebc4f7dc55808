"""Values an ORM model's client-side default makes: a column whose SQLAlchemy
``default`` is a Python callable (``default=uuid.uuid4``) gets a new value in every
delivery, as a value the handler makes itself does, so two clean deliveries of the
reference differ in it (:func:`~kafka_idem.testing.tables.drifting`).

The kit knows the app's models through ``app.sessions.metadata``
(``app.sqlalchemy(metadata=...)``). Such a column is left out of the comparison, its
reason naming the default, while it stays in the database; when its value *leaves*
the transaction (an event field, the stored result: each, in both deliveries, that
column's value) the check fails: a re-run of the message after its record is purged,
or a replay, would send a value nothing downstream has seen (:func:`leak_fault`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kafka_idem.app import App
from kafka_idem.testing.events import columns_of, flatten
from kafka_idem.testing.report import Fault
from kafka_idem.testing.tables import ORM_DEFAULT, State, freeze, split_name


@dataclass(frozen=True)
class OrmMade:
    """A compared column an ORM default fills, whose values differ between the two
    clean deliveries of the reference: ``probe`` (the first's) and ``ref`` (the
    reference's)."""

    column: str  # schema.table.column
    default: str  # the default's name: uuid.uuid4
    probe: list[Any]
    ref: list[Any]

    @property
    def table(self) -> str:
        return self.column.rsplit(".", 1)[0]

    @property
    def name(self) -> str:
        return self.column.rsplit(".", 1)[1]

    @property
    def why(self) -> str:
        """The reason it is left out of the comparison."""
        return f"{ORM_DEFAULT} {self.default} of {self.column}"


@dataclass(frozen=True)
class Leak:
    """An ORM-made value that leaves the transaction, and where (``event TOPIC field
    NAME``, ``the stored result['NAME']``)."""

    made: OrmMade
    where: str


def _named(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module and module not in ("builtins", "__main__") else name


def client_defaults(app: App) -> dict[str, str]:
    """``schema.table.column`` -> its Python default's name, for every column of the
    app's ORM metadata whose ``default`` is a callable (not a ``server_default``, not a
    SQL expression: the database makes those)."""
    metadata = app.sessions.metadata
    if metadata is None:
        return {}
    out: dict[str, str] = {}
    for table in metadata.tables.values():
        schema, name = split_name(f"{table.schema}.{table.name}" if table.schema
                                  else table.name)
        for column in table.columns:
            default = column.default
            if default is not None and getattr(default, "is_callable", False):
                out[f"{schema}.{name}.{column.name}"] = _named(getattr(default, "arg", None))
    return out


def orm_made(app: App, drift: Mapping[str, Iterable[str]], probe: State,
             ref: State) -> dict[str, OrmMade]:
    """The columns of ``drift`` (by table) that an ORM client-side default fills."""
    defaults = client_defaults(app)
    out: dict[str, OrmMade] = {}
    for table, columns in drift.items():
        for column in columns:
            name = f"{table}.{column}"
            if name in defaults:
                out[name] = OrmMade(name, defaults[name],
                                    [r[column] for r in probe[table].rows],
                                    [r[column] for r in ref[table].rows])
    return out


def carrying(made: Mapping[str, OrmMade], first: Any, second: Any) -> OrmMade | None:
    """The ORM-made column whose value ``first`` is in the first delivery and ``second``
    in the reference's (scalars, or structures compared leaf by leaf), or ``None``."""
    if not made:
        return None
    a, b = flatten(first), flatten(second)
    for path in a.keys() & b.keys():
        if freeze(a[path]) == freeze(b[path]):
            continue
        for m in made.values():
            if (columns_of(a[path], {m.column: m.probe})
                    and columns_of(b[path], {m.column: m.ref})):
                return m
    return None


def leak_fault(leaks: Iterable[Leak]) -> Fault | None:
    """The check's failure for the ORM-made values that leave the transaction (one
    entry per column, naming where), or ``None``: none leaves it."""
    where: dict[str, list[str]] = {}
    made: dict[str, OrmMade] = {}
    for leak in leaks:
        where.setdefault(leak.made.column, []).append(leak.where)
        made[leak.made.column] = leak.made
    if not where:
        return None
    lines: list[str] = []
    for column, places in sorted(where.items()):
        m = made[column]
        lines += [
            f"{column} is made by SQLAlchemy's client-side default {m.default} (a new value "
            f"in every delivery) and leaves the transaction: in {', '.join(places)}",
            "  a re-run of the message after its record is purged, or a replay, sends a "
            "value nothing downstream has seen",
            f"  fix: derive it from the idempotency key and set it yourself, e.g. {m.name}="
            "uuid.uuid5(NAMESPACE, ctx.idempotency_key), instead of the default",
        ]
    n = len(where)
    head = (f"{n} value(s) made by an SQLAlchemy client-side default leave the transaction"
            if n > 1 else "a value made by an SQLAlchemy client-side default leaves the "
            "transaction")
    return Fault(head, lines)
