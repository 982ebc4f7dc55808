"""Dead letters produced and acknowledged before their offsets may be committed.

A unit's result may carry a dead letter (a message that failed for good). Its
offset counts as finished only once the DLQ topic acknowledged the record; a
record not acknowledged turns its message, and what the unit did after it in
that partition, back into a deferral, so the letter is produced again later
and the offset never moves past a message with no outcome anywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kafka_idem.consume.outcome import Deferred, Finished, Result
from kafka_idem.deadletters.dead_letter import DeadLetterer
from kafka_idem.observe.metrics import Metrics

log = logging.getLogger(__name__)


def send_letters(
    dlq: DeadLetterer, metrics: Metrics, results: Mapping[Any, list[Result]]
) -> None:
    """Produce the dead letters in ``results`` (by partition, or by partition and offset
    for key-ordered jobs); cut each list at its first letter not acknowledged, which
    becomes a deferral (the lists are changed)."""
    todo = [
        (tp, i, r.letter)
        for tp, rs in results.items()
        for i, r in enumerate(rs)
        if isinstance(r, Finished) and r.letter is not None
    ]
    if not todo:
        return
    errors = dlq.send([letter for _, _, letter in todo])
    for (tp, i, letter), err in zip(todo, errors, strict=True):
        if err is None:
            metrics.dead_lettered.labels(letter.source.topic(), letter.handler, letter.kind).inc()
            continue
        metrics.dlq_failures.labels(letter.dlq_topic).inc()
        log.error(
            "dead-letter produce to %s failed (%s); the source offset stays "
            "uncommitted and the dead letter will be retried",
            letter.dlq_topic, err,
            extra={"action": "dlq_failed", "topic": letter.source.topic(),
                   "partition": letter.source.partition(),
                   "offset": letter.source.offset(), "key": letter.idempotency_key},
        )
        rs = results[tp]
        if i < len(rs):
            del rs[i:]
            rs.append(Deferred(0.0, "dlq"))
