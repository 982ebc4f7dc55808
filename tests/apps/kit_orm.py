"""An app whose handlers write through the ORM (``ctx.session``), written as a user
would, for the test kit's ORM tests; the ORM variants of the classic mistakes
switched on by name (``MISTAKE``, reset to "none" by the tests).

``shop.orders`` (local mode, ``batch=True``) and ``shop.payments`` (leased) add an
:class:`Order` row through ``ctx.session`` and emit ``shop.order-placed`` with the
order's public reference, derived from the idempotency key (``uuid5``). The
mistakes:

* ``own_session``: the row is added through a ``Session`` of its own, on an engine of
  its own, committed whatever becomes of the handler's transaction;
* ``tx_commit``, ``session_commit``, ``session_rollback``: the handler ends its
  transaction itself (refused: a code defect);
* ``default_ref_in_event``: the reference is left to the model's client-side default
  (``uuid4``) and sent in the event;
* ``default_ref_in_result``: the same reference, in the stored result (the event
  without it);
* ``default_ref_in_column``: the same reference, stored in its column only (left out
  of the comparison, said; not a mistake while it stays in the database);
* ``own_uuid_in_event``: the event carries a ``uuid4()`` the handler makes itself, no
  column's (left out as such a value always was: not the ORM's);
* ``rejects``: the handler refuses the order (``Permanent``): a reference that does
  not succeed, on purpose.
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

import psycopg
from pydantic import BaseModel
from sqlalchemy import MetaData, Numeric, String, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from kafka_idem import App, Context, Permanent

ORDERS = "shop.orders"
PAYMENTS = "shop.payments"
PLACED = "shop.order-placed"
MISTAKE = {"now": "none"}
NAMESPACE = uuid.UUID("6f1c1e9e-3c0a-4c55-9a55-0f4a2d1f5e11")


class Base(DeclarativeBase):
    metadata = MetaData(schema="shop")


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)  # a serial: the database's
    # the order's public reference; a client-side default: a new uuid4 for every row
    # SQLAlchemy inserts without one (the handler sets it unless a mistake says not to)
    ref: Mapped[uuid.UUID] = mapped_column(default=uuid.uuid4)
    key: Mapped[str] = mapped_column(String)
    order_id: Mapped[str] = mapped_column(String)
    amount: Mapped[Decimal] = mapped_column(Numeric)


class Placed(BaseModel):
    tenant_id: str
    order_id: str
    amount: Decimal


app = App("orm-shop", max_attempts=3)
app.event_topic(PLACED, format="json")


@app.migration
def schema(conn: Any) -> None:
    conn.execute("CREATE SCHEMA IF NOT EXISTS shop")


app.sqlalchemy(metadata=Base.metadata)  # its tables: a migration after the schema's


def place_order(msg: Placed, ctx: Context) -> dict[str, Any]:
    mistake = MISTAKE["now"]
    if mistake == "rejects":
        raise Permanent(f"no orders for {msg.tenant_id}")
    order = Order(key=ctx.idempotency_key, order_id=msg.order_id, amount=msg.amount)
    if not mistake.startswith("default_ref"):
        order.ref = uuid.uuid5(NAMESPACE, ctx.idempotency_key)  # the same in every run
    ref = order.ref
    if mistake == "own_session":
        # wrong: an engine and a session of its own, committed whatever becomes of ctx.tx
        dsn = ctx.tx.info.dsn
        engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn))
        try:
            with Session(engine) as own:
                own.add(order)
                own.commit()
        finally:
            engine.dispose()
    else:
        ctx.session.add(order)
        ctx.session.flush()  # the default ran: order.ref is set
        ref = order.ref
    if mistake == "tx_commit":
        ctx.tx.commit()
    elif mistake == "session_commit":
        ctx.session.commit()
    elif mistake == "session_rollback":
        ctx.session.rollback()
    event: dict[str, Any] = {"order_id": msg.order_id, "amount": str(msg.amount)}
    if mistake not in ("default_ref_in_result", "default_ref_in_column"):
        event["ref"] = str(ref)
    if mistake == "own_uuid_in_event":
        event["event_id"] = str(uuid.uuid4())
    ctx.emit(PLACED, event, key=msg.order_id)
    result: dict[str, Any] = {"order_id": msg.order_id}
    if mistake == "default_ref_in_result":
        result["ref"] = str(ref)
    return result


app.handler(topic=ORDERS, model=Placed, key="{tenant_id}:order:{order_id}",
            hash_fields=("amount",), batch=True, name="place")(place_order)
app.handler(topic=PAYMENTS, model=Placed, key="{tenant_id}:pay:{order_id}",
            hash_fields=("amount",), mode="leased", name="pay")(place_order)
