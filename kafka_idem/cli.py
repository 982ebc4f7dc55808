"""The ``kafka-idem`` command line.

Exit codes: 0 ok; 1 a check failed or nothing matched where something was
required; 2 usage or configuration error.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

import click

from kafka_idem import logs
from kafka_idem.app import App
from kafka_idem.errors import ConfigError, FrameworkError
from kafka_idem.migrate import migrate as run_migrations
from kafka_idem.settings import Settings, load_settings
from kafka_idem.store import connect

log = logging.getLogger("kafka_idem.cli")


def load_app(spec: str) -> App:
    """Import ``module:attribute`` and return the :class:`App` it names."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise click.BadParameter(f"{spec!r} is not MODULE:APP (e.g. consumers.payments:app)")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise click.BadParameter(f"cannot import {module_name!r}: {exc}") from exc
    app = getattr(module, attr, None)
    if not isinstance(app, App):
        raise click.BadParameter(f"{spec!r} is not a kafka_idem App")
    return app


class Ctx:
    def __init__(self, overrides: dict[str, Any]) -> None:
        self.overrides = overrides

    def settings(self, app: App | None = None) -> Settings:
        if app is not None:
            app.configure(**self.overrides)
            return app.settings
        return load_settings(**self.overrides)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--bootstrap-servers", envvar=None, help="Kafka bootstrap servers.")
@click.option("--database-url", envvar=None, help="PostgreSQL URL.")
@click.option("--schema", "schema_name", help="Store schema (default kafka_idem).")
@click.option("--table", help="Idempotency table (default task_idempotency).")
@click.option("--log-format", type=click.Choice(["text", "json"]), default=None)
@click.pass_context
def cli(ctx: click.Context, /, log_format: str | None, **overrides: Any) -> None:
    """kafka_idem: exactly-once effects for Kafka consumers, backed by PostgreSQL."""
    clean = {k: v for k, v in overrides.items() if v is not None}
    if log_format:
        clean["log_format"] = log_format
    ctx.obj = Ctx(clean)
    try:
        s = load_settings(**clean)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    logs.configure(s.log_format, s.log_level)


@cli.command()
@click.option("--app", "app_spec", help="Also run MODULE:APP's own migrations.")
@click.pass_obj
def migrate(obj: Ctx, app_spec: str | None) -> None:
    """Create or upgrade the store schema (versioned, add-only; twice is a no-op)."""
    app = load_app(app_spec) if app_spec else None
    s = obj.settings(app)
    applied = run_migrations(s.dsn, s.schema_name, s.table)
    if app is not None and app.migrations:
        conn = connect(s.dsn)
        try:
            with conn.transaction():
                for fn in app.migrations:
                    fn(conn)
        finally:
            conn.close()
    names = ", ".join(f"{m.version:04d}_{m.name}" for m in applied) or "nothing to do"
    click.echo(f"schema {s.schema_name}: {names}")


@cli.command()
@click.argument("app_spec", metavar="MODULE:APP")
@click.option("--metrics-port", type=int, help="Serve /metrics on this port (0 = any).")
@click.option("--group-id", help="Consumer group id (default: the app's).")
@click.option("--max-seconds", type=float, help="Stop after this long (tests, demos).")
@click.pass_obj
def run(
    obj: Ctx, app_spec: str, metrics_port: int | None, group_id: str | None,
    max_seconds: float | None,
) -> None:
    """Run one consumer group member; graceful on SIGTERM/SIGINT."""
    from kafka_idem.runner import Runner

    app = load_app(app_spec)
    obj.overrides.update({k: v for k, v in {"metrics_port": metrics_port,
                                             "group_id": group_id}.items() if v is not None})
    s = obj.settings(app)
    runner = Runner(app)
    if s.metrics_port is not None:
        runner.metrics.serve(s.metrics_port)
    runner.install_signal_handlers()
    code = runner.run(max_seconds=max_seconds)
    sys.exit(code)


def main() -> None:
    try:
        cli(standalone_mode=True)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except FrameworkError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
