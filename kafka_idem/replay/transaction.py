"""Steps 3-5 of a replay batch (:mod:`~kafka_idem.replay.run`): produce its records in
one Kafka transaction, re-run its failed keys in PostgreSQL, then commit the transaction
with the replay group's new position; a record the broker refuses for itself is set aside
and the batch produced again without it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from kafka_idem.errors import BrokerError
from kafka_idem.replay.reading import (
    TIMEOUT,
    kafka_errors,
)
from kafka_idem.replay.records import DlqRecord
from kafka_idem.replay.redrive import (
    Batch,
    rerun_failed,
)
from kafka_idem.replay.republishing import (
    TokenBucket,
    republish,
)
from kafka_idem.replay.summary import ReplaySummary
from kafka_idem.replay.targets import fault_of, reason_of
from kafka_idem.store import Conn, Store

log = logging.getLogger(__name__)


class _Gone(Exception):
    """Keys that left ``failed`` since the batch was decided: roll their re-runs back."""

    def __init__(self, records: list[DlqRecord]) -> None:
        super().__init__(f"{len(records)} key(s) no longer failed")
        self.records = records


def deliver(producer: Producer, consumer: Consumer, conn: Conn, store: Store,
             summary: ReplaySummary, batch: Batch, *, actor: str, reason: str | None,
             bucket: TokenBucket | None, wait: float) -> None:
    """Steps 3-5 for one batch: produce, re-run, commit, until the batch commits with
    every record the broker takes. Each pass either commits, sets aside at least one
    record, or (several records refused at once, which may share one produce request)
    produces the next pass one record at a time to find the one at fault."""
    one_by_one = False
    while True:
        refused = _produce(producer, summary, batch, actor=actor, bucket=bucket, wait=wait,
                           one_by_one=one_by_one)
        if refused:
            _abort(producer)
            named = [(rec, err) for rec, err in refused if fault_of(err) == "target"]
            if named or len(refused) == 1 or one_by_one:
                for rec, err in named or refused:
                    batch.skip(rec, "skipped_unsendable", f"refused: {reason_of(err)}")
                one_by_one = False
            else:
                one_by_one = True
            continue
        try:
            with conn.transaction():  # step 4: committed only with the messages produced
                gone = rerun_failed(conn, store, batch, group=summary.group,
                                    run=summary.run, actor=actor, reason=reason)
                if gone:
                    raise _Gone(gone)
        except _Gone as exc:
            _abort(producer)
            for rec in exc.records:
                batch.skip(rec, "skipped_in_progress")
            continue
        except BaseException:
            _abort(producer)
            raise
        with kafka_errors("replaying a batch", topic=summary.dlq_topic, group=summary.group):
            try:  # step 5
                offsets = [TopicPartition(summary.dlq_topic, p, o)
                           for p, o in batch.positions.items()]
                producer.send_offsets_to_transaction(
                    offsets, consumer.consumer_group_metadata(), TIMEOUT)
                _commit(producer)
            except BaseException:
                _abort(producer)
                raise
        return


def _produce(producer: Producer, summary: ReplaySummary, batch: Batch, *, actor: str,
             bucket: TokenBucket | None, wait: float, one_by_one: bool,
             ) -> list[tuple[DlqRecord, Any]]:
    """Step 3: begin the batch's transaction and produce its records; return the ones
    refused for themselves or their target (the caller then aborts the transaction).
    Any other refusal, or a report missing after ``wait``, aborts and raises
    :class:`BrokerError` (exit 3): the broker's fault, nothing of the batch committed.
    ``one_by_one`` waits for each record's report before the next and stops at the
    first refusal: the one at fault."""
    where = {"topic": summary.dlq_topic, "group": summary.group}
    reports: dict[int, Any] = {}
    produced = 0

    def report(index: int) -> Callable[[Any, Any], None]:
        def on_delivery(err: Any, _msg: Any) -> None:
            reports[index] = err
        return on_delivery

    with kafka_errors("replaying a batch", **where):
        producer.begin_transaction()
    try:
        for i, (rec, _target) in enumerate(batch.send):
            if bucket is not None:
                bucket.acquire()
            produced += 1
            try:
                _republish(producer, summary, rec, actor, report(i), wait)
            except KafkaException as exc:  # refused before it left: unknown partition...
                reports[i] = exc.args[0] if exc.args else exc
            if one_by_one:
                producer.flush(wait)
                if reports.get(i) is not None:
                    break
        producer.flush(wait)
    except BaseException:
        _abort(producer)
        raise
    failures = {i: err for i, err in reports.items() if err is not None}
    refused = [(batch.send[i][0], err) for i, err in sorted(failures.items())
               if fault_of(err) is not None]
    missing = produced - len(reports)
    if not refused and (failures or missing):
        _abort(producer)
        first = next(iter(failures.values()), None)
        raise BrokerError(
            f"replaying a batch: {len(failures)} of {produced} record(s) refused"
            + (f" ({reason_of(first)})" if first is not None else "")
            + (f", {missing} not acknowledged in time" if missing else ""), **where)
    return refused


def _republish(producer: Producer, summary: ReplaySummary, rec: DlqRecord, actor: str,
               on_delivery: Callable[[Any, Any], None], wait: float) -> None:
    try:
        republish(producer, rec, to_topic=summary.to_topic, actor=actor,
                  group=summary.group, on_delivery=on_delivery)
    except BufferError:  # the local queue is full: let it drain, then once more
        producer.flush(wait)
        republish(producer, rec, to_topic=summary.to_topic, actor=actor,
                  group=summary.group, on_delivery=on_delivery)


def _commit(producer: Producer) -> None:
    for _ in range(5):
        try:
            producer.commit_transaction(TIMEOUT)
            return
        except KafkaException as exc:
            err = exc.args[0]
            if not err.retriable() or err.txn_requires_abort():
                raise
            time.sleep(0.5)
    producer.commit_transaction(TIMEOUT)


def _abort(producer: Producer) -> None:
    try:
        producer.abort_transaction(TIMEOUT)
    except KafkaException as exc:  # a fenced or fatal producer: the broker aborts it anyway
        log.warning("could not abort the replay transaction: %s", exc,
                    extra={"action": "replay_abort_failed"})
