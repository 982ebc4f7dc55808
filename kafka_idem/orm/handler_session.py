"""The session classes of ``ctx.session``: SQLAlchemy's, minus ending the transaction.

``commit()``, ``rollback()`` and ``begin()`` raise what ``ctx.tx.commit()`` raises inside a
handler (a ``ProgrammingError`` with no SQLSTATE: a code defect, the attempt fails and
nothing of it commits): the handler's writes commit with its idempotency record, once it
returns. ``begin_nested()`` (a savepoint) works as everywhere.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NoReturn

from sqlalchemy.orm import Session, SessionTransaction

from kafka_idem.orm.engines import refused

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession


class HandlerSession(Session):
    """A sync handler's ``ctx.session`` (and an ``AsyncSession``'s sync session)."""

    def commit(self) -> NoReturn:
        raise refused("session.commit()")

    def rollback(self) -> NoReturn:
        raise refused("session.rollback()")

    def begin(self, nested: bool = False) -> SessionTransaction:
        if not nested:
            raise refused("session.begin()")
        return super().begin(nested=True)


@functools.cache
def async_session_class() -> type[AsyncSession]:
    """An ``async def`` handler's ``ctx.session`` class (made at the first use: SQLAlchemy's
    asyncio extension needs greenlet, which a sync app never imports)."""
    from sqlalchemy.ext.asyncio import AsyncSession

    class HandlerAsyncSession(AsyncSession):
        """An ``async def`` handler's ``ctx.session``."""

        async def commit(self) -> NoReturn:
            raise refused("session.commit()")

        async def rollback(self) -> NoReturn:
            raise refused("session.rollback()")

        def begin(self) -> Any:
            raise refused("session.begin()")

    return HandlerAsyncSession
