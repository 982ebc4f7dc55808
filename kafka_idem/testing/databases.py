"""The test kit's throwaway databases, on the PostgreSQL server a URL names.

A harness makes two (``kafka_idem_kit_<pid>_<id>`` for :meth:`Harness.deliver` and
``..._check`` for the scenario matrix, a copy of the first made right after the
migrations) and drops both when it closes. The URL's own database is only used to
issue ``CREATE DATABASE`` / ``DROP DATABASE``; nothing is written into it. Between
two scenarios a database is reset in place (:mod:`kafka_idem.testing.reset`), which
costs milliseconds where making a database costs a tenth of a second or more.
"""

from __future__ import annotations

import contextlib
import os
import uuid

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from kafka_idem.errors import ConfigError, StoreError
from kafka_idem.observe.redact import redact, secrets_in
from kafka_idem.store import translate_errors

PREFIX = "kafka_idem_kit_"


class Databases:
    """The databases of one harness (the name says which process made it, should a
    killed test run leave one behind)."""

    def __init__(self, server_dsn: str) -> None:
        self.server_dsn = server_dsn
        self.base = f"{PREFIX}{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self._made: list[str] = []

    def dsn(self, name: str) -> str:
        return make_conninfo(self.server_dsn, dbname=name)

    def create(self, suffix: str = "", *, template: str | None = None) -> str:
        """A new database (a copy of ``template``, when given, which nobody may be
        connected to): its URL."""
        name = self.base + suffix
        query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template is not None:
            query = sql.SQL("{} TEMPLATE {}").format(
                query, sql.Identifier(self.name_of(template)))
        with translate_errors(), self._admin() as conn:
            try:
                conn.execute(query)
            except psycopg.errors.InsufficientPrivilege as exc:
                where = redact(self.server_dsn, secrets_in(self.server_dsn))
                raise ConfigError(
                    f"the test kit makes throwaway databases on the server of {where} and "
                    f"may not: {str(exc).strip()} (give the role CREATEDB, or point "
                    "database_url at a server where it has it)", setting="database_url",
                ) from None
        self._made.append(name)
        return self.dsn(name)

    @staticmethod
    def name_of(dsn: str) -> str:
        name = psycopg.conninfo.conninfo_to_dict(dsn).get("dbname")
        assert isinstance(name, str)
        return name

    def _admin(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self.server_dsn, autocommit=True, connect_timeout=10)

    def close(self) -> None:
        """Drop every database made (their connections are ended first)."""
        names, self._made = self._made, []
        for name in reversed(names):
            with contextlib.suppress(StoreError), translate_errors(), self._admin() as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(name)))
