"""What a replay does with one dead letter, by its key's record in the store."""

from __future__ import annotations

from typing import Any

import pytest

from kafka_idem.replay.records import DlqRecord
from kafka_idem.replay.redrive import classify as _classify

GROUP = "kafka-idem-replay.t.dlq.abc"


def letter(kind: str = "exhausted", key: str | None = "k", offset: int = 7,
           truncated: str | None = None, replayed_by: str | None = None) -> DlqRecord:
    """A dead letter; ``replayed_by``: of a copy that replay group sent from t.dlq."""
    return DlqRecord("t.dlq", 0, offset, None, b"k", b"v", (("idem.error.kind", b"x"),),
                     idempotency_key=key, kind=kind, truncated=truncated,
                     replayed_from="t.dlq" if replayed_by else None, replay_group=replayed_by)


def state(status: str, error_kind: str | None = "exhausted", *, action: str | None = None,
          group: str | None = None, offset: int = 7) -> dict[str, Any]:
    return {"status": status, "error_kind": error_kind, "last_action": action,
            "last_group": group, "last_topic": "t.dlq", "last_partition": "0",
            "last_offset": str(offset)}


def decide(rec: DlqRecord, st: dict[str, Any] | None, *, include_permanent: bool = False,
           redriven: frozenset[str] = frozenset(), start: int = 0) -> str:
    # the key's record is in namespace "app" (a replay looks it up there)
    states = [] if st is None else [{"namespace": "app", "idempotency_key": "k", **st}]
    return _classify(rec, states, group=GROUP, include_permanent=include_permanent,
                     redriven={("app", k) for k in redriven}, starts={0: start})


@pytest.mark.parametrize(("rec", "st", "extra", "expected"), [
    (letter(), state("failed"), {}, "rerun"),
    (letter("permanent"), state("failed", "permanent"), {}, "skipped_permanent"),
    (letter("permanent"), state("failed", "permanent"), {"include_permanent": True}, "rerun"),
    (letter(), state("succeeded"), {}, "skipped_succeeded"),
    (letter("payload_conflict"), state("succeeded"), {}, "skipped_succeeded"),
    # another payload holds the key: it would conflict again, whatever the key's state
    (letter("payload_conflict"), state("failed"), {}, "skipped_conflict"),
    (letter("payload_conflict"), state("retryable_failed"), {}, "skipped_conflict"),
    (letter("payload_conflict"), None, {}, "as_is"),  # the record was purged: let it in
    (letter("undecodable", key=None), None, {}, "as_is"),
    (letter("permanent"), None, {}, "as_is"),  # no record: invalid payload, bad key
    # dead letters of copies a replay sent: never sent twice by it, nor as-is by any
    (letter(replayed_by=GROUP), state("failed"), {}, "skipped_replayed"),
    (letter(replayed_by="another"), state("failed"), {}, "rerun"),
    (letter("undecodable", key=None, replayed_by="another"), None, {}, "skipped_replayed"),
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


def test_a_key_redriven_in_another_namespace_is_not_a_duplicate() -> None:
    assert _classify(letter(), [{"namespace": "app", "idempotency_key": "k", **state("failed")}],
                     group=GROUP, include_permanent=False, redriven={("other", "k")},
                     starts={0: 0}) == "rerun"


def test_a_letter_from_before_namespaces_whose_key_is_in_two_is_left_alone() -> None:
    both = [{"namespace": ns, "idempotency_key": "k", **state("failed")} for ns in ("a", "b")]
    assert _classify(letter(), both, group=GROUP, include_permanent=False, redriven=set(),
                     starts={0: 0}) == "skipped_ambiguous"
