"""A small ORM app for the ``ctx.session`` tests: accounts and their entries
(Account 1-n Entry, the account versioned), a JSON deposit per message, written with
``ctx.session`` only.

Each deposit adds an entry (its ``order_id`` is a natural key: unique) and its amount to
the account's balance. One handler per mode:

* ``deposit``: sync, for ``local`` (``batch=False``), ``batch`` (the batch path) and
  ``leased``;
* ``deposit_async``: ``async def`` (leased, an ``AsyncSession``).

``kafka-idem run tests.apps.orm_ledger:app`` reads ``ORM_TOPIC`` and ``ORM_MODE``
(``local``, ``batch``, ``leased``, ``async``); ``CRASH_BEFORE_OFFSET_COMMIT=1``
SIGKILLs the member right after a database commit, before the Kafka offset commit
(as ``tests.apps.variants`` does).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, Field
from sqlalchemy import ForeignKey, Integer, MetaData, Numeric, String, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from kafka_idem import App, Context, RetryPolicy
from kafka_idem.app import ErrorKind
from kafka_idem.consume.runner import Runner

TOPIC = os.environ.get("ORM_TOPIC", "orm.deposits")
MODE = os.environ.get("ORM_MODE", "local")
MODES = ("local", "batch", "leased", "async")


class Base(DeclarativeBase):
    # Named: the test user's "$user" schema (kafka_idem) comes first on the search path.
    metadata = MetaData(schema="public")


class Account(Base):
    __tablename__ = "orm_account"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    balance: Mapped[Decimal] = mapped_column(Numeric(12, 2), nullable=False)
    version: Mapped[int] = mapped_column(Integer, nullable=False)
    entries: Mapped[list[Entry]] = relationship(back_populates="account",
                                                order_by="Entry.id")

    __mapper_args__ = {"version_id_col": version}


class Entry(Base):
    __tablename__ = "orm_entry"

    id: Mapped[int] = mapped_column(primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("public.orm_account.id"), nullable=False)
    order_id: Mapped[str] = mapped_column(String(40), unique=True, nullable=False)
    amount: Mapped[Decimal] = mapped_column(Numeric(12, 2), nullable=False)
    idempotency_key: Mapped[str] = mapped_column(String(200), nullable=False)
    account: Mapped[Account] = relationship(back_populates="entries")


class Deposit(BaseModel):
    account: str = Field(min_length=1)
    order_id: str = Field(min_length=1)
    amount: Decimal


KEY = "{account}:deposit:{order_id}"


def _ensure_account(account: str) -> Any:
    """The account's row, made if missing (concurrent first deposits must not collide)."""
    return insert(Account).values(id=account, balance=0, version=1).on_conflict_do_nothing()


def deposit(msg: Deposit, ctx: Context) -> dict[str, Any]:
    s = ctx.session
    s.execute(_ensure_account(msg.account))
    acct = s.get(Account, msg.account, with_for_update=True)
    assert acct is not None
    acct.entries.append(Entry(order_id=msg.order_id, amount=msg.amount,
                              idempotency_key=ctx.idempotency_key))
    acct.balance += msg.amount
    return {"order_id": msg.order_id, "entries": len(acct.entries)}


async def deposit_async(msg: Deposit, ctx: Any) -> dict[str, Any]:
    s = ctx.session
    await s.execute(_ensure_account(msg.account))
    acct = await s.get(Account, msg.account, with_for_update=True)
    assert acct is not None
    s.add(Entry(account=acct, order_id=msg.order_id, amount=msg.amount,
                idempotency_key=ctx.idempotency_key))
    acct.balance += msg.amount
    n = (await s.execute(select(Entry.id).where(Entry.account_id == msg.account))).all()
    return {"order_id": msg.order_id, "entries": len(n)}


def build_app(
    *, topic: str = TOPIC, mode: str = MODE, fn: Callable[..., Any] | None = None,
    retry: RetryPolicy | None = None,
    errors: dict[type[BaseException], ErrorKind] | None = None, **settings: Any,
) -> App:
    """The ledger app on ``topic`` in ``mode`` (one of :data:`MODES`); ``fn`` replaces
    the handler (sync or ``async def`` as ``mode`` wants)."""
    assert mode in MODES, mode
    application = App("orm_ledger", **settings)
    application.sqlalchemy(metadata=Base.metadata)
    handler = fn or (deposit_async if mode == "async" else deposit)
    application.handler(
        topic=topic, model=Deposit, format="json", key=KEY, hash_fields=("amount",),
        mode="local" if mode in ("local", "batch") else "leased",
        batch=mode == "batch", name="deposit", retry=retry, errors=errors,
    )(handler)
    return application


def encode(account: str, order_id: str, amount: str | Decimal) -> bytes:
    return Deposit(account=account, order_id=order_id,
                   amount=Decimal(amount)).model_dump_json().encode()


if os.environ.get("CRASH_BEFORE_OFFSET_COMMIT") == "1":
    _original = Runner._commit_pending

    def _crash(self: Runner, *, sync: bool = False) -> None:
        if any(st.to_commit is not None for st in self.parts.values()):
            os.kill(os.getpid(), signal.SIGKILL)
        _original(self, sync=sync)

    Runner._commit_pending = _crash  # type: ignore[method-assign]


app = build_app()
