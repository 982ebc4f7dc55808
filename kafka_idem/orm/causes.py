"""SQLAlchemy's database errors, judged as their psycopg causes (no SQLAlchemy import).

SQLAlchemy wraps every error the driver raises (``sqlalchemy.exc.IntegrityError``
around ``psycopg.errors.UniqueViolation``, its text quoting the statement and its
parameters). A handler's ORM error is judged and recorded as its psycopg cause, as the
same error through ``ctx.tx`` would be: data errors permanent, deadlocks and
serialization failures retried without charge, a lost connection the framework's; the
record keeps the cause's class and message, never the parameters.
"""

from __future__ import annotations

import psycopg

from kafka_idem.store.attempt import unmasked


def orm_cause(exc: BaseException) -> BaseException | None:
    """The psycopg error behind ``exc`` when ``exc`` is SQLAlchemy's wrapper of one (the
    framework raises it ``from`` the wrapper, which an ``errors=`` mapping may name)."""
    if not type(exc).__module__.startswith("sqlalchemy"):
        return None
    orig = getattr(exc, "orig", None)
    if not isinstance(orig, psycopg.Error):
        return None
    return unmasked(orig)
