"""Example: charge requests, effects only in this database (local mode).

Topic ``payments.charge-requested``; Kafka key = order id; value = Avro
``payments.ChargeRequested`` (single-object encoding). Idempotency key
``{tenant_id}:charge:{order_id}``; the request hash covers amount and currency,
not the per-send ``request_id`` / ``requested_at``.

Every charge that takes effect emits one ``payments.charge-completed`` event
(:class:`ChargeCompleted`, Avro ``payments.ChargeCompleted``; Kafka key = order
id): the charge and the ledger entry it wrote, in the handler's own transaction
(``ctx.emit``: the transactional outbox), so it exists if and only if the charge
committed. A replay, a payload conflict or a failed charge emits nothing.

The ledger has *no* unique constraint on purpose: this example relies on the
framework alone, so a double execution would show as a second ledger row.

    kafka-idem migrate --app consumers.payments:app
    kafka-idem topics create consumers.payments:app         # + payments.charge-completed
    kafka-idem run consumers.payments:app                   # the relay publishes the events
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kafka_idem import App, AsyncContext, Context, Permanent
from kafka_idem.codecs import AvroCodec

# The topic and mode can be changed from the environment so tests and demos can
# run the same example on a fresh topic (PAYMENTS_TOPIC) or in leased mode.
TOPIC = os.environ.get("PAYMENTS_TOPIC", "payments.charge-requested")
MODE = os.environ.get("PAYMENTS_MODE", "local")
# leased mode: key-ordered concurrency (the chaos run's --concurrency, --order-by-tenant)
CONCURRENCY = int(os.environ.get("PAYMENTS_CONCURRENCY") or 1)
ORDERING_KEY = os.environ.get("PAYMENTS_ORDERING_KEY") or None
ASYNC = os.environ.get("PAYMENTS_ASYNC", "") in ("1", "true", "yes")
# "json" runs the same example on JSON payloads (the chaos run and the bench use it to
# prove and measure the JSON codec); producers' encode_charge follows it.
FORMAT = os.environ.get("PAYMENTS_FORMAT", "avro")
SCHEMA = "payments.ChargeRequested"
EVENT_SCHEMA = "payments.ChargeCompleted"
# "off" builds the app without its events (the bench's batch path without emit).
EVENTS = os.environ.get("PAYMENTS_EVENTS", "on") != "off"
CURRENCIES = frozenset({"EUR", "USD", "GBP", "CHF", "JPY"})
SCHEMAS_DIR = Path(__file__).resolve().parent.parent / "schemas"


class ChargeRequested(BaseModel):
    tenant_id: str
    order_id: str
    amount: Decimal
    currency: str
    request_id: str
    requested_at: dt.datetime


class LedgerEntry(BaseModel):
    id: int
    created_at: dt.datetime


class ChargeCompleted(BaseModel):
    """The event of a charge that took effect: the charge and its ledger entry."""

    tenant_id: str
    order_id: str
    amount: Decimal
    currency: str
    idempotency_key: str
    request_id: str
    ledger_entry: LedgerEntry


def events_topic(topic: str) -> str:
    """The event topic of a charge topic: ``payments.charge-requested`` ->
    ``payments.charge-completed``; any other name gets ``.charge-completed`` appended."""
    base = topic.removesuffix("charge-requested")
    return f"{base}charge-completed" if base != topic else f"{topic}.charge-completed"


def create_tables(conn: Any) -> None:
    conn.execute("CREATE SCHEMA IF NOT EXISTS payments")
    conn.execute(
        """
        CREATE TABLE IF NOT EXISTS payments.ledger (
            id              bigserial,
            tenant_id       text          NOT NULL,
            order_id        text          NOT NULL,
            amount          numeric(18,2) NOT NULL,
            currency        text          NOT NULL,
            idempotency_key text          NOT NULL,
            created_at      timestamptz   NOT NULL DEFAULT now(),
            -- the tenant first: on Citus the table is distributed by it (co_locate)
            PRIMARY KEY (tenant_id, id)
        )
        """
    )
    conn.execute(
        """
        CREATE TABLE IF NOT EXISTS payments.balances (
            tenant_id text          NOT NULL,
            currency  text          NOT NULL,
            balance   numeric(18,2) NOT NULL,
            PRIMARY KEY (tenant_id, currency)
        )
        """
    )


def co_locate(app: App) -> Any:
    """The migration that, on a store distributed on Citus, distributes the tables by
    tenant with the store's records (the handler's ``shard_key``): a charge, its ledger
    entry, its balance and its event are then one shard's transaction. Nothing on one
    PostgreSQL."""
    def co_locate_tables(conn: Any) -> None:
        for table in ("payments.ledger", "payments.balances"):
            app.co_locate(conn, table, "tenant_id")

    return co_locate_tables


def validate(msg: ChargeRequested) -> Permanent | None:
    """The business rules; a broken rule is permanent (retrying can't fix it)."""
    if msg.amount <= 0:
        return Permanent(f"amount must be positive, got {msg.amount}")
    if msg.currency not in CURRENCIES:
        return Permanent(f"unknown currency {msg.currency!r}")
    return None


def result_of(msg: ChargeRequested) -> dict[str, Any]:
    return {"order_id": msg.order_id, "amount": str(msg.amount), "currency": msg.currency}


LEDGER_INSERT = (
    "INSERT INTO payments.ledger (tenant_id, order_id, amount, currency, idempotency_key)"
    " VALUES (%s, %s, %s, %s, %s) RETURNING id, created_at")
BALANCE_UPSERT = (
    "INSERT INTO payments.balances AS b (tenant_id, currency, balance) VALUES (%s, %s, %s)"
    " ON CONFLICT (tenant_id, currency) DO UPDATE SET balance = b.balance + EXCLUDED.balance")


def _ledger_params(msg: ChargeRequested, key: str) -> tuple[Any, ...]:
    return (msg.tenant_id, msg.order_id, msg.amount, msg.currency, key)


def completed(msg: ChargeRequested, key: str, entry: Any) -> dict[str, Any]:
    """The ``payments.ChargeCompleted`` event of ``msg``, whose ledger row is ``entry``
    (its ``id, created_at``)."""
    return {"tenant_id": msg.tenant_id, "order_id": msg.order_id, "amount": msg.amount,
            "currency": msg.currency, "idempotency_key": key, "request_id": msg.request_id,
            "ledger_entry": {"id": entry[0], "created_at": entry[1]}}


def charge(msg: ChargeRequested, ctx: Context, events: str | None = None) -> dict[str, Any]:
    """The charge; with ``events`` (an event topic of ``ctx``'s app), also its
    ``ChargeCompleted`` there. Other apps reuse it for the effect alone."""
    problem = validate(msg)
    if problem is not None:
        raise problem
    entry = ctx.tx.execute(LEDGER_INSERT, _ledger_params(msg, ctx.idempotency_key)).fetchone()
    ctx.tx.execute(BALANCE_UPSERT, (msg.tenant_id, msg.currency, msg.amount))
    if events is not None:
        ctx.emit(events, completed(msg, ctx.idempotency_key, entry), key=msg.order_id)
    return result_of(msg)


async def charge_async(msg: ChargeRequested, ctx: AsyncContext,
                       events: str | None = None) -> dict[str, Any]:
    """``charge`` as an ``async def`` handler (leased mode, ``PAYMENTS_ASYNC=1``)."""
    problem = validate(msg)
    if problem is not None:
        raise problem
    cur = await ctx.tx.execute(LEDGER_INSERT, _ledger_params(msg, ctx.idempotency_key))
    entry = await cur.fetchone()
    await ctx.tx.execute(BALANCE_UPSERT, (msg.tenant_id, msg.currency, msg.amount))
    if events is not None:
        await ctx.emit(events, completed(msg, ctx.idempotency_key, entry), key=msg.order_id)
    return result_of(msg)


def charge_many(
    batch: list[tuple[ChargeRequested, Context]], tx: Any, events: str | None = None
) -> list[dict[str, Any] | Permanent]:
    """The same effect as ``charge`` on each item, in two statements for the batch, and
    with ``events`` the same event per charged item (emitted on the item's own ``ctx``).

    Rejected items write nothing and come back as their ``Permanent`` error.
    Balances are updated in (tenant, currency) order so concurrent batches lock
    rows in one order and can't deadlock.
    """
    out: list[dict[str, Any] | Permanent] = []
    rows: list[tuple[Any, ...]] = []
    charged: list[tuple[ChargeRequested, Context]] = []
    totals: dict[tuple[str, str], Decimal] = {}
    for msg, ctx in batch:
        problem = validate(msg)
        if problem is not None:
            out.append(problem)
            continue
        rows.append(_ledger_params(msg, ctx.idempotency_key))
        charged.append((msg, ctx))
        pair = (msg.tenant_id, msg.currency)
        totals[pair] = totals.get(pair, Decimal(0)) + msg.amount
        out.append(result_of(msg))
    if rows:
        tenants, orders, amounts, currencies, keys = (list(col) for col in zip(*rows, strict=True))
        # The arrays travel in binary (%b): psycopg quotes a text array element by
        # element, several times slower for a batch of 500.
        ledger = tx.execute(
            "INSERT INTO payments.ledger (tenant_id, order_id, amount, currency, idempotency_key)"
            " SELECT * FROM unnest(%b::text[], %b::text[], %b::numeric[], %b::text[], %b::text[])"
            + (" RETURNING id, created_at, idempotency_key" if events is not None else ""),
            (tenants, orders, amounts, currencies, keys),
        )
        if events is not None:  # only the events need the ledger rows' ids and times
            entries = {key: (entry_id, at) for entry_id, at, key in ledger.fetchall()}
            for msg, ctx in charged:
                key = ctx.idempotency_key
                ctx.emit(events, completed(msg, key, entries[key]), key=msg.order_id)
        pairs = sorted(totals)
        tx.execute(
            "INSERT INTO payments.balances AS b (tenant_id, currency, balance)"
            " SELECT * FROM unnest(%b::text[], %b::text[], %b::numeric[])"
            " ON CONFLICT (tenant_id, currency)"
            " DO UPDATE SET balance = b.balance + EXCLUDED.balance",
            ([p[0] for p in pairs], [p[1] for p in pairs], [totals[p] for p in pairs]),
        )
    return out


def _key_order(mode: str) -> dict[str, Any]:
    if mode != "leased":
        return {}
    return {"concurrency": CONCURRENCY, "ordering_key": ORDERING_KEY}


def build_app(
    *, topic: str = TOPIC, mode: str = MODE, name: str = "payments", fmt: str = FORMAT,
    events: bool = EVENTS, **settings: Any,
) -> App:
    """The payments app on ``topic``; ``settings`` override Settings fields.

    With ``events`` (the default; ``PAYMENTS_EVENTS=off`` turns it off) every charge
    that takes effect emits a :class:`ChargeCompleted` to :func:`events_topic`.

    The consumer group is ``KAFKA_IDEM_GROUP_ID`` (or ``run --group-id``), else the
    app's name: a group id given here in code would win over the environment.
    """
    settings.setdefault("schemas_dir", SCHEMAS_DIR)
    application = App(name, **settings)
    application.migration(create_tables)
    application.migration(co_locate(application))  # on Citus: with the records, by tenant
    emits = events_topic(topic) if events else None
    if emits is not None:
        application.event_topic(emits, format="avro", schema=EVENT_SCHEMA, model=ChargeCompleted)
    handler = application.handler(
        topic=topic,
        model=ChargeRequested,
        key="{tenant_id}:charge:{order_id}",
        shard_key="{tenant_id}",  # where a store distributed on Citus places the record
        hash_fields=("amount", "currency"),
        format=fmt,  # type: ignore[arg-type]  # "avro": single-object encoding, reader SCHEMA
        schema=SCHEMA if fmt == "avro" else None,
        mode=mode,  # type: ignore[arg-type]
        name="charge",
        **_key_order(mode),
    )(_handlers(emits, asynchronous=ASYNC and mode == "leased"))
    handler.bulk_handler(lambda batch, tx: charge_many(batch, tx, emits))
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


@functools.cache
def codec() -> AvroCodec:
    """The Avro schemas of ``schemas/`` (to write records the model would refuse)."""
    return AvroCodec.from_dir(SCHEMAS_DIR)


def encode_charge(
    tenant_id: str,
    order_id: str,
    amount: Decimal | str,
    currency: str = "EUR",
    *,
    request_id: str | None = None,
    requested_at: dt.datetime | None = None,
) -> bytes:
    """The bytes of one charge request (what producers send: Avro single-object, or JSON
    with PAYMENTS_FORMAT=json), made by the handler's own codec (the one that decodes
    them)."""
    return app.handlers[TOPIC].encode(charge_payload(
        tenant_id, order_id, amount, currency, request_id=request_id,
        requested_at=requested_at))


def charge_payload(
    tenant_id: str,
    order_id: str,
    amount: Decimal | str,
    currency: str = "EUR",
    *,
    request_id: str | None = None,
    requested_at: dt.datetime | None = None,
) -> dict[str, Any]:
    """One charge request as the payload any of the app's codecs encodes."""
    return {
        "tenant_id": tenant_id,
        "order_id": order_id,
        "amount": Decimal(amount),
        "currency": currency,
        "request_id": request_id or str(uuid.uuid4()),
        "requested_at": requested_at or dt.datetime.now(dt.UTC),
    }
