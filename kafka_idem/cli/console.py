"""``kafka-idem console MODULE:APP``: the operator's web console (:mod:`kafka_idem.console`)."""

from __future__ import annotations

import signal
import socket

import click

from kafka_idem.admin import audit
from kafka_idem.cli.common import Ctx, load_app, store_connection
from kafka_idem.cli.errors import ServiceError

EXTRA = "pip install 'kafka-idem[console]'"


@click.command()
@click.argument("app_spec", metavar="MODULE:APP")
@click.option("--addr", default="127.0.0.1", show_default=True,
              help="Address to listen on. Any but a loopback one needs the console_token "
              "setting (KAFKA_IDEM_CONSOLE_TOKEN).")
@click.option("--port", type=click.IntRange(1, 65535), default=8088, show_default=True,
              help="Port to listen on.")
@click.option("--read-only", is_flag=True, help="Show everything, change nothing: no write "
              "button, and every write request refused.")
@click.option("--actor", default=None, help="Who acts in the audit trail when no one logs in: "
              "every request of a console without a token, and requests with Authorization: "
              "Bearer TOKEN (default: KAFKA_IDEM_ACTOR or the OS user). Logged-in operators act "
              "under the name they log in with.")
@click.option("--refresh", type=click.FloatRange(1, 3600), default=5.0, show_default=True,
              help="Seconds between two samples of the overview's counts (each reads every "
              "record), and the overview page's own refresh.")
@click.option("--trust-unsigned", is_flag=True,
              help="Where signing keys are configured, also act on unsigned dead letters "
              "(written before signing), as dlq replay --trust-unsigned.")
@click.pass_obj
def console(obj: Ctx, app_spec: str, addr: str, port: int, read_only: bool, actor: str | None,
            refresh: float, trust_unsigned: bool) -> None:
    """Serve the web console of MODULE:APP: overview (records by status, retry backlog,
    expired leases, dead letters, outbox, the group's members and lag), records, dead
    letters with their decoded payloads, re-drive (dlq replay) and re-run, each after
    its dry run and with a reason, audited with the operator's name.

    Listens on 127.0.0.1:8088 by default. On any other address it refuses to start
    (exit 2) unless the console_token setting (KAFKA_IDEM_CONSOLE_TOKEN) is set;
    with a token, every request needs it (the login form, or Authorization: Bearer).
    Stops on SIGTERM or Ctrl-C."""
    try:
        import uvicorn

        from kafka_idem.console import Options, create_app
        from kafka_idem.console.security import is_loopback
    except ImportError as exc:
        raise click.UsageError(f"the console needs its extra ({exc.name} is missing): "
                               f"{EXTRA}") from None
    app = load_app(app_spec)
    s = obj.settings(app)
    if not is_loopback(addr) and s.console_token is None:
        raise click.BadParameter(
            f"listening on {addr} needs a token: set console_token "
            "(KAFKA_IDEM_CONSOLE_TOKEN, at least 16 characters); without one the console "
            "listens on a loopback address only", param_hint="'--addr'")
    store_connection(s).close()  # a store never migrated: say so (exit 2) before serving
    options = Options(addr=addr, port=port, read_only=read_only,
                      actor=actor or audit.default_actor(), refresh_seconds=refresh,
                      trust_unsigned=trust_unsigned)
    web = create_app(app, s, options)
    # Listening before saying so: a request sent once the line is out waits for the
    # server (it queues) instead of being refused; a port in use is one line, exit 3.
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets (else Nagle holds
    # every response body back about 40 ms on a kept-alive connection)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ServiceError(f"cannot listen on {addr}:{port}: {exc.strerror or exc}; choose "
                           "another --port or --addr") from exc
    shown = f"[{addr}]" if family == socket.AF_INET6 else addr
    where = (f"http://{shown}:{port}/" if addr not in ("0.0.0.0", "::")
             else f"port {port} of every address of this host")
    click.echo(f"kafka-idem console of app {app.name}: {where}"
               + (" (read-only)" if read_only else "")
               + (" (token required)" if s.console_token is not None else ""), err=True)
    server = uvicorn.Server(uvicorn.Config(web, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))
    # uvicorn stops on SIGTERM/SIGINT, then raises the signal again with the handlers it
    # found: these make that a plain exit 0, as a member's stop is.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
