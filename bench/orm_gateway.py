"""The gateway charge written with ``ctx.session``: the ORM gateway rows of the bench.

The same work as ``consumers.gateway``'s handlers (the raw-SQL ones of the
``gateway_c64`` and ``gateway_async`` rows): the same remote call with the idempotency
key, through the same client class, then the charge recorded in
``payments.gateway_charges``, here as a mapped object added to ``ctx.session`` (the
framework flushes it when the handler returns: the raw handler's ``INSERT`` reads
nothing back, so the handler does not flush). The reconciler records a charge the
gateway already made the same way. :func:`build_app` is the gateway app with these
handlers instead of its own and ``app.sqlalchemy(metadata=...)``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from decimal import Decimal
from typing import Any, cast

from sqlalchemy import BigInteger, MetaData, Numeric, Text, func
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from consumers import gateway, payments
from kafka_idem import App, AsyncContext, Context, Done


class Base(DeclarativeBase):
    metadata = MetaData(schema="payments")


class GatewayCharge(Base):
    __tablename__ = "gateway_charges"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    idempotency_key: Mapped[str] = mapped_column(Text)
    charge_id: Mapped[str] = mapped_column(Text)
    amount: Mapped[Decimal] = mapped_column(Numeric(18, 2))
    currency: Mapped[str] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(server_default=func.now())


def _charge_row(ctx: Context | AsyncContext, charge: dict[str, Any]) -> GatewayCharge:
    return GatewayCharge(idempotency_key=ctx.idempotency_key, charge_id=charge["id"],
                         amount=Decimal(charge["amount"]), currency=charge["currency"])


def build_app(*, gateway_url: str | None = None, timeout: float | None = None,
              use_async: bool | None = None, **settings: Any) -> App:
    """:func:`consumers.gateway.build_app` (same arguments) with handlers and a reconciler
    that record the charge through ``ctx.session``."""
    app = gateway.build_app(gateway_url=gateway_url, timeout=timeout, use_async=use_async,
                            **settings)
    app.sqlalchemy(metadata=Base.metadata)
    client = gateway.AsyncGatewayClient(gateway_url, timeout)
    (handler,) = app.handlers.values()
    if handler.is_async:

        async def charge_async(msg: payments.ChargeRequested, ctx: AsyncContext) -> Any:
            found = await client.charge_async(ctx.idempotency_key, gateway._request(msg))
            ctx.session.add(_charge_row(ctx, found))
            return {"charge_id": found["id"]}

        async def reconcile_async(msg: payments.ChargeRequested,
                                  ctx: AsyncContext) -> Done | None:
            found = await client.find_async(ctx.idempotency_key)
            if found is None:
                return None  # never applied: the handler runs again with the same key
            ctx.session.add(_charge_row(ctx, found))
            return Done({"charge_id": found["id"]})

        handler.fn = cast("Callable[[Any, Context], Any]", charge_async)
        handler.reconcile = reconcile_async
        return app

    def charge(msg: payments.ChargeRequested, ctx: Context) -> dict[str, Any]:
        found = client.charge(ctx.idempotency_key, gateway._request(msg))
        ctx.session.add(_charge_row(ctx, found))
        return {"charge_id": found["id"]}

    def reconcile(msg: payments.ChargeRequested, ctx: Context) -> Done | None:
        found = client.find(ctx.idempotency_key)
        if found is None:
            return None  # never applied: the handler runs again with the same key
        ctx.session.add(_charge_row(ctx, found))
        return Done({"charge_id": found["id"]})

    handler.fn, handler.reconcile = charge, reconcile
    return app
