"""The ``kafka-idem`` operations commands: ``status``, ``inspect``, ``rerun``
(``purge`` is :mod:`~kafka_idem.cli.purge`'s).

Each reads or changes the store through :mod:`kafka_idem.admin.operations` (audited admin
actions) and prints plain, escaped text (:mod:`kafka_idem.observe.text`); refusals are
one line and exit 1. Registered on the command group by :mod:`kafka_idem.cli.commands`.
"""

from __future__ import annotations

import json
import sys
from contextlib import AbstractContextManager
from typing import Any

import click

from kafka_idem.admin import audit, pauses, retention
from kafka_idem.admin import operations as admin
from kafka_idem.admin.operations import AUDIT_COLUMNS, RECORD_FIELDS, record_json
from kafka_idem.cli.common import (
    NAMESPACE_HELP,
    Ctx,
    duration,
    iso_time,
    store_connection,
    store_of,
)
from kafka_idem.cli.errors import ServiceError, as_typed, warn
from kafka_idem.cli.table import Grid, emit
from kafka_idem.observe.text import plain, to_json
from kafka_idem.settings import Settings


def _print_json(data: Any) -> None:
    click.echo(to_json(data))


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--long-running", "long_running", help="Threshold, e.g. 10m (default: settings).")
@click.option("--namespace", help=NAMESPACE_HELP)
@click.pass_obj
def status(obj: Ctx, as_json: bool, long_running: str | None, namespace: str | None) -> None:
    """Counts by status, leases, long-running records, failures by kind, retry backlog;
    the records of each namespace by status; the outbox's unpublished events (count and
    age of the oldest) per namespace; the paused handlers (who, why, since); the
    background retention's last run that removed records (when, by which member, how
    many, its window) per namespace. Exit 1 for an
    unknown --namespace."""
    s = obj.settings()
    threshold = (duration(long_running, '--long-running') if long_running
                 else s.long_running_seconds)
    store = store_of(s)
    conn = store_connection(s)
    try:
        if namespace is not None:
            admin.require_namespace(conn, store, namespace)
        st = admin.status(conn, store, long_running_seconds=threshold, namespace=namespace)
        paused = pauses.listed(conn, store, namespace)
        purged = retention.last_runs(conn, store, namespace)
    finally:
        conn.close()
    if as_json:
        _print_json({**st.to_json(), "paused_handlers": [p.to_json() for p in paused],
                     "retention": purged})
        return
    scope = f" namespace {namespace}" if namespace is not None else ""
    table = Grid(["what", "count"], title=f"kafka_idem store {s.schema_name}.{s.table}{scope}",
                 right=frozenset({"count"}))
    rows: list[tuple[str, object]] = [(name, n) for name, n in st.by_status.items()]
    rows += [("processing, live lease", st.processing_live),
             ("processing, expired lease", st.processing_expired),
             (f"long-running (> {threshold:.0f}s)", st.long_running)]
    rows += [(f"failed: {kind}", n) for kind, n in st.failed_by_kind.items()]
    rows += [("retry backlog (due now)", f"{st.retry_backlog} ({st.retry_due_now})"),
             ("next retry due", st.next_retry_at.isoformat() if st.next_retry_at else "-")]
    for what, value in rows:
        table.add(what, value)
    emit(table)
    spaces = Grid(["namespace", *admin.STATUSES], title="records by namespace",
                  right=frozenset(admin.STATUSES))
    for ns, counts in st.by_namespace.items():
        spaces.add(admin.shown(ns), *(counts[n] for n in admin.STATUSES))
    emit(spaces)
    outbox = Grid(["namespace", "pending", "oldest (s)"], title="outbox: events not published "
                  "yet", right=frozenset({"pending", "oldest (s)"}))
    pending = st.outbox_pending()
    for ns, (n, age) in pending.items():
        outbox.add(admin.shown(ns), n, "-" if age is None else f"{age:.1f}")
    if not pending:
        outbox.add("-", 0, "-")
    emit(outbox)
    held = Grid(["namespace", "handler", "since", "by", "reason"], title="paused handlers "
                "(kafka-idem resume MODULE:APP --handler NAME)")
    for p in paused:
        held.add(admin.shown(p.namespace), p.handler, p.since.isoformat(timespec="seconds"),
                 p.actor, p.reason)
    if not paused:
        held.add("-", "none", "-", "-", "-")
    emit(held)
    _last_purges(purged)


def _last_purges(purged: dict[str, dict[str, Any]]) -> None:
    """The background retention's latest run that removed records, per namespace."""
    table = Grid(["namespace", "at", "member", "removed", "retention"],
                 title="retention: last background purge", right=frozenset({"removed"}))
    for ns, run in purged.items():
        window = run["retention"] + (" (forced)" if run["force"] else "")
        table.add(admin.shown(ns), run["at"], run["member"], run["removed"], window)
    if not purged:
        table.add("-", "none", "-", 0, "-")
    emit(table)


@click.command()
@click.argument("key")
@click.option("--namespace", help=NAMESPACE_HELP)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (one record: "
              "give --namespace when the key is in several).")
@click.pass_obj
def inspect(obj: Ctx, key: str, namespace: str | None, as_json: bool) -> None:
    """The key's record (status, hash, attempts, owner, lease, result, error, last
    delivery) and its audit trail, in each namespace that holds the key. Exit 1 when the
    key or the --namespace is unknown."""
    s = obj.settings()
    conn = store_connection(s)
    try:
        recs = admin.inspect(conn, store_of(s), key, namespace)
        similar = [] if recs else admin.similar_keys(conn, store_of(s), key, namespace)
    finally:
        conn.close()
    if not recs:
        where = f" in namespace {namespace!r}" if namespace is not None else ""
        hint = (f" (did you mean {' or '.join(map(repr, similar))}? a key template "
                "percent-encodes its separators inside a field's value)" if similar else "")
        click.echo(plain(f"error: no record with key {key!r}{where}{hint}"), err=True)
        sys.exit(1)
    if as_json:
        if len(recs) > 1:
            names = ", ".join(repr(r["namespace"]) for r in recs)
            warn(plain(f"refused: {key}: the key exists in namespaces {names}: give --namespace"))
            sys.exit(1)
        _print_json(record_json(key, recs[0]))
        return
    for rec in recs:
        _print_record(key, rec)


def _print_record(key: str, rec: dict[str, Any]) -> None:
    table = Grid(["field", "value"], header=False,
                 title=f"{key}  (namespace {admin.shown(rec['namespace'])})")
    for name in RECORD_FIELDS:
        value = rec.get(name)
        if name == "shard_key" and value is None:
            continue  # one PostgreSQL, a handler without shard_key=: none
        table.add(name, json.dumps(value, default=str) if name == "result_json" else value)
    emit(table)
    trail = Grid(list(AUDIT_COLUMNS), title="audit trail")
    for row in rec["audit"]:
        trail.add(*(row[c] or "" for c in AUDIT_COLUMNS))
    emit(trail)


@click.command()
@click.argument("key", required=False)
@click.option("--reason", help="Why (kept in the audit trail); required unless --dry-run.")
@click.option("--actor", default=None, help="Who (default: KAFKA_IDEM_ACTOR or the OS user).")
@click.option("--dlq", "dlq_topic", help="DLQ topic to find the messages in "
              "(default: each record's topic + dlq suffix).")
@click.option("--kind", type=click.Choice(["exhausted", "permanent"]),
              help="Bulk: failed records of this error kind.")
@click.option("--since", metavar="ISO-DATETIME", callback=iso_time,
              help="Bulk: last failure at or after this time (ISO 8601; UTC if no offset).")
@click.option("--until", metavar="ISO-DATETIME", callback=iso_time,
              help="Bulk: last failure before this time (ISO 8601; UTC if no offset).")
@click.option("--handler", help="Bulk: failed records of this handler.")
@click.option("--namespace", help="The key's namespace (needed when the key is in several); "
              "bulk: only records of this namespace (default: every namespace).")
@click.option("--key-prefix", help="Bulk: keys starting with this text.")
@click.option("--limit", type=click.IntRange(min=1), help="Bulk: at most this many keys "
              "(oldest failure first); run again for the next ones.")
@click.option("--dry-run", is_flag=True, help="Bulk: print what would be re-run; change "
              "and send nothing.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Bulk: print the summary as JSON.")
@click.option("--trust-unsigned", is_flag=True,
              help="Where signing keys are configured, also send unsigned dead letters "
              "(written before signing); a bad signature is never trusted.")
@click.pass_obj
def rerun(obj: Ctx, key: str | None, reason: str | None, actor: str | None,
          dlq_topic: str | None, kind: str | None, since: Any, until: Any,
          handler: str | None, namespace: str | None, key_prefix: str | None,
          limit: int | None, dry_run: bool, no_progress: bool, as_json: bool,
          trust_unsigned: bool) -> None:
    """Audited admin re-run of failed keys: failed -> retryable_failed (fresh retry budget),
    and each key's latest dead-lettered message republished so the consumer group runs
    it again.

    With KEY, that one key: the state change and its audit row commit only once the
    broker acknowledged the message (if republishing fails, nothing changes: exit 3,
    and a later rerun works); refuses succeeded and live processing records (exit 1).
    A key a dlq replay re-ran and left untouched since (retryable_failed, its message
    maybe never sent: "stranded") is taken too: its dead letter is sent again.

    The dead letter sent is the key's latest that says it came from the record's own
    topic and, where signing keys are configured, whose signature holds.

    Without KEY, every failed record the filters select (--kind, --since, --until,
    --handler, --key-prefix, --limit): the DLQ topics are read once, then keys are
    re-run and republished in batches, each committed after its messages were
    acknowledged. Keys re-run before and not failed again are not selected, so a
    repeat is safe. Exit 1 when nothing matches."""
    filters = {"--kind": kind, "--since": since, "--until": until, "--handler": handler,
               "--key-prefix": key_prefix, "--limit": limit}
    if key is not None:
        given = [name for name, value in filters.items() if value is not None]
        given += [name for name, on in (("--dry-run", dry_run), ("--json", as_json)) if on]
        if given:
            raise click.UsageError(f"{', '.join(given)}: bulk options; give either KEY or "
                                   "filters")
        _rerun_one(obj, key, reason or "", actor, dlq_topic, namespace, trust_unsigned)
        return
    _rerun_bulk(obj, reason, actor, dlq_topic, kind=kind, since=since, until=until,
                handler=handler, namespace=namespace, key_prefix=key_prefix, limit=limit,
                dry_run=dry_run, progress=not no_progress, as_json=as_json,
                trust_unsigned=trust_unsigned)


def _rerun_one(obj: Ctx, key: str, reason: str, actor: str | None,
               dlq_topic: str | None, namespace: str | None, trust_unsigned: bool) -> None:
    from kafka_idem.replay.single import NotRecorded, rerun_key

    s = obj.settings()
    who = actor or audit.default_actor()
    conn = store_connection(s)
    try:
        with _dlq_typed(s, dlq_topic):
            done = rerun_key(s, conn, store_of(s), key, actor=who, reason=reason,
                             namespace=namespace, dlq_topic=dlq_topic,
                             trust_unsigned=trust_unsigned)
    except NotRecorded as exc:
        raise ServiceError(f"{exc}; fix the cause and run the same rerun again") from exc
    finally:
        conn.close()
    letter, topic, target = done.letter, done.dlq_topic, done.target
    if done.stranded_by is not None:
        by = done.stranded_by
        click.echo(plain(f"{key}: retryable_failed since replay {by['group']} (run {by['run']}) "
                         f"re-ran it at {by['at']}, and untouched since (its message may never "
                         f"have been sent); message republished to {target} from "
                         f"{topic}[{letter.partition}]@{letter.offset} by {who}"))
        return
    click.echo(plain(f"{key}: failed -> retryable_failed by {who}; message republished to "
                     f"{target} from {topic}[{letter.partition}]@{letter.offset}"))


def _dlq_typed(s: Settings, dlq_topic: str | None) -> AbstractContextManager[None]:
    """A DLQ that does not exist named as the user gave it: --dlq, or by default."""
    if dlq_topic:
        return as_typed({"dlq_topic": f"--dlq {dlq_topic}"})
    return as_typed({"dlq_topic": None}, hints={
        "dlq_topic": f"the DLQ of a record's topic is that topic + the dlq_suffix setting "
                     f"{s.dlq_suffix!r}; --dlq TOPIC names a DLQ itself"})


def _rerun_bulk(obj: Ctx, reason: str | None, actor: str | None, dlq_topic: str | None, *,
                kind: str | None, since: Any, until: Any, handler: str | None,
                namespace: str | None, key_prefix: str | None, limit: int | None,
                dry_run: bool, progress: bool, as_json: bool, trust_unsigned: bool) -> None:
    from kafka_idem.replay.bulk import Filter, bulk_rerun

    flt = Filter(kind=kind, handler=handler, since=since, until=until,
                 key_prefix=key_prefix, limit=limit, namespace=namespace)
    if not flt.to_json() or list(flt.to_json()) == ["limit"]:
        raise click.UsageError("give KEY, or at least one filter (--kind, --since, --until, "
                               "--handler, --namespace, --key-prefix) to re-run in bulk")
    s = obj.settings()
    who = actor or audit.default_actor()
    conn = store_connection(s)
    try:
        if namespace is not None:
            admin.require_namespace(conn, store_of(s), namespace)
            conn.rollback()
        with _dlq_typed(s, dlq_topic):
            summary = bulk_rerun(s, conn, store_of(s), flt, dlq_topic=dlq_topic, actor=who,
                                 reason=reason, dry_run=dry_run, progress=progress,
                                 trust_unsigned=trust_unsigned)
    finally:
        conn.close()
    if as_json:
        _print_json(summary.to_json())
    else:
        verb = "would re-run" if dry_run else "re-run"
        count = summary.ready if dry_run else summary.rerun
        click.echo(plain(
            f"{'dry run: ' if dry_run else ''}selected {summary.selected} failed key(s), "
            f"{verb} {count}"
            + (f", no longer failed {summary.not_failed}" if summary.not_failed else "")
            + (f", no dead letter found {len(summary.no_dead_letter)}"
               if summary.no_dead_letter else "")
            + (f", dead letter without its value {len(summary.truncated)}"
               if summary.truncated else "")))
        for topic, n in sorted(summary.dlq_topics.items()):
            click.echo(plain(f"  from {topic}: {n}"))
        for k in summary.no_dead_letter[:20]:
            click.echo(plain(f"  no dead letter: {k}"))
        for k in summary.truncated[:20]:
            click.echo(plain(f"  without its value (re-run from the source topic): {k}"))
    if summary.selected == 0:
        click.echo(plain(f"error: no failed record matches {json.dumps(flt.to_json())}"),
                   err=True)
        sys.exit(1)
