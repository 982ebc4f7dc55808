"""The Kafka side of ``kafka-idem verify``: topics, producing, committed offsets, reading
a topic to its end, describing a group. Every read is bounded and only asks the broker."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from kafka_idem.errors import BrokerError
from kafka_idem.settings import Settings

TIMEOUT = 30.0
T = TypeVar("T")


class Timeout(Exception):
    """A condition the scenario waited for did not come true in time."""


def wait_for(predicate: Callable[[], Any], *, timeout: float, what: str,
             interval: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something truthy; :class:`Timeout` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise Timeout(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@dataclass(frozen=True)
class Sent:
    """One record produced and acknowledged."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes


_TRANSIENT = {
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError._TIMED_OUT,
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
}


def retrying(fn: Callable[[], T], *, what: str, timeout: float = TIMEOUT,
             also: frozenset[int] = frozenset()) -> T:
    """``fn()``, again after a short pause while the broker answers with a transient
    error (a coordinator moving or loading, a leader election, a timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            transient = isinstance(err, KafkaError) and (
                err.code() in _TRANSIENT or err.code() in also
                or (err.retriable() and not err.fatal()))
            if not transient or time.monotonic() > deadline:
                raise BrokerError(f"{what}: {exc}") from exc
            time.sleep(0.5)


def headers(msg: Any) -> dict[str, str]:
    return {k: (v or b"").decode("utf-8", "replace") for k, v in (msg.headers() or [])}


class Kafka:
    def __init__(self, settings: Settings, run_id: str) -> None:
        self.settings = settings
        self.run_id = run_id
        self._admin: AdminClient | None = None

    @property
    def admin(self) -> AdminClient:
        if self._admin is None:  # made once the broker answered (see check)
            self._admin = AdminClient(self.settings.admin_config())
        return self._admin

    def _consumer(self, group: str, **extra: Any) -> Consumer:
        conf = self.settings.consumer_config(group)
        conf.update(extra)
        return Consumer(conf)

    def check(self) -> None:
        # A client of its own with librdkafka's logging off: an unreachable broker is
        # reported once, below, not by a log line per reconnect attempt.
        probe = AdminClient({**self.settings.admin_config(), "log_level": 0})
        try:
            probe.list_topics(timeout=10)
        except KafkaException as exc:
            raise BrokerError(f"Kafka at {self.settings.bootstrap_servers} is not reachable: "
                              f"{exc}") from exc

    def create_topics(self, names: Sequence[str], partitions: int) -> None:
        def create() -> None:
            # Replication factor: the broker's default (-1), so this works on real clusters.
            futures = self.admin.create_topics(
                [NewTopic(n, num_partitions=partitions, replication_factor=-1) for n in names],
                operation_timeout=TIMEOUT,
            )
            for f in futures.values():
                try:
                    f.result(timeout=TIMEOUT)
                except KafkaException as exc:  # fresh names: "exists" means our own retry
                    if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                        raise

        retrying(create, what=f"creating topics {list(names)}")

        def ready() -> bool:
            try:
                md = self.admin.list_topics(timeout=10)
            except KafkaException:
                return False  # the broker is busy (or restarting): ask again
            return all(n in md.topics and md.topics[n].error is None
                       and len(md.topics[n].partitions) == partitions
                       and all(p.leader >= 0 for p in md.topics[n].partitions.values())
                       for n in names)

        wait_for(ready, timeout=TIMEOUT, what=f"topics {list(names)} to have leaders")

    def delete_topics(self, names: Sequence[str]) -> list[str]:
        """Delete; return the problems (a topic already gone is not one)."""
        gone: set[str] = set()

        def delete() -> None:
            todo = [n for n in names if n not in gone]
            if not todo:
                return
            for name, f in self.admin.delete_topics(todo, operation_timeout=TIMEOUT).items():
                try:
                    f.result(timeout=TIMEOUT)
                except KafkaException as exc:
                    if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                        raise
                gone.add(name)

        try:
            retrying(delete, what=f"deleting topics {list(names)}")
        except BrokerError as exc:
            return [str(exc)]
        return []

    def delete_group(self, group: str) -> list[str]:
        """Delete; a group still holding a killed member waits for its session to end."""
        def delete() -> None:
            for f in self.admin.delete_consumer_groups([group], request_timeout=TIMEOUT).values():
                try:
                    f.result(timeout=TIMEOUT)
                except KafkaException as exc:
                    if exc.args[0].code() != KafkaError.GROUP_ID_NOT_FOUND:
                        raise

        try:
            retrying(delete, what=f"deleting group {group}",
                     also=frozenset({KafkaError.NON_EMPTY_GROUP}))
        except BrokerError as exc:
            return [str(exc)]
        return []

    def produce(self, topic: str,
                records: Sequence[tuple[bytes | None, bytes, int | None]]) -> list[Sent]:
        """Produce ``(key, value, partition)`` records, acknowledged (idempotent, acks=all)."""
        producer = Producer(self.settings.producer_config())
        sent: list[Sent] = []
        errors: list[Any] = []

        def report(err: Any, msg: Any) -> None:
            if err is not None:
                errors.append(err)
            else:
                sent.append(Sent(msg.topic(), msg.partition(), msg.offset(), msg.key(),
                                 msg.value()))

        for key, value, partition in records:
            kwargs: dict[str, Any] = {"key": key, "value": value, "on_delivery": report}
            if partition is not None:
                kwargs["partition"] = partition
            producer.produce(topic, **kwargs)
        producer.flush(TIMEOUT)
        if errors or len(sent) != len(records):
            raise BrokerError(f"producing to {topic} failed: {errors or 'not acknowledged'}")
        return sorted(sent, key=lambda s: (s.partition, s.offset))

    def end_offsets(self, topic: str) -> dict[int, int]:
        c = self._consumer(f"{self.settings.name_prefix}kafka-idem-verify-probe-{self.run_id}")

        def ask() -> dict[int, int]:
            parts = c.list_topics(topic, timeout=TIMEOUT).topics[topic].partitions
            return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=TIMEOUT)[1]
                    for p in parts}

        try:
            return retrying(ask, what=f"end offsets of {topic}")
        finally:
            c.close()

    def committed(self, group: str, topic: str) -> dict[int, int]:
        """The group's committed offset per partition (negative: none)."""
        c = self._consumer(group)  # never subscribes: only asks for the committed offsets

        def ask() -> dict[int, int]:
            parts = c.list_topics(topic, timeout=TIMEOUT).topics[topic].partitions
            tps = [TopicPartition(topic, p) for p in parts]
            return {tp.partition: tp.offset for tp in c.committed(tps, timeout=TIMEOUT)}

        try:
            return retrying(ask, what=f"committed offsets of {group}")
        finally:
            c.close()

    def caught_up(self, group: str, topic: str) -> bool:
        ends = self.end_offsets(topic)
        got = self.committed(group, topic)
        return all(got.get(p, -1) == end for p, end in ends.items() if end > 0)

    def read(self, topic: str) -> list[Any]:
        """Every record of ``topic`` from the beginning to the end offsets seen now, as a
        ``read_committed`` consumer sees it (an aborted transaction's records never)."""
        ends = self.end_offsets(topic)
        if not any(ends.values()):
            return []
        c = self._consumer(
            f"{self.settings.name_prefix}kafka-idem-verify-reader-{uuid.uuid4().hex[:8]}",
            **{"enable.partition.eof": True, "isolation.level": "read_committed"})
        out: list[Any] = []
        try:
            c.assign([TopicPartition(topic, p, 0) for p, end in ends.items() if end > 0])
            pending = {p for p, end in ends.items() if end > 0}
            deadline = time.monotonic() + TIMEOUT
            while pending and time.monotonic() < deadline:
                for m in c.consume(500, timeout=0.2):
                    err = m.error()
                    if err is None:
                        out.append(m)
                        part, offset = m.partition(), m.offset()
                        if part is not None and offset is not None and offset >= ends[part] - 1:
                            pending.discard(part)
                    elif err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(m.partition())
        finally:
            c.close()
        return out

    def assignment(self, group: str) -> list[list[int]] | None:
        """Partitions per member when the group is stable, else ``None``."""
        try:
            futures = self.admin.describe_consumer_groups([group], request_timeout=10)
            desc = futures[group].result(timeout=10)
        except KafkaException:
            return None
        if "STABLE" not in str(desc.state).upper():
            return None
        return [sorted(tp.partition for tp in m.assignment.topic_partitions)
                for m in desc.members]
