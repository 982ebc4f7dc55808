"""The pytest plugin of kafka_idem's test kit (registered as the ``pytest11`` entry
point ``kafka_idem``, so installing kafka_idem enables it).

    def test_charge_is_idempotent(kafka_idem_harness):
        harness = kafka_idem_harness("myapp.consumer:app")   # or the App itself
        harness.check("payments.charge-requested", {...})

``kafka_idem_harness(app, **options)`` gives a :class:`~kafka_idem.testing.Harness`
for ``app`` (``options`` as the harness takes them: ``tables``, ``ignore``,
``remotes``, ``setup``, ``concurrency``). The database server comes from
``--kafka-idem-database-url``, else ``KAFKA_IDEM_DATABASE_URL``, else kafka_idem's
default (``postgresql://kafka_idem@127.0.0.1:55432/kafka_idem``). When none answers,
the tests that ask for a harness are skipped, saying why; with the ini option
``kafka_idem_require_database = true`` (or ``--kafka-idem-require-database``) they
fail instead, for a suite where the database must be there.

Making a harness costs a second or two (two databases, the migrations), so the
plugin keeps the last few it made for the session: asked again for the same app
(the same object, with the same migrations) and options, it gives the same harness
back, reset to a clean database with the app's current handlers and the remotes
given now. They are dropped at the end of the session.
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import pytest

KEEP = 4  # harnesses kept for the session (each holds two databases)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kafka_idem", "kafka_idem test kit")
    group.addoption("--kafka-idem-database-url", dest="kafka_idem_database_url", default=None,
                    help="PostgreSQL server the kafka_idem_harness fixture makes its "
                         "throwaway databases on (default: $KAFKA_IDEM_DATABASE_URL)")
    group.addoption("--kafka-idem-require-database", dest="kafka_idem_require_database",
                    action="store_true", default=False,
                    help="fail, rather than skip, the tests that need a kafka_idem harness "
                         "when no database answers")
    parser.addini("kafka_idem_require_database", type="bool", default=False,
                  help="fail, rather than skip, kafka_idem harness tests without a database")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """A section listing what the session's ``Harness.check`` calls left out of their
    comparisons (each column, stored result key and event field, with why), so that a
    value no scenario compares is seen even when every check passed."""
    report = sys.modules.get("kafka_idem.testing.report")
    left: dict[tuple[str, tuple[str, ...]], list[str]] = getattr(report, "LEFT_OUT", {})
    if not left:
        return
    terminalreporter.section("kafka_idem: values Harness.check LEFT OUT (not compared)",
                             yellow=True)
    for (what, lines), tests in left.items():
        shown = ", ".join(tests[:3]) + (f" and {len(tests) - 3} more" if len(tests) > 3 else "")
        terminalreporter.write_line(f"{what}, checked by {shown}:")
        for line in lines:
            terminalreporter.write_line(f"    - {line}")


def _url(config: pytest.Config) -> str:
    from kafka_idem.settings import DEFAULT_DATABASE_URL

    url = config.getoption("kafka_idem_database_url")
    return str(url or os.environ.get("KAFKA_IDEM_DATABASE_URL") or DEFAULT_DATABASE_URL)


def reachable(config: pytest.Config) -> str:
    """The database URL, once a connection to it worked; else the test is skipped (or,
    when the suite requires the database, failed) with the reason."""
    import psycopg

    from kafka_idem.observe.redact import redact, secrets_in

    url = _url(config)
    try:
        psycopg.connect(url, connect_timeout=5).close()
    except psycopg.Error as exc:
        shown = redact(url, secrets_in(url))
        why = redact(" ".join(str(exc).split()), secrets_in(url))
        reason = (f"kafka_idem test kit: no PostgreSQL answers at {shown} ({why}); set "
                  "KAFKA_IDEM_DATABASE_URL or pass --kafka-idem-database-url")
        if (config.getoption("kafka_idem_require_database")
                or config.getini("kafka_idem_require_database")):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return url


@pytest.fixture(scope="session")
def kafka_idem_database_url(pytestconfig: pytest.Config) -> str:
    """The PostgreSQL server of the kit's throwaway databases (checked once: a test
    that needs it is skipped, or failed, when it does not answer)."""
    return reachable(pytestconfig)


def _frozen(value: Any) -> Any:
    """A key for an option's value: equal for equal data, identity for objects."""
    if isinstance(value, str | int | float | bool | type(None)):
        return value
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple | set | frozenset):
        items = [_frozen(v) for v in value]
        return tuple(sorted(items, key=repr) if isinstance(value, set | frozenset) else items)
    return ("id", id(value))


class _Harnesses:
    """The harnesses of a session, the least recently used dropped beyond ``KEEP``."""

    def __init__(self) -> None:
        self.kept: OrderedDict[Any, Any] = OrderedDict()

    def get(self, url: str, app: Any, options: dict[str, Any]) -> Any:
        from kafka_idem.testing.harness import Harness, load_app

        app = load_app(app) if isinstance(app, str) else app
        remotes = options.pop("remotes", None)
        key = (url, id(app), tuple(id(m) for m in app.migrations), _frozen(options))
        harness = self.kept.pop(key, None)
        if harness is None:
            harness = Harness(app, database_url=url, remotes=remotes, **options)
        else:
            harness.rebind(remotes=remotes)
        self.kept[key] = harness
        while len(self.kept) > KEEP:
            self.kept.popitem(last=False)[1].close()
        return harness

    def close(self) -> None:
        while self.kept:
            self.kept.popitem()[1].close()


@pytest.fixture(scope="session")
def _kafka_idem_harnesses() -> Iterator[_Harnesses]:
    kept = _Harnesses()
    yield kept
    kept.close()


@pytest.fixture
def kafka_idem_harness(kafka_idem_database_url: str,
                       _kafka_idem_harnesses: _Harnesses) -> Callable[..., Any]:
    """``kafka_idem_harness(app, **options)``: a :class:`~kafka_idem.testing.Harness`
    for ``app`` (an ``App`` or ``"module:attribute"``) on a clean database."""

    def harness(app: Any, **options: Any) -> Any:
        return _kafka_idem_harnesses.get(kafka_idem_database_url, app, options)

    return harness
