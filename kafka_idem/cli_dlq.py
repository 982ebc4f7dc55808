"""``kafka-idem dlq list|show|replay``: inspect and replay dead-letter topics.

    kafka-idem dlq list --topic payments.charge-requested --kind permanent
    kafka-idem dlq show --dlq payments.charge-requested.dlq --partition 0 --offset 42
    kafka-idem dlq replay --topic payments.charge-requested --since 2024-05-01T00:00Z --dry-run

Exit codes: 0 ok; 1 nothing matched, or refused (re-running failed keys without
--reason); 2 usage or configuration error; 3 operational
error (Kafka or the database unreachable or refusing). Keys, error texts and headers
are printed as plain text (never markup), control characters escaped.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import click

from kafka_idem import audit, replay
from kafka_idem.app import App
from kafka_idem.cli_admin import store_connection
from kafka_idem.cli_errors import as_typed, warn
from kafka_idem.cli_table import Grid, emit
from kafka_idem.cli_text import plain, to_json
from kafka_idem.dlq import ERROR_KINDS
from kafka_idem.settings import Settings
from kafka_idem.signing import MEANING, verify
from kafka_idem.store import Store

F = TypeVar("F", bound=Callable[..., Any])

MESSAGE_WIDTH = 60


class _Obj(Protocol):
    """What the parent ``kafka-idem`` group puts in ``ctx.obj`` (``cli.Ctx``)."""

    overrides: dict[str, Any]

    def settings(self, app: App | None = None) -> Settings: ...


def _when(ctx: click.Context, param: click.Parameter, value: str | None) -> dt.datetime | None:
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


def _topic_options(fn: F) -> F:
    fn = click.option("--topic", "source_topic", metavar="SOURCE",
                      help="Source topic; the DLQ is SOURCE + the DLQ suffix (.dlq).")(fn)
    fn = click.option("--dlq", "dlq_topic", metavar="TOPIC", help="The DLQ topic.")(fn)
    return fn


def _selection_options(fn: F) -> F:
    options = [
        click.option("--key", help="Only this idempotency key."),
        click.option("--kind", type=click.Choice(ERROR_KINDS), help="Only this error kind."),
        click.option("--error-class", metavar="NAME",
                     help="Only records whose idem.error.class is NAME (e.g. TypeError: "
                     "the code defects a fix addressed)."),
        click.option("--handler", help="Only records of this handler."),
        click.option("--namespace", help="Only records of this namespace (records written "
                     "before namespaces have none: they match)."),
        click.option("--since", metavar="ISO-DATETIME", callback=_when,
                     help="Last failure at or after this time (ISO 8601; UTC if no offset)."),
        click.option("--until", metavar="ISO-DATETIME", callback=_when,
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


def _selection(opts: dict[str, Any]) -> replay.Selection:
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


def _dlq_topic(s: Settings, dlq_topic: str | None, source_topic: str | None) -> str:
    if bool(dlq_topic) == bool(source_topic):
        raise click.UsageError("give exactly one of --dlq TOPIC or --topic SOURCE")
    return dlq_topic or replay.dlq_topic_for(s, source_topic or "")


def _typed(s: Settings, dlq_topic: str | None, source_topic: str | None,
           **options: str | None) -> AbstractContextManager[None]:
    """:func:`~kafka_idem.cli_errors.as_typed` for the options the user typed, by the
    replay parameter each one filled: the DLQ named by --dlq or --topic, and
    ``options`` (``partition="--partition 3"``...)."""
    if dlq_topic:
        return as_typed({"dlq_topic": f"--dlq {dlq_topic}", **options})
    return as_typed({"dlq_topic": f"--topic {source_topic}", **options}, hints={
        "dlq_topic": f"the DLQ of --topic SOURCE is SOURCE + the dlq_suffix setting "
                     f"{s.dlq_suffix!r}; --dlq TOPIC names a DLQ itself"})


def _app(app_spec: str | None) -> App | None:
    """The app given with --app, imported."""
    if not app_spec:
        return None
    from kafka_idem.cli import load_app

    return load_app(app_spec, param_hint="'--app'")


def _option(name: str, value: object | None) -> str | None:
    return None if value is None else f"{name} {value}"


def _nothing(message: str) -> None:
    """Nothing matched: one ``error:`` line, like every failure, and exit 1."""
    click.echo(plain(f"error: {message}"), err=True)
    click.get_current_context().exit(1)


def _echo_json(data: Any) -> None:
    click.echo(to_json(data, sort_keys=True))


def _short(text: str | None, width: int = MESSAGE_WIDTH) -> str:
    text = plain(" ".join((text or "").split()))
    return text if len(text) <= width else text[: width - 1] + "…"


def _time(value: dt.datetime | None) -> str:
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S") if value else ""


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def dlq() -> None:
    """Dead-letter topics: list and show records, replay them after a fix.

    The DLQ is named with --dlq TOPIC, or --topic SOURCE for SOURCE's default DLQ.
    Filters (all optional, all must match): --key, --kind, --error-class, --handler,
    --namespace, --since/--until
    (on the last failure time), --partition, --from-offset/--to-offset (DLQ positions).
    Exit codes: 0 ok, 1 nothing matched, 2 usage error, 3 Kafka or the database failed.
    """


@dlq.command("list")
@_topic_options
@_selection_options
@click.option("--limit", type=click.IntRange(min=1), default=1000, show_default=True,
              help="At most this many records.")
@click.option("--app", "app_spec", metavar="MODULE:APP",
              help="Also say, per record, whether a replay with --app would trust it "
              "(column trust: ok, or why not).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (a JSON list).")
@click.pass_obj
def list_(obj: _Obj, /, dlq_topic: str | None, source_topic: str | None, limit: int,
          app_spec: str | None, as_json: bool, **opts: Any) -> None:
    """List DLQ records (position, time, error kind and class, key, handler, attempts,
    whether its signature holds; with --app, whether a replay would trust it)."""
    app = _app(app_spec)
    s = obj.settings(app)
    topic = _dlq_topic(s, dlq_topic, source_topic)
    with _typed(s, dlq_topic, source_topic, app=_option("--app", app_spec)):
        boundary = replay.Boundary.of(s, topic, app=app) if app is not None else None
    selection = _selection(opts)
    records: list[replay.DlqRecord] = []
    more = False
    with _typed(s, dlq_topic, source_topic,
                         partition=_option("--partition", opts["partition"])):
        found = replay.scan(s, topic, selection)
        try:
            for rec in found:
                if len(records) == limit:
                    more = True
                    break
                records.append(rec)
        finally:
            found.close()
    if not records:
        _nothing(f"no record of {topic} matches")
    records.sort(key=lambda r: (r.partition, r.offset))
    keys = s.signing_keys
    trust = _trust(s, boundary, records)
    if as_json:
        _echo_json([{**r.to_json(), "signature": _signature(keys, r),
                     **({"trust": trust[i]} if trust else {})}
                    for i, r in enumerate(records)])
        return
    columns = LIST_COLUMNS + (["trust"] if boundary is not None else [])
    table = Grid(columns, title=f"{topic}: {len(records)} record(s)"
                 + (" (--limit reached)" if more else ""))
    for i, r in enumerate(records):
        verdict = [trust[i]] if trust else []
        table.add(r.partition, r.offset, _time(r.last_failure_at), r.kind, r.error_class,
                  r.idempotency_key, r.namespace or "", r.handler, r.attempts,
                  _short(r.error_message), _signature(keys, r), *verdict)
    emit(table)


LIST_COLUMNS = ["partition", "offset", "last failure (UTC)", "kind", "class", "key",
                "namespace", "handler", "attempts", "message", "signature"]


def _trust(s: Settings, boundary: replay.Boundary | None,
           records: list[replay.DlqRecord]) -> list[str]:
    """Per record, what a replay with --app would say of it ("ok" or why not); the
    request hashes come from the store (empty without --app)."""
    if boundary is None:
        return []
    conn = store_connection(s)
    try:
        states = boundary.states(conn, Store(schema=s.schema_name, table=s.table), records)
    finally:
        conn.close()
    return [boundary.verdict(r, states.get(r.idempotency_key or "")) for r in records]


def _signature(keys: tuple[bytes, ...], rec: replay.DlqRecord) -> str:
    """valid, invalid, unsigned, or unverifiable (no signing key configured)."""
    return verify(keys, rec.headers, rec.key, rec.value)


@dlq.command()
@_topic_options
@click.option("--partition", type=click.IntRange(min=0), required=True, help="DLQ partition.")
@click.option("--offset", type=click.IntRange(min=0), required=True, help="DLQ offset.")
@click.option("--payload", is_flag=True, help="Also show the value: decoded as JSON by the "
              "handler's codec with --app (else JSON text, parsed); when it does not "
              "decode, its text if it is UTF-8, else base64.")
@click.option("--app", "app_spec", metavar="MODULE:APP",
              help="The app whose DLQ this is: its handler of the record's original topic "
              "decodes --payload, and the record's trust is judged as a replay with --app "
              "would (topic, namespace, whether its value builds its key).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_obj
def show(obj: _Obj, dlq_topic: str | None, source_topic: str | None, partition: int,
         offset: int, payload: bool, app_spec: str | None, as_json: bool) -> None:
    """Show one DLQ record: every header, the Kafka key, the value's size (with
    --payload, the value itself) and whether its signature holds (with --app, whether
    a replay would trust it)."""
    app = _app(app_spec)
    s = obj.settings(app)
    topic = _dlq_topic(s, dlq_topic, source_topic)
    with _typed(s, dlq_topic, source_topic, partition=_option("--partition", partition),
                app=_option("--app", app_spec)):
        boundary = replay.Boundary.of(s, topic, app=app) if app is not None else None
        rec = replay.read_one(s, topic, partition, offset)
    if rec is None:
        _nothing(f"no record at {topic}[{partition}]@{offset}")
        return
    shown = replay.payload_view(rec, app) if payload else None
    signature = _signature(s.signing_keys, rec)
    trust = _trust(s, boundary, [rec])[0] if boundary is not None else None
    if as_json:
        _echo_json({**rec.to_json(), "signature": signature,
                    **({"trust": trust} if trust is not None else {}),
                    **({"payload": shown} if shown is not None else {})})
        return
    size = "null" if rec.value is None else f"{len(rec.value)} bytes"
    click.echo(plain(f"{topic}[{partition}]@{offset}"))
    click.echo(plain(f"timestamp:  {rec.timestamp.isoformat() if rec.timestamp else '-'}"))
    click.echo(plain(f"kafka key:  {replay.display_bytes(rec.key)}"))
    click.echo(f"value:      {size}")
    click.echo(f"signature:  {signature} ({MEANING[signature]})")
    if trust is not None:
        click.echo(plain(f"trust:      {trust}" + (
            f" ({replay.REASONS[trust]})" if trust in replay.REASONS else
            " (a replay with --app would act on it)")))
    table = Grid(["name", "value"], title="headers")
    for name, value in rec.headers:
        table.add(name, replay.display_bytes(value))
    emit(table)
    if shown is not None:
        _echo_payload(shown)


def _echo_payload(shown: dict[str, Any]) -> None:
    if "value" in shown:
        click.echo(plain(f"payload ({shown['decoded_by']}):"))
        click.echo(json.dumps(shown["value"], indent=2, sort_keys=True, ensure_ascii=True))
        return
    why = f"does not decode: {shown['error']}" if shown.get("error") else "not decoded"
    click.echo(plain(f"payload {why}"))
    if shown.get("text") is not None:
        click.echo(plain(f"raw text: {shown['text']}"))
    elif shown.get("base64") is not None:
        click.echo(f"raw bytes (base64): {shown['base64']}")


@dlq.command("replay")
@_topic_options
@_selection_options
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
@click.option("--reason", help="Why failed keys are re-run (kept in each key's audit row); "
              "required when the replay re-runs failed keys.")
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
def replay_(obj: _Obj, /, dlq_topic: str | None, source_topic: str | None, to_topic: str | None,
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
    app = _app(app_spec)
    s = obj.settings(app)
    topic = _dlq_topic(s, dlq_topic, source_topic)
    store_connection(s).close()  # a store never migrated: say so (exit 2) before any read
    selection = _selection(opts)
    would: list[dict[str, Any]] = []

    def on_action(rec: replay.DlqRecord, target: str, action: str) -> None:
        if not as_json:
            _would_send(rec, target, action)
        would.append({"partition": rec.partition, "offset": rec.offset,
                      "idempotency_key": rec.idempotency_key, "kind": rec.kind,
                      "target": target, "action": action})

    typed = _typed(s, dlq_topic, source_topic, partition=_option("--partition", opts["partition"]),
                   to_topic=_option("--to", to_topic), limit=_option("--limit", limit),
                   rate=_option("--rate", rate), app=_option("--app", app_spec),
                   namespace=_option("--namespace", opts["namespace"]))
    with typed:
        summary = replay.replay(  # a refusal (no --reason...): one line, exit 1 (cli_errors)
            s, None, topic, selection, to_topic=to_topic, dry_run=dry_run, rate=rate,
            limit=limit, actor=actor or audit.default_actor(), progress=not no_progress,
            group=group, on_action=on_action if dry_run else None,
            include_permanent=include_permanent, reason=reason, app=app,
            trust_unsigned=trust_unsigned,
        )
    if as_json:
        _echo_json({**summary.to_json(), **({"would_send_records": would} if dry_run else {})})
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
        _nothing(f"no record of {topic} matches (from the replay's position; "
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


__all__ = ["dlq"]
