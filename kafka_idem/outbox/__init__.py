"""The transactional outbox (docs/OUTBOX.md): ``ctx.emit`` writes events with the
handler's transaction (:mod:`~kafka_idem.outbox.emit`); the relay publishes them to
Kafka exactly once (:mod:`~kafka_idem.outbox.relay`, one
:mod:`~kafka_idem.outbox.shard` publisher per shard, :mod:`~kafka_idem.outbox.marker`
records telling a successor what was published)."""

from kafka_idem.outbox.relay import Relay, RelayHooks, control_topic

__all__ = ["Relay", "RelayHooks", "control_topic"]
