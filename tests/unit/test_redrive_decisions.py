"""What a replay does with one dead letter, by its key's record in the store."""

from __future__ import annotations

from typing import Any

import pytest

from kafka_idem.replay.records import DlqRecord
from kafka_idem.replay.run import _classify

GROUP = "kafka-idem-replay.t.dlq.abc"


def letter(kind: str = "exhausted", key: str | None = "k", offset: int = 7,
           truncated: str | None = None) -> DlqRecord:
    return DlqRecord("t.dlq", 0, offset, None, b"k", b"v", (("idem.error.kind", b"x"),),
                     idempotency_key=key, kind=kind, truncated=truncated)


def state(status: str, error_kind: str | None = "exhausted", *, action: str | None = None,
          group: str | None = None, offset: int = 7) -> dict[str, Any]:
    return {"status": status, "error_kind": error_kind, "last_action": action,
            "last_group": group, "last_topic": "t.dlq", "last_partition": "0",
            "last_offset": str(offset)}


def decide(rec: DlqRecord, st: dict[str, Any] | None, *, include_permanent: bool = False,
           redriven: frozenset[str] = frozenset(), start: int = 0) -> str:
    return _classify(rec, st, group=GROUP, include_permanent=include_permanent,
                     redriven=set(redriven), starts={0: start})


@pytest.mark.parametrize(("rec", "st", "extra", "expected"), [
    (letter(), state("failed"), {}, "rerun"),
    (letter("permanent"), state("failed", "permanent"), {}, "skipped_permanent"),
    (letter("permanent"), state("failed", "permanent"), {"include_permanent": True}, "rerun"),
    (letter(), state("succeeded"), {}, "skipped_succeeded"),
    (letter("payload_conflict"), state("succeeded"), {}, "skipped_succeeded"),
    (letter("payload_conflict"), state("failed"), {}, "as_is"),
    (letter("undecodable", key=None), None, {}, "as_is"),
    (letter("permanent"), None, {}, "as_is"),  # no record: invalid payload, bad key
    (letter(truncated="value"), state("failed"), {}, "skipped_truncated"),
    (letter(), state("failed"), {"redriven": frozenset({"k"})}, "skipped_duplicate"),
    # Re-run by an interrupted run of this replay for a letter it has not passed: resend.
    (letter(), state("retryable_failed", action="rerun", group=GROUP, offset=7), {"start": 5},
     "resend"),
    # ... for a letter before this run's start: its batch was committed and sent.
    (letter(), state("retryable_failed", action="rerun", group=GROUP, offset=3), {"start": 5},
     "skipped_in_progress"),
    (letter(), state("retryable_failed", action="rerun", group="another"), {},
     "skipped_in_progress"),
    (letter(), state("retryable_failed"), {}, "skipped_in_progress"),
    (letter(), state("processing"), {}, "skipped_in_progress"),
])
def test_each_state_has_one_outcome(rec: DlqRecord, st: dict[str, Any] | None,
                                    extra: dict[str, Any], expected: str) -> None:
    assert decide(rec, st, **extra) == expected
