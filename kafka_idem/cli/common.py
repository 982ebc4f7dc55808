"""What the ``kafka-idem`` commands share: loading ``MODULE:APP`` (:func:`load_app`, from
the current directory: :func:`importable_cwd`), the group's context object (:class:`Ctx`,
``ctx.obj`` of every command), a connection to a migrated store
(:func:`store_connection`), the options several commands take (``--namespace``, a
duration, an ISO 8601 time) and those of the ``dlq`` commands (the DLQ, the selection,
``--app``).

The command modules import this module, :mod:`~kafka_idem.cli.errors` and the output
helpers (:mod:`~kafka_idem.cli.table`, :mod:`kafka_idem.observe.text`), never one
another: :mod:`~kafka_idem.cli.commands` registers them all on the group.
"""

from __future__ import annotations

import datetime as dt
import difflib
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import click
import psycopg

from kafka_idem import replay
from kafka_idem.admin import operations as admin
from kafka_idem.app import App
from kafka_idem.cli import errors as cli_errors
from kafka_idem.deadletters.dead_letter import ERROR_KINDS
from kafka_idem.errors import ConfigError, FrameworkError
from kafka_idem.observe import logs
from kafka_idem.observe.text import plain, to_json
from kafka_idem.settings import Settings, load_settings
from kafka_idem.store import Conn, Store, connect

F = TypeVar("F", bound=Callable[..., Any])

HINT = "'MODULE:APP'"


def importable_cwd() -> None:
    """Make the current directory importable, as ``python -m`` does, so that
    ``kafka-idem run MODULE:APP`` finds the user's module where it is run."""
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")


def load_app(spec: str, *, param_hint: str = HINT) -> App:
    """Import ``module:attribute`` and return the :class:`App` it names (``param_hint``:
    what the user typed it as, in the error of a bad one: an option's ``'--app'``)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise click.BadParameter(f"{spec!r} is not MODULE:APP (e.g. consumers.payments:app)",
                                 param_hint=param_hint)
    importable_cwd()
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = ""
        if module_name.endswith(".py"):  # a file name typed for a module name
            hint = (f" (MODULE is a module name, as for python -m: "
                    f"{module_name[:-3].replace(os.sep, '.')}:{attr})")
        raise click.BadParameter(f"cannot import {module_name!r}: {exc}{hint}",
                                 param_hint=param_hint) from exc
    except ConfigError:
        raise
    except Exception as exc:
        raise click.BadParameter(f"importing {module_name!r} failed{_where(exc)}: "
                                 f"{type(exc).__name__}: {exc}", param_hint=param_hint) from exc
    app = getattr(module, attr, None)
    if isinstance(app, App):
        # the app's loggers show INFO, even when it is installed like a library
        logs.LIBRARIES.own_modules([module_name, *(getattr(h.fn, "__module__", "")
                                                   for h in app.handlers.values())])
        return app
    apps = sorted(name for name, value in vars(module).items() if isinstance(value, App))
    found = (f"its App objects: {', '.join(f'{module_name}:{a}' for a in apps)}" if apps
             else "it has no App object")
    if not hasattr(module, attr):
        raise click.BadParameter(f"module {module_name!r} has no attribute {attr!r} ({found})",
                                 param_hint=param_hint)
    kind = type(app).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    raise click.BadParameter(f"{spec!r} is {article} {kind}, not a kafka_idem App "
                             f"({found})", param_hint=param_hint)


def _where(exc: BaseException) -> str:
    """' at FILE:LINE' of the last frame outside kafka_idem: the user's line that raised."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f"{os.sep}kafka_idem{os.sep}" not in f.filename and "<frozen" not in f.filename]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


# --- the group's own options, before or after the command ---------------------------
class GlobalOptions(click.Group):
    """The ``kafka-idem`` group: its own options (``--database-url``, ``--debug``...)
    are taken before the command, as click parses them, and after it too
    (``kafka-idem status --database-url URL``), unless the command has an option of
    that name (its own then). An option the command does not know that is, or is
    close to, one of the group's says where it goes."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, hoisted(self, ctx, args))

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.NoSuchOption as exc:
            said = _belongs_before(self, exc) if exc.ctx and exc.ctx.command is not self else None
            if said is None:
                raise
            raise click.NoSuchOption(exc.option_name, said, ctx=exc.ctx) from None


def option_table(params: Sequence[click.Parameter]) -> dict[str, bool]:
    """The names of the options among ``params``, each with whether it takes a value."""
    table: dict[str, bool] = {}
    for p in params:
        if isinstance(p, click.Option):
            for name in (*p.opts, *p.secondary_opts):
                table[name] = not (p.is_flag or p.count)
    return table


def _after(table: dict[str, bool], args: Sequence[str], i: int) -> int:
    """The index after the option ``args[i]`` (after its value when it takes one)."""
    name, eq, _ = args[i].partition("=")
    return i + 2 if table.get(name) and not eq else i + 1


def _option(token: str) -> bool:
    return token.startswith("-") and token not in ("-", "--")


def hoisted(group: click.Group, ctx: click.Context, args: Sequence[str]) -> list[str]:
    """``args`` with ``group``'s own options given after the command (and its
    sub-commands) moved before it; those of the same name as an option of the
    command path, and everything after ``--``, stay where they are."""
    args = list(args)
    own = option_table(group.params)
    i = 0
    while i < len(args) and _option(args[i]):
        i = _after(own, args, i)
    command = group.get_command(ctx, args[i]) if i < len(args) else None
    if command is None:
        return args
    path = option_table(command.get_params(ctx))
    kept, moved = args[:i + 1], list[str]()
    k = i + 1
    while k < len(args):
        token = args[k]
        name = token.partition("=")[0]
        if token == "--":
            kept += args[k:]
            break
        table = path if name in path or name not in own else own
        end = _after(table, args, k) if _option(token) else k + 1
        (moved if table is own else kept).extend(args[k:end])
        if not _option(token) and isinstance(command, click.Group):
            sub = command.get_command(ctx, token)
            if sub is not None:
                command = sub
                path.update(option_table(sub.get_params(ctx)))
        k = end
    return args[:i] + moved + kept[i:]


def _belongs_before(group: click.Group, exc: click.NoSuchOption) -> str | None:
    """``exc``'s message saying that its option, or the one of ``group``'s it is close
    to, is the group's own and goes before the command; ``None``: it is close to none."""
    own = [n for n in option_table(group.params) if n.startswith("--")]
    near = [exc.option_name] if exc.option_name in own else difflib.get_close_matches(
        exc.option_name, own, n=1)
    if not near:
        return None
    prog = exc.ctx.find_root().info_name if exc.ctx is not None else "kafka-idem"
    return (f"No such option: {exc.option_name}. {near[0]} is an option of {prog} "
            f"itself: it goes before the command ({prog} {near[0]} ... COMMAND)")


class Ctx:
    """``ctx.obj`` of every command: the group's options, the settings they give."""

    def __init__(self, overrides: dict[str, Any]) -> None:
        self.overrides = overrides

    def settings(self, app: App | None = None) -> Settings:
        if app is not None:
            app.configure(**self.overrides)
            s = app.settings
            logs.set_levels(s.logger_levels)  # the app's own log_levels too
        else:
            s = load_settings(**self.overrides)
        cli_errors.add_secrets(s.secret_values())  # an app may set its own database URL
        return s


_PLACED: dict[tuple[str, str, str], bool] = {}  # (dsn, schema, table): distributed?


def store_of(s: Settings) -> Store:
    """The store the settings name (every namespace), with the queries of its placement:
    a store distributed on Citus is asked once per command (a short connection); a store
    half distributed is refused (exit 2), one not reachable left to the command's own
    connection to report."""
    from kafka_idem.store.citus import fit

    store = Store(schema=s.schema_name, table=s.table)
    where = (s.dsn, s.schema_name, s.table)
    if where not in _PLACED:
        try:
            conn = connect(s.dsn)
        except (FrameworkError, psycopg.Error):
            return store
        try:
            _PLACED[where] = fit(conn, store)
        except ConfigError:
            raise  # a store half distributed: refused, naming the table (exit 2)
        except (FrameworkError, psycopg.Error):
            return store  # e.g. no store here yet: the command says so
        finally:
            conn.close()
    elif _PLACED[where]:
        store.distribute()
    return store


def store_connection(s: Settings) -> Conn:
    """A connection to the store, refused with one line naming what to run (exit 2)
    when the store was never created here or lacks migrations (``kafka-idem migrate``),
    instead of a ``relation ... does not exist`` from the first query."""
    from kafka_idem.admin.migrate import require_current

    conn = connect(s.dsn)
    try:
        require_current(conn, s.schema_name)
        conn.rollback()
    except BaseException:
        conn.close()
        raise
    return conn


NAMESPACE_HELP = ("Only records of this namespace (default: every namespace; an app's "
                  "namespace is its `namespace` setting, else its name).")


def duration(text: str, option: str) -> float:
    """``text`` (``30d``, ``10m``...) in seconds; a bad one is a usage error of ``option``."""
    try:
        return admin.parse_duration(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'{option}'") from exc


def iso_time(ctx: click.Context, param: click.Parameter, value: str | None) -> dt.datetime | None:
    """An ISO 8601 date or date-time; without a UTC offset it is taken as UTC."""
    if value is None:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not an ISO 8601 date-time (e.g. 2024-05-01T10:00:00Z)"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def nothing(message: str) -> None:
    """Nothing matched: one ``error:`` line, like every failure, and exit 1."""
    click.echo(plain(f"error: {message}"), err=True)
    click.get_current_context().exit(1)


# --- the dlq commands ---------------------------------------------------------------
def topic_options(fn: F) -> F:
    """``--topic SOURCE`` and ``--dlq TOPIC``: the DLQ a ``dlq`` command reads."""
    fn = click.option("--topic", "source_topic", metavar="SOURCE",
                      help="Source topic; the DLQ is SOURCE + the DLQ suffix (.dlq).")(fn)
    fn = click.option("--dlq", "dlq_topic", metavar="TOPIC", help="The DLQ topic.")(fn)
    return fn


def selection_options(fn: F) -> F:
    """The filters of ``dlq list`` and ``dlq replay`` (read back by :func:`selection`)."""
    options = [
        click.option("--key", help="Only this idempotency key."),
        click.option("--kind", type=click.Choice(ERROR_KINDS), help="Only this error kind."),
        click.option("--error-class", metavar="NAME",
                     help="Only records whose idem.error.class is NAME (e.g. TypeError: "
                     "the code defects a fix addressed)."),
        click.option("--handler", help="Only records of this handler."),
        click.option("--namespace", help="Only records of this namespace (records written "
                     "before namespaces have none: they match)."),
        click.option("--since", metavar="ISO-DATETIME", callback=iso_time,
                     help="Last failure at or after this time (ISO 8601; UTC if no offset)."),
        click.option("--until", metavar="ISO-DATETIME", callback=iso_time,
                     help="Last failure before this time (ISO 8601; UTC if no offset)."),
        click.option("--partition", type=click.IntRange(min=0), help="Only this DLQ partition."),
        click.option("--from-offset", type=click.IntRange(min=0),
                     help="DLQ offsets from this one (inclusive)."),
        click.option("--to-offset", type=click.IntRange(min=0),
                     help="DLQ offsets up to this one (inclusive)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def selection(opts: dict[str, Any]) -> replay.Selection:
    """The records the :func:`selection_options` given select."""
    if (opts["from_offset"] is not None and opts["to_offset"] is not None
            and opts["from_offset"] > opts["to_offset"]):
        raise click.BadParameter("--from-offset must be <= --to-offset")
    return replay.Selection(
        key=opts["key"], kind=opts["kind"], error_class=opts["error_class"],
        handler=opts["handler"],
        namespace=opts["namespace"], since=opts["since"],
        until=opts["until"], partition=opts["partition"], from_offset=opts["from_offset"],
        to_offset=opts["to_offset"],
    )


def dlq_of(s: Settings, dlq_topic: str | None, source_topic: str | None) -> str:
    """The DLQ named by exactly one of the :func:`topic_options`."""
    if bool(dlq_topic) == bool(source_topic):
        raise click.UsageError("give exactly one of --dlq TOPIC or --topic SOURCE")
    return dlq_topic or replay.dlq_topic_for(s, source_topic or "")


def dlq_typed(s: Settings, dlq_topic: str | None, source_topic: str | None,
              **options: str | None) -> AbstractContextManager[None]:
    """:func:`~kafka_idem.cli.errors.as_typed` for the options the user typed, by the
    replay parameter each one filled: the DLQ named by --dlq or --topic, and
    ``options`` (``partition="--partition 3"``...)."""
    if dlq_topic:
        return cli_errors.as_typed({"dlq_topic": f"--dlq {dlq_topic}", **options})
    return cli_errors.as_typed({"dlq_topic": f"--topic {source_topic}", **options}, hints={
        "dlq_topic": f"the DLQ of --topic SOURCE is SOURCE + the dlq_suffix setting "
                     f"{s.dlq_suffix!r}; --dlq TOPIC names a DLQ itself"})


def app_option(app_spec: str | None) -> App | None:
    """The app given with --app, imported."""
    if not app_spec:
        return None
    return load_app(app_spec, param_hint="'--app'")


def typed_option(name: str, value: object | None) -> str | None:
    """``--name value`` as the user typed it, for :func:`dlq_typed` (None: not given)."""
    return None if value is None else f"{name} {value}"


def echo_json(data: Any) -> None:
    """A ``dlq`` command's ``--json`` output (keys sorted)."""
    click.echo(to_json(data, sort_keys=True))
