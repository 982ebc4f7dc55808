"""Retention purges: ``kafka-idem purge`` deletes old ``succeeded`` (and optionally
``failed``) records in audited batches, and refuses a window shorter than the source
topics' retention (:func:`purge_risk`), past which a redelivered message would find no
record and run again."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kafka_idem.admin import audit
from kafka_idem.admin.operations import set_admin_action
from kafka_idem.settings import Settings
from kafka_idem.settings.durations import format_duration as format_duration  # re-exported
from kafka_idem.store import Conn, Store, translate_errors


def topics_seen(conn: Conn, store: Store) -> list[str]:
    return store.topics_seen(conn)


RETENTION_FLOOR_SECONDS = 3600.0
"""The shortest purge window allowed without ``--force`` when a source topic's
``retention.ms`` cannot be read (broker unreachable, describe_configs failing, the
topic gone) or no topic is known."""


@dataclass(frozen=True)
class TopicRetention:
    """A source topic's ``retention.ms`` as the broker reported it (-1: kept forever),
    or ``None`` and ``why`` it could not be read."""

    topic: str
    ms: int | None
    why: str = ""


@dataclass(frozen=True)
class PurgeRisk:
    """Why a purge window is too short: a source message redelivered from before the
    window (a restart from an old offset, a group reset, a replay) would find no
    record and its effect would run again.

    ``retention`` is the topic that decides: the one keeping messages longest (or
    forever), or one whose retention could not be read (``ms`` ``None``; with no
    topic at all, ``None``) when the window is under :data:`RETENTION_FLOOR_SECONDS`.
    """

    window: float
    retention: TopicRetention | None
    others: int = 0  # more topics whose retention could not be read

    @property
    def needed(self) -> float | None:
        """The shortest window that is not too short; ``None``: none (kept forever)."""
        if self.retention is None or self.retention.ms is None:
            return RETENTION_FLOOR_SECONDS
        if self.retention.ms < 0:
            return None
        return self.retention.ms / 1000

    def facts(self, window: str) -> str:
        """What is too short and why it matters (``window``: as the user typed it)."""
        r = self.retention
        if r is None:
            what = (f"no record names its source topic, so no retention.ms could be read, "
                    f"and {window} is under the one-hour floor that applies then")
        elif r.ms is None:
            more = f" (and of {self.others} more)" if self.others else ""
            what = (f"the retention of topic {r.topic}{more} could not be read ({r.why}), "
                    f"and {window} is under the one-hour floor that applies then")
        elif r.ms < 0:
            what = (f"topic {r.topic} keeps messages forever (retention.ms=-1), so any "
                    f"window is too short")
        else:
            what = (f"topic {r.topic} keeps messages for {format_duration(r.ms / 1000)} "
                    f"(retention.ms={r.ms}), longer than the window {window}")
        return (f"{what}: a source message redelivered from before the window would find no "
                "record and its effect would run again")

    def way_forward(self) -> str:
        topic = (f"topic {self.retention.topic}" if self.retention is not None
                 else "the source topics")
        force = f"--force if {topic} will never be re-read from before the window"
        needed = self.needed
        if needed is None:
            return f"no window is long enough; give {force}"
        return f"give --older-than {format_duration(needed)} or longer, or {force}"

    def refusal(self, window: str) -> str:
        """The one line of a refused purge."""
        return f"purge --older-than {window}: {self.facts(window)}; {self.way_forward()}"


def purge_risk(window: float, retentions: list[TopicRetention]) -> PurgeRisk | None:
    """Why ``window`` (seconds) is too short for the source topics whose retention is
    ``retentions`` (:func:`topics_seen`), or ``None`` when it is long enough: at least
    the longest ``retention.ms`` (a topic kept forever: no window is), and at least
    :data:`RETENTION_FLOOR_SECONDS` when a topic's retention could not be read or no
    topic is known. Only ``retention.ms`` is read (not ``retention.bytes``, nor
    compaction, which keeps a key's latest message whatever its age)."""
    forever = [r for r in retentions if r.ms is not None and r.ms < 0]
    if forever:
        return PurgeRisk(window, forever[0])
    read = [r for r in retentions if r.ms is not None]
    longest = max(read, key=lambda r: r.ms or 0, default=None)
    if longest is not None and longest.ms is not None and longest.ms / 1000 > window:
        return PurgeRisk(window, longest)
    unread = [r for r in retentions if r.ms is None]
    if (unread or not retentions) and window < RETENTION_FLOOR_SECONDS:
        return PurgeRisk(window, unread[0] if unread else None, others=max(len(unread) - 1, 0))
    return None


def purge_statuses(include_failed: bool) -> list[str]:
    return ["succeeded", "failed"] if include_failed else ["succeeded"]


def purge_preview(conn: Conn, store: Store, *, older_than: float,
                  include_failed: bool) -> dict[str, int]:
    """What :func:`purge` would delete now, by status; changes nothing, audits nothing."""
    counts = store.purge_count(conn, statuses=purge_statuses(include_failed),
                               older_than=older_than)  # its errors translated there
    conn.rollback()
    return counts


def purge(
    conn: Conn,
    store: Store,
    *,
    older_than: float,
    include_failed: bool,
    batch_size: int,
    actor: str,
    reason: str | None = None,
    force: bool = False,
    between: Callable[[int, float], bool] | None = None,
    noted: dict[str, Any] | None = None,
) -> int:
    """Delete old ``succeeded`` (and optionally ``failed``) records in batches.

    Each batch is its own transaction with its own audit row, so a long purge
    never holds many locks and an interrupted one leaves an exact trail. The
    window is not checked here (the CLI and the background retention check it
    against the source topics' retention, :func:`purge_risk`); ``force`` (it was
    purged with ``--force``) and ``noted`` are kept in each audit row's selection.
    ``between`` is called after each full batch with what it deleted and the seconds
    it took, and may pause (the background retention paces itself); false stops the
    purge there.
    """
    statuses = purge_statuses(include_failed)
    selection = {"older_than_seconds": older_than, "statuses": statuses,
                 "namespace": store.namespace, "force": force, **(noted or {})}
    total = 0
    while True:
        started = time.monotonic()
        with translate_errors(), conn.transaction():
            set_admin_action(conn, store, "purge")
            deleted = store.purge_batch(conn, statuses=statuses, older_than=older_than,
                                        batch_size=batch_size)
            if deleted:
                audit.record(conn, store, actor=actor, action="purge", selection=selection,
                             reason=reason, counts={"deleted": deleted})
        total += deleted
        if deleted < batch_size:
            return total
        if between is not None and not between(deleted, time.monotonic() - started):
            return total


RETENTION_READ_SECONDS = 10.0
"""How long ``purge`` waits for the source topics' retention.ms, at most."""


def read_retention(s: Settings, topics: list[str], *,
                   timeout: float = RETENTION_READ_SECONDS) -> list[TopicRetention]:
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
        return [TopicRetention(t, None, why) for t in topics]
    deadline = time.monotonic() + timeout
    while (not down and time.monotonic() < deadline
           and not all(f.done() for f in futures.values())):
        client.poll(0.05)
    where = f"Kafka at {s.bootstrap_servers}"
    out: list[TopicRetention] = []
    for topic, res in resources.items():
        fut = futures[res]
        if not fut.done():
            why = (f"{where} is unreachable: {down[0]}" if down
                   else f"{where} did not answer within {timeout:g}s")
            out.append(TopicRetention(topic, None, why))
            continue
        try:
            entry = fut.result(timeout=0)["retention.ms"]
            out.append(TopicRetention(topic, int(entry.value)))
        except Exception as exc:  # the topic gone, not authorized, no retention.ms
            out.append(TopicRetention(topic, None, f"{where}: {_kafka_text(exc)}"))
    return out


def _kafka_text(exc: BaseException) -> str:
    """A Kafka error's own words (``Broker: Unknown topic or partition``)."""
    err = exc.args[0] if exc.args else None
    words = getattr(err, "str", None)
    text = words() if callable(words) else str(exc)
    return str(text) or type(exc).__name__
