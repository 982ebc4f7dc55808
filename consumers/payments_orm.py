"""Example: the payments example (:mod:`consumers.payments`) written with SQLAlchemy's ORM.

The same service as ``consumers/payments.py``: topic ``payments.charge-requested``
(Kafka key = order id; value = Avro ``payments.ChargeRequested``), idempotency key
``{tenant_id}:charge:{order_id}``, the request hash over amount and currency, and one
``payments.charge-completed`` event per charge that takes effect, through ``ctx.emit``
(the outbox). Its models, business rules, codecs and schemas are payments.py's; only
the writes differ: ``ctx.session`` (a SQLAlchemy ``Session`` on the handler's own
transaction; an ``AsyncSession`` for the ``async def`` variant) instead of SQL on
``ctx.tx``. The app's name is ``payments`` too, so its records, outbox and tables are
the same ones: either app can take over from the other on a running deployment.

Declarative models map the existing tables (``payments.ledger``, ``payments.balances``)
column for column; ``kafka-idem migrate --app`` creates them from ``Base.metadata``
(those missing, and the schema), and payments.py's ``create_tables`` and the metadata
may run in either order on one database. ``LedgerEntry.balance`` is a many-to-one
relationship to the entry's ``Balance`` by (tenant_id, currency) without a foreign key
(a charge's ledger row is written before its balance exists, and the tables stay
payments.py's): ``primaryjoin`` with ``foreign()``, read-only.

The balance is an upsert (``INSERT ... ON CONFLICT DO UPDATE``, PostgreSQL's
``insert``), not a read-modify-write: two members charging a new (tenant, currency)
at once must not hit a unique violation, nor lose an update. The ledger entry is
flushed before the event is emitted, for the id and time the database gives it.

No bulk handler: the batch path runs this handler once per message inside the batch's
transaction (payments.py's ``charge_many`` is the faster bulk form of the same writes).
The environment knobs are payments.py's (``PAYMENTS_TOPIC``, ``PAYMENTS_MODE``,
``PAYMENTS_CONCURRENCY``, ``PAYMENTS_ORDERING_KEY``, ``PAYMENTS_ASYNC``,
``PAYMENTS_FORMAT``, ``PAYMENTS_EVENTS``).

    pip install 'kafka-idem[sqlalchemy]'
    kafka-idem migrate --app consumers.payments_orm:app
    kafka-idem topics create consumers.payments_orm:app         # + payments.charge-completed
    kafka-idem run consumers.payments_orm:app                   # the relay publishes the events
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    BigInteger,
    DateTime,
    MetaData,
    Numeric,
    PrimaryKeyConstraint,
    Text,
    and_,
    func,
)
from sqlalchemy.dialects.postgresql import Insert, insert
from sqlalchemy.orm import DeclarativeBase, Mapped, foreign, mapped_column, relationship

from consumers import payments
from consumers.payments import (
    ASYNC,
    EVENT_SCHEMA,
    EVENTS,
    FORMAT,
    MODE,
    SCHEMA,
    SCHEMAS_DIR,
    TOPIC,
    ChargeCompleted,
    ChargeRequested,
    charge_payload,
    completed,
    events_topic,
    result_of,
    validate,
)
from kafka_idem import App, AsyncContext, Context

__all__ = ["Balance", "Base", "LedgerEntry", "app", "build_app", "charge", "charge_async",
           "charge_payload", "encode_charge", "events_topic"]


class Base(DeclarativeBase):
    metadata = MetaData(schema="payments")


class Balance(Base):
    """``payments.balances``: one row per (tenant, currency)."""

    __tablename__ = "balances"

    tenant_id: Mapped[str] = mapped_column(Text, primary_key=True)
    currency: Mapped[str] = mapped_column(Text, primary_key=True)
    balance: Mapped[Decimal] = mapped_column(Numeric(18, 2))


class LedgerEntry(Base):
    """``payments.ledger``: one row per charge that took effect (no unique constraint on
    purpose, as in payments.py: a double execution would show as a second row)."""

    __tablename__ = "ledger"
    # the INSERT returns the id and created_at the database makes (for the event)
    __mapper_args__ = {"eager_defaults": True}

    # payments.py's key (tenant_id, id): on Citus the table is distributed by tenant
    __table_args__ = (PrimaryKeyConstraint("tenant_id", "id", name="ledger_pkey"),)

    id: Mapped[int] = mapped_column(BigInteger, autoincrement=True)  # bigserial
    tenant_id: Mapped[str] = mapped_column(Text)
    order_id: Mapped[str] = mapped_column(Text)
    amount: Mapped[Decimal] = mapped_column(Numeric(18, 2))
    currency: Mapped[str] = mapped_column(Text)
    idempotency_key: Mapped[str] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True),
                                                    server_default=func.now())

    # The entry's balance. No foreign key: the tables are payments.py's (and an entry
    # is written before its balance row exists); read-only, the upsert writes balances.
    balance: Mapped[Balance] = relationship(
        primaryjoin=lambda: and_(foreign(LedgerEntry.tenant_id) == Balance.tenant_id,
                                 foreign(LedgerEntry.currency) == Balance.currency),
        viewonly=True)


def entry_of(msg: ChargeRequested, key: str) -> LedgerEntry:
    return LedgerEntry(tenant_id=msg.tenant_id, order_id=msg.order_id, amount=msg.amount,
                       currency=msg.currency, idempotency_key=key)


def balance_upsert(msg: ChargeRequested) -> Insert:
    """Add ``msg.amount`` to its (tenant, currency) balance, made if missing: one
    statement, so concurrent charges of a new pair neither collide nor lose an update."""
    stmt = insert(Balance).values(tenant_id=msg.tenant_id, currency=msg.currency,
                                  balance=msg.amount)
    return stmt.on_conflict_do_update(
        index_elements=[Balance.tenant_id, Balance.currency],
        set_={"balance": Balance.balance + stmt.excluded.balance})


def charge(msg: ChargeRequested, ctx: Context, events: str | None = None) -> dict[str, Any]:
    """The charge on ``ctx.session``; with ``events`` (an event topic of ``ctx``'s app),
    also its ``ChargeCompleted`` there."""
    problem = validate(msg)
    if problem is not None:
        raise problem
    entry = entry_of(msg, ctx.idempotency_key)
    ctx.session.add(entry)
    ctx.session.flush()  # INSERT ... RETURNING id, created_at
    ctx.session.execute(balance_upsert(msg))
    if events is not None:
        ctx.emit(events, completed(msg, ctx.idempotency_key, (entry.id, entry.created_at)),
                 key=msg.order_id)
    return result_of(msg)  # the framework flushes what is left and closes the session


async def charge_async(msg: ChargeRequested, ctx: AsyncContext,
                       events: str | None = None) -> dict[str, Any]:
    """``charge`` as an ``async def`` handler on an ``AsyncSession`` (leased mode,
    ``PAYMENTS_ASYNC=1``)."""
    problem = validate(msg)
    if problem is not None:
        raise problem
    entry = entry_of(msg, ctx.idempotency_key)
    ctx.session.add(entry)
    await ctx.session.flush()
    await ctx.session.execute(balance_upsert(msg))
    if events is not None:
        await ctx.emit(events, completed(msg, ctx.idempotency_key,
                                         (entry.id, entry.created_at)), key=msg.order_id)
    return result_of(msg)


def build_app(
    *, topic: str = TOPIC, mode: str = MODE, name: str = "payments", fmt: str = FORMAT,
    events: bool = EVENTS, asynchronous: bool = ASYNC, **settings: Any,
) -> App:
    """payments.py's ``build_app`` with the ORM handler (``asynchronous``: the ``async
    def`` one, leased mode only); ``settings`` override Settings fields."""
    settings.setdefault("schemas_dir", SCHEMAS_DIR)
    application = App(name, **settings)
    application.sqlalchemy(metadata=Base.metadata)  # migrate --app creates its tables
    application.migration(payments.co_locate(application))  # on Citus: by tenant
    emits = events_topic(topic) if events else None
    if emits is not None:
        application.event_topic(emits, format="avro", schema=EVENT_SCHEMA, model=ChargeCompleted)
    key_order: dict[str, Any] = {}  # leased mode: key-ordered concurrency, as payments.py
    if mode == "leased":
        key_order = {"concurrency": payments.CONCURRENCY, "ordering_key": payments.ORDERING_KEY}
    application.handler(
        topic=topic,
        model=ChargeRequested,
        key="{tenant_id}:charge:{order_id}",
        shard_key="{tenant_id}",
        hash_fields=("amount", "currency"),
        format=fmt,  # type: ignore[arg-type]
        schema=SCHEMA if fmt == "avro" else None,
        mode=mode,  # type: ignore[arg-type]
        name="charge",
        **key_order,
    )(_handlers(emits, asynchronous=asynchronous and mode == "leased"))
    return application


def _handlers(events: str | None, *, asynchronous: bool) -> Any:
    """``charge`` (or ``charge_async``) emitting to ``events`` (None: nothing)."""
    if asynchronous:
        async def charge_and_emit_async(msg: ChargeRequested, ctx: AsyncContext) -> Any:
            return await charge_async(msg, ctx, events)

        return charge_and_emit_async

    def charge_and_emit(msg: ChargeRequested, ctx: Context) -> Any:
        return charge(msg, ctx, events)

    return charge_and_emit


app = build_app()


def encode_charge(tenant_id: str, order_id: str, amount: Decimal | str, currency: str = "EUR",
                  **kw: Any) -> bytes:
    """The bytes of one charge request, made by this app's handler's codec."""
    return app.handlers[TOPIC].encode(charge_payload(tenant_id, order_id, amount, currency,
                                                     **kw))
