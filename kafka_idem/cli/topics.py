"""``kafka-idem topics create MODULE:APP``: the topics an app needs, created once.

    kafka-idem topics create app:app
    kafka-idem topics create app:app --partitions 6 --replication-factor 3 --dry-run

Every handler's source and dead-letter topic, and the topics the app declares with
``app.topic(...)`` (:mod:`kafka_idem.admin.topics` has the rules: DLQs with their source's
partitions, ``cleanup.policy=delete`` and 30 days' retention). Running it again
creates nothing and exits 0; existing topics are never changed.

Exit codes: 0 every topic exists now; 2 a bad option, or the broker refused the
request for a reason the command or the app can fix (an impossible replication
factor, an invalid config), naming it; 3 Kafka unreachable or refusing (not
authorized to create topics).
"""

from __future__ import annotations

import click

from kafka_idem.admin import topics as topic_rules
from kafka_idem.admin.operations import parse_duration
from kafka_idem.cli.common import Ctx, load_app
from kafka_idem.observe.text import plain


@click.group()
def topics() -> None:
    """The Kafka topics an app needs."""


def _retention(_ctx: click.Context, _param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(parse_duration(value) * 1000)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


@topics.command()
@click.argument("app_spec", metavar="MODULE:APP")
@click.option("--partitions", type=click.IntRange(min=1),
              help="Partitions of new topics the app gives no count (default: the broker's "
              "num.partitions); a new DLQ always gets as many as its source.")
@click.option("--replication-factor", type=click.IntRange(min=1),
              help="Replication factor of new topics (default: the broker's "
              "default.replication.factor).")
@click.option("--dlq-retention", callback=_retention, metavar="DURATION",
              help="retention.ms of new DLQ topics, e.g. 30d (the default), 90d, 12h.")
@click.option("--dry-run", is_flag=True, help="Say what would be created; create nothing.")
@click.pass_obj
def create(obj: Ctx, app_spec: str, partitions: int | None, replication_factor: int | None,
           dlq_retention: int | None, dry_run: bool) -> None:
    """Create every topic MODULE:APP needs that does not exist yet: each handler's source
    and dead-letter topic and the topics the app declares (idempotent; existing topics are
    left as they are)."""
    from confluent_kafka.admin import AdminClient

    app = load_app(app_spec)
    s = obj.settings(app)
    admin = AdminClient(s.admin_config())
    done = topic_rules.create(app, admin, partitions=partitions,
                              replication_factor=replication_factor,
                              dlq_retention_ms=dlq_retention, dry_run=dry_run)
    for d in done:
        click.echo(plain(_line(d, dry_run)))
    made = sum(d.created for d in done)
    verb = "would create" if dry_run else "created"
    click.echo(f"{verb} {made} topic(s); {len(done) - made} existed already")


def _line(d: topic_rules.Done, dry_run: bool) -> str:
    what = {"source": "source", "dlq": "dead-letter topic", "declared": "declared",
            "outbox": "outbox control topic"}[d.role]
    parts = [what]
    if d.partitions is not None:
        parts.append(f"{d.partitions} partition{'s' if d.partitions != 1 else ''}")
    elif d.role == "dlq":
        parts.append("as many partitions as its source")
    else:
        parts.append("the broker's default partitions")
    retention = d.config.get("retention.ms") if d.created else None
    if retention is not None:
        parts.append(f"retention {_days(int(retention))}")
    if not d.created:
        line = f"exists        {d.name} ({', '.join(parts)})"
    else:
        line = f"{'would create' if dry_run else 'created':<13} {d.name} ({', '.join(parts)})"
    return line + (f": {d.note}" if d.note else "")


def _days(ms: int) -> str:
    if ms < 0:
        return "forever"
    if ms % 86_400_000 == 0:
        return f"{ms // 86_400_000} days"
    return f"{ms / 3_600_000:g} hours"


__all__ = ["topics"]
