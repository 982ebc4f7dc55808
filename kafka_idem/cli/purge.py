"""``kafka-idem purge``: retention of the store, refused where it could let a message
that can still be redelivered run its effect again.

The command and its output; the rules, and each source topic's ``retention.ms`` as the
broker reports it, are :mod:`kafka_idem.admin.purge`'s (``purge_risk``, ``purge``,
``read_retention``), shared with the members' background retention. Registered on the
command group by :mod:`~kafka_idem.cli.commands`.
"""

from __future__ import annotations

import click

from kafka_idem.admin import audit
from kafka_idem.admin import operations as admin
from kafka_idem.admin import purge as purging
from kafka_idem.cli.common import NAMESPACE_HELP, Ctx, duration, store_connection, store_of
from kafka_idem.cli.errors import warn
from kafka_idem.observe.text import plain


@click.command()
@click.option("--older-than", required=True, help="Age of records to delete, e.g. 30d: at "
              "least the longest retention.ms of their source topics (one hour when it "
              "cannot be read), else refused without --force.")
@click.option("--include-failed", is_flag=True, help="Also purge old failed records.")
@click.option("--batch-size", type=click.IntRange(1, 100_000), default=5000, show_default=True,
              help="Records deleted per transaction (each with its own audit row).")
@click.option("--actor", default=None, help="Who (default: KAFKA_IDEM_ACTOR or the OS user).")
@click.option("--reason", default=None, help="Why (kept in the audit trail).")
@click.option("--namespace", help=NAMESPACE_HELP)
@click.option("--dry-run", is_flag=True,
              help="Count what would be deleted, by status, and say why the window is too "
              "short if it is; delete and audit nothing.")
@click.option("--force", is_flag=True,
              help="Purge although the window is shorter than a source topic's retention: "
              "only if those topics will never be re-read from before the window (kept in "
              "the audit trail).")
@click.pass_obj
def purge(obj: Ctx, older_than: str, include_failed: bool, batch_size: int,
          actor: str | None, reason: str | None, namespace: str | None,
          dry_run: bool, force: bool) -> None:
    """Retention: delete succeeded (and with --include-failed, failed) records older than
    the window, in audited batches. Never touches processing or retryable_failed records.

    A record purged while its source message can still be redelivered lets that
    message run its effect again, so a window shorter than the longest retention.ms of
    the records' source topics (any window when one keeps messages forever; under one
    hour when the retention cannot be read) is refused (exit 1, nothing deleted)
    unless --force. --dry-run counts what would go and says why the window is too
    short; it is never refused. Exit 1 for an unknown --namespace."""
    s = obj.settings()
    seconds = duration(older_than, "--older-than")
    store = store_of(s) if namespace is None else store_of(s).scoped(namespace)
    conn = store_connection(s)
    try:
        if namespace is not None:
            admin.require_namespace(conn, store, namespace)
        topics = purging.topics_seen(conn, store)
        conn.rollback()
        risk = purging.purge_risk(seconds, purging.read_retention(s, topics))
        if dry_run:
            counts = purging.purge_preview(conn, store, older_than=seconds,
                                         include_failed=include_failed)
        else:
            if risk is not None and not force:
                raise admin.Refused(risk.refusal(older_than))
            if risk is not None:
                warn(f"warning: {risk.facts(older_than)}; purging anyway (--force)")
            deleted = purging.purge(conn, store, older_than=seconds, include_failed=include_failed,
                                  batch_size=batch_size, actor=actor or audit.default_actor(),
                                  reason=reason, force=force)
    finally:
        conn.close()
    scope = f" in namespace {namespace}" if namespace is not None else ""
    if dry_run:
        by = ", ".join(f"{status} {counts.get(status, 0)}"
                       for status in purging.purge_statuses(include_failed))
        click.echo(plain(f"dry run: would purge {sum(counts.values())} records older than "
                         f"{older_than}{scope} ({by}); nothing deleted"))
        if risk is not None:
            click.echo(plain(
                f"dry run: with --force it would purge anyway: {risk.facts(older_than)}"
                if force else
                f"dry run: a purge would be refused without --force: "
                f"{risk.refusal(older_than)}"))
        return
    click.echo(plain(f"purged {deleted} records older than {older_than}{scope}"))
