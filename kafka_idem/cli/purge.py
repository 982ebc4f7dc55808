"""``kafka-idem purge``: retention of the store, refused where it could let a message
that can still be redelivered run its effect again.

The command, its output and :func:`read_retention` (each source topic's ``retention.ms``,
as the broker reports it); the rules are :mod:`kafka_idem.admin.operations`'
(``purge_risk``, ``purge``). Registered on the command group by
:mod:`~kafka_idem.cli.commands`.
"""

from __future__ import annotations

import time
from typing import Any

import click

from kafka_idem.admin import audit
from kafka_idem.admin import operations as admin
from kafka_idem.admin import purge as purging
from kafka_idem.cli.common import NAMESPACE_HELP, Ctx, duration, store_connection, store_of
from kafka_idem.cli.errors import warn
from kafka_idem.observe.text import plain
from kafka_idem.settings import Settings


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
        risk = purging.purge_risk(seconds, read_retention(s, topics))
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


RETENTION_READ_SECONDS = 10.0
"""How long ``purge`` waits for the source topics' retention.ms, at most."""


def read_retention(s: Settings, topics: list[str], *,
                   timeout: float = RETENTION_READ_SECONDS) -> list[purging.TopicRetention]:
    """Each topic's ``retention.ms`` as the broker reports it, read within ``timeout``
    seconds in all; a topic whose retention could not be read (broker unreachable or
    silent, describe_configs failing, the topic gone) has ``ms`` ``None`` and why.
    Gives up at once when librdkafka reports every broker down (a closed port, a
    host that does not resolve), instead of waiting out the timeout."""
    if not topics:
        return []
    from confluent_kafka import KafkaError
    from confluent_kafka.admin import (  # type: ignore[attr-defined]
        AdminClient,
        ConfigResource,
    )

    down: list[str] = []

    def on_error(err: KafkaError) -> None:
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            down.append(err.str())

    # librdkafka's own log off: an unreachable broker is said once, in the reason.
    conf: dict[str, Any] = {**s.admin_config(), "log_level": 0, "error_cb": on_error}
    client = AdminClient(conf)
    resources = {t: ConfigResource(ConfigResource.Type.TOPIC, t) for t in topics}
    try:
        futures = client.describe_configs(list(resources.values()), request_timeout=timeout)
    except Exception as exc:  # unread: the one-hour floor applies
        why = f"describe_configs failed: {_kafka_text(exc)}"
        return [purging.TopicRetention(t, None, why) for t in topics]
    deadline = time.monotonic() + timeout
    while (not down and time.monotonic() < deadline
           and not all(f.done() for f in futures.values())):
        client.poll(0.05)
    where = f"Kafka at {s.bootstrap_servers}"
    out: list[purging.TopicRetention] = []
    for topic, res in resources.items():
        fut = futures[res]
        if not fut.done():
            why = (f"{where} is unreachable: {down[0]}" if down
                   else f"{where} did not answer within {timeout:g}s")
            out.append(purging.TopicRetention(topic, None, why))
            continue
        try:
            entry = fut.result(timeout=0)["retention.ms"]
            out.append(purging.TopicRetention(topic, int(entry.value)))
        except Exception as exc:  # the topic gone, not authorized, no retention.ms
            out.append(purging.TopicRetention(topic, None, f"{where}: {_kafka_text(exc)}"))
    return out


def _kafka_text(exc: BaseException) -> str:
    """A Kafka error's own words (``Broker: Unknown topic or partition``)."""
    err = exc.args[0] if exc.args else None
    words = getattr(err, "str", None)
    text = words() if callable(words) else str(exc)
    return str(text) or type(exc).__name__
