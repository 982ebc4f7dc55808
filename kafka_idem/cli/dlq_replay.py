"""``kafka-idem dlq replay``: re-drive a dead-letter topic's records after a fix.

    kafka-idem dlq replay --topic payments.charge-requested --since 2024-05-01T00:00Z --dry-run

The command and its output (what a dry run would send, the summary); the decisions are
:func:`kafka_idem.replay.replay`'s. Registered on the ``dlq`` group
(:mod:`~kafka_idem.cli.dlq`) by :mod:`~kafka_idem.cli.commands`. Exit codes as for every
``dlq`` command: 0 ok; 1 nothing matched, or refused (re-running failed keys without
--reason); 2 usage or configuration error; 3 Kafka or the database failed.
"""

from __future__ import annotations

from typing import Any

import click

from kafka_idem import replay
from kafka_idem.admin import audit
from kafka_idem.cli.common import (
    Ctx,
    app_option,
    dlq_of,
    dlq_typed,
    echo_json,
    nothing,
    selection,
    selection_options,
    store_connection,
    store_of,
    topic_options,
    typed_option,
)
from kafka_idem.cli.errors import warn
from kafka_idem.observe.text import plain


@click.command("replay")
@topic_options
@selection_options
@click.option("--to", "to_topic", metavar="TOPIC",
              help="Send to this topic instead of each record's original topic (re-run keys' "
              "messages too: only useful when a member of the handler consumes TOPIC).")
@click.option("--dry-run", is_flag=True,
              help="Print what would be sent from the replay's current position; "
              "send, commit and audit nothing.")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True),
              help="At most this many records per second.")
@click.option("--limit", type=click.IntRange(min=1),
              help="Send at most this many records; run again to continue.")
@click.option("--reason", help="Why the records are replayed (kept in the replay's audit "
              "row and in each re-run key's); required when the replay re-runs failed keys.")
@click.option("--include-permanent", is_flag=True,
              help="Also re-run keys that failed permanently (default: only exhausted ones).")
@click.option("--app", "app_spec", metavar="MODULE:APP",
              help="The app whose DLQ this is: the boundary of the replay. Records go back "
              "only to the topics of its handlers that dead-letter here, only keys of its "
              "namespace are re-run, and a record's value must build the key it names. "
              "Without it: the DLQ's own source topic, and keys re-run only with --namespace.")
@click.option("--trust-unsigned", is_flag=True,
              help="Where signing keys are configured (KAFKA_IDEM_DLQ_SIGNING_KEYS), also act "
              "on unsigned records (written before signing); a bad signature is never "
              "trusted.")
@click.option("--actor", help="Who replays (default: KAFKA_IDEM_ACTOR or the OS user).")
@click.option("--group", help="The replay's own consumer group (default: derived from the "
              "DLQ, the filters and --to, so the same replay resumes where it stopped).")
@click.option("--prefix", help="Put this before the replay's consumer group and "
              "transactional id (default: the name_prefix setting, KAFKA_IDEM_NAME_PREFIX), "
              "e.g. 'team-a.' on a cluster whose ACLs grant names by prefix.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.pass_obj
def replay_(obj: Ctx, /, dlq_topic: str | None, source_topic: str | None, to_topic: str | None,
            dry_run: bool, rate: float | None, limit: int | None, reason: str | None,
            include_permanent: bool, app_spec: str | None, trust_unsigned: bool,
            actor: str | None, group: str | None,
            prefix: str | None, no_progress: bool, as_json: bool, **opts: Any) -> None:
    """Re-drive matching DLQ records: republish them to their original topic (or --to).

    Each record is decided by its key's record in the store. A key that is failed
    (exhausted; permanent too with --include-permanent) is re-run first (audited,
    fresh retry budget, needs --reason), committed before its latest dead letter is
    sent, once per key. Keys that already succeeded, failed permanently, or are in
    the consumer's hands (retryable_failed, processing) are skipped and counted;
    records without a record (undecodable, invalid) are republished as they are,
    once; a payload conflict is skipped while its key's record exists (it would
    conflict again); the dead letter of a copy this replay sent (marked
    idem.replay.group) is skipped, and one of any replay's as-is copy too; records
    without idem.* headers are reported and left alone.

    Only records inside the replay's boundary are acted on; the others are skipped
    as untrusted, each reported with its position and reason: a bad signature (or
    none, where signing keys are configured, unless --trust-unsigned), a topic that
    is not a source topic of this DLQ (the app's handlers with --app, else the DLQ's
    name less the suffix), a namespace that is not the replay's (--app's, or
    --namespace; without one no key is re-run), a value that does not build its key
    (with --app). A record whose target cannot take it (no such topic or partition,
    too large, not authorised) is skipped as unsendable and the batch goes on.

    Key and value bytes are unchanged; idem.replay.* headers record when, who and
    from which DLQ position. Each batch and the replay's position are committed in
    one Kafka transaction, so an interrupted replay, run again with the same
    filters and --to, continues where it stopped without sending anything twice
    and sends the keys it had re-run. --dry-run prints the same counts, per kind.
    """
    if prefix is not None:
        obj.overrides["name_prefix"] = prefix
    app = app_option(app_spec)
    s = obj.settings(app)
    topic = dlq_of(s, dlq_topic, source_topic)
    store_connection(s).close()  # a store never migrated: say so (exit 2) before any read
    chosen = selection(opts)
    would: list[dict[str, Any]] = []

    def on_action(rec: replay.DlqRecord, target: str, action: str) -> None:
        if not as_json:
            _would_send(rec, target, action)
        would.append({"partition": rec.partition, "offset": rec.offset,
                      "idempotency_key": rec.idempotency_key, "kind": rec.kind,
                      "target": target, "action": action})

    typed = dlq_typed(s, dlq_topic, source_topic,
                      partition=typed_option("--partition", opts["partition"]),
                      to_topic=typed_option("--to", to_topic), limit=typed_option("--limit", limit),
                      rate=typed_option("--rate", rate), app=typed_option("--app", app_spec),
                      namespace=typed_option("--namespace", opts["namespace"]))
    with typed:
        summary = replay.replay(  # a refusal (no --reason...): one line, exit 1 (cli_errors)
            s, store_of(s), topic, chosen, to_topic=to_topic, dry_run=dry_run, rate=rate,
            limit=limit, actor=actor or audit.default_actor(), progress=not no_progress,
            group=group, on_action=on_action if dry_run else None,
            include_permanent=include_permanent, reason=reason, app=app,
            trust_unsigned=trust_unsigned,
        )
    if as_json:
        echo_json({**summary.to_json(), **({"would_send_records": would} if dry_run else {})})
    else:
        _echo_summary(summary)
    if not summary.verified:
        warn("note: no signing key configured (KAFKA_IDEM_DLQ_SIGNING_KEYS): the records' "
             "headers could not be verified; only the topic and namespace boundary applied")
    if dry_run and summary.total("rerun") and not (reason or "").strip():
        warn(f"note: re-running these {summary.total('rerun')} failed key(s) needs "
             "--reason TEXT; without it the replay is refused")
    if summary.matched == 0 and summary.resumed:
        # The same replay ran before and went past every record: done, not a mistake.
        if not as_json:
            click.echo(plain(f"nothing new to replay: an earlier run of this replay (group "
                             f"{summary.group}) went past every matching record of {topic}"))
    elif summary.matched == 0:
        nothing(f"no record of {topic} matches (from the replay's position; "
                f"group {summary.group})")


_ACTION = {"rerun": "re-run, then send", "resend": "resend", "as_is": "send as-is"}


def _would_send(rec: replay.DlqRecord, target: str, action: str) -> None:
    click.echo(plain(f"would send {rec.dlq_topic}[{rec.partition}]@{rec.offset} -> {target}  "
                     f"kind={rec.kind} key={rec.idempotency_key or '-'}  "
                     f"({_ACTION.get(action, action)})"))


def _echo_summary(summary: replay.ReplaySummary) -> None:
    dry = summary.dry_run
    verb = "would send" if dry else "sent"
    count = summary.would_send if dry else summary.sent
    targets = ", ".join(f"{t}: {n}" for t, n in sorted(summary.targets.items())) or "-"
    rerun, resent = summary.total("rerun"), summary.total("resend")
    click.echo(
        f"{'dry run: ' if dry else ''}scanned {summary.scanned}, "
        f"matched {summary.matched}, {verb} {count} "
        f"({'would re-run' if dry else 're-run'} {rerun}, "
        f"{'would resend' if dry else 'resent'} {resent}, as-is {summary.total('as_is')}), "
        f"skipped (key already succeeded) {summary.skipped_succeeded}"
        + "".join(f", skipped ({replay.WHY[o]}) {summary.total(o)}"
                  for o in replay.SKIPS[1:] if summary.total(o))
    )
    for kind, per in sorted(summary.by_kind.items()):
        parts = ", ".join(f"{_OUTCOME_NAMES[o]} {per[o]}" for o in replay.OUTCOMES if per.get(o))
        click.echo(plain(f"  {kind}: {parts}"))
    if summary.untrusted:
        click.echo(plain("untrusted: " + ", ".join(
            f"{why} {n}" for why, n in sorted(summary.untrusted.items()))))
    for item in summary.unsendable:
        click.echo(plain(f"unsendable: {summary.dlq_topic}[{item['partition']}]@"
                         f"{item['offset']}: {item['reason']}"))
    click.echo(plain(f"targets: {targets}"))
    click.echo(plain(f"replay group: {summary.group}"))
    if summary.limited:
        click.echo("stopped at --limit; run the same command again to continue")


_OUTCOME_NAMES = {
    "rerun": "re-run", "resend": "resend", "as_is": "as-is",
    "skipped_succeeded": "skipped succeeded", "skipped_permanent": "skipped permanent",
    "skipped_in_progress": "skipped in progress", "skipped_duplicate": "skipped duplicate",
    "skipped_truncated": "skipped truncated", "skipped_ambiguous": "skipped ambiguous",
    "skipped_foreign": "skipped foreign", "skipped_replayed": "skipped replayed",
    "skipped_conflict": "skipped conflict", "skipped_untrusted": "skipped untrusted",
    "skipped_unsendable": "skipped unsendable",
}


__all__ = ["replay_"]
