"""The payments charge written with ``ctx.session``: the ORM rows of the bench.

The same work as :func:`consumers.payments.charge` (the raw-SQL per-message handler of
the ``batch_nobulk`` and ``leased`` rows), on the same tables, written as a SQLAlchemy
user would: the ledger entry is a mapped object added to the session and flushed (the
``INSERT ... RETURNING id, created_at`` the raw handler sends, the server's defaults
fetched by the flush), the balance an upsert
(``sqlalchemy.dialects.postgresql.insert(...).on_conflict_do_update``) run through the
session. :func:`build_app` is the payments app with this handler instead of its own
(no bulk handler: an ORM handler has none) and ``app.sqlalchemy(metadata=...)``.
"""

from __future__ import annotations

import datetime as dt
import statistics
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from sqlalchemy import BigInteger, MetaData, Numeric, Text, bindparam, func
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from consumers import payments
from kafka_idem import App, Context

if TYPE_CHECKING:
    from rich.table import Table

# raw-SQL row -> its ORM rows: the same handler work, the same path and topic
PAIRS: dict[str, tuple[str, ...]] = {
    "leased": ("leased_orm", "leased_orm_core"),
    "batch_nobulk": ("batch_orm", "batch_orm_core"),
    "gateway_c64": ("gateway_c64_orm",),
    "gateway_async": ("gateway_async_orm",),
}
ORM_PATHS = frozenset(p for rows in PAIRS.values() for p in rows)
# the ORM rows whose handler is the 2.0-style one (charge_core), not the unit of work's
CORE_PATHS = frozenset({"leased_orm_core", "batch_orm_core"})
TARGET = 1.5  # an ORM row's consumer CPU per message, at most this x its raw row's


class Base(DeclarativeBase):
    metadata = MetaData(schema="payments")


class LedgerEntry(Base):
    __tablename__ = "ledger"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(Text)
    order_id: Mapped[str] = mapped_column(Text)
    amount: Mapped[Decimal] = mapped_column(Numeric(18, 2))
    currency: Mapped[str] = mapped_column(Text)
    idempotency_key: Mapped[str] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(server_default=func.now())


class Balance(Base):
    __tablename__ = "balances"

    tenant_id: Mapped[str] = mapped_column(Text, primary_key=True)
    currency: Mapped[str] = mapped_column(Text, primary_key=True)
    balance: Mapped[Decimal] = mapped_column(Numeric(18, 2))


def charge(msg: payments.ChargeRequested, ctx: Context,
           events: str | None = None) -> dict[str, Any]:
    """:func:`consumers.payments.charge` through ``ctx.session``."""
    problem = payments.validate(msg)
    if problem is not None:
        raise problem
    session = ctx.session
    entry = LedgerEntry(tenant_id=msg.tenant_id, order_id=msg.order_id, amount=msg.amount,
                        currency=msg.currency, idempotency_key=ctx.idempotency_key)
    session.add(entry)
    session.flush()  # the entry's id and created_at, for its event
    upsert = insert(Balance).values(tenant_id=msg.tenant_id, currency=msg.currency,
                                    balance=msg.amount)
    session.execute(upsert.on_conflict_do_update(
        index_elements=[Balance.tenant_id, Balance.currency],
        set_={"balance": Balance.balance + upsert.excluded.balance}))
    if events is not None:
        ctx.emit(events, payments.completed(msg, ctx.idempotency_key,
                                            (entry.id, entry.created_at)), key=msg.order_id)
    return payments.result_of(msg)


# charge_core's statements, built once: the ledger entry's INSERT ... RETURNING id,
# created_at (an ORM insert given a list of parameter sets) and the balance's upsert
LEDGER_INSERT = insert(LedgerEntry).returning(LedgerEntry.id, LedgerEntry.created_at)
_balance = insert(Balance).values(tenant_id=bindparam("tenant_id"),
                                  currency=bindparam("currency"), balance=bindparam("amount"))
BALANCE_UPSERT = _balance.on_conflict_do_update(
    index_elements=[Balance.tenant_id, Balance.currency],
    set_={"balance": Balance.balance + _balance.excluded.balance})


def charge_core(msg: payments.ChargeRequested, ctx: Context,
                events: str | None = None) -> dict[str, Any]:
    """:func:`charge` in SQLAlchemy 2.0's statement style: no unit of work, the
    statements built once at import, run through ``ctx.session`` (the ``*_orm_core``
    rows, an extra measurement beside the idiomatic :func:`charge`)."""
    problem = payments.validate(msg)
    if problem is not None:
        raise problem
    session = ctx.session
    entry = session.execute(LEDGER_INSERT, [{
        "tenant_id": msg.tenant_id, "order_id": msg.order_id, "amount": msg.amount,
        "currency": msg.currency, "idempotency_key": ctx.idempotency_key}]).one()
    session.execute(BALANCE_UPSERT, {"tenant_id": msg.tenant_id, "currency": msg.currency,
                                     "amount": msg.amount})
    if events is not None:
        ctx.emit(events, payments.completed(msg, ctx.idempotency_key, tuple(entry)),
                 key=msg.order_id)
    return payments.result_of(msg)


def build_app(*, events: bool = False, core: bool = False, **settings: Any) -> App:
    """:func:`consumers.payments.build_app` (same arguments) with :func:`charge` (with
    ``core``: :func:`charge_core`) as its handler, no bulk handler, and the models'
    metadata as its ORM configuration."""
    app = payments.build_app(events=events, **settings)
    app.sqlalchemy(metadata=Base.metadata)
    emits = payments.events_topic(settings.get("topic", payments.TOPIC)) if events else None
    fn = charge_core if core else charge

    def charge_and_emit(msg: payments.ChargeRequested, ctx: Context) -> Any:
        return fn(msg, ctx, emits)

    for handler in app.handlers.values():
        handler.fn = charge_and_emit
        handler.bulk = None
    return app


# --- the rows side by side (python -m bench) -----------------------------------------------


def pair_of(path: str, wanted: list[str]) -> tuple[str, ...] | None:
    """``(raw row, its measured ORM rows...)`` when ``path`` is one of them and the raw
    row and at least one of its ORM rows are measured."""
    for raw, orms in PAIRS.items():
        group = (raw, *(o for o in orms if o in wanted))
        if path in (raw, *orms) and raw in wanted and len(group) > 1:
            return group
    return None


def _cpu_ms(run: dict[str, Any]) -> float | None:
    """Consumer CPU milliseconds per message over a throughput run's window."""
    cpu = (run.get("cpu") or {}).get("consumer")
    n = run.get("messages") or 0
    return cpu / n * 1000 if cpu is not None and n and run.get("ok") else None


def _rate(run: dict[str, Any]) -> float | None:
    secs = run.get("seconds") or 0
    return run["messages"] / secs if secs and run.get("ok") else None


def summary(run: dict[str, Any]) -> str:
    rate, cpu = _rate(run), _cpu_ms(run)
    if rate is None or cpu is None:
        return f"FAILED: {run.get('check')}"
    return f"{rate:,.0f} msgs/s, consumer CPU {cpu:.3f} ms/msg; {run.get('check')}"


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median consumer CPU per message (its figures are the row's), with
    every run's figures under ``runs``; not ok when any run failed."""
    good = sorted((r for r in runs if _cpu_ms(r) is not None), key=lambda r: _cpu_ms(r) or 0)
    chosen = dict(good[(len(good) - 1) // 2] if good else runs[0])
    chosen["runs"] = [{"msgs_per_s": _rate(r), "consumer_cpu_ms_per_msg": _cpu_ms(r),
                       "ok": bool(r.get("ok")), "check": r.get("check")} for r in runs]
    if len(good) < len(runs):
        chosen["ok"] = False
        chosen["check"] = (f"FAILED: {len(runs) - len(good)} of {len(runs)} runs; "
                           + "; ".join(str(r.get("check")) for r in runs if not r.get("ok")))
    else:
        chosen["check"] = f"{chosen.get('check')} (all {len(runs)} runs)"
    return chosen


def _median(values: list[float | None]) -> float | None:
    have = [v for v in values if v is not None]
    return statistics.median(have) if have else None


def comparisons(rows: list[Any]) -> list[dict[str, Any]]:
    """Each measured ORM row next to its raw-SQL row: per pair of runs and medians."""
    by = {m.path: m for m in rows}
    out = []
    for raw, orm in ((r, o) for r, orms in PAIRS.items() for o in orms):
        if raw not in by or orm not in by:
            continue
        a = by[raw].throughput.get("runs") or []
        b = by[orm].throughput.get("runs") or []
        pairs = []
        for x, y in zip(a, b, strict=False):
            rx, ry = x["consumer_cpu_ms_per_msg"], y["consumer_cpu_ms_per_msg"]
            sx, sy = x["msgs_per_s"], y["msgs_per_s"]
            pairs.append({"raw": x, "orm": y,
                          "cpu_ratio": ry / rx if rx and ry else None,
                          "rate_ratio": sy / sx if sx and sy else None})
        cpu_ratio = _median([p["cpu_ratio"] for p in pairs])
        out.append({
            "raw": raw, "orm": orm, "pairs": pairs,
            "raw_msgs_per_s": _median([x["msgs_per_s"] for x in a]),
            "orm_msgs_per_s": _median([y["msgs_per_s"] for y in b]),
            "raw_cpu_ms_per_msg": _median([x["consumer_cpu_ms_per_msg"] for x in a]),
            "orm_cpu_ms_per_msg": _median([y["consumer_cpu_ms_per_msg"] for y in b]),
            "cpu_ratio": cpu_ratio,
            "rate_ratio": _median([p["rate_ratio"] for p in pairs]),
            "target": TARGET, "met": cpu_ratio is not None and cpu_ratio <= TARGET,
        })
    return out


def lines(comps: list[dict[str, Any]]) -> list[list[str]]:
    """The table's rows: a row per pair of runs, then the medians."""

    def f(v: float | None, fmt: str) -> str:
        return "—" if v is None else fmt.format(v)

    out = []
    for c in comps:
        for i, p in enumerate(c["pairs"], 1):
            out.append([f"{c['orm']} / {c['raw']}", f"pair {i}",
                        f(p["raw"]["msgs_per_s"], "{:,.0f}"), f(p["orm"]["msgs_per_s"], "{:,.0f}"),
                        f(p["rate_ratio"], "{:.2f}"),
                        f(p["raw"]["consumer_cpu_ms_per_msg"], "{:.3f}"),
                        f(p["orm"]["consumer_cpu_ms_per_msg"], "{:.3f}"),
                        f(p["cpu_ratio"], "{:.2f}"), ""])
        out.append([f"{c['orm']} / {c['raw']}", "median",
                    f(c["raw_msgs_per_s"], "{:,.0f}"), f(c["orm_msgs_per_s"], "{:,.0f}"),
                    f(c["rate_ratio"], "{:.2f}"), f(c["raw_cpu_ms_per_msg"], "{:.3f}"),
                    f(c["orm_cpu_ms_per_msg"], "{:.3f}"), f(c["cpu_ratio"], "{:.2f}"),
                    f"{'met' if c['met'] else 'not met'} (<= {c['target']})"])
    return out


HEADER = ["ORM row / raw row", "runs", "raw msgs/s", "ORM msgs/s", "msgs/s ORM/raw",
          "raw CPU ms/msg", "ORM CPU ms/msg", "CPU ORM/raw", f"target CPU <= {TARGET} x"]


def render(comps: list[dict[str, Any]]) -> Table | None:
    if not comps:
        return None
    from rich.table import Table

    table = Table(title="ORM handlers (ctx.session) against the same work in raw SQL: "
                  "consumer CPU per message, alternating pairs of throughput runs",
                  title_justify="left")
    for i, col in enumerate(HEADER):
        table.add_column(col, justify="left" if i < 2 or i == len(HEADER) - 1 else "right")
    for row in lines(comps):
        table.add_row(*row)
    return table
