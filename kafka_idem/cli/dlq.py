"""``kafka-idem dlq list|show|replay``: inspect and replay dead-letter topics.

    kafka-idem dlq list --topic payments.charge-requested --kind permanent
    kafka-idem dlq show --dlq payments.charge-requested.dlq --partition 0 --offset 42
    kafka-idem dlq replay --topic payments.charge-requested --since 2024-05-01T00:00Z --dry-run

``dlq replay`` is :mod:`~kafka_idem.cli.dlq_replay`'s (added to the group by
:mod:`~kafka_idem.cli.commands`); the options the commands share are
:mod:`~kafka_idem.cli.common`'s.

Exit codes: 0 ok; 1 nothing matched, or refused (re-running failed keys without
--reason); 2 usage or configuration error; 3 operational
error (Kafka or the database unreachable or refusing). Keys, error texts and headers
are printed as plain text (never markup), control characters escaped.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import click

from kafka_idem import replay
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
from kafka_idem.cli.table import Grid, emit
from kafka_idem.deadletters.signing import MEANING, verify
from kafka_idem.observe.text import plain
from kafka_idem.settings import Settings

MESSAGE_WIDTH = 60


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
@topic_options
@selection_options
@click.option("--limit", type=click.IntRange(min=1), default=1000, show_default=True,
              help="At most this many records.")
@click.option("--app", "app_spec", metavar="MODULE:APP",
              help="Also say, per record, whether a replay with --app would trust it "
              "(column trust: ok, or why not).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (a JSON list).")
@click.pass_obj
def list_(obj: Ctx, /, dlq_topic: str | None, source_topic: str | None, limit: int,
          app_spec: str | None, as_json: bool, **opts: Any) -> None:
    """List DLQ records (position, time, error kind and class, key, handler, attempts,
    whether its signature holds; with --app, whether a replay would trust it)."""
    app = app_option(app_spec)
    s = obj.settings(app)
    topic = dlq_of(s, dlq_topic, source_topic)
    with dlq_typed(s, dlq_topic, source_topic, app=typed_option("--app", app_spec)):
        boundary = replay.Boundary.of(s, topic, app=app) if app is not None else None
    chosen = selection(opts)
    records: list[replay.DlqRecord] = []
    more = False
    with dlq_typed(s, dlq_topic, source_topic,
                   partition=typed_option("--partition", opts["partition"])):
        found = replay.scan(s, topic, chosen)
        try:
            for rec in found:
                if len(records) == limit:
                    more = True
                    break
                records.append(rec)
        finally:
            found.close()
    if not records:
        nothing(f"no record of {topic} matches")
    records.sort(key=lambda r: (r.partition, r.offset))
    keys = s.signing_keys
    trust = _trust(s, boundary, records)
    if as_json:
        echo_json([{**r.to_json(), "signature": _signature(keys, r),
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
        states = boundary.states(conn, store_of(s), records)
    finally:
        conn.close()
    return [boundary.verdict(r, states.get(r.idempotency_key or "")) for r in records]


def _signature(keys: tuple[bytes, ...], rec: replay.DlqRecord) -> str:
    """valid, invalid, unsigned, or unverifiable (no signing key configured)."""
    return verify(keys, rec.headers, rec.key, rec.value)


@dlq.command()
@topic_options
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
def show(obj: Ctx, dlq_topic: str | None, source_topic: str | None, partition: int,
         offset: int, payload: bool, app_spec: str | None, as_json: bool) -> None:
    """Show one DLQ record: every header, the Kafka key, the value's size (with
    --payload, the value itself) and whether its signature holds (with --app, whether
    a replay would trust it)."""
    app = app_option(app_spec)
    s = obj.settings(app)
    topic = dlq_of(s, dlq_topic, source_topic)
    with dlq_typed(s, dlq_topic, source_topic, partition=typed_option("--partition", partition),
                   app=typed_option("--app", app_spec)):
        boundary = replay.Boundary.of(s, topic, app=app) if app is not None else None
        rec = replay.read_one(s, topic, partition, offset)
    if rec is None:
        nothing(f"no record at {topic}[{partition}]@{offset}")
        return
    shown = replay.payload_view(rec, app) if payload else None
    signature = _signature(s.signing_keys, rec)
    trust = _trust(s, boundary, [rec])[0] if boundary is not None else None
    if as_json:
        echo_json({**rec.to_json(), "signature": signature,
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


__all__ = ["dlq"]
