"""What a replay did (:class:`ReplaySummary`, the counts its output and audit row show),
and the consumer group a replay keeps its position in (:func:`replay_group`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from kafka_idem.replay.records import Selection
from kafka_idem.replay.redrive import (
    OUTCOMES,
    Batch,
    RecordId,
)

REPLAY_GROUP_PREFIX = "kafka-idem-replay"


SHOWN = 100  # unsendable records listed in a summary (all are counted and logged)


def replay_group(dlq_topic: str, selection: Selection, to_topic: str | None,
                 include_permanent: bool = False, prefix: str = "") -> str:
    """The replay's own consumer group (and transactional id): the same replay, run
    again, resumes where the last one stopped; a different selection starts afresh.
    ``prefix`` (the ``name_prefix`` setting, ``--prefix``) goes in front, for clusters
    whose ACLs grant group and transactional ids by prefix.

    >>> replay_group("p.dlq", Selection(kind="permanent"), None)  # doctest: +ELLIPSIS
    'kafka-idem-replay.p.dlq....'
    """
    spec_: dict[str, Any] = {"selection": selection.to_json(), "to": to_topic}
    if include_permanent:  # it sends records a replay without it skips: its own position
        spec_["include_permanent"] = True
    spec = json.dumps(spec_, sort_keys=True)
    digest = hashlib.sha256(spec.encode()).hexdigest()[:12]
    return f"{prefix}{REPLAY_GROUP_PREFIX}.{dlq_topic}.{digest}"


@dataclass
class ReplaySummary:
    """What a replay did. Counts cover the batches committed (all of them in a dry run).

    ``by_kind`` counts records per DLQ error kind and outcome (:data:`OUTCOMES`);
    ``rerun`` and ``resent`` are keys, as each key is sent once per run.
    ``untrusted`` counts the records outside the boundary by reason
    (:data:`~kafka_idem.replay.trust.REASONS`); ``unsendable`` lists the first
    :data:`SHOWN` records whose target could not take them, with why; ``verified``
    says whether signatures were checked (signing keys configured).
    """

    dlq_topic: str
    group: str
    to_topic: str | None
    dry_run: bool
    scanned: int = 0
    matched: int = 0
    sent: int = 0
    would_send: int = 0
    skipped_succeeded: int = 0
    skipped_truncated: int = 0  # DLQ copies without their value: nothing to send
    limited: bool = False  # stopped by --limit with records left to read
    completed: bool = False
    resumed: bool = False  # began at the position an earlier run of this replay committed
    run: str = ""
    targets: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    redriven: set[RecordId] = field(default_factory=set)  # re-run or resent by this run
    verified: bool = False
    untrusted: dict[str, int] = field(default_factory=dict)
    unsendable: list[dict[str, Any]] = field(default_factory=list)

    def total(self, outcome: str) -> int:
        return sum(c.get(outcome, 0) for c in self.by_kind.values())

    def counts(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "scanned": self.scanned,
            "matched": self.matched,
            "skipped_succeeded": self.skipped_succeeded,
            "skipped_truncated": self.skipped_truncated,
            "limited": self.limited,
            "completed": self.completed,
            "resumed": self.resumed,
            "targets": dict(self.targets),
            "verified": self.verified,
            "untrusted": dict(sorted(self.untrusted.items())),
            "unsendable": list(self.unsendable),
        }
        for outcome in OUTCOMES:
            out.setdefault(outcome, self.total(outcome))
        out["by_kind"] = {k: dict(v) for k, v in sorted(self.by_kind.items())}
        out["would_send" if self.dry_run else "sent"] = (
            self.would_send if self.dry_run else self.sent
        )
        return out

    def to_json(self) -> dict[str, Any]:
        return {"dlq_topic": self.dlq_topic, "group": self.group, "run": self.run,
                "to_topic": self.to_topic, "dry_run": self.dry_run, **self.counts()}


def apply_batch(summary: ReplaySummary, batch: Batch) -> None:
    summary.scanned += batch.scanned
    summary.matched += batch.matched
    for (partition, offset), (kind, outcome) in sorted(batch.outcomes.items()):
        per = summary.by_kind.setdefault(kind, {})
        per[outcome] = per.get(outcome, 0) + 1
        why = batch.reasons.get((partition, offset))
        if why is None:
            continue
        if outcome == "skipped_untrusted":
            summary.untrusted[why] = summary.untrusted.get(why, 0) + 1
        elif outcome == "skipped_unsendable" and len(summary.unsendable) < SHOWN:
            summary.unsendable.append({"partition": partition, "offset": offset,
                                       "reason": why})
    summary.skipped_succeeded = summary.total("skipped_succeeded")
    summary.skipped_truncated = summary.total("skipped_truncated")
    summary.redriven |= batch.redriven
    if summary.dry_run:
        summary.would_send += len(batch.send)
    else:
        summary.sent += len(batch.send)
    for _rec, target in batch.send:
        summary.targets[target] = summary.targets.get(target, 0) + 1
