"""The ``kafka-idem`` command line.

Exit codes: 0 ok; 1 a check failed, nothing matched where something was required,
or an admin action was refused; 2 usage or configuration error (the message names
the option or setting); 3 operational error (the database or Kafka unreachable or
refusing, the metrics port in use...); 4 internal error (a bug). A failure prints
one line ``error: ...`` on stderr, secrets masked; ``kafka-idem --debug COMMAND``
adds the traceback. Stored and user-controlled values (keys, error texts, DLQ
headers) are printed as plain text with control characters escaped, never as markup.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import click

from kafka_idem._version import __version__
from kafka_idem.admin import audit
from kafka_idem.admin.migrate import distribute_store, migrate_app
from kafka_idem.admin.migrate import migrate as run_migrations
from kafka_idem.cli import errors as cli_errors
from kafka_idem.cli.admin import inspect, rerun, status
from kafka_idem.cli.common import Ctx, GlobalOptions, importable_cwd, load_app, store_of
from kafka_idem.cli.console import console
from kafka_idem.cli.dlq import dlq
from kafka_idem.cli.dlq_replay import replay_
from kafka_idem.cli.errors import ServiceError
from kafka_idem.cli.pause import pause, resume
from kafka_idem.cli.purge import purge
from kafka_idem.cli.topics import topics
from kafka_idem.cli.verify import verify
from kafka_idem.errors import ConfigError
from kafka_idem.observe import logs
from kafka_idem.observe.text import plain
from kafka_idem.settings import load_settings, warn_unknown_variables
from kafka_idem.store import connect

log = logging.getLogger(__name__)


@click.group(cls=GlobalOptions, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="kafka-idem",
                      message="%(prog)s %(version)s")
@click.option("--bootstrap-servers", envvar=None, help="Kafka bootstrap servers.")
@click.option("--database-url", envvar=None, help="PostgreSQL URL.")
@click.option("--schema", "schema_name", help="Store schema (default kafka_idem).")
@click.option("--table", help="Idempotency table (default task_idempotency).")
@click.option("--log-format", type=click.Choice(["text", "json"]), default=None,
              help="Log output format (default: the log_format setting, text).")
@click.option("--debug", is_flag=True, help="Print the traceback of an error, not just its "
              "one line.")
@click.pass_context
def cli(ctx: click.Context, /, log_format: str | None, debug: bool, **overrides: Any) -> None:
    """kafka_idem: exactly-once effects for Kafka consumers, backed by PostgreSQL.

    Exit codes: 0 ok; 1 a check failed, nothing matched or refused; 2 usage or
    configuration error; 3 operational error (database or Kafka unreachable or
    refusing, port in use); 4 internal error (run with --debug)."""
    cli_errors.start(debug=debug, database_url=overrides.get("database_url"))
    clean = {k: v for k, v in overrides.items() if v is not None}
    if log_format:
        clean["log_format"] = log_format
    ctx.obj = Ctx(clean)
    try:
        s = load_settings(warn_unknown=False, **clean)
    except ConfigError:  # one line and exit 2 (main), after the misspelt variables
        logs.configure()
        warn_unknown_variables()
        raise
    logs.configure(s.log_format, s.log_level, s.logger_levels)
    warn_unknown_variables()  # once logging is set: said in the chosen format
    if (ctx.invoked_subcommand != "run" and s.log_level != "DEBUG"
            and not any(n.startswith("kafka_idem") for n in s.logger_levels)):
        # The tools print their own results; librdkafka's notices (INFO) are noise there.
        logging.getLogger("kafka_idem.observe.kafka_logs").setLevel(logging.WARNING)


@cli.command()
@click.option("--app", "app_spec", help="Also run MODULE:APP's own migrations, and assign "
              "to its namespace the records its handlers wrote before namespaces.")
@click.option("--citus/--no-citus", default=None, help="Distribute the store's tables on "
              "this Citus coordinator (default: when the database has the citus extension; "
              "--no-citus keeps them local).")
@click.pass_obj
def migrate(obj: Ctx, app_spec: str | None, citus: bool | None) -> None:
    """Create or upgrade the store schema (versioned, add-only; twice is a no-op).

    With --app, also the app's own migrations, then the adoption: records written
    before keys were scoped per app (migration 0005) by one of the app's handlers
    (same topic and handler name) move to the app's namespace, with an audit row.
    An app with such records is refused at start until this ran.

    On a Citus coordinator the store is then distributed (docs/CITUS.md): records
    and outbox by shard_key, the rest as reference tables."""
    from kafka_idem.admin import namespaces

    app = load_app(app_spec, param_hint="'--app'") if app_spec else None
    s = obj.settings(app)
    applied = run_migrations(s.dsn, s.schema_name, s.table)
    names = ", ".join(f"{m.version:04d}_{m.name}" for m in applied) or "nothing to do"
    click.echo(f"schema {s.schema_name}: {names}")
    for line in distribute_store(s.dsn, s.schema_name, s.table, citus=citus):
        click.echo(plain(f"schema {s.schema_name}: {line}"))
    if app is None:
        return
    steps = migrate_app(s.dsn, s.schema_name, app.migrations)
    click.echo(plain(f"app {app.name}: " + ("; ".join(step.describe() for step in steps)
                                            or "no migrations (@app.migration) to run")))
    conn = connect(s.dsn)
    try:
        moved = namespaces.adopt(conn, store_of(s), app, actor=audit.default_actor())
    finally:
        conn.close()
    for p in moved:
        click.echo(plain(f"namespace {app.namespace}: adopted {p.records} record(s) of "
                         f"{p.topic}/{p.handler} written before namespaces"))


@cli.command()
@click.argument("app_spec", metavar="MODULE:APP")
@click.option("--metrics-port", type=int, help="Serve /metrics on this port (0 = any).")
@click.option("--metrics-addr", help="Address /metrics binds (default 127.0.0.1; 0.0.0.0 in "
              "a container).")
@click.option("--group-id", help="Consumer group id (default: the app's).")
@click.option("--instance-id", "group_instance_id", help="Static membership: this member's "
              "group.instance.id, the same across its restarts ({hostname}: the host name).")
@click.option("--max-seconds", type=float, help="Stop after this long (tests, demos).")
@click.option("--no-relay", is_flag=True, help="Do not run the outbox relay in this member "
              "(run `kafka-idem relay` apart; KAFKA_IDEM_OUTBOX_RELAY=false).")
@click.pass_obj
def run(
    obj: Ctx, app_spec: str, metrics_port: int | None, metrics_addr: str | None,
    group_id: str | None, group_instance_id: str | None, max_seconds: float | None,
    no_relay: bool,
) -> None:
    """Run one consumer group member; graceful on SIGTERM/SIGINT. An app with event
    topics (app.event_topic) also publishes its outbox here, unless --no-relay."""
    from kafka_idem.consume.runner import Runner

    early = _stop_requests()  # a SIGTERM while the app loads is a clean stop too
    app = load_app(app_spec)
    obj.overrides.update({k: v for k, v in {"metrics_port": metrics_port,
                                             "metrics_addr": metrics_addr,
                                             "group_id": group_id,
                                             "group_instance_id": group_instance_id,
                                             "outbox_relay": False if no_relay else None,
                                             }.items()
                          if v is not None})
    s = obj.settings(app)
    where = obj.overrides.get("bootstrap_servers")
    option = f" --bootstrap-servers {where}" if where else ""
    command = f"kafka-idem{option} topics create {app_spec}"
    runner = Runner(app, topics_command=command, migrate_command=_migrate_command(obj, app_spec))
    if s.metrics_port is not None:
        try:
            runner.metrics.serve(s.metrics_port, addr=s.metrics_addr)
        except OSError as exc:
            raise ServiceError(
                f"cannot serve /metrics on {s.metrics_addr}:{s.metrics_port}: "
                f"{exc.strerror or exc}; choose another --metrics-port "
                "(KAFKA_IDEM_METRICS_PORT) or --metrics-addr (KAFKA_IDEM_METRICS_ADDR)"
            ) from exc
    runner.install_signal_handlers()
    if early:
        log.info("stopping before the consumer started (%s)", signal.Signals(early[0]).name,
                 extra={"action": "stopping", "kind": signal.Signals(early[0]).name})
        sys.exit(0)
    code = runner.run(max_seconds=max_seconds)
    sys.exit(code)


def _migrate_command(obj: Ctx, app_spec: str) -> str:
    """What a member or relay started before `migrate` says to run: the store's
    migrations and the app's own, with the store's options given here."""
    given = {"--schema": obj.overrides.get("schema_name"), "--table": obj.overrides.get("table")}
    options = "".join(f" {name} {value}" for name, value in given.items() if value)
    return f"kafka-idem{options} migrate --app {app_spec}"


def _stop_requests() -> list[int]:
    """Catch SIGTERM/SIGINT until the runner installs its own handlers: the signals
    received meanwhile (the member then stops before it starts, exit 0). A second
    one stops at once (an app module whose import hangs)."""
    got: list[int] = []

    def note(signum: int, _frame: object) -> None:
        if got:
            raise SystemExit(128 + signum)
        got.append(signum)

    signal.signal(signal.SIGTERM, note)
    signal.signal(signal.SIGINT, note)
    return got


@cli.command()
@click.argument("app_spec", metavar="MODULE:APP")
@click.option("--metrics-port", type=int, help="Serve /metrics and /readyz on this port "
              "(0 = any).")
@click.option("--metrics-addr", help="Address /metrics binds (default 127.0.0.1).")
@click.option("--max-seconds", type=float, help="Stop after this long (tests, demos).")
@click.pass_obj
def relay(obj: Ctx, app_spec: str, metrics_port: int | None, metrics_addr: str | None,
          max_seconds: float | None) -> None:
    """Run only the outbox relay of MODULE:APP: publish the events its handlers
    emitted, exactly once (docs/OUTBOX.md); graceful on SIGTERM/SIGINT. Relays (and
    members running one) share the shards: run as many as you like."""
    from kafka_idem.cli.relay import run_relay

    app = load_app(app_spec)
    obj.overrides.update({k: v for k, v in {"metrics_port": metrics_port,
                                             "metrics_addr": metrics_addr}.items()
                          if v is not None})
    sys.exit(run_relay(app, obj.settings(app), max_seconds=max_seconds,
                       migrate_command=_migrate_command(obj, app_spec)))


# --- operations ------------------------------------------------------------------
dlq.add_command(replay_)
for command in (status, inspect, rerun, purge, dlq, verify, topics, console, pause, resume):
    cli.add_command(command)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The console script: exit codes and one-line errors as in the module docstring."""
    importable_cwd()  # `kafka-idem run MODULE:APP`, `verify`: the user's modules, as python -m
    try:
        code = cli.main(args=argv, prog_name="kafka-idem", standalone_mode=False)
    except click.ClickException as exc:
        sys.exit(cli_errors.usage(exc))
    except click.Abort:
        click.echo("Aborted!", err=True)
        sys.exit(1)
    except Exception as exc:
        sys.exit(cli_errors.fail(exc))
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
