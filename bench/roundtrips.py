"""Counting PostgreSQL round trips made through psycopg 3, client side.

A *round trip* is one time the client waits for the server's answer:

* outside pipeline mode, every ``generators.execute`` call (send, then wait for
  the results): statements run by cursors and ``Connection.execute``, the extra
  Parse of a statement psycopg decides to prepare, and the internal commands
  ``BEGIN`` / ``SAVEPOINT`` / ``RELEASE`` / ``COMMIT`` / ``ROLLBACK`` that
  ``conn.transaction()`` and ``conn.commit()`` send via ``_exec_command``;
* in pipeline mode, every wait for queued results (``BasePipeline._fetch_gen``
  with results pending: a ``sync()``, the end of the pipeline block, or a cursor
  fetching its rows). Statements queued in between travel together and add no
  round trip of their own.

Separately it counts statements executed (pipelined or not) and the internal
commands by kind, so the split can be shown. Wrapping these few functions
counts without touching the code under measurement; ``pg_stat_statements`` is
not needed, and other clients of the same database don't pollute the counts.

psycopg's internals are not a public API: :func:`install` checks the hooks it
needs exist and refuses (raises) if a psycopg upgrade moved them.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import psycopg._connection_base as connection_base
import psycopg._cursor_base as cursor_base
import psycopg._pipeline_base as pipeline_base
import psycopg.generators as generators

_lock = threading.Lock()
_counts: Counter[str] = Counter()
_installed = False

CONTROL = ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE", "ROLLBACK TO")


def _bump(name: str) -> None:
    with _lock:
        _counts[name] += 1


def _command_kind(command: Any) -> str:
    if isinstance(command, str):
        command = command.encode()
    if isinstance(command, bytes):
        words = command.split(None, 2)
        if not words:
            return "other"
        first = words[0].upper().decode("ascii", "replace")
        if first == "ROLLBACK" and len(words) > 1 and words[1].upper() == b"TO":
            return "ROLLBACK TO"
        return first if first in CONTROL else "other"
    return "other"


def install() -> None:
    """Wrap psycopg's waits for results, statement sends and internal commands (idempotent)."""
    global _installed
    if _installed:
        return
    if vars(cursor_base).get("execute") is not generators.execute or not hasattr(
        pipeline_base.BasePipeline, "_fetch_gen"
    ):
        raise RuntimeError("psycopg internals changed: cannot count round trips reliably")
    original_execute: Any = generators.execute
    original_command = connection_base.BaseConnection._exec_command
    original_statement = cursor_base.BaseCursor._maybe_prepare_gen
    original_fetch = pipeline_base.BasePipeline._fetch_gen

    def execute(pgconn: Any) -> Generator[Any, Any, Any]:
        _bump("round_trips")
        return (yield from original_execute(pgconn))

    def exec_command(
        self: Any, command: Any, result_format: Any = psycopg.pq.Format.TEXT
    ) -> Generator[Any, Any, Any]:
        _bump(f"command:{_command_kind(command)}")
        if self._pipeline:
            _bump("pipelined")
        return (yield from original_command(self, command, result_format))

    def statement(self: Any, *args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        _bump("statements")
        if self._conn._pipeline:
            _bump("pipelined")
        return (yield from original_statement(self, *args, **kwargs))

    def fetch(self: Any, *, flush: bool) -> Generator[Any, Any, Any]:
        if self.result_queue:
            _bump("round_trips")
            _bump("pipeline_waits")
        return (yield from original_fetch(self, flush=flush))

    generators.execute = execute
    # _cursor_base binds it by name (from .generators import execute).
    setattr(cursor_base, "execute", execute)  # noqa: B010
    connection_base.BaseConnection._exec_command = exec_command  # type: ignore[method-assign]
    cursor_base.BaseCursor._maybe_prepare_gen = statement  # type: ignore[method-assign]
    pipeline_base.BasePipeline._fetch_gen = fetch  # type: ignore[method-assign]
    _installed = True


def snapshot() -> Counter[str]:
    with _lock:
        return Counter(_counts)


@contextmanager
def counting() -> Iterator[Counter[str]]:
    """Counts made inside the block, filled in when it ends."""
    install()
    before = snapshot()
    result: Counter[str] = Counter()
    try:
        yield result
    finally:
        after = snapshot()
        after.subtract(before)
        result.update({k: v for k, v in after.items() if v})


def summary(counts: Counter[str]) -> dict[str, int]:
    """Round trips, statements, pipelined sends and transaction control by kind."""
    commands = {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("command:")}
    return {
        "round_trips": counts.get("round_trips", 0),
        "pipeline_waits": counts.get("pipeline_waits", 0),
        "statements": counts.get("statements", 0),
        "pipelined": counts.get("pipelined", 0),
        "begin": commands.get("BEGIN", 0),
        "commit": commands.get("COMMIT", 0),
        "rollback": commands.get("ROLLBACK", 0),
        "savepoint": commands.get("SAVEPOINT", 0),
        "release": commands.get("RELEASE", 0),
        "rollback_to": commands.get("ROLLBACK TO", 0),
        "other_commands": commands.get("other", 0),
    }
