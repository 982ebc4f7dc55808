"""``kafka-idem pause MODULE:APP --handler NAME --reason TEXT`` and ``resume``.

    kafka-idem pause consumers.payments:app --handler charge --reason "PSP incident 4411"
    kafka-idem resume consumers.payments:app --handler charge

Each is an audited admin action on the store (:mod:`kafka_idem.admin.pauses`): the
members of the app, in every group, honour it within seconds and across restarts. Both
are idempotent: pausing a paused handler keeps its first pause (who, why, since) and
says so, resuming one not paused says so; both exit 0 then.

Exit codes: 0 done (or already so); 2 a bad option, or no such handler in the app (the
line names its handlers); 3 the database unreachable.
"""

from __future__ import annotations

import click

from kafka_idem.admin import audit, pauses
from kafka_idem.cli.common import Ctx, load_app, store_connection
from kafka_idem.errors import ConfigError
from kafka_idem.observe.text import plain
from kafka_idem.settings import Settings
from kafka_idem.store import Store


def _target(obj: Ctx, app_spec: str, handler: str) -> tuple[Store, Settings]:
    """The app's store, scoped to its namespace, and its settings; a handler the app
    does not have is a usage error naming the ones it has."""
    app = load_app(app_spec)
    s = obj.settings(app)
    try:
        pauses.check_handler(app, handler)
    except ConfigError as exc:
        raise click.BadParameter(exc.message, param_hint="'--handler'") from exc
    return Store(schema=s.schema_name, table=s.table, namespace=app.namespace), s


@click.command()
@click.argument("app_spec", metavar="MODULE:APP")
@click.option("--handler", required=True, help="The handler's name (@app.handler(name=...), "
              "else its function's).")
@click.option("--reason", required=True, help="Why (kept with the pause and in the audit "
              "trail; `status` shows it).")
@click.option("--actor", default=None, help="Who (default: KAFKA_IDEM_ACTOR or the OS user).")
@click.pass_obj
def pause(obj: Ctx, app_spec: str, handler: str, reason: str, actor: str | None) -> None:
    """Pause a handler of MODULE:APP on every member of the app, until `resume`: its
    partitions are paused at each consumer, no message of it is claimed or started; what
    runs finishes; the app's other handlers go on. Durable (a restarted member starts
    paused) and audited. Pausing a paused handler changes nothing and exits 0."""
    store, s = _target(obj, app_spec, handler)
    who = actor or audit.default_actor()
    conn = store_connection(s)
    try:
        with conn.transaction():
            done = pauses.pause(conn, store, handler=handler, actor=who, reason=reason)
    finally:
        conn.close()
    p = done.pause
    if not done.changed and p is not None:
        click.echo(plain(f"{handler}: paused already, by {p.actor} since {_at(p)} "
                         f"({p.reason}); nothing changed"))
        return
    click.echo(plain(f"{handler}: paused by {who} in namespace {store.ns} ({reason}); the "
                     "members stop starting its messages within seconds"))


@click.command()
@click.argument("app_spec", metavar="MODULE:APP")
@click.option("--handler", required=True, help="The handler's name.")
@click.option("--reason", default=None, help="Why (kept in the audit trail).")
@click.option("--actor", default=None, help="Who (default: KAFKA_IDEM_ACTOR or the OS user).")
@click.pass_obj
def resume(obj: Ctx, app_spec: str, handler: str, reason: str | None,
           actor: str | None) -> None:
    """Resume a paused handler of MODULE:APP on every member (audited). Resuming a handler
    that is not paused changes nothing and exits 0."""
    store, s = _target(obj, app_spec, handler)
    who = actor or audit.default_actor()
    conn = store_connection(s)
    try:
        with conn.transaction():
            done = pauses.resume(conn, store, handler=handler, actor=who, reason=reason)
    finally:
        conn.close()
    p = done.pause
    if not done.changed or p is None:
        click.echo(plain(f"{handler}: not paused; nothing changed"))
        return
    click.echo(plain(f"{handler}: resumed by {who} (paused by {p.actor} since {_at(p)}: "
                     f"{p.reason})"))


def _at(p: pauses.Pause) -> str:
    return p.since.isoformat(timespec="seconds")
