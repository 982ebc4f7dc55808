"""Reading and replaying dead-letter topics.

    sel = Selection(kind="permanent", since=dt.datetime(2024, 5, 1, tzinfo=dt.UTC))
    for rec in scan(settings, "payments.charge-requested.dlq", sel):
        print(rec.partition, rec.offset, rec.idempotency_key, rec.error_message)

    summary = replay(settings, None, "payments.charge-requested.dlq", sel,
                     to_topic=None, actor="ops@example")

Reads are bounded: the end offsets are captured when a read starts, so a read
never waits for records that arrive later. A replay never sends a record twice,
even when interrupted: each batch and the replay's position commit in one Kafka
transaction (the steps are in :mod:`kafka_idem.replay.run`).

* :mod:`~kafka_idem.replay.records` — :class:`DlqRecord` (one record, its
  ``idem.*`` headers parsed) and :class:`Selection` (which records to pick);
* :mod:`~kafka_idem.replay.reading` — bounded reads of a DLQ topic: :func:`scan`,
  :func:`read_one`, ``latest_for_key``; ``Reader`` reads single records with one
  consumer kept open;
* :mod:`~kafka_idem.replay.republishing` — :func:`republish` with lineage headers,
  the target topic, :class:`TokenBucket`, :class:`Deliveries` (delivery reports
  latched) and :func:`republish_acknowledged`;
* :mod:`~kafka_idem.replay.single` — ``rerun_key``: one key's audited re-run;
* :mod:`~kafka_idem.replay.bulk` — ``bulk_rerun``: the failed keys a filter selects;
* :mod:`~kafka_idem.replay.trust` — :class:`Boundary`: which records a replay may
  act on (signature, topic, namespace, key), the reasons in :data:`REASONS`;
* :mod:`~kafka_idem.replay.targets` — :class:`Targets`: whether a target can take
  a record (topic, partition, size), and which delivery errors are a record's own;
* :mod:`~kafka_idem.replay.redrive` — what the replay does with each record (the
  re-drive's decisions, :data:`OUTCOMES` and :data:`WHY`);
* :mod:`~kafka_idem.replay.run` — :func:`replay`: the resumable, transactional,
  audited run.

The names below are the API; import them from ``kafka_idem.replay``.
"""

from kafka_idem.replay.reading import (
    read_one,
    scan,
)
from kafka_idem.replay.records import (
    DlqRecord,
    Selection,
    display_bytes,
    dlq_topic_for,
    payload_view,
)
from kafka_idem.replay.redrive import OUTCOMES, SKIPS, WHY
from kafka_idem.replay.run import replay
from kafka_idem.replay.summary import ReplaySummary
from kafka_idem.replay.trust import REASONS, Boundary

__all__ = [
    "OUTCOMES",
    "REASONS",
    "SKIPS",
    "WHY",
    "Boundary",
    "DlqRecord",
    "ReplaySummary",
    "Selection",
    "display_bytes",
    "dlq_topic_for",
    "payload_view",
    "read_one",
    "replay",
    "scan",
]
