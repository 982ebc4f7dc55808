"""What a member checks and sets once as it starts: the store's schema and unadopted
records (:func:`check_schema`), the topics the cluster lacks (:func:`absent_topics`,
said once each by :func:`warn_missing`),
and the garbage collector's thresholds (:func:`tune_gc`)."""

from __future__ import annotations

import gc
import logging

from confluent_kafka.admin import AdminClient

from kafka_idem.admin import topics
from kafka_idem.admin.migrate import require_current
from kafka_idem.admin.namespaces import refuse_unassigned
from kafka_idem.app import App
from kafka_idem.errors import FrameworkError
from kafka_idem.settings import Settings
from kafka_idem.store import Store, connect
from kafka_idem.store.citus import fit, refuse_uncolocated

log = logging.getLogger(__name__)

# What a member (or a relay) started before `migrate` says to run: the store's
# migrations and the app's own (its tables), with the app (`kafka-idem run` names it).
MIGRATE_COMMAND = "kafka-idem migrate --app MODULE:APP"


def check_schema(settings: Settings, store: Store, app: App, *,
                 migrate_command: str | None = None) -> None:
    """Refuse to run on a store older than this code (deploy-before-migrate), naming
    ``migrate_command``, or while records of this app's handlers from before namespaces
    wait to be adopted."""
    conn = connect(settings.dsn, application_name=f"kafka_idem:{app.name}")
    try:
        require_current(conn, settings.schema_name, command=migrate_command or MIGRATE_COMMAND)
        if fit(conn, store):
            app.outbox.store.distribute()  # ctx.emit's statements: the same flavour
            refuse_uncolocated(conn, store, app.sessions.table_names())
        refuse_unassigned(conn, store, app)
    finally:
        conn.close()


def absent_topics(settings: Settings, app: App) -> list[str]:
    """The topics the app needs that the cluster lacks, asked once before joining
    (librdkafka would otherwise report each subscribed one as it notices it); none
    when the broker is not answering yet (the loop will say)."""
    # Its own client: a full metadata request on the consumer keeps librdkafka from
    # noticing a subscribed topic created later (until its 5-minute refresh).
    admin = AdminClient(settings.admin_config())
    try:
        return topics.missing(app, admin, timeout=5.0)
    except FrameworkError as exc:
        log.debug("topic check skipped: %s", exc, extra={"action": "topics"})
        return []


def warn_missing(warned: set[str], absent: list[str], command: str,
                 logger: logging.Logger) -> None:
    """Say once which of the ``absent`` topics were not ``warned`` about yet (noted
    there), with the ``command`` that creates them, on ``logger`` (the member's loop's:
    operators filter on it)."""
    new = [t for t in absent if t not in warned]
    if not new:
        return
    warned.update(new)
    logger.warning(
        "topic%s %s do%s not exist; create %s with: %s (this member starts consuming a "
        "topic as soon as it exists)", "s" if len(new) > 1 else "", ", ".join(new),
        "" if len(new) > 1 else "es", "them" if len(new) > 1 else "it",
        command, extra={"action": "topics_missing", "topic": ",".join(new)})


GC_YOUNG_THRESHOLD = 10_000  # allocations between collections of the youngest generation


def tune_gc() -> None:
    """Fewer, cheaper garbage collections on the loop thread (``gc_tuning``): what the
    member made while starting (modules, the app, clients) is frozen out of every
    collection, and the youngest generation is collected every 10,000 net allocations
    instead of 700, so the older ones, which scan more, run proportionally less often.
    Measured on the gateway benchmark: collections took 8-10% of the loop thread before,
    about half that after (docs/PERFORMANCE.md). Once per process."""
    _, older, oldest = gc.get_threshold()
    if gc.get_threshold()[0] < GC_YOUNG_THRESHOLD:
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
