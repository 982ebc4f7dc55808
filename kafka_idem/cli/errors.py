"""How ``kafka-idem`` fails: one line ``error: ...`` on stderr and a documented exit
code; the traceback only with ``kafka-idem --debug``.

Every text the CLI prints about a failure goes through :func:`show`: secrets are
masked (:func:`kafka_idem.observe.redact.redact`, with the passwords the command was
given) and the text is put on one line with control characters escaped.

Exit codes (:data:`EXIT_CODES`; also in the ``kafka-idem`` docstring and the
docs/reference/cli-conventions.md): 0 ok; 1 a check failed, nothing matched where something
was required, or refused; 2 usage or configuration error; 3 operational error (the
database or Kafka unreachable or refusing, a port in use); 4 internal error.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import click
import psycopg
from confluent_kafka import KafkaException

from kafka_idem.admin.operations import Refused
from kafka_idem.errors import (
    BrokerError,
    ConfigError,
    FrameworkError,
    StoreError,
    StoreUnavailable,
)
from kafka_idem.observe.redact import option_secrets, redact, secrets_in
from kafka_idem.observe.text import one_line

OK = 0
CHECK_FAILED = 1  # a check failed, nothing matched where something was required, refused
USAGE = 2  # usage or configuration error: the command line or a setting is wrong
OPERATIONAL = 3  # a service failed: database or broker unreachable or refusing, port in use
INTERNAL = 4  # a bug in kafka_idem (or in the app's code): run with --debug, report it

EXIT_CODES = {
    OK: "ok",
    CHECK_FAILED: "a check failed, nothing matched where something was required, or refused",
    USAGE: "usage or configuration error (the message names the option or setting)",
    OPERATIONAL: "operational error: the database or Kafka unreachable or refusing, a port "
    "in use",
    INTERNAL: "internal error (a bug): run again with --debug for the traceback",
}

# Where secrets may come from before (or without) valid settings.
_SECRET_VARIABLES = ("KAFKA_IDEM_DATABASE_URL", "KAFKA_IDEM_SCHEMA_REGISTRY_URL",
                     "KAFKA_IDEM_KAFKA")


class ServiceError(Exception):
    """An operational failure the CLI reports in one line with exit code 3."""


@dataclass
class _State:
    debug: bool = False
    secrets: list[str] = field(default_factory=list)


STATE = _State()


def start(*, debug: bool, database_url: str | None) -> None:
    """Called first by the ``kafka-idem`` group: remember ``--debug`` and every secret
    the command was given, before anything can fail with one in its text."""
    STATE.debug = debug
    STATE.secrets = []
    add_secrets(secrets_in(database_url) if database_url else [])
    add_secrets(environment_secrets(os.environ))


def environment_secrets(env: Mapping[str, str]) -> list[str]:
    found: list[str] = []
    for name in _SECRET_VARIABLES:
        text = env.get(name)
        if not text:
            continue
        found += secrets_in(text)
        if name == "KAFKA_IDEM_KAFKA":
            try:
                options = json.loads(text)
            except ValueError:
                continue
            if isinstance(options, dict):
                found += option_secrets(options)
    return found


def add_secrets(values: Iterable[str]) -> None:
    for value in values:
        if value and value not in STATE.secrets:
            STATE.secrets.append(value)


def show(text: str) -> str:
    """``text`` as the CLI may print it: secrets masked, on one line."""
    return one_line(redact(text, STATE.secrets))


def warn(text: str) -> None:
    click.echo(show(text), err=True)


@contextmanager
def as_typed(options: Mapping[str, str | None],
             hints: Mapping[str, str] | None = None) -> Iterator[None]:
    """Say a :class:`ConfigError` about a parameter a command filled from the command
    line in the user's words: ``options`` maps the parameter (the error's ``setting``,
    e.g. ``dlq_topic``) to the option as it was typed (``--topic orders``), which then
    leads the message, instead of a ``(setting=dlq_topic)`` that names nothing the
    user knows; ``None``: the message says enough (only the parameter's name goes).
    ``hints`` adds a parenthesis after the message, by parameter."""
    try:
        yield
    except ConfigError as exc:
        setting = exc.context.get("setting")
        if not isinstance(setting, str) or setting not in options:
            raise
        typed = options[setting]
        hint = (hints or {}).get(setting)
        text = (f"{typed}: {exc.message}" if typed else exc.message) + (
            f" ({hint})" if hint else "")
        rest = {k: v for k, v in exc.context.items() if k != "setting"}
        raise ConfigError(text, **rest) from exc


def describe(exc: BaseException) -> tuple[int, str]:
    """The exit code and the one-line message for an exception that ended a command."""
    if isinstance(exc, Refused):
        return CHECK_FAILED, str(exc)
    if isinstance(exc, ConfigError):
        return USAGE, str(exc)
    if isinstance(exc, StoreUnavailable):
        return OPERATIONAL, f"database unreachable: {_db_cause(exc)}{DATABASE_HINT}"
    if isinstance(exc, StoreError):
        return OPERATIONAL, f"database error: {_db_cause(exc)}"
    if isinstance(exc, psycopg.OperationalError):
        return OPERATIONAL, f"database unreachable: {exc}{DATABASE_HINT}"
    if isinstance(exc, psycopg.Error):
        return OPERATIONAL, f"database error: {exc}"
    if isinstance(exc, KafkaException):
        return OPERATIONAL, f"Kafka: {exc}{broker_hint(str(exc))}"
    if isinstance(exc, BrokerError):
        return OPERATIONAL, f"{exc}{broker_hint(str(exc))}"
    if isinstance(exc, FrameworkError | ServiceError):
        return OPERATIONAL, str(exc)
    if isinstance(exc, OSError):
        return OPERATIONAL, str(exc)
    return INTERNAL, (f"internal error: {type(exc).__name__}: {exc} "
                      "(run again with kafka-idem --debug for the traceback)")


DATABASE_HINT = " (the database is KAFKA_IDEM_DATABASE_URL, or --database-url)"
_UNREACHABLE = ("transport failure", "timed out", "all brokers", "connection refused",
                "did not answer", "_transport", "_all_brokers_down")


def broker_hint(text: str) -> str:
    """Where the command looked for Kafka, when the error says it found nobody there."""
    if not any(word in text.lower() for word in _UNREACHABLE):
        return ""
    return " (the brokers are KAFKA_IDEM_BOOTSTRAP_SERVERS, or --bootstrap-servers)"


def _db_cause(exc: StoreError) -> str:
    """The database's own words (the wrapper's summary says the same, longer)."""
    cause = exc.__cause__
    if isinstance(cause, psycopg.Error):
        context = ", ".join(f"{k}={v}" for k, v in sorted(exc.context.items()))
        return f"{cause}" + (f" ({context})" if context else "")
    return str(exc)


def fail(exc: BaseException) -> int:
    """Print ``exc`` as one ``error:`` line (and its traceback with --debug); return
    the exit code."""
    code, message = describe(exc)
    if STATE.debug:
        text = "".join(traceback.format_exception(exc))
        sys.stderr.write(redact(text, STATE.secrets))
    # an admin action refused is the operator's answer, not a failure
    click.echo(f"{'refused' if isinstance(exc, Refused) else 'error'}: {show(message)}",
               err=True)
    return code


def usage(exc: click.ClickException) -> int:
    """A click usage error as one line ``error: ...``, like every other failure (a
    missing or unknown argument also names the command's ``--help``); secrets masked."""
    text = exc.format_message()
    ctx = getattr(exc, "ctx", None)
    if ctx is not None and (type(exc) is not click.BadParameter):
        text += f" (see '{ctx.command_path} --help')"
    sys.stderr.write(f"error: {one_line(redact(text, STATE.secrets))}\n")
    return exc.exit_code


__all__ = ["CHECK_FAILED", "EXIT_CODES", "INTERNAL", "OK", "OPERATIONAL", "STATE", "USAGE",
           "ServiceError", "add_secrets", "as_typed", "describe", "fail", "show", "start",
           "usage", "warn"]
