"""SQLAlchemy for handlers: ``ctx.session``, an ORM session on the handler's own
transaction (the ``sqlalchemy`` extra: ``pip install 'kafka-idem[sqlalchemy]'``).

Configured once per app with ``app.sqlalchemy(metadata=..., ...)``
(:class:`~kafka_idem.orm.sessions.Sessions`); the engines lend the framework's
connection instead of pooling their own (:mod:`kafka_idem.orm.engines`); the sessions
refuse to end the transaction (:mod:`kafka_idem.orm.handler_session`). Importing this
package does not import SQLAlchemy.
"""
