"""An ORM app whose batch handler loads a large collection lazily (a customer's
subscriptions, a few hundred each), for the regression test of a crash: on CPython
3.11, closing each handler's session after its flush on the batch path crashed the
process in the garbage collector (tests/kit/test_orm_large_sessions.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from sqlalchemy import ForeignKey, MetaData, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from kafka_idem import App, Context

TOPIC = "subs.activate"


class Base(DeclarativeBase):
    metadata = MetaData(schema="subs")


class Customer(Base):
    __tablename__ = "customers"
    id: Mapped[int] = mapped_column(primary_key=True)
    external_id: Mapped[str] = mapped_column(unique=True)
    subscriptions: Mapped[list[Subscription]] = relationship(back_populates="customer")


class Subscription(Base):
    __tablename__ = "subscriptions"
    id: Mapped[int] = mapped_column(primary_key=True)
    sub_ref: Mapped[str] = mapped_column(unique=True)
    customer_id: Mapped[int] = mapped_column(ForeignKey("subs.customers.id"))
    seats: Mapped[int]
    version: Mapped[int] = mapped_column(nullable=False)
    customer: Mapped[Customer] = relationship(back_populates="subscriptions")
    __mapper_args__ = {"version_id_col": version}


class Activate(BaseModel):
    sub_ref: str
    customer: str
    seats: int


app = App("subs")
app.sqlalchemy(metadata=Base.metadata)


@app.handler(topic=TOPIC, model=Activate, key="activate:{sub_ref}", hash_fields=("seats",),
             batch=True)
def activate(msg: Activate, ctx: Context) -> dict[str, Any]:
    session = ctx.session
    customer = session.scalar(select(Customer).where(Customer.external_id == msg.customer))
    assert customer is not None
    customer.subscriptions.append(Subscription(sub_ref=msg.sub_ref, seats=msg.seats))
    session.flush()
    return {"customer": customer.id, "subscriptions": len(customer.subscriptions)}


def many_subscriptions(conn: Any) -> None:
    """Seven customers with about 285 subscriptions each (the harness's ``setup``)."""
    conn.execute("INSERT INTO subs.customers (external_id) "
                 "SELECT 'c-' || g FROM generate_series(0, 6) g")
    conn.execute("INSERT INTO subs.subscriptions (sub_ref, customer_id, seats, version) "
                 "SELECT 'pre-' || g, 1 + g % 7, 1, 1 FROM generate_series(1, 2000) g")
