"""The consumer group as the broker sees it: members, the partitions each holds, the
committed offset and the lag of every partition of the app's topics (the console's
overview). Read with the admin client: the console never joins the group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]

from kafka_idem.settings import Settings

TIMEOUT = 5.0


@dataclass
class PartitionLag:
    topic: str
    partition: int
    committed: int | None  # None: nothing committed yet
    end: int | None
    member: str | None  # the client id@host of the member that holds it, if any

    @property
    def lag(self) -> int | None:
        if self.end is None:
            return None
        return max(self.end - (self.committed or 0), 0) if self.committed is not None else None


@dataclass
class GroupView:
    group: str
    state: str = "unknown"
    members: list[dict[str, Any]] = field(default_factory=list)
    partitions: list[PartitionLag] = field(default_factory=list)
    error: str | None = None

    @property
    def total_lag(self) -> int:
        return sum(p.lag or 0 for p in self.partitions)


def describe(settings: Settings, group: str, topics: list[str],
             admin: AdminClient | None = None) -> GroupView:
    """``group``'s state, members and per-partition committed offsets and lag over
    ``topics``; a broker that does not answer gives a view with ``error`` set.
    ``admin``: a client to reuse (else one is made for this call)."""
    view = GroupView(group)
    admin = admin or AdminClient(settings.admin_config())
    try:
        described = admin.describe_consumer_groups([group], request_timeout=TIMEOUT)[group]
        desc = described.result(timeout=TIMEOUT)
        view.state = str(getattr(desc.state, "name", desc.state)).lower()
        held: dict[tuple[str, int], str] = {}
        for m in desc.members:
            tps = list(m.assignment.topic_partitions) if m.assignment else []
            who = f"{m.client_id}@{m.host}"
            view.members.append({"member_id": m.member_id, "client_id": m.client_id,
                                 "host": m.host, "partitions": sorted(
                                     (tp.topic, tp.partition) for tp in tps)})
            for tp in tps:
                held[(tp.topic, tp.partition)] = who
        md = admin.list_topics(timeout=TIMEOUT)
        tps = [TopicPartition(t, p) for t in topics if t in md.topics
               for p in sorted(md.topics[t].partitions)]
        if not tps:
            return view
        offsets = admin.list_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(group, tps)], request_timeout=TIMEOUT)[group]
        committed = {(tp.topic, tp.partition): tp.offset
                     for tp in offsets.result(timeout=TIMEOUT).topic_partitions}
        latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]
        ends_f = admin.list_offsets({tp: latest for tp in tps},
                                    request_timeout=TIMEOUT)
        ends = {(tp.topic, tp.partition): f.result(timeout=TIMEOUT).offset
                for tp, f in ends_f.items()}
        for tp in tps:
            at = (tp.topic, tp.partition)
            c = committed.get(at)
            view.partitions.append(PartitionLag(
                tp.topic, tp.partition, c if c is not None and c >= 0 else None,
                ends.get(at), held.get(at)))
    except (KafkaException, TimeoutError, RuntimeError) as exc:
        view.error = f"{type(exc).__name__}: {exc}"
    return view
