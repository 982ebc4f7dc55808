"""The topics an app needs, and creating them (``kafka-idem topics create MODULE:APP``).

An app needs each handler's source topic, each handler's dead-letter topic, and
every topic it declares with :meth:`kafka_idem.App.topic` (one it produces to, or
the partition count a source should have) or :meth:`kafka_idem.App.event_topic` (one
its handlers emit to), and with event topics, its outbox control topic (one partition
per outbox shard, compacted)::

    >>> app.topic("inventory.reserve", partitions=6)
    >>> [t.name for t in needed(app)]
    ['inventory.reserve', 'inventory.reserve.dlq']

Creating is idempotent: a topic that exists is left exactly as it is (never given
more partitions: that would move keys to other partitions and break their order).
A new dead-letter topic gets as many partitions as its source has (the most of its
sources, when several handlers share it), ``cleanup.policy=delete`` (a compacted DLQ
would keep only the last dead letter of a key) and a retention of 30 days by
default: long enough to investigate, fix and ``dlq replay`` after a holiday. Source
topics keep the broker's defaults (``num.partitions``, ``log.retention.*``) unless
the app or the command says otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from kafka_idem.app import App
from kafka_idem.errors import BrokerError, ConfigError

DLQ_RETENTION_MS = 30 * 86_400_000
BROKER_DEFAULT = -1  # CreateTopics: the broker's num.partitions / default.replication.factor

Role = Literal["source", "dlq", "declared", "outbox"]

# The outbox control topic holds one small marker per shard (a partition each):
# compacted on one key, it keeps about one record per partition however long the
# relays run; the cleaner keeps the last committed marker (aborted ones are dropped).
OUTBOX_CONFIG = {"cleanup.policy": "compact", "segment.ms": "3600000",
                 "min.cleanable.dirty.ratio": "0.1"}

# What the broker says about a request the command's options or the app made wrong.
_CONFIG_ERRORS = {
    KafkaError.INVALID_REPLICATION_FACTOR: "replication_factor",
    KafkaError.INVALID_PARTITIONS: "partitions",
    KafkaError.INVALID_CONFIG: "config",
    KafkaError.POLICY_VIOLATION: "config",
    KafkaError.TOPIC_EXCEPTION: "topic",
}


@dataclass(frozen=True)
class Needed:
    """One topic the app needs: its role, the partitions and configs asked for."""

    name: str
    role: Role
    partitions: int | None = None  # None: --partitions, else the broker's default
    config: Mapping[str, str] = field(default_factory=dict)
    sources: tuple[str, ...] = ()  # a DLQ's source topics


@dataclass(frozen=True)
class Done:
    """What became of one topic: created, or found (and left alone)."""

    name: str
    role: Role
    created: bool
    partitions: int | None  # None: the broker's default (a dry run)
    config: Mapping[str, str] = field(default_factory=dict)
    note: str | None = None  # e.g. an existing DLQ with fewer partitions than its source


def needed(app: App) -> list[Needed]:
    """Every topic ``app`` needs, sources first, then DLQs, then the other declared ones."""
    declared = app.declared_topics
    out: dict[str, Needed] = {}
    for handler in app.handlers.values():
        decl = declared.get(handler.topic, {})
        out[handler.topic] = Needed(handler.topic, "source", decl.get("partitions"),
                                    dict(decl.get("config") or {}))
    dlqs: dict[str, list[str]] = {}
    for handler in app.handlers.values():
        dlqs.setdefault(app.dlq_topic(handler), []).append(handler.topic)
    for name, sources in dlqs.items():
        if name in out:  # a handler consumes its own DLQ topic: a source like the others
            continue
        decl = declared.get(name, {})
        config = {"cleanup.policy": "delete", "retention.ms": str(DLQ_RETENTION_MS),
                  **(decl.get("config") or {})}
        out[name] = Needed(name, "dlq", decl.get("partitions"), config, tuple(sources))
    for name, decl in declared.items():
        if name not in out:
            out[name] = Needed(name, "declared", decl.get("partitions"),
                               dict(decl.get("config") or {}))
    if app.event_topics:
        from kafka_idem.outbox import control_topic

        name = control_topic(app.settings, app.namespace)
        out[name] = Needed(name, "outbox", app.settings.outbox_shards, OUTBOX_CONFIG)
    return list(out.values())


def partition_counts(client: Any, *, timeout: float = 10.0) -> dict[str, int]:
    """Every topic the cluster shows us, with its partition count (``client``: a
    Consumer, Producer or AdminClient); :class:`BrokerError` when Kafka does not answer."""
    try:
        md = client.list_topics(timeout=timeout)
    except KafkaException as exc:
        raise BrokerError(f"Kafka did not answer a metadata request: {exc.args[0]}") from exc
    return {name: len(t.partitions) for name, t in md.topics.items() if t.error is None}


def broker_configs(admin: AdminClient, names: Iterable[str], *,
                   timeout: float = 10.0) -> dict[str, str]:
    """The values of broker configuration ``names`` (of the cluster's controller, or
    any broker); empty when the broker does not answer or does not allow it."""
    try:
        meta = admin.list_topics(timeout=timeout)
        broker = meta.controller_id if meta.controller_id >= 0 else next(iter(meta.brokers))
        resource = ConfigResource(ResourceType.BROKER, str(broker))
        found = admin.describe_configs([resource])[resource].result(timeout=timeout)
    except (KafkaException, StopIteration, TimeoutError):  # the caller says it without
        return {}
    return {n: found[n].value for n in names if n in found}


def missing(app: App, client: Any, *, timeout: float = 10.0) -> list[str]:
    """The topics ``app`` needs that the cluster does not have (or does not show us)."""
    have = partition_counts(client, timeout=timeout)
    return [t.name for t in needed(app) if t.name not in have]


def create(
    app: App,
    admin: AdminClient,
    *,
    partitions: int | None = None,
    replication_factor: int | None = None,
    dlq_retention_ms: int | None = None,
    dry_run: bool = False,
    timeout: float = 30.0,
) -> list[Done]:
    """Create the topics ``app`` needs that do not exist; return what became of each.

    Sources and declared topics first (``partitions``: for those the app gives no
    count; else the broker's default), then the DLQs, each with its source's partition
    count as the broker reports it. A refusal caused by the request (an impossible
    replication factor, an invalid config) is a :class:`ConfigError` naming the
    option; anything else the broker refuses is a :class:`BrokerError`."""
    if partitions is not None and partitions < 1:
        raise ConfigError("--partitions must be at least 1", setting="partitions")
    if replication_factor is not None and replication_factor < 1:
        raise ConfigError("--replication-factor must be at least 1",
                          setting="replication_factor")
    plan = needed(app)
    have = partition_counts(admin)
    done: dict[str, Done] = {}
    first = [t for t in plan if t.role != "dlq"]
    for t in first:
        if t.name in have:
            done[t.name] = _found(t, have[t.name])
    new = [(t, t.partitions or partitions) for t in first if t.name not in have]
    done.update(_create(admin, new, replication_factor, dry_run, timeout))
    if new and not dry_run:
        have = _settled(admin, [t.name for t, _ in new], timeout)
    dlqs = []
    for t in (t for t in plan if t.role == "dlq"):
        counts = [have.get(s) or (done[s].partitions if s in done else None) for s in t.sources]
        matching = max((c for c in counts if c), default=None)
        if t.name in have:
            done[t.name] = _found(t, have[t.name], matching)
            continue
        config = dict(t.config)
        if dlq_retention_ms is not None and "retention.ms" not in app.declared_topics.get(
                t.name, {}).get("config", {}):
            config["retention.ms"] = str(dlq_retention_ms)
        dlqs.append((Needed(t.name, t.role, t.partitions, config, t.sources),
                     t.partitions or matching or partitions))
    done.update(_create(admin, dlqs, replication_factor, dry_run, timeout))
    if dlqs and not dry_run:
        have = _settled(admin, [t.name for t, _ in dlqs], timeout)
    if (new or dlqs) and not dry_run:  # the counts as applied (the broker's defaults)
        done = {n: replace(d, partitions=have.get(n) or d.partitions) for n, d in done.items()}
    return [done[t.name] for t in plan]


def _settled(admin: AdminClient, names: list[str], timeout: float) -> dict[str, int]:
    """The cluster's topics once every one of ``names`` shows its partitions (metadata
    lags a creation by a moment: a DLQ must not be made before its source's count is
    known)."""
    deadline = time.monotonic() + timeout
    while True:
        have = partition_counts(admin)
        if all(have.get(n) for n in names) or time.monotonic() > deadline:
            return have
        time.sleep(0.1)


def _found(t: Needed, count: int, matching: int | None = None) -> Done:
    note = None
    if t.partitions is not None and count != t.partitions:
        note = f"the app asks for {t.partitions} partitions; left as it is"
    elif t.role == "outbox" and count < (t.partitions or 0):
        note = (f"FEWER partitions than the {t.partitions} outbox shards: the relay refuses "
                "to start; recreate it (with an empty outbox) or lower outbox_shards")
    elif t.role == "dlq" and matching is not None and count != matching:
        note = (f"its source has {matching} partitions; left as it is "
                "(dead letters still work)")
    return Done(t.name, t.role, False, count, note=note)


def _create(
    admin: AdminClient, todo: Iterable[tuple[Needed, int | None]], replication_factor: int | None,
    dry_run: bool, timeout: float,
) -> dict[str, Done]:
    todo = list(todo)
    if not todo:
        return {}
    if dry_run:
        return {t.name: Done(t.name, t.role, True, n, t.config) for t, n in todo}
    rf = replication_factor or BROKER_DEFAULT
    new = [NewTopic(t.name, num_partitions=n or BROKER_DEFAULT, replication_factor=rf,
                    config=dict(t.config)) for t, n in todo]
    futures = admin.create_topics(new, operation_timeout=timeout, request_timeout=timeout)
    out = {}
    for t, n in todo:
        try:
            futures[t.name].result(timeout=timeout)
            out[t.name] = Done(t.name, t.role, True, n, t.config)
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
            if err.code() == KafkaError.TOPIC_ALREADY_EXISTS:  # created meanwhile
                out[t.name] = Done(t.name, t.role, False, n, note="created meanwhile by another")
                continue
            setting = _CONFIG_ERRORS.get(err.code())
            if setting is not None:
                raise ConfigError(f"Kafka refused to create topic {t.name!r}: {err.str()}",
                                  setting=setting) from exc
            raise BrokerError(f"Kafka refused to create topic {t.name!r}: {err.str()}") from exc
    return out


__all__ = ["DLQ_RETENTION_MS", "Done", "Needed", "create", "missing", "needed",
           "partition_counts"]
